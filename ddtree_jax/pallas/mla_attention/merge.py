"""The MLA partials' merge as one Triton-lowered Pallas kernel (`MERGE_KERNEL`).

Notation as in mosaic.py: K partials (the cache splits, and the new tokens' split when the
Mosaic kernel attends them), Q query rows, R latent width, BR columns per program.

The XLA merge (`partials.merge`) is a few launches beside the attention kernel (on an H100 at
64 heads, 32K, AR: five, 11.8 us of the call's 33.5; docs/benchmarks.md, session 35). Here
program (b, q, j) loads the K partials' [K, BR] tile of row q at once, with their K
log-sum-exps, and writes the row's merged, normalized BR columns; the new tokens' partial of
XLA (`mosaic._new_partial`), where there is one, is a (K + 1)-th term. One launch, and the
normalization and the exp of the weights inside it.

K must be a power of two (a Triton block; `takes`), as the splits chosen for a batch-1 AR
step at 64 heads are (128); other counts keep the XLA merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MERGE_KERNEL = True
"""Whether `mosaic.mla_attention_mosaic` merges its partials with this kernel where `takes`
(False: the XLA merge). Read when traced. Measured on an H100 at 32K, batch-1 AR, 128 splits
(session 36, docs/benchmarks.md; `experiments/mla_splits.py --set
ddtree_jax.pallas.mla_attention.merge.MERGE_KERNEL=True` against False, alternated twice):
the call went 0.0335-0.0336 -> 0.0299-0.0300 ms at 64 heads and 0.0325-0.0327 -> 0.0312-0.0315
at 8 heads."""

BLOCK_R = 128
"""Latent columns per program."""


def takes(o: jax.Array) -> bool:
    """Whether the kernel merges partials o [B, K, Qp, R]: K a power of two, R a multiple of BLOCK_R."""
    k, r = o.shape[1], o.shape[-1]
    return k & (k - 1) == 0 and r % BLOCK_R == 0


def _kernel(o_ref, lse_ref, *rest, has_new):
    f32 = jnp.float32
    lse = lse_ref[...]  # [K]
    top = jnp.max(lse)
    if has_new:
        new_o_ref, new_lse_ref, out_ref = rest
        new_lse = new_lse_ref[0]
        top = jnp.maximum(top, new_lse)
    else:
        (out_ref,) = rest
    top = jnp.where(top == -jnp.inf, 0.0, top)  # every partial empty: weights 0, output 0
    w = jnp.exp(lse - top)  # [K]; an empty partial (lse = -inf) weighs 0
    acc = jnp.sum(w[:, None] * o_ref[...].astype(f32), axis=0)  # [BR]
    total = jnp.sum(w)
    if has_new:
        w_new = jnp.exp(new_lse - top)
        acc, total = acc + w_new * new_o_ref[...], total + w_new
    out_ref[...] = acc / jnp.where(total > 0, total, 1.0)


@functools.partial(jax.jit, static_argnames=("rows", "shared", "interpret"))
def merge_partials(
    o: jax.Array,  # [B, K, Qp, R] normalized partials, any float dtype
    lse: jax.Array,  # [B, K, Qp] float32, -inf for an empty partial
    new: tuple[jax.Array, jax.Array] | None = None,  # (o [B, Q / shared, R], lse [B, Q] float32)
    *,
    rows: int,
    shared: int = 1,
    interpret: bool = False,
) -> jax.Array:  # [B, Q, R] float32
    """The first `rows` (Q) query rows' partials merged by log-sum-exp, as `partials.merge`.

    `new`'s output rows may be shared by `shared` consecutive query rows: at AR the new
    token's partial output is its latent c_kv for every head (one key: weight 1), so it is
    passed once, [B, 1, R], not broadcast over the heads."""
    b, k, _, r = o.shape
    if not takes(o):
        raise ValueError(f"merge_partials needs K a power of two and R % {BLOCK_R} == 0, got K={k}, R={r}")
    in_specs = [
        pl.BlockSpec((None, k, None, BLOCK_R), lambda i, q, j: (i, 0, q, j)),
        pl.BlockSpec((None, k, None), lambda i, q, j: (i, 0, q)),
    ]
    args = [o, lse]
    if new is not None:
        in_specs += [
            pl.BlockSpec((None, None, BLOCK_R), lambda i, q, j: (i, q // shared, j)),
            pl.BlockSpec((None, 1), lambda i, q, j: (i, q)),
        ]
        args += [new[0].astype(jnp.float32), new[1].astype(jnp.float32)]
    return pl.pallas_call(
        functools.partial(_kernel, has_new=new is not None),
        grid=(b, rows, r // BLOCK_R),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, BLOCK_R), lambda i, q, j: (i, q, j)),
        out_shape=jax.ShapeDtypeStruct((b, rows, r), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(*args)
