"""Drafters for tests and experiments, behind the same protocol as DFlash.

- `OracleDrafter`: proposes the target's own greedy continuation (every full round
  must accept block_size tokens).
- `RandomDrafter`: random logits (trees that are mostly rejected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax.cache import KVCache
from ddtree_jax.model import TargetParams, causal_mask, forward, logits


class _Stateless:
    """Drafters that keep no state and read no target features."""

    tap_layers: tuple[int, ...] = ()
    tap_final_norm: bool = True

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
