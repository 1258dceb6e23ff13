"""Numerics modes: how the target's reductions are ordered.

Notation: M rows (tokens: batch x new tokens, flattened), TM = ROW_TILE rows per tile.

XLA picks a kernel, and with it a rounding order, from an op's shapes. Measured on
XLA:CPU (jax 0.11.2): a token's row of `x @ w` differs in the last bits between
M = 1, M = 2..32 and M >= 33 rows, a column of it changes with the number of
columns, a row reduction changes once there are 33 rows, and `exp` of 3 elements
differs from `exp` of 16. The target's output for a token therefore depended on how
many other tokens shared its forward (the method's tree, the batch, the padded prompt
width) and on the cache capacity, and near-ties (two experts 1e-7 apart in router
score) let such 1-ulp differences change the greedy text hundreds of tokens later.

- "fast": XLA's kernels as they come. Deterministic for one program, but not
  across capacities, methods or batch layouts.
- "exact": every per-token op runs inside a loop over tiles of TM rows, so that every
  dot, reduction and elementwise op has the same shape whatever M is (the routed
  experts of a model with many, large experts in tiles of TM (token, expert) pairs of
  one expert, sorted by expert: `routed_in_pair_tiles`); attention
  walks the keys in blocks of KEY_BLOCK positions aligned to absolute positions with
  an online softmax (a block a query does not see adds exactly nothing), so the
  cache capacity and the layout of the new tokens do not enter the rounding. A token's
  hidden state is then a function of its own prefix alone: greedy output is bitwise
  the same at any capacity, for AR, DFlash and DDTree, alone or in a padded batch.

"exact" is the default for float32 weights on the XLA path; "fast" otherwise (bf16,
and the Pallas kernels, whose tiles follow the array sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

NUMERICS = ("fast", "exact")
ROW_TILE = 8
"""Rows per tile in "exact" mode: an AR step at batch 1 computes 8 rows for its one."""
EXACT_PAIR_TILES_MIN_RATIO = 8
EXACT_PAIR_TILES_MIN_WEIGHTS = 2**14


def routed_in_pair_tiles(n_experts: int, top_k: int, hidden: int, expert_intermediate: int) -> bool:
    """Whether "exact" mode runs the routed experts as (token, expert) pairs in tiles of one
    expert (`moe_pairs_in_tiles`: the routed work, plus a sort, a scatter and a loop) rather
    than every expert on every row tile (E / K times the routed work in fewer, simpler ops).

    Pairs when E >= EXACT_PAIR_TILES_MIN_RATIO * K and an expert's matrices hold at least
    EXACT_PAIR_TILES_MIN_WEIGHTS weights. Measured on a 2-core CPU: a forward of 2 x 65 tokens
    of the shipped target (E = 16, K = 2, 384 x 192) 566 -> 162 ms in pairs; the tests' tiny
    models (64 x 32), compile-bound, 27-43% slower in pairs.
    """
    return (
        n_experts >= EXACT_PAIR_TILES_MIN_RATIO * top_k and hidden * expert_intermediate >= EXACT_PAIR_TILES_MIN_WEIGHTS
    )


KEY_BLOCK = 64
"""Keys per attention block in "exact" mode; block j holds positions [64 j, 64 j + 64)."""


def resolve(numerics: str | None, dtype: Any, implementation: str = "xla") -> str:
    """The numerics mode to run: `numerics` if given, else "exact" for float32 on the XLA path
    ("xla", or "auto", which takes no kernel for float32).

    Raises:
      ValueError: an unknown mode, or "exact" with the Pallas kernels.
    """
    # "auto" takes no kernel for float32 (the kernels compute in bf16 / f16), and
    # "exact" replaces the ops' dispatch by its own XLA path anyway.
    if numerics is None:
        xla = implementation == "xla" or (implementation == "auto" and jnp.dtype(dtype) == jnp.float32)
        return "exact" if xla and jnp.dtype(dtype) == jnp.float32 else "fast"
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics {numerics!r}; choose one of {NUMERICS}")
    if numerics == "exact" and implementation not in ("xla", "auto"):
        raise ValueError(f"numerics='exact' runs on the XLA path only, not implementation={implementation!r}")
    return numerics


def tile_rows(fn: Callable[..., Any], *rows: jax.Array, tile: int = ROW_TILE) -> Any:
    """Applies a row-wise `fn` to arrays [M, ...] in tiles of `tile` rows.

    `fn` takes arrays [tile, ...] and returns a pytree of arrays [tile, ...]; row i of
    its output must depend on row i of its inputs alone. Rows are zero-padded to a
    multiple of `tile` and the tiles run one after another in a loop, so `fn` is
    compiled once at one shape: each row is computed the same way whatever M is.

    Returns:
      `fn`'s pytree with leaves [M, ...].
    """
    m = rows[0].shape[0]
    padded = -(-m // tile) * tile

    def split(a):
        a = jnp.pad(a, [(0, padded - m)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((padded // tile, tile, *a.shape[1:]))

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in rows))
    return jax.tree.map(lambda a: a.reshape((padded, *a.shape[2:]))[:m], out)
