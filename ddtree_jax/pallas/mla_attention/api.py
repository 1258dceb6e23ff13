"""Dispatch for absorbed-MLA attention (see reference.py for the notation)."""

from __future__ import annotations

import functools

import chex
import jax

from ddtree_jax import sharding
from ddtree_jax.pallas import check_implementation
from ddtree_jax.pallas.mla_attention.exact import mla_attention_exact
from ddtree_jax.pallas.mla_attention.kernel import mla_attention_pallas
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference

AVAILABLE = ("xla", "exact", "pallas")


def mla_attention(
    q_lat: jax.Array,  # [B, T, N, R]
    q_pe: jax.Array,  # [B, T, N, P]
    cache_ckv: jax.Array,  # [B, S, R]
    cache_kpe: jax.Array,  # [B, S, P]
    cache_len: jax.Array,  # [B]
    new_ckv: jax.Array,  # [B, T, R]
    new_kpe: jax.Array,  # [B, T, P]
    new_mask: jax.Array,  # [B, T, T] bool
    *,
    scale: float,
    implementation: str = "xla",
    positions: jax.Array | None = None,  # [B, T] int32, for "exact"
    span: int | None = None,
) -> jax.Array:  # [B, T, N, R] float32
    """Absorbed-MLA attention of T query tokens over a latent cache plus themselves.

    Every cache entry s < cache_len[b] is visible to every query of sequence b;
    among the new tokens, query t sees key u iff new_mask[b, t, u].

    Args:
      q_lat: queries already multiplied by W_UK (the "absorbed" nope part).
      q_pe: RoPE'd rope part of the queries.
      cache_ckv, cache_kpe: the committed latent cache of one layer.
      cache_len: committed length per sequence.
      new_ckv, new_kpe: latent entries of the new tokens.
      new_mask: visibility among the new tokens (causal for prefill, the
        ancestor-or-self matrix for a draft tree).
      scale: the model's softmax scale (qk_head_dim^-0.5, times YaRN mscale^2).
      implementation: "xla" (pure jnp), "exact" (pure jnp in a rounding order fixed
        by absolute positions, exact.py) or "pallas" (the Triton-style kernel in
        kernel.py; on a CPU backend it runs in interpret mode; under a mesh
        context (`sharding.use_mesh`) it runs per shard, batch and heads split by its rules).
      positions: absolute positions of the new tokens ("exact" only: it orders the
        keys by them). Each query's visible new tokens must sit at distinct positions
        in [cache_len, cache_len + span).
      span: a static bound on the new tokens' offsets from cache_len ("exact" only);
        default T.

    Returns:
      The attention-weighted latent values, float32.
    """
    check_implementation(implementation, AVAILABLE, "mla_attention")
    b, t, n, r = q_lat.shape
    s, p = cache_ckv.shape[1], q_pe.shape[-1]
    chex.assert_shape(q_pe, (b, t, n, p))
    chex.assert_shape(cache_ckv, (b, s, r))
    chex.assert_shape(cache_kpe, (b, s, p))
    chex.assert_shape(cache_len, (b,))
    chex.assert_shape(new_ckv, (b, t, r))
    chex.assert_shape(new_kpe, (b, t, p))
    chex.assert_shape(new_mask, (b, t, t))
    args = (q_lat, q_pe, cache_ckv, cache_kpe, cache_len, new_ckv, new_kpe, new_mask)
    if implementation == "exact":
        if positions is None:
            raise ValueError("mla_attention(implementation='exact') needs the new tokens' positions")
        chex.assert_shape(positions, (b, t))
        return mla_attention_exact(*args, positions, scale, t if span is None else span)
    if implementation == "pallas":
        kernel = functools.partial(mla_attention_pallas, scale=scale, interpret=jax.default_backend() == "cpu")
        # Per shard: the batch and the query heads as the mesh's rules split them (MQA:
        # every head reads the whole latent cache, which no rule splits but by batch).
        axes = [("batch", None, "heads", None)] * 2 + [("batch", None, None)] * 2 + [("batch",)]
        axes += [("batch", None, None)] * 3
        specs = tuple(sharding.kernel_spec(a, x.shape) for a, x in zip(axes, args, strict=True))
        if specs[0] is None:
            return kernel(*args)
        # check_vma=False: pallas_call outputs carry no varying-axes annotation.
        return jax.shard_map(kernel, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)
    return mla_attention_reference(*args, scale)
