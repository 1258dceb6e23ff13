"""Draft trees built on the device, inside jit, as fixed-size arrays.

Notation: B batch, D draft depth (block_size - 1), V vocab, N = 1 + budget tree
slots (slot 0 is the root), K = min(budget, V) candidate tokens per depth.

A node is a rank path (r_1, ..., r_d): the r_i-th most likely drafter token at
depth i. Its score is sum_i logp[i, r_i]. DDTree's tree is the set of the
`budget` best rank paths under the total order (score descending, then rank path
lexicographically ascending, shorter prefix first), which is the order the
reference's best-first heap pops them in. That set is prefix-closed, so it is a
tree, and nodes listed in that order have parent index < child index.

`build_ddtree` finds it without a heap, in one of two exact ways:
- Enumeration (budgets up to 64 at D = 15): a path is in the tree only if fewer than
  `budget` paths precede it. Every path of depth j <= d whose ranks are <= the path's
  first j ranks precedes it (or is it), and there are sum_j prod_{i<=j}(r_i + 1) of
  them, so only paths with that sum <= budget are eligible. That set is small (3576
  paths at budget 32, 29934 at 64) and fixed for (budget, D, K): it is listed once on
  the host in lexicographic order, and on the device a round scores all of it at once
  and keeps a stable top-`budget`: a handful of kernels instead of a loop over depths.
- Beam (larger budgets): the best `budget` paths of depth d extend only the best
  `budget` paths of depth d - 1 (any path that beats a parent gives a child that beats
  its child), so a beam of width `budget` over the depths, then one merge across
  depths, is exact. Each depth extends only the ~budget * ln(budget) (parent, rank)
  pairs that can still make the beam (`_eligible`) and sorts them by (score,
  lexicographic id).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax import topk
from ddtree_jax.pallas.draft_topk import api as draft_topk
from ddtree_jax.sampling import check_float32_positive

MAX_BUDGET = 1024
# Enumerate eligible rank paths up to this many (a [P, D] int32 constant in the program).
MAX_ENUMERATED_PATHS = 1 << 15


@struct.dataclass
class DraftTree:
    """A batch of draft trees; slot 0 of each is the root (the previous round's bonus token).

    Slots past a tree's node count are padding: valid False, token 0, parent 0,
    visible to nobody but themselves.
    """

    tokens: jax.Array  # [B, N] int32
    parents: jax.Array  # [B, N] int32, -1 for the root
    depths: jax.Array  # [B, N] int32, 0 for the root
    valid: jax.Array  # [B, N] bool
    visibility: jax.Array  # [B, N, N] bool: [b, i, j] iff j is an ancestor of i or i itself
    max_depth: int = struct.field(pytree_node=False)  # static bound on node depth (D)

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1]

    def positions(self, lengths: jax.Array) -> jax.Array:
        """Absolute positions [B, N] of the slots for committed lengths [B]: L + depth."""
        return lengths[:, None] + self.depths


def check_budget(budget) -> None:
    """Raises TypeError unless budget is an int (not a bool or a float), ValueError outside [1, MAX_BUDGET]."""
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"tree budget must be an int in [1, {MAX_BUDGET}], got {budget!r} ({type(budget).__name__})")
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"tree budget must be an int in [1, {MAX_BUDGET}], got {budget!r}")


def check_tree_temperature(temperature) -> float:
    """Returns the tree temperature as a float; raises TypeError unless it is a real number,
    ValueError unless it is finite and > 0."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"tree temperature must be a real number > 0, got {temperature!r} ({type(temperature).__name__})"
        )
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"tree temperature must be finite and > 0, got {temperature!r}")
    check_float32_positive("tree temperature", temperature, zero_means="a larger one")
    return float(temperature)


def _assemble(roots, tokens, parents, depths, valid, node_vis, max_depth) -> DraftTree:
    """Prepends the root slot; node_vis [B, n, n] is ancestor-or-self among the nodes."""
    b, n_nodes = tokens.shape
    tokens = jnp.concatenate([roots[:, None], jnp.where(valid, tokens, 0)], axis=1).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((b, 1), -1), jnp.where(valid, parents, 0)], axis=1).astype(jnp.int32)
    depths = jnp.concatenate([jnp.zeros((b, 1)), jnp.where(valid, depths, 0)], axis=1).astype(jnp.int32)
    valid = jnp.concatenate([jnp.ones((b, 1), jnp.bool_), valid], axis=1)
    vis = jnp.zeros((b, n_nodes + 1, n_nodes + 1), jnp.bool_).at[:, 1:, 1:].set(node_vis)
    vis = vis.at[:, :, 0].set(True)  # every node sees the root
    # Padding slots see only themselves, and no slot sees a padding slot.
    vis = (vis & valid[:, :, None] & valid[:, None, :]) | jnp.eye(n_nodes + 1, dtype=jnp.bool_)
    return DraftTree(
        tokens=tokens, parents=parents, depths=depths, valid=valid, visibility=vis, max_depth=min(max_depth, n_nodes)
    )


def root_only(roots: jax.Array) -> DraftTree:
    """The tree of plain AR decoding: the root alone. roots: [B]."""
    b = roots.shape[0]
    z = jnp.zeros((b, 0), jnp.int32)
    return _assemble(roots, z, z, z, jnp.zeros((b, 0), jnp.bool_), jnp.zeros((b, 0, 0), jnp.bool_), 0)


def build_chain(draft_logits: jax.Array, roots: jax.Array) -> DraftTree:
    """DFlash's tree: one node per depth, the drafter's argmax. draft_logits [B, D, V] -> N = 1 + D."""
    b, d, _ = draft_logits.shape
    tokens = jnp.argmax(draft_logits, axis=-1).astype(jnp.int32)
    parents = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (b, d))
    depths = parents + 1
    chain_vis = jnp.broadcast_to(jnp.tril(jnp.ones((d, d), jnp.bool_)), (b, d, d))
    return _assemble(roots, tokens, parents, depths, jnp.ones((b, d), jnp.bool_), chain_vis, d)


def _eligible(width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(p, j) pairs with (p + 1)(j + 1) <= width, j < k: the only extensions that can make a beam.

    With parents in beam order (score descending, then lexicographic) and children in
    rank order, candidate (p, j) comes after every (p' <= p, j' <= j) in the total
    order (ties included: the parent or the rank breaks them the same way), so
    (p + 1)(j + 1) - 1 candidates precede it. About width * ln(width) pairs instead of
    width * k.
    """
    p = np.concatenate([np.full(min(k, width // (i + 1)), i) for i in range(width)])
    j = np.concatenate([np.arange(min(k, width // (i + 1))) for i in range(width)])
    return p.astype(np.int32), j.astype(np.int32)


@functools.lru_cache(maxsize=32)
def _eligible_paths(budget: int, d: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Every rank path with sum_j prod_{i<=j}(r_i + 1) <= budget, depth <= d, ranks < k.

    Returns (ranks [P, d] with -1 past the path's depth, depth [P], parent [P] index of
    the path's parent or -1), paths in lexicographic order with prefixes first (the
    tie order of the pop order); None when there are more than MAX_ENUMERATED_PATHS.
    """
    r = np.arange(min(k, budget), dtype=np.int64)
    ranks = np.full((len(r), d), -1, np.int64)
    ranks[:, 0] = r
    prod = count = r + 1
    levels = [(ranks, np.full(len(r), -1, np.int64))]  # (ranks, parent index in the previous level)
    total = len(r)
    for j in range(1, d):
        n_child = np.clip((budget - count) // prod, 0, k)  # ranks r with count + prod (r + 1) <= budget
        if not n_child.any():
            break
        parent = np.repeat(np.arange(len(prod)), n_child)
        rank = np.arange(n_child.sum()) - np.repeat(np.cumsum(n_child) - n_child, n_child)
        ranks = ranks[parent]
        ranks[:, j] = rank
        prod = prod[parent] * (rank + 1)
        count = count[parent] + prod
        levels.append((ranks, parent + total - len(levels[-1][0])))
        total += len(rank)
        if total > MAX_ENUMERATED_PATHS:
            return None
    ranks = np.concatenate([q for q, _ in levels])
    parents = np.concatenate([p for _, p in levels])
    depth = np.concatenate([np.full(len(q), i + 1) for i, (q, _) in enumerate(levels)])
    order = np.lexsort([ranks[:, j] for j in reversed(range(d))])  # -1 sorts first: prefixes first
    new_index = np.empty(total, np.int64)
    new_index[order] = np.arange(total)
    parents = np.where(parents[order] >= 0, new_index[np.maximum(parents[order], 0)], -1)
    return ranks[order].astype(np.int32), depth[order].astype(np.int32), parents.astype(np.int32)


def enumerated_paths(budget: int, depth: int, vocab: int) -> int | None:
    """How many rank paths `build_ddtree` scores when it enumerates, at this shape.

    Args:
      budget: node budget (1..MAX_BUDGET).
      depth: drafted depths D (block size - 1).
      vocab: vocabulary size V (ranks run below min(budget, V)).

    Returns:
      The number of eligible paths, or None when there are more than
      MAX_ENUMERATED_PATHS: then method="auto" builds with the beam, and
      method="enumerate" raises.
    """
    check_budget(budget)
    if depth < 1 or vocab < 1:
        raise ValueError(f"depth and vocab must be >= 1, got depth={depth}, vocab={vocab}")
    paths = _eligible_paths(int(budget), int(depth), min(int(budget), int(vocab)))
    return None if paths is None else len(paths[1])


def _finish(roots, top_tok, order, n_candidates, node_ranks, node_depth, node_parent, valid) -> DraftTree:
    """Tree arrays from the chosen nodes in pop order.

    order [B, n] the chosen candidate ids (of n_candidates) in pop order; node_ranks
    [B, n, D] (-1 past each depth), node_depth [B, n] (1-based), node_parent [B, n] the
    parent's candidate id (-1 at depth 1).
    """
    b, n, d = node_ranks.shape
    # Tree index of every candidate (0 = not chosen), to turn parent ids into parent nodes.
    index_of = (
        jnp.zeros((b, n_candidates), jnp.int32)
        .at[jnp.arange(b)[:, None], order]
        .set(jnp.arange(1, n + 1, dtype=jnp.int32))
    )
    last = jnp.take_along_axis(node_ranks, (node_depth - 1)[:, :, None], 2)[:, :, 0]
    flat_tok = top_tok.reshape(b, -1)
    node_tok = jnp.take_along_axis(flat_tok, (node_depth - 1) * top_tok.shape[2] + jnp.maximum(last, 0), 1)
    parents = jnp.where(node_parent >= 0, jnp.take_along_axis(index_of, jnp.maximum(node_parent, 0), 1), 0)
    # j is an ancestor-or-self of i iff j's rank path is a prefix of i's (unused ranks are -1).
    prefix = (node_ranks[:, None, :, :] < 0) | (node_ranks[:, :, None, :] == node_ranks[:, None, :, :])
    return _assemble(roots, node_tok, parents, node_depth, valid, jnp.all(prefix, axis=-1), d)


def _build_enumerated(top_lp, top_tok, roots, budget, paths) -> DraftTree:
    """Scores every eligible path (`_eligible_paths`) and keeps a stable top-`budget`."""
    ranks, depth, parent = paths
    _, d, k = top_lp.shape
    if len(depth) < budget:  # tiny vocab / depth: fewer paths than the budget, pad with -inf
        extra = budget - len(depth)
        ranks = np.concatenate([ranks, np.full((extra, d), -1, np.int32)])
        depth = np.concatenate([depth, np.ones(extra, np.int32)])
        parent = np.concatenate([parent, np.full(extra, -1, np.int32)])
    lp = jnp.pad(top_lp, ((0, 0), (0, 0), (0, 1)))  # column k: log p 0 for depths past the path
    cols = np.where(ranks < 0, k, ranks)
    # Summed depth by depth, in the order a parent's score plus its child's log p rounds.
    score = lp[:, 0, cols[:, 0]]
    for j in range(1, d):
        score = score + lp[:, j, cols[:, j]]
    score = jnp.where(jnp.asarray(ranks[:, 0] >= 0), score, -jnp.inf)
    # Stable: equal scores keep lexicographic order, which is the pop order's tie-break.
    node_score, order = topk.chunked_top_k(score, budget)
    return _finish(
        roots,
        top_tok,
        order,
        score.shape[1],
        jnp.asarray(ranks)[order],
        jnp.asarray(depth)[order],
        jnp.asarray(parent)[order],
        jnp.isfinite(node_score),
    )


def _build_beam(top_lp, top_tok, roots, budget) -> DraftTree:
    """A beam of width `budget` over the depths, then one merge across depths."""
    b, d, k = top_lp.shape
    # Depth 1: rank order is lexicographic order. Beam slots past K are padding (-inf).
    pad = budget - k
    score = jnp.pad(top_lp[:, 0], ((0, 0), (0, pad)), constant_values=-jnp.inf)  # [B, W], W = budget
    ranks = jnp.full((b, budget, d), -1, jnp.int32).at[:, :k, 0].set(jnp.arange(k, dtype=jnp.int32))
    parent_slot = jnp.full((b, budget), -1, jnp.int32)

    ep, ej = _eligible(budget, k)
    rows = jnp.arange(b)[:, None]
    slots = jnp.broadcast_to(jnp.arange(budget, dtype=jnp.int32), (b, budget))

    def level(carry, depth):
        score, ranks, by_score = carry  # beam in lexicographic order; by_score[q] = slot of the q-th best
        lp = jax.lax.dynamic_index_in_dim(top_lp, depth, axis=1, keepdims=False)  # [B, K]
        parent = by_score[:, ep]  # [B, M]
        cand = jnp.take_along_axis(score, parent, 1) + lp[:, ej]
        # Candidate id parent * K + rank is its lexicographic order: sort by (score desc, id asc).
        neg, ids = jax.lax.sort((-cand, parent * k + ej), num_keys=2)
        flat = jnp.where(jnp.isfinite(neg[:, :budget]), ids[:, :budget], budget * k)  # padding sorts last
        flat, score_pos = jax.lax.sort((flat, slots), num_keys=1)  # back to lexicographic order
        by_score = jnp.zeros_like(slots).at[rows, score_pos].set(slots)
        parent_slot = jnp.minimum(flat // k, budget - 1).astype(jnp.int32)
        rank = (flat % k).astype(jnp.int32)
        live = flat < budget * k
        score = jnp.where(live, jnp.take_along_axis(score, parent_slot, 1) + jnp.take_along_axis(lp, rank, 1), -jnp.inf)
        ranks = jnp.take_along_axis(ranks, parent_slot[:, :, None], 1).at[:, :, depth].set(jnp.where(live, rank, -1))
        # Parent as a candidate id of the stacked levels below: (depth - 1) * W + slot.
        return (score, ranks, by_score), (score, ranks, (depth - 1) * budget + parent_slot)

    # Unrolled: a GPU loop would pay a launch and a host round trip per level.
    _, deeper = jax.lax.scan(level, (score, ranks, slots), jnp.arange(1, d), unroll=True)

    # Levels stacked depth-major: candidate id = depth * W + slot.
    def stack(first, rest):
        both = jnp.concatenate([first[None], rest], axis=0)  # [D, B, W, ...]
        return jnp.moveaxis(both, 0, 1).reshape((b, d * budget, *first.shape[2:]))

    all_score, all_ranks, all_parent = (stack(f, r) for f, r in zip((score, ranks, parent_slot), deeper, strict=True))
    # Merge the depths: order by (score desc, rank path asc).
    keys = [all_ranks[..., j] for j in reversed(range(d))] + [-all_score]
    order = jnp.lexsort(keys, axis=-1)[:, :budget]  # [B, budget] candidate ids in pop order
    return _finish(
        roots,
        top_tok,
        order,
        d * budget,
        jnp.take_along_axis(all_ranks, order[:, :, None], 1),
        order // budget + 1,
        jnp.take_along_axis(all_parent, order, 1),
        jnp.isfinite(jnp.take_along_axis(all_score, order, 1)),
    )


def build_ddtree(
    draft_logits: jax.Array,
    roots: jax.Array,
    budget: int,
    *,
    method: str = "auto",
    temperature: float | jax.Array = 1.0,
    implementation: str = "auto",
) -> DraftTree:
    """DDTree's best tree of `budget` nodes from per-depth drafter logits.

    Args:
      draft_logits: [B, D, V] drafter logits for depths 1..D (any float dtype).
      roots: [B] the root tokens.
      budget: node budget, root not counted (1..MAX_BUDGET).
      method: "enumerate", "beam" or "auto" (enumerate when the eligible paths
        number at most MAX_ENUMERATED_PATHS); both give the same tree.
      temperature: the logits are divided by it before the tree is chosen (1.0: the
        drafter's distributions as they are; below 1 sharper). It shapes the tree only:
        which tokens are accepted is the target's choice either way. A float32 scalar
        array is taken as it is (traced: one program for every value; `generate` checks it).
      implementation: the per-depth log-softmax top-K's (`pallas.draft_topk`: "auto" takes its
        kernel on a GPU for K <= 16, "xla" `topk.chunked_top_k`).

    Returns:
      A DraftTree with N = 1 + budget slots, nodes in pop order. Fewer than
      `budget` nodes exist only when the vocabulary and depth allow fewer paths;
      the rest is padding.
    """
    check_budget(budget)
    traced = isinstance(temperature, jax.Array)
    if not traced:
        temperature = check_tree_temperature(temperature)
    if method not in ("auto", "enumerate", "beam"):
        raise ValueError(f"method must be 'auto', 'enumerate' or 'beam', got {method!r}")
    b, d, v = draft_logits.shape
    chex.assert_shape(roots, (b,))
    budget, k = int(budget), min(int(budget), v)
    paths = _eligible_paths(budget, d, k) if method != "beam" else None
    if method == "enumerate" and paths is None:
        raise ValueError(f"budget {budget} at depth {d} has more than {MAX_ENUMERATED_PATHS} eligible paths")
    with jax.named_scope("build_tree"):
        scale = jnp.asarray(temperature, jnp.float32) if traced or temperature != 1.0 else None
        # [B, D, K], ranks sorted descending
        top_lp, top_tok = draft_topk.log_softmax_top_k(draft_logits, k, scale, implementation=implementation)
        if paths is not None:
            return _build_enumerated(top_lp, top_tok, roots, budget, paths)
        return _build_beam(top_lp, top_tok, roots, budget)
