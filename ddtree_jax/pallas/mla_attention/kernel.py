"""Pallas (Triton-style) absorbed-MLA attention: flash attention over cache blocks, then the new tokens.

Notation as in reference.py; Q = T * N query rows (every head of every new token:
MQA over one latent stream), BQ query rows and BK cache slots per block.

Grid: (B, Q / BQ). Each program holds BQ query rows and streams the committed
cache in BK-slot blocks up to cache_len[b] only (empty blocks are never read),
with an online softmax in float32; the T new tokens come last, masked per row by
the tree / causal mask. Checked against the reference in interpret mode on the
CPU (tests/test_mla_kernel.py). Not yet compiled, tuned or measured on a GPU: the
Triton lowering's limits (power-of-two blocks, a whole-cache block per batch row,
register use at R = 512) are the first things to check there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -1e30


def _kernel(len_ref, qlat_ref, qpe_ref, ckv_ref, kpe_ref, nckv_ref, nkpe_ref, mask_ref, o_ref, *, scale, block_k):
    f32 = jnp.float32
    q_lat = qlat_ref[...].astype(f32)  # [BQ, R]
    q_pe = qpe_ref[...].astype(f32)  # [BQ, P]
    cache_len = len_ref[0]
    bq, r = q_lat.shape

    def scores(ckv, kpe):
        s = jax.lax.dot_general(q_lat, ckv.astype(f32), (((1,), (1,)), ((), ())), preferred_element_type=f32)
        s += jax.lax.dot_general(q_pe, kpe.astype(f32), (((1,), (1,)), ((), ())), preferred_element_type=f32)
        return s * scale

    def update(carry, s, v):
        m, denom, acc = carry  # running max, softmax denominator, weighted values
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        denom = denom * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p, v.astype(f32), preferred_element_type=f32)
        return m_new, denom, acc

    def cache_block(i, carry):
        start = pl.multiple_of(i * block_k, block_k)
        ckv = ckv_ref[pl.ds(start, block_k), :]
        kpe = kpe_ref[pl.ds(start, block_k), :]
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
        s = jnp.where(slot < cache_len, scores(ckv, kpe), MASK_VALUE)
        return update(carry, s, ckv)

    carry = (jnp.full((bq,), MASK_VALUE, f32), jnp.zeros((bq,), f32), jnp.zeros((bq, r), f32))
    carry = jax.lax.fori_loop(0, pl.cdiv(cache_len, block_k), cache_block, carry)
    nckv = nckv_ref[...]
    s_new = jnp.where(mask_ref[...] != 0, scores(nckv, nkpe_ref[...]), MASK_VALUE)
    _, denom, acc = update(carry, s_new, nckv)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "interpret"))
def mla_attention_pallas(
    q_lat,  # [B, T, N, R]
    q_pe,  # [B, T, N, P]
    cache_ckv,  # [B, S, R]
    cache_kpe,  # [B, S, P]
    cache_len,  # [B]
    new_ckv,  # [B, T, R]
    new_kpe,  # [B, T, P]
    new_mask,  # [B, T, T]
    *,
    scale: float,
    block_q: int = 64,
    block_k: int = 64,
    interpret: bool = False,
):
    """Same contract as `mla_attention_reference`; float32 output [B, T, N, R]."""
    b, t, n, r = q_lat.shape
    s, p = cache_ckv.shape[1], q_pe.shape[-1]
    q = t * n
    bq = min(block_q, pl.next_power_of_2(q))
    q_pad = pl.cdiv(q, bq) * bq
    s_pad = pl.cdiv(s, block_k) * block_k

    def rows(x):  # [B, T, N, X] -> [B, Q_pad, X]
        x = x.reshape(b, q, x.shape[-1])
        return jnp.pad(x, ((0, 0), (0, q_pad - q), (0, 0)))

    # Block shapes are powers of two: the new tokens are padded to t_pad (invisible keys).
    t_pad = pl.next_power_of_2(t)
    # Row t * N + h of the query block belongs to token t: expand the mask to rows.
    mask = jnp.repeat(new_mask.astype(jnp.int32), n, axis=1)
    mask = jnp.pad(mask, ((0, 0), (0, q_pad - q), (0, t_pad - t)))
    mask = mask.at[:, q:, 0].set(1)  # padding query rows see one key: no empty softmax
    new_ckv = jnp.pad(new_ckv, ((0, 0), (0, t_pad - t), (0, 0)))
    new_kpe = jnp.pad(new_kpe, ((0, 0), (0, t_pad - t), (0, 0)))
    # A cache whose capacity is a multiple of block_k (generate rounds it) is used as is:
    # padding would copy the whole cache on every call.
    ckv, kpe = cache_ckv, cache_kpe
    if s_pad != s:
        ckv = jnp.pad(cache_ckv, ((0, 0), (0, s_pad - s), (0, 0)))
        kpe = jnp.pad(cache_kpe, ((0, 0), (0, s_pad - s), (0, 0)))
    lens = jnp.minimum(cache_len.astype(jnp.int32), s)[:, None]

    grid = (b, q_pad // bq)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_k=block_k),
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((None, bq, r), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, bq, p), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, s_pad, r), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, s_pad, p), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, t_pad, r), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, t_pad, p), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, bq, t_pad), lambda i, j: (i, j, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, r), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, q_pad, r), jnp.float32),
        interpret=interpret,
    )(lens, rows(q_lat), rows(q_pe), ckv, kpe, new_ckv, new_kpe, mask)
    return out[:, :q].reshape(b, t, n, r)
