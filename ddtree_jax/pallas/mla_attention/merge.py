"""The MLA partials' merge as one Triton-lowered Pallas kernel (`MERGE_KERNEL`).

Notation as in mosaic.py: K partials (the cache splits, and the new tokens' split when the
Mosaic kernel attends them), Kp = K rounded up to a power of two (a Triton block), Q query
rows, R latent width, P rope width, BR columns per program (`block_r`).

The XLA merge (`partials.merge`) is a few launches beside the attention kernel (on an H100 at
64 heads, 32K, AR: five, 11.8 us of the call's 33.5; docs/benchmarks.md, session 35). Here
program (b, q, j) loads the K partials' [Kp, BR] tile of row q at once (masked past K),
with their log-sum-exps, and writes the row's merged, normalized BR columns. The new tokens'
partial, where the attention kernel did not attend them, is a (K + 1)-th term: XLA's
(`mosaic._new_partial`; at AR its output is the key's c_kv for every head, passed once), or,
with `MERGE_EXTENDED`, at AR the one new key scored here from the query row (its weight is 1
and its log-sum-exp its score). One launch, with the normalization and the exp of the
weights inside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas.mla_attention.reference import MASK_VALUE

MERGE_KERNEL = True
"""Whether `mosaic.mla_attention_mosaic` merges its partials with this kernel where `takes`
(False: the XLA merge). Read when traced. Measured on an H100 at 32K, batch-1 AR, 128 splits
(session 36, docs/benchmarks.md; `experiments/mla_splits.py --set
ddtree_jax.pallas.mla_attention.merge.MERGE_KERNEL=True` against False, alternated twice):
the call went 0.0335-0.0336 -> 0.0299-0.0300 ms at 64 heads and 0.0325-0.0327 -> 0.0312-0.0315
at 8 heads."""

MERGE_EXTENDED = True
"""Whether the kernel also takes K that is no power of two (trees, batch > 1, the one-wave
split counts; up to `MAX_PARTIALS`) and, at AR, scores the new key itself instead of XLA
(two launches fewer). On since session 38: on one H200 it was as fast or faster at every
shape timed (AR batch 1, 64 heads at 32K: 0.0261 -> 0.0237 ms; 8 heads: 0.0274 -> 0.0250;
8-head trees of 17 / 33 tokens: 0.0658 -> 0.0545, 0.0767 -> 0.0733), the rest within 1%
(`experiments/mla_splits.py --heads 64 8 --contexts 32768 --batches 1 8 --tokens 1 17 33 65
--every --set ddtree_jax.pallas.mla_attention.merge.MERGE_EXTENDED=False|True`,
docs/results/s38/mla_merge_*.log). Read when traced."""

BLOCK_R = 128
"""Latent columns per program, up to 128 partials (`block_r`)."""

TILE_ELEMENTS = 128 * 128
"""A program's [Kp, BR] float32 tile: 128 registers a thread of its 4 warps."""

MAX_PARTIALS = 256
"""The most partials a program loads at once (then 64 columns a program)."""


def takes(o: jax.Array) -> bool:
    """Whether the kernel merges partials o [B, K, Qp, R]: R a multiple of BLOCK_R, K a power of
    two (any K <= MAX_PARTIALS with `MERGE_EXTENDED`)."""
    k, r = o.shape[1], o.shape[-1]
    pow2 = k & (k - 1) == 0
    return k <= MAX_PARTIALS and r % BLOCK_R == 0 and (pow2 or MERGE_EXTENDED)


def takes_key(r: int, p: int) -> bool:
    """Whether the kernel can score an AR key itself (`merge_partials`' `key`): it loads whole
    latent and rope rows, so R and P must be powers of two (Triton blocks)."""
    return r & (r - 1) == 0 and p & (p - 1) == 0


def block_r(k: int) -> int:
    """Columns per program for K partials: BLOCK_R, fewer past 128 partials (`TILE_ELEMENTS`)."""
    return min(BLOCK_R, TILE_ELEMENTS // pl.next_power_of_2(k))


def _kernel(o_ref, lse_ref, *rest, k, new, scale):
    f32 = jnp.float32
    kp = lse_ref.shape[0]
    real = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0) < k  # the block's rows past K are not read
    lse = plgpu.load(lse_ref, mask=real, other=-jnp.inf)  # [Kp]
    o = plgpu.load(o_ref, mask=real[:, None], other=0.0).astype(f32)  # [Kp, BR]
    out_ref = rest[-1]
    if new == "rows":  # XLA's partial of the new tokens for this row (or its group of `shared`)
        new_o_ref, new_lse_ref = rest[:2]
        new_o, new_lse = new_o_ref[...], new_lse_ref[0]
    elif new == "key":  # AR: the one new key, its score from the query row
        q_lat_ref, q_pe_ref, ckv_ref, kpe_ref, ckv_cols_ref, valid_ref = rest[:6]
        score = jnp.sum(q_lat_ref[...].astype(f32) * ckv_ref[...].astype(f32))
        score += jnp.sum(q_pe_ref[...].astype(f32) * kpe_ref[...].astype(f32))
        new_o, new_lse = ckv_cols_ref[...].astype(f32), jnp.where(valid_ref[0] != 0, score * scale, MASK_VALUE)
    top = jnp.max(lse)
    if new != "none":
        top = jnp.maximum(top, new_lse)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # every partial empty: weights 0, output 0
    w = jnp.exp(lse - top)  # [Kp]; an empty partial (lse = -inf) weighs 0
    acc = jnp.sum(w[:, None] * o, axis=0)  # [BR]
    total = jnp.sum(w)
    if new != "none":
        w_new = jnp.exp(new_lse - top)
        acc, total = acc + w_new * new_o, total + w_new
    out_ref[...] = acc / jnp.where(total > 0, total, 1.0)


@functools.partial(jax.jit, static_argnames=("rows", "shared", "scale", "interpret"))
def merge_partials(
    o: jax.Array,  # [B, K, Qp, R] normalized partials, any float dtype
    lse: jax.Array,  # [B, K, Qp] float32, -inf for an empty partial
    new: tuple[jax.Array, jax.Array] | None = None,  # (o [B, Q / shared, R], lse [B, Q] float32)
    key: tuple[jax.Array, ...] | None = None,  # (q_lat, q_pe, ckv, kpe, valid): see Args
    *,
    rows: int,
    shared: int = 1,
    scale: float = 1.0,
    interpret: bool = False,
) -> jax.Array:  # [B, Q, R] float32
    """The first `rows` (Q) query rows' partials merged by log-sum-exp, as `partials.merge`.

    Args:
      o, lse: the partials and their natural-log log-sum-exps.
      new: the new tokens' partial from XLA, or None; its output rows may be shared by
        `shared` consecutive query rows (at AR the key's c_kv, once for all heads).
      key: at AR, the one new key instead of `new`: q_lat [B, Qp, R] and q_pe [B, Qp, P], the
        query rows as the attention kernel saw them; the key's ckv [B, 1, R] and kpe [B, 1, P];
        valid [B], whether row b's key is visible. Its score is scale * (q_lat . ckv + q_pe .
        kpe) in float32 (masked: MASK_VALUE), its output term ckv.
      rows: Q, the real query rows (of Qp).
      shared: query rows per output row of `new`.
      scale: the scores' scale (with `key`).
      interpret: run on the CPU.
    """
    b, k, _, r = o.shape
    if not takes(o):
        raise ValueError(
            f"merge_partials needs K a power of two (any K <= {MAX_PARTIALS} with MERGE_EXTENDED) and "
            f"R % {BLOCK_R} == 0, got K={k}, R={r}"
        )
    if new is not None and key is not None:
        raise ValueError("merge_partials takes the new tokens' partial or the AR key, not both")
    kp, br = pl.next_power_of_2(k), block_r(k)
    in_specs = [
        pl.BlockSpec((None, kp, None, br), lambda i, q, j: (i, 0, q, j)),
        pl.BlockSpec((None, kp, None), lambda i, q, j: (i, 0, q)),
    ]
    args = [o, lse]
    mode = "none"
    if new is not None:
        mode = "rows"
        in_specs += [
            pl.BlockSpec((None, None, br), lambda i, q, j: (i, q // shared, j)),
            pl.BlockSpec((None, 1), lambda i, q, j: (i, q)),
        ]
        args += [new[0].astype(jnp.float32), new[1].astype(jnp.float32)]
    elif key is not None:
        mode = "key"
        q_lat, q_pe, ckv, kpe, valid = key
        p = q_pe.shape[-1]
        if not takes_key(r, p):
            raise ValueError(f"merge_partials scores an AR key only for R and P powers of two, got R={r}, P={p}")
        in_specs += [
            pl.BlockSpec((None, None, r), lambda i, q, j: (i, q, 0)),
            pl.BlockSpec((None, None, p), lambda i, q, j: (i, q, 0)),
            pl.BlockSpec((None, None, r), lambda i, q, j: (i, 0, 0)),
            pl.BlockSpec((None, None, p), lambda i, q, j: (i, 0, 0)),
            pl.BlockSpec((None, None, br), lambda i, q, j: (i, 0, j)),
            pl.BlockSpec((None, 1), lambda i, q, j: (i, 0)),
        ]
        args += [q_lat, q_pe, ckv, kpe, ckv, valid.astype(jnp.int32).reshape(b, 1)]
    return pl.pallas_call(
        functools.partial(_kernel, k=k, new=mode, scale=scale),
        grid=(b, rows, r // br),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, br), lambda i, q, j: (i, q, j)),
        out_shape=jax.ShapeDtypeStruct((b, rows, r), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(*args)
