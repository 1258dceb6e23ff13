"""Functional latent KV cache for absorbed MLA.

Notation: L layers, B batch, S capacity (slots = absolute positions), R
kv_lora_rank, P qk_rope_head_dim.

The cache holds only what absorbed MLA needs: per token and layer the normed
latent c_kv [R] and the RoPE'd shared key k_pe [P]. Slot s of sequence b holds
position s; entries s < lengths[b] are committed and visible to every query. Under a mesh the
cache is split by sequence ("cache_batch", see `ddtree_jax.sharding`).
Forward passes never write the cache: they return the new tokens' entries
(`LatentKV`), and the caller decides which to commit (all of them for prefill and
AR decode, the accepted path for tree verification).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax import sharding
from ddtree_jax.config import TargetConfig


def cache_spec(batch: int) -> jax.sharding.PartitionSpec | None:
    """Placement of c_kv / k_pe under the current mesh (None without one): split by
    sequence over `sharding.cache_split`'s axes."""
    if sharding.context_mesh() is None:
        return None
    home, extra = sharding.cache_split(batch)
    return jax.sharding.PartitionSpec(None, home + extra or None, None, None)


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
        spec = cache_spec(batch)

        def zeros(width):
            z = jnp.zeros((nl, batch, capacity, width), dtype)
            return z if spec is None else jax.lax.with_sharding_constraint(z, spec)

        return cls(
            c_kv=zeros(cfg.kv_lora_rank), k_pe=zeros(cfg.qk_rope_head_dim), lengths=jnp.zeros((batch,), jnp.int32)
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
        c_kv, k_pe = new.c_kv.astype(self.dtype), new.k_pe.astype(self.dtype)
        home, extra = sharding.cache_split(b)
        if not extra:
            return self.replace(c_kv=_put(self.c_kv, c_kv, slots), k_pe=_put(self.k_pe, k_pe, slots))

        def local(cache_c, cache_k, c, k, s):  # this device's sequences only
            c, k = sharding.rows_here(c, extra, axis=1), sharding.rows_here(k, extra, axis=1)
            s = sharding.rows_here(s, extra)
            return _put(cache_c, c, s), _put(cache_k, k, s)

        spec = jax.sharding.PartitionSpec(None, home + extra, None, None)  # = cache_spec(b)
        home_spec = jax.sharding.PartitionSpec(None, home or None, None, None)
        c_kv, k_pe = jax.shard_map(
            local,
            in_specs=(spec, spec, home_spec, home_spec, jax.sharding.PartitionSpec(home or None, None)),
            out_specs=(spec, spec),
        )(self.c_kv, self.k_pe, c_kv, k_pe, slots)
        return self.replace(c_kv=c_kv, k_pe=k_pe)


def _put(cache: jax.Array, entries: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [L, B, S, W] with entries [L, B, T, W] at slots [B, T] (slots >= S dropped)."""
    rows = jnp.arange(slots.shape[0])[:, None]
    return cache.at[:, rows, slots].set(entries, mode="drop")
