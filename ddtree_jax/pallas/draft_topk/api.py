"""Dispatch for the drafter's log-softmax top k (see reference.py for the notation)."""

from __future__ import annotations

import jax

from ddtree_jax.pallas import runs_unpartitioned_kernel
from ddtree_jax.pallas.draft_topk.kernel import DraftTopKTiles, log_softmax_top_k_pallas, takes
from ddtree_jax.pallas.draft_topk.reference import log_softmax_top_k_xla

AUTO_KERNEL = True
"""Whether "auto" takes the kernel on a GPU (False: the XLA path, for before / after runs:
`experiments/profile_round.py --set ddtree_jax.pallas.draft_topk.api.AUTO_KERNEL=False`).
Read when a program is traced."""

AUTO_MAX_K = 16
""""auto" takes the kernel for at most this many ranks: its selection costs two reductions of
the row a rank, where XLA's sorts cost the same for any K."""

__all__ = ["DraftTopKTiles", "log_softmax_top_k", "uses_kernel"]

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
      tiles: the kernel's `DraftTopKTiles` (None: the defaults).

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
        tiles=tiles or DraftTopKTiles(),
        interpret=jax.default_backend() != "gpu",
    )
    return values.reshape(*lead, k), ids.reshape(*lead, k)
