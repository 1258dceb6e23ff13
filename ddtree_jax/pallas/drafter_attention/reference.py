"""Pure-jnp drafter block attention: the float32 reference and the XLA path.

Notation: B batch, T block tokens (queries, and the block's own keys), S context cache
capacity, Nq query heads, Nkv key / value heads (G = Nq / Nkv query heads share one, HF's
repeat_kv order), hd head dim.

A block query at position p sees context slot s (slot s holds position s) iff s < ctx_len
and p - s < window, and block key u iff u is a real block token and, in a causal layer,
position[u] <= p. Every query sees at least its own block token, so no row is all masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.layers import einsum


def masked_attention(
    q: jax.Array,  # [B, T, Nq, hd]
    k_ctx: jax.Array,  # [B, S, Nkv, hd]
    v_ctx: jax.Array,  # [B, S, Nkv, hd]
    ctx_visible: jax.Array,  # [B, T or 1, S] bool
    k_blk: jax.Array,  # [B, U, Nkv, hd]
    v_blk: jax.Array,  # [B, U, Nkv, hd]
    blk_visible: jax.Array | None = None,  # [B, T, U] bool; None = every block key
) -> jax.Array:  # [B, T, Nq, hd] in q's dtype
    """Queries over visible context keys plus visible block keys, one softmax over both
    (float32 scores and weights; the weights cast to the values' dtype for P V)."""
    b, t, nq, hd = q.shape
    nkv, s = k_blk.shape[2], k_ctx.shape[1]
    qg = q.reshape(b, t, nkv, nq // nkv, hd)  # query head j * G + g reads kv head j
    s_ctx = einsum("btkgd,bskd->bkgts", qg, k_ctx)
    s_ctx = jnp.where(ctx_visible[:, None, None], s_ctx, -jnp.inf)
    s_blk = einsum("btkgd,bukd->bkgtu", qg, k_blk)
    if blk_visible is not None:
        s_blk = jnp.where(blk_visible[:, None, None], s_blk, -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1) * hd**-0.5, axis=-1)
    o = einsum("bkgts,bskd->btkgd", p[..., :s].astype(v_ctx.dtype), v_ctx)
    o = o + einsum("bkgtu,bukd->btkgd", p[..., s:].astype(v_blk.dtype), v_blk)
    return o.reshape(b, t, nq, hd).astype(q.dtype)


def visibility(
    positions: jax.Array,  # [B, T] int32
    ctx_len: jax.Array,  # [B] int32
    capacity: int,
    window: jax.Array | int,  # scalar: context slots with p - s < window are visible
    causal: jax.Array | bool,  # scalar: block key u visible iff position[u] <= p
) -> tuple[jax.Array, jax.Array]:
    """(ctx_visible [B, T, S], blk_visible [B, T, T]) of the module docstring's rule."""
    slots = jnp.arange(capacity, dtype=jnp.int32)
    ctx = (slots[None, None, :] < ctx_len[:, None, None]) & (positions[:, :, None] - slots < window)
    earlier = positions[:, None, :] <= positions[:, :, None]
    return ctx, earlier | ~jnp.asarray(causal)


def drafter_attention_reference(
    q: jax.Array,  # [B, T, Nq, hd]
    k_ctx: jax.Array,  # [B, S, Nkv, hd]
    v_ctx: jax.Array,  # [B, S, Nkv, hd]
    ctx_len: jax.Array,  # [B] int32
    positions: jax.Array,  # [B, T] int32
    k_blk: jax.Array,  # [B, T, Nkv, hd]
    v_blk: jax.Array,  # [B, T, Nkv, hd]
    window: jax.Array | int,
    causal: jax.Array | bool,
) -> jax.Array:  # [B, T, Nq, hd]
    """The block attention of one drafter layer with its masks built from lengths and positions."""
    ctx_visible, blk_visible = visibility(positions, ctx_len, k_ctx.shape[1], window, causal)
    return masked_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk, blk_visible)
