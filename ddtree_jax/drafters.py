"""Drafters behind one interface, so that AR, DFlash and DDTree share one decode loop.

A drafter proposes per-depth distributions for the tokens after the root:
`propose(...) -> logits [B, D, V]` for depths 1..D (D = block_size - 1). It sees
the target's tapped features of committed tokens through `observe`.

- `DFlashDrafter`: the trained DFlash block-diffusion drafter (drafter.py).
- `OracleDrafter`: proposes the target's own greedy continuation (tests: every
  full round must accept block_size tokens).
- `RandomDrafter`: random logits (tests: trees that are mostly rejected).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax import drafter as dflash
from ddtree_jax.cache import KVCache
from ddtree_jax.checks import check_int
from ddtree_jax.model import TargetParams, causal_mask, forward, logits


@struct.dataclass
class DFlashDrafter:
    """Adapter: a DFlash drafter's params as a decode-loop drafter."""

    params: dflash.DrafterParams
    block_size: int = struct.field(pytree_node=False)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.params.config.target_layer_ids)

    def init_state(self, target: TargetParams, batch: int, capacity: int) -> dflash.DrafterCache:
        return dflash.DrafterCache.init(self.params.config, batch, capacity, self.params.fc.dtype)

    def observe(self, state, taps, positions, valid):
        return dflash.extend_context(self.params, state, dflash.tap_features(taps), positions, valid)

    def propose(self, state, target: TargetParams, cache: KVCache, roots: jax.Array, key: jax.Array) -> jax.Array:
        b, bs = roots.shape[0], self.block_size
        mask_id = self.params.config.mask_token_id
        block = jnp.full((b, bs), mask_id, jnp.int32).at[:, 0].set(roots)
        positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)
        return dflash.draft(self.params, state, target.embed, target.unembed, block, positions)


class _Stateless:
    """Drafters that keep no state and read no target features."""

    tap_layers: tuple[int, ...] = ()

    def init_state(self, target, batch, capacity):
        return None

    def observe(self, state, taps, positions, valid):
        return state


@struct.dataclass
class OracleDrafter(_Stateless):
    """Proposes the target's greedy continuation of the root, as near one-hot logits.

    With `noise` > 0, Gaussian noise of that scale is added to the logits, so the
    oracle's token is sometimes not the drafter's top choice: trees then accept
    partially, and by different amounts in different rows.
    """

    block_size: int = struct.field(pytree_node=False)
    confidence: float = struct.field(pytree_node=False, default=30.0)
    noise: float = struct.field(pytree_node=False, default=0.0)

    def propose(self, state, target: TargetParams, cache: KVCache, roots: jax.Array, key: jax.Array) -> jax.Array:
        b, bs = roots.shape[0], self.block_size
        block = jnp.zeros((b, bs), jnp.int32).at[:, 0].set(roots)
        positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)
        mask = causal_mask(jnp.full((b,), bs, jnp.int32), bs)

        def extend(j, block):
            out = forward(target, block, positions, cache, mask)
            nxt = jnp.argmax(logits(target, out.hidden[:, j]), axis=-1).astype(jnp.int32)
            return block.at[:, j + 1].set(nxt)

        block = jax.lax.fori_loop(0, bs - 1, extend, block)
        out = self.confidence * jax.nn.one_hot(block[:, 1:], target.config.vocab_size)
        if self.noise:
            out = out + self.noise * jax.random.normal(key, out.shape)
        return out


@struct.dataclass
class RandomDrafter(_Stateless):
    """Independent random logits at every depth (scale sets how peaked)."""

    block_size: int = struct.field(pytree_node=False)
    scale: float = struct.field(pytree_node=False, default=3.0)

    def propose(self, state, target: TargetParams, cache: KVCache, roots: jax.Array, key: jax.Array) -> jax.Array:
        shape = (roots.shape[0], self.block_size - 1, target.config.vocab_size)
        return self.scale * jax.random.normal(key, shape)


PROTOCOL = ("block_size", "tap_layers", "init_state", "observe", "propose")
"""What the decode loop uses of a drafter; any pytree with these members works."""


def is_drafter(x: Any) -> bool:
    return isinstance(x, dflash.DrafterParams) or all(hasattr(x, name) for name in PROTOCOL)


def as_drafter(drafter: Any, block_size: int | None):
    """Wraps DrafterParams; applies a smaller block size. Raises ValueError on a bad one."""
    if isinstance(drafter, dflash.DrafterParams):
        drafter = DFlashDrafter(params=drafter, block_size=drafter.config.block_size)
    if not is_drafter(drafter):
        raise TypeError(f"drafter must be DrafterParams or implement {PROTOCOL}, got {type(drafter).__name__}")
    own = drafter.params.config.block_size if isinstance(drafter, DFlashDrafter) else drafter.block_size
    if own < 2:
        raise ValueError(f"the drafter's block_size must be >= 2, got {own}")
    if block_size is None:
        return drafter
    block_size = check_int("block_size", block_size)
    if not 2 <= block_size <= own:
        raise ValueError(f"block_size={block_size!r} must be an int in [2, the drafter's block_size={own}]")
    return drafter.replace(block_size=block_size)
