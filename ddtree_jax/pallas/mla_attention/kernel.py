"""Pallas (Triton-style) absorbed-MLA attention, split over the cache (flash-decoding).

Notation as in reference.py; Q = T * N query rows (every head of every new token:
MQA over one latent stream), BQ query rows and BK cache slots per block, NS cache
splits of C slots each.

Decoding has few query rows (T * N is 8 for one AR token on one TP-8 shard of
Kimi-K2), so one program per query block would stream a 32K-slot cache on a few
SMs. Instead the grid is (B, Q / BQ, NS + 1): program (b, j, k < NS) attends
query block j to cache slots [k * C, (k + 1) * C) clipped to cache_len[b]
(splits past the end read nothing), and program k = NS attends it to the T new
tokens under the tree / causal mask. Each writes a partial (running max m,
denominator l, weighted values acc) in float32; `_combine` merges the NS + 1
partials in XLA. Both the cache and the new tokens stream in blocks of at most BK
slots, so shared memory does not grow with the tree. Matmul operands stay in the
input dtype (bf16 on the GPU) with float32 accumulation. Checked against the reference in interpret mode on the CPU
(tests/test_mla_kernel.py); GPU figures in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler, check_tiles

MASK_VALUE = -1e30
MIN_DOT = 16
"""Smallest block dimension a compiled Triton dot takes."""
TARGET_PROGRAMS = 264
"""About two programs per SM of an H200 (132 SMs): how finely the cache is split."""


def _kernel(
    len_ref,
    qlat_ref,
    qpe_ref,
    ckv_ref,
    kpe_ref,
    nckv_ref,
    nkpe_ref,
    mask_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    scale,
    block_k,
    chunk,
):
    f32 = jnp.float32
    q_lat = qlat_ref[...]  # [BQ, R]
    q_pe = qpe_ref[...]  # [BQ, P]
    bq, r = q_lat.shape
    split = pl.program_id(2)
    tree_split = pl.num_programs(2) - 1

    def scores(ckv, kpe):  # [BQ, BK] float32
        dims = (((1,), (1,)), ((), ()))
        s = jax.lax.dot_general(q_lat, ckv, dims, preferred_element_type=f32)
        s += jax.lax.dot_general(q_pe, kpe, dims, preferred_element_type=f32)
        return s * scale

    def update(carry, s, v):
        m, denom, acc = carry  # running max, softmax denominator, weighted values
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        denom = denom * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=f32)
        return m_new, denom, acc

    def store(carry):
        m, denom, acc = carry
        m_ref[...] = m
        l_ref[...] = denom
        acc_ref[...] = acc

    empty = (jnp.full((bq,), MASK_VALUE, f32), jnp.zeros((bq,), f32), jnp.zeros((bq, r), f32))

    @pl.when(split < tree_split)
    def _cache():
        lo = split * chunk
        hi = jnp.minimum(lo + chunk, len_ref[0])

        def block(i, carry):
            start = pl.multiple_of(lo + i * block_k, block_k)
            ckv = ckv_ref[pl.ds(start, block_k), :]
            slot = start + jax.lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
            s = jnp.where(slot < hi, scores(ckv, kpe_ref[pl.ds(start, block_k), :]), MASK_VALUE)
            return update(carry, s, ckv)

        store(jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), block, empty))

    @pl.when(split == tree_split)
    def _tree():
        # The new tokens in blocks too: a 128-token tree at R = 512 is 128 KiB of bf16,
        # more shared memory than one load may take next to the query block.
        block_t = min(block_k, nckv_ref.shape[0])

        def block(i, carry):
            start = pl.multiple_of(i * block_t, block_t)
            nckv = nckv_ref[pl.ds(start, block_t), :]
            visible = mask_ref[:, pl.ds(start, block_t)] != 0
            s = jnp.where(visible, scores(nckv, nkpe_ref[pl.ds(start, block_t), :]), MASK_VALUE)
            return update(carry, s, nckv)

        store(jax.lax.fori_loop(0, nckv_ref.shape[0] // block_t, block, empty))


def _combine(acc, m, denom):  # [B, K, Q, R], [B, K, Q], [B, K, Q] -> [B, Q, R]
    """Merge per-split softmax partials; empty splits (m = MASK_VALUE, denom = 0) weigh 0."""
    w = jnp.exp(m - jnp.max(m, axis=1, keepdims=True))
    # An elementwise sum, not an einsum: a float32 matmul could run in TF32 on the GPU.
    return jnp.sum(w[..., None] * acc, axis=1) / jnp.sum(w * denom, axis=1)[..., None]


@dataclasses.dataclass(frozen=True)
class MLATiles:
    """Tiles and launch parameters of `mla_attention_pallas` (validated on construction).

    Attributes:
      block_q: query rows (token x head) per program; shrinks to the next power of two of T * N.
      block_k: cache slots (and new tokens) per inner step.
      num_splits: cache splits; None picks `num_cache_splits`.
      num_warps, num_stages: Triton launch parameters.
    """

    block_q: int = 64
    block_k: int = 32
    num_splits: int | None = None
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(block_q=self.block_q, block_k=self.block_k)
        check_compiler(self.num_warps, self.num_stages)
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"num_splits must be None or a positive int, got {self.num_splits!r}")


def num_cache_splits(batch: int, query_blocks: int, cache_blocks: int) -> int:
    """Splits so that batch * query_blocks * splits is about TARGET_PROGRAMS, at most one per block."""
    return max(1, min(cache_blocks, -(-TARGET_PROGRAMS // (batch * query_blocks))))


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
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
    tiles: MLATiles = MLATiles(),
    interpret: bool = False,
):
    """Same contract as `mla_attention_reference`; float32 output [B, T, N, R]."""
    block_q, block_k = tiles.block_q, tiles.block_k
    if not interpret and block_k < MIN_DOT:
        raise ValueError(f"block_k must be >= {MIN_DOT} for the compiled kernel, got {block_k}")
    b, t, n, r = q_lat.shape
    s, p = cache_ckv.shape[1], q_pe.shape[-1]
    q = t * n
    bq = max(MIN_DOT, min(block_q, pl.next_power_of_2(q)))
    q_pad = pl.cdiv(q, bq) * bq
    s_pad = pl.cdiv(s, block_k) * block_k
    dtype = cache_ckv.dtype

    def rows(x):  # [B, T, N, X] -> [B, Q_pad, X]
        x = x.reshape(b, q, x.shape[-1]).astype(dtype)
        return jnp.pad(x, ((0, 0), (0, q_pad - q), (0, 0)))

    # Block shapes are powers of two, and 16 or more (Triton's dots give wrong sums below
    # that: one AR token on the GPU did): the new tokens are padded to t_pad (invisible keys).
    t_pad = max(MIN_DOT, pl.next_power_of_2(t))
    # Row t * N + h of the query block belongs to token t: expand the mask to rows.
    mask = jnp.repeat(new_mask.astype(jnp.int32), n, axis=1)
    mask = jnp.pad(mask, ((0, 0), (0, q_pad - q), (0, t_pad - t)))
    mask = mask.at[:, q:, 0].set(1)  # padding query rows see one key: no empty softmax
    new_ckv = jnp.pad(new_ckv.astype(dtype), ((0, 0), (0, t_pad - t), (0, 0)))
    new_kpe = jnp.pad(new_kpe.astype(dtype), ((0, 0), (0, t_pad - t), (0, 0)))
    # A cache whose capacity is a multiple of block_k (generate rounds it) is used as is:
    # padding would copy the whole cache on every call.
    ckv, kpe = cache_ckv, cache_kpe
    if s_pad != s:
        ckv = jnp.pad(cache_ckv, ((0, 0), (0, s_pad - s), (0, 0)))
        kpe = jnp.pad(cache_kpe, ((0, 0), (0, s_pad - s), (0, 0)))
    lens = jnp.minimum(cache_len.astype(jnp.int32), s)[:, None]

    nq, cache_blocks = q_pad // bq, s_pad // block_k
    ns = tiles.num_splits or num_cache_splits(b, nq, cache_blocks)
    chunk = pl.cdiv(cache_blocks, ns) * block_k
    acc, m, denom = pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_k=block_k, chunk=chunk),
        grid=(b, nq, ns + 1),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, j, k: (i, 0)),
            pl.BlockSpec((None, bq, r), lambda i, j, k: (i, j, 0)),
            pl.BlockSpec((None, bq, p), lambda i, j, k: (i, j, 0)),
            pl.BlockSpec((None, s_pad, r), lambda i, j, k: (i, 0, 0)),
            pl.BlockSpec((None, s_pad, p), lambda i, j, k: (i, 0, 0)),
            pl.BlockSpec((None, t_pad, r), lambda i, j, k: (i, 0, 0)),
            pl.BlockSpec((None, t_pad, p), lambda i, j, k: (i, 0, 0)),
            pl.BlockSpec((None, bq, t_pad), lambda i, j, k: (i, j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bq, r), lambda i, j, k: (i, k, j, 0)),
            pl.BlockSpec((None, None, bq), lambda i, j, k: (i, k, j)),
            pl.BlockSpec((None, None, bq), lambda i, j, k: (i, k, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, ns + 1, q_pad, r), jnp.float32),
            jax.ShapeDtypeStruct((b, ns + 1, q_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, ns + 1, q_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(lens, rows(q_lat), rows(q_pe), ckv, kpe, new_ckv, new_kpe, mask)
    return _combine(acc, m, denom)[:, :q].reshape(b, t, n, r)
