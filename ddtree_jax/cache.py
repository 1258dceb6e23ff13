"""Functional latent KV cache for absorbed MLA.

Notation: L layers, B batch, S capacity (slots = absolute positions), R
kv_lora_rank, P qk_rope_head_dim.

The cache holds only what absorbed MLA needs: per token and layer the normed
latent c_kv [R] and the RoPE'd shared key k_pe [P]. Slot s of sequence b holds
position s; entries s < lengths[b] are committed and visible to every query.
Forward passes never write the cache: they return the new tokens' entries
(`LatentKV`), and the caller decides which to commit (all of them for prefill and
AR decode, the accepted path for tree verification).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax.config import TargetConfig


@struct.dataclass
class LatentKV:
    """Latent entries of T new tokens for every layer."""

    c_kv: jax.Array  # [L, B, T, R]
    k_pe: jax.Array  # [L, B, T, P]


@struct.dataclass
class KVCache:
    """Fixed-capacity latent cache with a committed length per sequence."""

    c_kv: jax.Array  # [L, B, S, R]
    k_pe: jax.Array  # [L, B, S, P]
    lengths: jax.Array  # [B] int32

    @classmethod
    def init(cls, cfg: TargetConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
        """An empty cache: zeros, all lengths 0."""
        if batch < 1:
            raise ValueError(f"cache batch must be >= 1, got {batch}")
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        nl = cfg.num_hidden_layers
        return cls(
            c_kv=jnp.zeros((nl, batch, capacity, cfg.kv_lora_rank), dtype),
            k_pe=jnp.zeros((nl, batch, capacity, cfg.qk_rope_head_dim), dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.c_kv.shape[1]

    @property
    def capacity(self) -> int:
        return self.c_kv.shape[2]

    @property
    def dtype(self):
        return self.c_kv.dtype

    def write(self, new: LatentKV, slots: jax.Array) -> KVCache:
        """Writes new token t of sequence b into slot slots[b, t].

        Slots >= capacity are dropped, which is how callers skip padding or
        rejected tokens (pass `capacity`); slots must not be negative (they would
        wrap). Lengths are unchanged.
        """
        b, t = slots.shape
        chex.assert_shape(new.c_kv, (self.c_kv.shape[0], b, t, self.c_kv.shape[3]))
        rows = jnp.arange(b)[:, None]
        c_kv = self.c_kv.at[:, rows, slots].set(new.c_kv.astype(self.dtype), mode="drop")
        k_pe = self.k_pe.at[:, rows, slots].set(new.k_pe.astype(self.dtype), mode="drop")
        return self.replace(c_kv=c_kv, k_pe=k_pe)
