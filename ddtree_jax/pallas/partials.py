"""Attention computed in parts (cache splits, new tokens) put back together by log-sum-exp."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge(o: jax.Array, lse: jax.Array, new: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Normalized partial attention outputs o [B, K, ..., R] with their log-sum-exps lse
    [B, K, ...] merged over K, plus `new` (None, or one more partial ([B, ..., R], [B, ...]))
    -> [B, ..., R] float32.

    Empty partials (lse = -inf) weigh 0; a row whose partials are all empty comes out 0. Used by
    the MLA Mosaic kernel (its cache splits, and the new tokens' partial of XLA, never empty:
    masked scores are MASK_VALUE, finite) and the drafter attention kernel's split walk."""
    top = jnp.max(lse, axis=1)
    if new is not None:
        top = jnp.maximum(top, new[1])
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top[:, None])
    # One reduction gives the weighted sum and the total weight (o with a column of ones), so the
    # weights have one consumer and XLA fuses their exp into it: one launch, not three. An
    # elementwise sum, not an einsum: a float32 matmul could run in TF32 on the GPU.
    ones = jnp.ones((*o.shape[:-1], 1), jnp.float32)
    acc = jnp.sum(w[..., None] * jnp.concatenate([o.astype(jnp.float32), ones], axis=-1), axis=1)
    out, total = acc[..., :-1], acc[..., -1]
    if new is not None:
        w_new = jnp.exp(new[1] - top)
        out, total = out + w_new[..., None] * new[0], total + w_new
    return out / jnp.where(total > 0, total, 1.0)[..., None]
