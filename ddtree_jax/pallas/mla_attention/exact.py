"""Absorbed-MLA attention in a rounding order fixed by absolute positions ("exact" numerics).

Notation as in reference.py, plus M = B * T query tokens, TM query tokens per tile,
KB = KEY_BLOCK keys per block, W = span (the new tokens sit at offsets 0..W-1 after
their row's cache length).

A query's keys are positions 0, 1, ...: committed cache entries below its row's
length, then the new tokens it sees at their own positions (its ancestors in a tree,
its predecessors in a prefill). The keys are walked in blocks of KB positions aligned
to absolute positions (block j = positions [KB j, KB j + KB)) with an online softmax;
every block is computed at one shape, whether its keys come from the cache or from
the new tokens, and a block the query does not see leaves the running state exactly
as it was (exp(0) = 1, nothing added). So a query's output depends on its visible
keys alone: not on the cache capacity, on how many new tokens share the forward, on
where they sit in the batch, or on whether an ancestor is still a tree node or already
committed.

Requires that the new tokens a query sees sit at distinct positions in
[cache_len, cache_len + span) (true of causal and tree masks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.layers import einsum
from ddtree_jax.numerics import KEY_BLOCK, tile_rows


def _new_key_table(new_mask, positions, cache_len, span):
    """[B, T, W] int32: the new token query t sees at offset o (position cache_len + o), else -1."""
    b, t, _ = new_mask.shape
    offs = positions - cache_len[:, None]  # [B, T]
    slot = jnp.where(new_mask & (offs[:, None, :] >= 0), offs[:, None, :], span)  # out of range: dropped
    bi = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, t, t))
    qi = jnp.broadcast_to(jnp.arange(t)[None, :, None], (b, t, t))
    ui = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, None, :], (b, t, t))
    return jnp.full((b, t, span), -1, jnp.int32).at[bi, qi, slot].set(ui, mode="drop")


def mla_attention_exact(
    q_lat: jax.Array,  # [B, T, N, R]
    q_pe: jax.Array,  # [B, T, N, P]
    cache_ckv: jax.Array,  # [B, S, R]
    cache_kpe: jax.Array,  # [B, S, P]
    cache_len: jax.Array,  # [B] int32
    new_ckv: jax.Array,  # [B, T, R]
    new_kpe: jax.Array,  # [B, T, P]
    new_mask: jax.Array,  # [B, T, T] bool
    positions: jax.Array,  # [B, T] int32 absolute positions of the new tokens
    scale: float,
    span: int,
) -> jax.Array:  # [B, T, N, R] float32
    """Same function as `mla_attention_reference`, in a position-fixed rounding order.

    A query that sees no key at all returns zeros.
    """
    b, t, n, r = q_lat.shape
    s = cache_ckv.shape[1]
    table = _new_key_table(new_mask, positions, cache_len, span)
    # The furthest position each query sees bounds the blocks its tile walks.
    newest = jnp.max(jnp.where(new_mask, positions[:, None, :], -1), axis=-1)
    last = jnp.maximum(newest, cache_len[:, None] - 1)  # [B, T]

    def tile(bi, ql, qp, length, tab, last):  # [TM], [TM, N, R], [TM, N, P], [TM], [TM, W], [TM]
        rows = bi[:, None]

        def block(j, carry):
            m, denom, acc = carry  # [TM, N], [TM, N], [TM, N, R]
            pos = j * KEY_BLOCK + jnp.arange(KEY_BLOCK)  # [KB]
            off = pos[None, :] - length[:, None]  # [TM, KB]
            from_cache = off < 0
            u = jnp.take_along_axis(tab, jnp.clip(off, 0, span - 1), axis=1)
            from_new = (off >= 0) & (off < span) & (u >= 0)
            cpos, upos = jnp.clip(pos, 0, s - 1)[None, :], jnp.clip(u, 0, t - 1)

            def keys(cache, new):  # [TM, KB, *] from the cache or the new tokens; zeros where unseen
                picked = jnp.where(from_cache[..., None], cache[rows, cpos], new[rows, upos])
                return jnp.where((from_cache | from_new)[..., None], picked, jnp.zeros((), picked.dtype))

            ckv, kpe = keys(cache_ckv, new_ckv), keys(cache_kpe, new_kpe)
            sc = (einsum("mnr,mkr->mnk", ql, ckv) + einsum("mnp,mkp->mnk", qp, kpe)) * scale
            sc = jnp.where((from_cache | from_new)[:, None, :], sc, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            m_use = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing seen yet: keep exp finite
            alpha = jnp.exp(m - m_use)
            p = jnp.exp(sc - m_use[..., None])
            denom = denom * alpha + jnp.sum(p, axis=-1)
            return m_new, denom, acc * alpha[..., None] + einsum("mnk,mkr->mnr", p, ckv)

        init = (
            jnp.full(ql.shape[:2], -jnp.inf, jnp.float32),
            jnp.zeros(ql.shape[:2], jnp.float32),
            jnp.zeros(ql.shape, jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(0, jnp.max(last) // KEY_BLOCK + 1, block, init)
        # denom == 0: no key seen (zeros out); a NaN denom stays NaN.
        return jnp.where(denom[..., None] == 0, 0.0, acc / jnp.where(denom == 0, 1.0, denom)[..., None])

    bidx = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    out = tile_rows(
        tile,
        bidx,
        q_lat.reshape(b * t, n, r),
        q_pe.reshape(b * t, n, -1),
        jnp.repeat(cache_len, t),
        table.reshape(b * t, span),
        last.reshape(b * t),
    )
    return out.reshape(b, t, n, r)
