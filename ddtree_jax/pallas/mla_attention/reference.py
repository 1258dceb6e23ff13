"""Pure-jnp absorbed-MLA attention: the float32 reference and the XLA path.

Notation: B batch, T new tokens (query rows), S cache capacity, N heads,
R kv_lora_rank (latent width, also the value width), P rope dim.

Attention is multi-query over one shared key stream [c_kv; k_pe] of width
R + P and one value stream c_kv of width R. Keys are the S cache entries (entry s
visible iff s < cache_len[b]) followed by the T new entries (visible per
new_mask[b, t, u]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.layers import einsum

MASK_VALUE = -1e30
"""Finite, so that a row with no visible key gives uniform weights, never NaN."""

JOIN_MAX_BYTES = 4 << 20
"""`mla_attention_xla` attends a call of several new tokens over the cache and the new keys
joined into one key stream ([B, S + T, R] and [B, S + T, P], a copy of the cache) when the
cache takes at most this many bytes: the score and value GEMMs of the cache and of the new keys,
and the concatenation of their scores, become one GEMM each (a verify of the shipped target ran
them as 6 GEMMs and a concatenation in each of its 8 layers; session 51's stage profile). On an
H100 (session 52, docs/benchmarks.md) it cut the shipped pair's verify12 from 0.593 to 0.539 ms
and a DDTree(12) round from 1.578 to 1.429 AR steps (caches of at most 1 MiB there). The bound
keeps the copy small (at 4 MiB, about 3 us of an H100's bandwidth a layer): a long context's
cache, which the split pass reads once, is not copied. 0: never."""


def _scores(q_lat, q_pe, ckv, kpe, scale: float) -> jax.Array:
    """scale * (q_lat . c_kv + q_pe . k_pe) [B, N, T, S'] over keys ckv [B, S', R], kpe [B, S', P]."""
    return (einsum("btnr,bsr->bnts", q_lat, ckv) + einsum("btnp,bsp->bnts", q_pe, kpe)) * scale


def _cache_visible(cache_len: jax.Array, s: int) -> jax.Array:
    """[B, S]: cache entry s is visible iff s < cache_len[b]."""
    return jnp.arange(s)[None, :] < cache_len[:, None]


def mla_attention_reference(
    q_lat: jax.Array,  # [B, T, N, R]
    q_pe: jax.Array,  # [B, T, N, P]
    cache_ckv: jax.Array,  # [B, S, R]
    cache_kpe: jax.Array,  # [B, S, P]
    cache_len: jax.Array,  # [B] int32
    new_ckv: jax.Array,  # [B, T, R]
    new_kpe: jax.Array,  # [B, T, P]
    new_mask: jax.Array,  # [B, T, T] bool
    scale: float,
) -> jax.Array:  # [B, T, N, R] float32
    """softmax(scale * (q_lat . c_kv + q_pe . k_pe)) @ c_kv over cache + new keys."""
    f32 = jnp.float32
    s_cache = _scores(q_lat, q_pe, cache_ckv, cache_kpe, scale)
    s_new = _scores(q_lat, q_pe, new_ckv, new_kpe, scale)
    s_cache = jnp.where(_cache_visible(cache_len, cache_ckv.shape[1])[:, None, None, :], s_cache, MASK_VALUE)
    s_new = jnp.where(new_mask[:, None, :, :], s_new, MASK_VALUE)
    p = jax.nn.softmax(jnp.concatenate([s_cache, s_new], axis=-1), axis=-1)
    p_cache, p_new = p[..., : cache_ckv.shape[1]], p[..., cache_ckv.shape[1] :]
    out = jnp.einsum("bnts,bsr->btnr", p_cache, cache_ckv.astype(f32))
    out += jnp.einsum("bntu,bur->btnr", p_new, new_ckv.astype(f32))
    return out


def mla_attention_xla(q_lat, q_pe, cache_ckv, cache_kpe, cache_len, new_ckv, new_kpe, new_mask, scale: float):
    """The XLA path: `mla_attention_reference`, or over the cache and the new keys joined (same
    arguments, same result up to float32 summation order) for T > 1 new tokens and a cache of at
    most `JOIN_MAX_BYTES`."""
    b, t = new_mask.shape[:2]
    if t == 1 or cache_ckv.nbytes + cache_kpe.nbytes > JOIN_MAX_BYTES:
        return mla_attention_reference(q_lat, q_pe, cache_ckv, cache_kpe, cache_len, new_ckv, new_kpe, new_mask, scale)
    # The wider dtype of the two, so that no key is rounded (the model's are the cache's already).
    ckv = jnp.concatenate([cache_ckv, new_ckv], axis=1, dtype=jnp.result_type(cache_ckv, new_ckv))  # [B, S + T, R]
    kpe = jnp.concatenate([cache_kpe, new_kpe], axis=1, dtype=jnp.result_type(cache_kpe, new_kpe))  # [B, S + T, P]
    s = cache_ckv.shape[1]
    cache_visible = jnp.broadcast_to(_cache_visible(cache_len, s)[:, None, :], (b, t, s))
    visible = jnp.concatenate([cache_visible, new_mask], axis=-1)  # [B, T, S + T]
    scores = _scores(q_lat, q_pe, ckv, kpe, scale)
    p = jax.nn.softmax(jnp.where(visible[:, None, :, :], scores, MASK_VALUE), axis=-1)
    return jnp.einsum("bnts,bsr->btnr", p, ckv.astype(jnp.float32))
