"""Dispatch for the drafter's log-softmax top k (see reference.py for the notation)."""

from __future__ import annotations

import jax

from ddtree_jax.pallas import runs_unpartitioned_kernel
from ddtree_jax.pallas.draft_topk.kernel import (
    DraftTopKTiles,
    log_softmax_top_k_pallas,
    takes,
    takes_row,
    top_k_pallas,
)
from ddtree_jax.pallas.draft_topk.reference import log_softmax_top_k_xla
from ddtree_jax.topk import chunked_top_k

AUTO_KERNEL = True
"""Whether "auto" takes the kernel on a GPU (False: the XLA path, for before / after runs:
`experiments/profile_round.py --set ddtree_jax.pallas.draft_topk.api.AUTO_KERNEL=False`).
Read when a program is traced."""

AUTO_MAX_K = 16
""""auto" takes the kernel for at most this many ranks: its selection costs two reductions of
the row a rank, where XLA's sorts cost the same for any K."""

CHUNK = 0
"""The kernel's tiles when none are given: 0, `DraftTopKTiles()` (a program a row); else
`DraftTopKTiles(chunk=CHUNK, num_warps=CHUNK_WARPS)` (two launches, a program a chunk). Not yet
timed on a GPU: 0. Read when a program is traced (`--set ddtree_jax.pallas.draft_topk.api.CHUNK=512`
for before / after runs; with `AUTO_MAX_K=32` also for DDTree(32)'s tree)."""

CHUNK_WARPS = 2
"""Warps of each program of the two launches of `CHUNK`."""

AUTO_PATHS = False
"""Whether "auto" takes `top_k`'s kernel on a GPU (the enumerated tree's choice among its
eligible paths: 166 at budget 12, 3576 at 32, sorted by XLA in one or two launches). Not yet
timed on a GPU: off. Read when a program is traced."""

__all__ = ["DraftTopKTiles", "log_softmax_top_k", "top_k", "uses_kernel"]

AVAILABLE = ("auto", "xla", "pallas", "mosaic")
""""mosaic" has no kernel of its own here: it takes the XLA path."""


def uses_kernel(implementation: str, vocab: int, k: int) -> bool:
    """Whether `log_softmax_top_k` runs the kernel: "pallas" where `kernel.takes` holds, "auto"
    also only on a GPU, for k <= `AUTO_MAX_K`. Under a mesh, neither: the kernel is not
    partitioned."""
    return runs_unpartitioned_kernel(
        implementation, AVAILABLE, "draft_topk", takes(vocab, k), AUTO_KERNEL and k <= AUTO_MAX_K
    )


def log_softmax_top_k(
    logits: jax.Array,  # [..., V]
    k: int,
    temperature: jax.Array | None = None,
    *,
    implementation: str = "xla",
    tiles: DraftTopKTiles | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The K most likely tokens of each row of drafter logits and their log-probabilities.

    Args:
      logits: drafter logits, any float dtype.
      k: ranks kept, 1..V.
      temperature: None (the logits as they are), or a float32 scalar the logits are divided
        by first (`sampling.scaled_logits`).
      implementation: "xla" (`reference.log_softmax_top_k_xla`), "pallas" (the Triton-lowered
        kernel; the CPU interprets it), "auto" (`uses_kernel`), or "mosaic" (XLA).
      tiles: the kernel's `DraftTopKTiles` (None: `CHUNK`'s).

    Returns:
      (values [..., K] float32 log-probabilities, descending; ids [..., K] int32), ties to the
      lower id.
    """
    *lead, v = logits.shape
    if not 1 <= k <= v:
        raise ValueError(f"draft_topk: k must be in [1, {v}] for rows of {v} logits, got {k}")
    if not uses_kernel(implementation, v, k):
        return log_softmax_top_k_xla(logits, k, temperature)
    values, ids = log_softmax_top_k_pallas(
        logits.reshape(-1, v),
        temperature,
        k=k,
        tiles=tiles or (DraftTopKTiles(chunk=CHUNK, num_warps=CHUNK_WARPS) if CHUNK else DraftTopKTiles()),
        interpret=jax.default_backend() != "gpu",
    )
    return values.reshape(*lead, k), ids.reshape(*lead, k)


def top_k(x: jax.Array, k: int, *, implementation: str = "xla") -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` of float rows [..., N]: the same values, ids and order (ties to the lower
    id, NaN first).

    Args:
      x: the rows, any float dtype.
      k: ranks kept, 1..N.
      implementation: "xla" (`topk.chunked_top_k`), "pallas" (`kernel.top_k_pallas`, two
        launches over chunks of a row, where `kernel.takes_row` holds; the CPU interprets it),
        "auto" (the kernel on a GPU if `AUTO_PATHS`), or "mosaic" (XLA).
    """
    *lead, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"draft_topk.top_k: k must be in [1, {n}] for rows of {n}, got {k}")
    if not runs_unpartitioned_kernel(implementation, AVAILABLE, "draft_topk", takes_row(n, k), AUTO_PATHS):
        return chunked_top_k(x, k)
    values, ids = top_k_pallas(x.reshape(-1, n), k=k, interpret=jax.default_backend() != "gpu")
    return values.reshape(*lead, k).astype(x.dtype), ids.reshape(*lead, k)
