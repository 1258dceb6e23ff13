"""One speculative round as pure functions: draft -> build tree -> verify -> accept -> commit.

Notation: B batch, N tree slots (1 + budget; slot 0 = root), D draft depth,
Dp = D + 1 the longest accepted path (root included), L committed length.

Plain AR decoding is the round whose tree is the root alone; DFlash's is a chain;
DDTree's is the best tree under a budget. `step` composes the functions below into
the whole round (both caches committed) and is what `generate` runs in its
`lax.while_loop`; `generate` adds only stop tokens, lengths and records.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax import tree as trees
from ddtree_jax.cache import KVCache, LatentKV
from ddtree_jax.model import ForwardOutput, TargetParams, forward, logits
from ddtree_jax.sampling import Sampler, SamplingConfig, choose


@struct.dataclass
class Acceptance:
    """Result of the acceptance walk."""

    path: jax.Array  # [B, Dp] tree slots of the accepted path (root first); padding repeats the last
    length: jax.Array  # [B] a = accepted slots including the root (= tokens emitted this round)
    bonus: jax.Array  # [B] the target's token after the path: the next root


def build_tree(
    method: str,
    draft_logits: jax.Array | None,
    roots: jax.Array,
    budget: int,
    tree_temperature: float | jax.Array = 1.0,
    implementation: str = "auto",
) -> trees.DraftTree:
    """The round's tree: root only ("ar"), argmax chain ("dflash") or best tree ("ddtree",
    from the drafter's logits divided by `tree_temperature`; `implementation`: its top-K's)."""
    if method == "ar":
        return trees.root_only(roots)
    if method == "dflash":
        return trees.build_chain(draft_logits, roots)
    return trees.build_ddtree(draft_logits, roots, budget, temperature=tree_temperature, implementation=implementation)


def verify(
    target: TargetParams,
    cache: KVCache,
    tree: trees.DraftTree,
    *,
    tap_layers: tuple[int, ...] = (),
    tap_final_norm: bool = True,
    implementation: str = "auto",
    numerics: str | None = None,
) -> ForwardOutput:
    """One target forward over every tree slot at positions L + depth with the ancestor mask."""
    with jax.named_scope("verify"):
        return forward(
            target,
            tree.tokens,
            tree.positions(cache.lengths),
            cache,
            tree.visibility,
            tap_layers=tap_layers,
            tap_final_norm=tap_final_norm,
            implementation=implementation,
            numerics=numerics,
            span=tree.max_depth + 1,
        )


def target_choices(
    target: TargetParams,
    hidden: jax.Array,
    key: jax.Array,
    sampling: SamplingConfig | Sampler,
    numerics: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The target's token at every slot [B, N] (argmax, or an independent sample per slot),
    and whether that slot's logits were all finite [B, N]."""
    slot_logits = logits(target, hidden, numerics=numerics)  # [B, N, V]
    return choose(slot_logits, key, sampling), jnp.all(jnp.isfinite(slot_logits), axis=-1)


def accept(tree: trees.DraftTree, choices: jax.Array) -> Acceptance:
    """The longest path down from the root along which every node carries the target's
    choice at its parent (choices: [B, N], the target's token at each slot).

    Siblings carry distinct tokens, so at most one child matches and the accepted nodes
    form one path. Each emitted token is the target's own choice given the path so far:
    greedy output equals AR greedy, and sampled output has the target's distribution.

    Computed at once rather than walked depth by depth: a node is accepted iff every node
    on its root path (the visibility row: ancestors and itself) matches, the path ends at
    the deepest accepted node, and its slot at depth d is that node's ancestor at depth d.
    A walk is ~5 small kernels a depth on the GPU (75 a round at block 16), this is a few.
    """
    dp = tree.max_depth + 1
    at_parent = jnp.take_along_axis(choices, jnp.maximum(tree.parents, 0), 1)  # [B, N]
    is_root = tree.parents < 0
    matches = is_root | (tree.valid & (tree.tokens == at_parent))  # [B, N]
    accepted = ~jnp.any(tree.visibility & ~matches[:, None, :], axis=2)  # [B, N]: its whole root path matches
    end = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1).astype(jnp.int32)  # [B] deepest accepted
    length = jnp.take_along_axis(tree.depths, end[:, None], 1)[:, 0] + 1
    on_path = jnp.take_along_axis(tree.visibility, end[:, None, None], 1)[:, 0]  # [B, N]: root .. end
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == jnp.arange(dp)[None, :, None])  # [B, Dp, N]
    path = jnp.where(jnp.any(at_depth, axis=2), jnp.argmax(at_depth, axis=2), end[:, None]).astype(jnp.int32)
    bonus = jnp.take_along_axis(choices, end[:, None], 1)[:, 0]
    return Acceptance(path=path, length=length, bonus=bonus)


def path_tokens(tree: trees.DraftTree, acc: Acceptance) -> jax.Array:
    """The a tokens a round emits: accepted drafts then the bonus, [B, Dp] (past a: the bonus)."""
    drafted = jnp.take_along_axis(tree.tokens, acc.path, 1)  # root first
    j = jnp.arange(acc.path.shape[1])[None, :]
    shifted = jnp.concatenate([drafted[:, 1:], drafted[:, -1:]], axis=1)
    return jnp.where(j < acc.length[:, None] - 1, shifted, acc.bonus[:, None])


def commit(cache: KVCache, kv: LatentKV, acc: Acceptance, active: jax.Array) -> KVCache:
    """Moves the accepted path's latent entries to slots L .. L + a - 1; drops the rest.

    A node at depth d was computed at position L + d, which is its final slot, so
    nothing is re-rotated.
    """
    with jax.named_scope("commit"):
        path = acc.path
        gathered = jax.tree.map(lambda a: jnp.take_along_axis(a, path[None, :, :, None], axis=2), kv)
        j = jnp.arange(path.shape[1])[None, :]
        keep = (j < acc.length[:, None]) & active[:, None]
        slots = jnp.where(keep, cache.lengths[:, None] + j, cache.capacity)
        return cache.write(gathered, slots).replace(lengths=cache.lengths + jnp.where(active, acc.length, 0))


def path_features(taps: jax.Array, acc: Acceptance) -> jax.Array:
    """Tapped target features [n_taps, B, N, H] at the accepted path -> [n_taps, B, Dp, H]."""
    return jnp.take_along_axis(taps, acc.path[None, :, :, None], axis=2)


def first_nonfinite(finite: jax.Array, path: jax.Array) -> jax.Array:
    """Index along the accepted path [B, Dp] of the first slot whose logits were not
    finite (finite: [B, N]), or Dp if none."""
    ok = jnp.take_along_axis(finite, path, axis=1)
    return jnp.where(jnp.all(ok, axis=1), path.shape[1], jnp.argmin(ok, axis=1))


@struct.dataclass
class RoundOutput:
    """What one round gives each row."""

    tokens: jax.Array  # [B, Dp] accepted drafts then the bonus (`path_tokens`)
    length: jax.Array  # [B] a: tokens accepted, root included (= tokens emitted)
    bonus: jax.Array  # [B] the target's token after the path: the next root
    first_nonfinite: jax.Array  # [B] index into `tokens` of the first chosen from non-finite logits; Dp if none
    draft_nonfinite: jax.Array  # [B] bool: the drafter's logits were not all finite


def step(
    target: TargetParams,
    drafter: Any,
    cache: KVCache,
    draft_state: Any,
    roots: jax.Array,  # [B] newest token of each row, not yet in the cache
    active: jax.Array,  # [B] bool: rows that take part (the others are left unchanged)
    draft_key: jax.Array,
    choice_key: jax.Array,
    *,
    method: str,
    budget: int,
    sampling: SamplingConfig | Sampler,
    implementation: str = "auto",
    numerics: str | None = None,
    tree_temperature: float | jax.Array = 1.0,
) -> tuple[KVCache, Any, RoundOutput]:
    """One whole round: draft -> build tree -> verify -> accept -> commit.

    Commits the accepted path of every active row to the target cache and its tapped
    features to the drafter's context, so the next round starts from `bonus`.

    Args:
      target: target weights.
      drafter: a drafter (`drafters.protocol`), or None for "ar".
      cache: the committed target cache.
      draft_state: the drafter's state (`drafter.init_state`), or None.
      roots: each row's newest token.
      active: rows to advance.
      draft_key: the drafter's randomness.
      choice_key: randomness of the target's sampled choices.
      method: "ar", "dflash" or "ddtree" (see `build_tree`).
      budget: DDTree node budget.
      sampling: greedy or sampled choices (`sampling.SamplingConfig`, or a `Sampler`
        with traced values).
      implementation: kernel implementation of the verify forward.
      numerics: "exact" / "fast" (numerics.py); None picks by dtype.
      tree_temperature: DDTree's drafter logits are divided by it before the tree is
        chosen (`tree.build_ddtree`; a float32 scalar array: traced).

    Returns:
      (cache, draft_state, RoundOutput) after the round.
    """
    draft_logits = None
    draft_nonfinite = jnp.zeros(roots.shape, jnp.bool_)
    if drafter is not None:
        with jax.named_scope("draft"):
            draft_logits = drafter.propose(draft_state, target, cache, roots, draft_key)
        draft_nonfinite = active & ~jnp.all(jnp.isfinite(draft_logits), axis=(1, 2))
    with jax.named_scope("build_tree"):
        tree = build_tree(method, draft_logits, roots, budget, tree_temperature, implementation)
    taps = drafter.tap_layers if drafter is not None else ()
    normed = drafter.tap_final_norm if drafter is not None else True
    out = verify(
        target, cache, tree, tap_layers=taps, tap_final_norm=normed, implementation=implementation, numerics=numerics
    )
    choices, finite = target_choices(target, out.hidden, choice_key, sampling, numerics)
    acc = accept(tree, choices)
    if drafter is not None:
        j = jnp.arange(acc.path.shape[1])[None, :]
        valid = (j < acc.length[:, None]) & active[:, None]
        feats = None if out.taps is None else path_features(out.taps, acc)
        draft_state = drafter.observe(draft_state, feats, cache.lengths[:, None] + j, valid)
    result = RoundOutput(
        tokens=path_tokens(tree, acc),
        length=acc.length,
        bonus=acc.bonus,
        first_nonfinite=first_nonfinite(finite, acc.path),
        draft_nonfinite=draft_nonfinite,
    )
    return commit(cache, out.kv, acc, active), draft_state, result
