"""One speculative round as pure functions: draft -> build tree -> verify -> accept -> commit.

Notation: B batch, N tree slots (1 + budget; slot 0 = root), D draft depth,
Dp = D + 1 the longest accepted path (root included), L committed length.

Plain AR decoding is the round whose tree is the root alone; DFlash's is a chain;
DDTree's is the best tree under a budget. `step` composes the functions below and
is what `generate` runs in its `lax.while_loop`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax import tree as trees
from ddtree_jax.cache import KVCache, LatentKV
from ddtree_jax.model import ForwardOutput, TargetParams, forward, logits
from ddtree_jax.sampling import SamplingConfig, choose


@struct.dataclass
class Acceptance:
    """Result of the acceptance walk."""

    path: jax.Array  # [B, Dp] tree slots of the accepted path (root first); padding repeats the last
    length: jax.Array  # [B] a = accepted slots including the root (= tokens emitted this round)
    bonus: jax.Array  # [B] the target's token after the path: the next root


def build_tree(method: str, draft_logits: jax.Array | None, roots: jax.Array, budget: int) -> trees.DraftTree:
    """The round's tree: root only ("ar"), argmax chain ("dflash") or best tree ("ddtree")."""
    if method == "ar":
        return trees.root_only(roots)
    if method == "dflash":
        return trees.build_chain(draft_logits, roots)
    return trees.build_ddtree(draft_logits, roots, budget)


def verify(
    target: TargetParams,
    cache: KVCache,
    tree: trees.DraftTree,
    *,
    tap_layers: tuple[int, ...] = (),
    implementation: str = "xla",
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
            implementation=implementation,
            numerics=numerics,
            span=tree.max_depth + 1,
        )


def target_choices(
    target: TargetParams, hidden: jax.Array, key: jax.Array, sampling: SamplingConfig, numerics: str | None = None
) -> jax.Array:
    """The target's token at every slot [B, N]: argmax, or an independent sample per slot."""
    return choose(logits(target, hidden, numerics=numerics), key, sampling)


def accept(tree: trees.DraftTree, choices: jax.Array) -> Acceptance:
    """Walks down from the root while some child carries the target's choice.

    Siblings carry distinct tokens, so at most one child matches. Each emitted
    token is the target's own choice given the path so far: greedy output equals
    AR greedy, and sampled output has the target's distribution.
    """
    b, dp = tree.tokens.shape[0], tree.max_depth + 1

    def down(i, carry):
        cur, length, alive, path = carry
        t = jnp.take_along_axis(choices, cur[:, None], 1)
        # The root's parent is -1, so it never matches.
        match = tree.valid & (tree.parents == cur[:, None]) & (tree.tokens == t) & alive[:, None]
        found = jnp.any(match, axis=1)
        cur = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32), cur)
        return cur, length + found, found, path.at[:, i + 1].set(cur)

    zeros = jnp.zeros((b,), jnp.int32)
    init = (zeros, zeros + 1, jnp.ones((b,), jnp.bool_), jnp.zeros((b, dp), jnp.int32))
    cur, length, _, path = jax.lax.fori_loop(0, tree.max_depth, down, init, unroll=True)  # no per-depth device loop
    bonus = jnp.take_along_axis(choices, cur[:, None], 1)[:, 0]
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
