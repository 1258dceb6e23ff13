"""Quantized weights: symmetric INT4 with per-group scales (compressed-tensors "pack-quantized").

Notation: a weight W [..., In, Out] (ours, x @ W) is stored as
  packed [..., In / 8, Out] int32: word k of a column holds elements 8k .. 8k+7 of
    that column, element 8k+j as (q + 8) in bits 4j .. 4j+3;
  scale  [..., In / G, Out]: one scale per group of G consecutive inputs;
and W[i, o] = q[i, o] * scale[i // G, o]. The HF checkpoint stores the transpose of
both ([Out, In / 8] and [Out, In / G]), so the words pack the same 8 inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

PACK = 8  # INT4 values per int32 word


@dataclasses.dataclass(frozen=True)
class Int4:
    """Symmetric INT4 over groups of `group_size` inputs (W4A16, as Kimi-K2.5 ships its routed experts)."""

    group_size: int = 32
    scale_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.group_size < PACK or self.group_size % PACK:
            raise ValueError(f"Int4 group_size must be a positive multiple of {PACK}, got {self.group_size}")

    def check(self, shape: tuple[int, ...], name: str) -> None:
        """Raises ValueError unless a [..., In, Out] weight of `shape` can be stored this way."""
        if len(shape) < 2 or shape[-2] % self.group_size:
            raise ValueError(f"{name}: input dim of shape {shape} is not a multiple of group_size {self.group_size}")

    def stored(self, shape: tuple[int, ...]) -> QuantizedArray:
        """The stored arrays' shapes and dtypes (`jax.ShapeDtypeStruct`s) for a weight of `shape`."""
        *lead, fan_in, fan_out = shape
        return QuantizedArray(
            packed=jax.ShapeDtypeStruct((*lead, fan_in // PACK, fan_out), jnp.int32),
            scale=jax.ShapeDtypeStruct((*lead, fan_in // self.group_size, fan_out), jnp.dtype(self.scale_dtype)),
        )

    def quantize(self, w: jax.Array) -> QuantizedArray:
        """Round-to-nearest W [..., In, Out] -> INT4 (scale = max |W| of the group / 7)."""
        self.check(w.shape, "quantize")
        *lead, fan_in, fan_out = w.shape
        g = w.astype(jnp.float32).reshape(*lead, fan_in // self.group_size, self.group_size, fan_out)
        scale = (jnp.max(jnp.abs(g), axis=-2) / 7.0).astype(self.scale_dtype)  # [..., In/G, Out]
        s = scale.astype(jnp.float32)[..., None, :]
        q = jnp.clip(jnp.round(g / jnp.where(s == 0, 1.0, s)), -8, 7).astype(jnp.int32)
        return QuantizedArray(packed=pack_int4(q.reshape(*lead, fan_in, fan_out)), scale=scale)


@struct.dataclass
class QuantizedArray:
    """An INT4 weight as stored: `packed` [..., In / 8, Out] int32, `scale` [..., In / G, Out]."""

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weight's shape [..., In, Out]."""
        *lead, words, fan_out = self.packed.shape
        return (*lead, words * PACK, fan_out)

    @property
    def group_size(self) -> int:
        return self.shape[-2] // self.scale.shape[-2]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """W [..., In, Out] = q * scale of its group, in `dtype`."""
        q = unpack_int4(self.packed).astype(jnp.float32)
        *lead, fan_in, fan_out = q.shape
        groups = self.scale.shape[-2]
        w = q.reshape(*lead, groups, fan_in // groups, fan_out) * self.scale.astype(jnp.float32)[..., None, :]
        return w.reshape(q.shape).astype(dtype)


def pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-8, 7], [..., In, Out] -> int32 words [..., In / 8, Out] (nibble j = element 8k + j, + 8)."""
    *lead, fan_in, fan_out = q.shape
    if fan_in % PACK:
        raise ValueError(f"pack_int4: input dim {fan_in} is not a multiple of {PACK}")
    nib = (q.astype(jnp.uint32) + 8) & 0xF
    nib = nib.reshape(*lead, fan_in // PACK, PACK, fan_out)
    shifts = (4 * jnp.arange(PACK, dtype=jnp.uint32))[:, None]
    return jax.lax.bitcast_convert_type(jnp.sum(nib << shifts, axis=-2, dtype=jnp.uint32), jnp.int32)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int32 words [..., In / 8, Out] -> int8 values in [-8, 7], [..., In, Out]."""
    *lead, words, fan_out = packed.shape
    u = jax.lax.bitcast_convert_type(packed, jnp.uint32)[..., None, :]  # [..., W, 1, Out]
    shifts = (4 * jnp.arange(PACK, dtype=jnp.uint32))[:, None]
    nib = (u >> shifts) & 0xF  # [..., W, 8, Out]
    return (nib.astype(jnp.int32) - 8).astype(jnp.int8).reshape(*lead, words * PACK, fan_out)
