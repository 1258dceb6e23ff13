"""Quantized weights: symmetric INT4 with per-group scales (compressed-tensors "pack-quantized").

Notation: a weight W [..., In, Out] (ours, x @ W) with one scale per group of G
consecutive inputs is held as
  packed [..., In / G, Out, G] int4 (signed): packed[..., g, o, j] = q[..., g * G + j, o];
  scale  [..., In / G, Out];
and W[i, o] = q[i, o] * scale[i // G, o]. The grouped layout is the W4A16 kernel's
(`pallas/moe/w4a16.py`): one group of one output is G contiguous int4 (G / 2 bytes), the
row of wgmma's A operand, and a tile of outputs x groups is one TMA box. jax stores int4
two to a byte on the device.

The HF checkpoint (compressed-tensors) stores per Linear [Out, In] the words
`weight_packed` [Out, In / 8] int32, element 8k + j of a row in bits 4j .. 4j+3 of word k
as (q + 8), and `weight_scale` [Out, In / G]: `to_words` / `from_words` convert.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

PACK = 8  # INT4 values per int32 word of the checkpoint


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
        groups = fan_in // self.group_size
        return QuantizedArray(
            packed=jax.ShapeDtypeStruct((*lead, groups, fan_out, self.group_size), jnp.int4),
            scale=jax.ShapeDtypeStruct((*lead, groups, fan_out), jnp.dtype(self.scale_dtype)),
        )

    def quantize(self, w: jax.Array) -> QuantizedArray:
        """Round-to-nearest W [..., In, Out] -> INT4 (scale = max |W| of the group / 7)."""
        self.check(w.shape, "quantize")
        *lead, fan_in, fan_out = w.shape
        g = w.astype(jnp.float32).reshape(*lead, fan_in // self.group_size, self.group_size, fan_out)
        scale = (jnp.max(jnp.abs(g), axis=-2) / 7.0).astype(self.scale_dtype)  # [..., In/G, Out]
        s = scale.astype(jnp.float32)[..., None, :]
        q = jnp.clip(jnp.round(g / jnp.where(s == 0, 1.0, s)), -8, 7).astype(jnp.int4)
        return QuantizedArray(packed=jnp.swapaxes(q, -1, -2), scale=scale)


@struct.dataclass
class QuantizedArray:
    """An INT4 weight as stored: `packed` [..., In / G, Out, G] int4, `scale` [..., In / G, Out]."""

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weight's shape [..., In, Out]."""
        *lead, groups, fan_out, g = self.packed.shape
        return (*lead, groups * g, fan_out)

    @property
    def group_size(self) -> int:
        return self.packed.shape[-1]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """W [..., In, Out] = q * scale of its group, in `dtype`."""
        w = self.packed.astype(jnp.float32) * self.scale.astype(jnp.float32)[..., None]  # [..., In/G, Out, G]
        return jnp.swapaxes(w, -1, -2).reshape(self.shape).astype(dtype)


def to_words(packed: np.ndarray) -> np.ndarray:
    """Grouped int4 [..., In / G, Out, G] -> the checkpoint's int32 words [..., Out, In / 8]
    (element 8k + j of a row in bits 4j .. 4j+3 of word k, as q + 8)."""
    *lead, groups, fan_out, g = packed.shape
    q = np.moveaxis(np.asarray(packed).astype(np.int32), -3, -2)  # [..., Out, In/G, G]
    nib = ((q + 8) & 0xF).astype(np.uint32).reshape(*lead, fan_out, groups * g // PACK, PACK)
    words = np.bitwise_or.reduce(nib << (4 * np.arange(PACK, dtype=np.uint32)), axis=-1)
    return words.view(np.int32)


def from_words(words: np.ndarray, group_size: int) -> np.ndarray:
    """The checkpoint's int32 words [..., Out, In / 8] -> grouped int4 [..., In / G, Out, G] (numpy)."""
    *lead, fan_out, n_words = words.shape
    u = np.asarray(words).view(np.uint32)[..., None] >> (4 * np.arange(PACK, dtype=np.uint32))  # [..., Out, W, 8]
    q = ((u & 0xF).astype(np.int8) - 8).reshape(*lead, fan_out, n_words * PACK // group_size, group_size)
    return np.ascontiguousarray(np.moveaxis(q, -3, -2)).astype(ml_dtypes.int4)


def bits(dtype) -> int:
    """Bits per element of `dtype` as stored (4 for int4, which numpy's itemsize counts as a byte;
    8 for bool)."""
    dtype = jnp.dtype(dtype)
    return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else 8 * dtype.itemsize


def nbytes(tree) -> int:
    """Device bytes of every array (or ShapeDtypeStruct) in `tree`, int4 at half a byte."""
    return sum(a.size * bits(a.dtype) // 8 for a in jax.tree.leaves(tree))
