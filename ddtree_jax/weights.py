"""Weight declarations: each weight written once, everything about it derived.

A model's `declare(cfg)` returns its params pytree with a `Weight` at every leaf
(the same dataclasses, `None` where the config has no such weight). From that one
tree come:
  `init`      random weights (each `Weight.seed` names its key, so a seed keeps its weights),
  `abstract`  `jax.ShapeDtypeStruct`s, for compile-only work on full-size configs,
  `axes`      logical axis names, which `sharding.RULES` maps to mesh axes,
  `cast`      a dtype change that keeps fixed-dtype weights (the float32 router),
and, through `Weight.hf`, the HF checkpoint reader and writer (`hf.py`). A weight
with `quant` set is stored quantized (`quant.QuantizedArray`): its abstract shapes,
axes and random init follow from the same declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.checks import check_dtype
from ddtree_jax.quant import Int4, QuantizedArray

INITS = ("normal", "ones", "uniform")


def identity(a):
    return a


def transpose(a):
    """Swaps the last two axes: torch Linear [out, in] <-> ours [in, out]."""
    return np.swapaxes(a, -1, -2)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """Where a weight lives in an HF checkpoint, and how it maps to ours.

    Attributes:
      name: tensor name; "{layer}" is the HF layer index of each entry of a stacked
        weight, "{expert}" means one tensor per routed expert, stacked on our expert axis.
      shape: its HF shape (of one expert when the name has "{expert}").
      to_ours: HF array -> ours (of one layer / expert).
      to_hf: ours -> the HF array, or this weight's piece of it (see `join_axis`).
      join_axis: set when several of our weights are one HF tensor: each `to_hf` gives
        a piece, and the pieces, in declaration order, are concatenated on this axis
        and reshaped to `shape`.
      layout: weights with several HFTensors are read from whichever layout the
        checkpoint holds and written in the one the writer asks for.
    """

    name: str
    shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray] = identity
    to_hf: Callable[[np.ndarray], np.ndarray] = identity
    join_axis: int | None = None
    layout: str = "default"


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight: everything the engine needs to make, place, load and save it.

    Attributes:
      shape: the array's shape (a stacked weight leads with its layer axis).
      axes: one logical axis name (or None) per dimension.
      init: "normal" (std * N(0, 1), rounded through the params dtype), "ones", or
        "uniform" (0.1 * U[0, 1), the router's correction bias).
      dtype: a fixed dtype (the router stays float32), or None for the params dtype.
      hf: its HF tensor(s), one per layout.
      layers: HF layer indices of the stack's entries; None for an unstacked weight.
      quant: how it is stored quantized, or None.
      seed: which of the model's init keys it draws.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    dtype: Any = None
    hf: tuple[HFTensor, ...] = ()
    layers: tuple[int, ...] | None = None
    quant: Int4 | None = None
    seed: int = 0

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"logical axes {self.axes} do not fit shape {self.shape}")
        if self.init not in INITS:
            raise ValueError(f"init {self.init!r} is not one of {INITS}")
        if self.layers is not None and (not self.axes or self.axes[0] != "layers" or len(self.layers) != self.shape[0]):
            raise ValueError(
                f"a stack of layers {self.layers} needs a leading 'layers' axis of that size: {self.shape}"
            )
        if self.quant is not None:
            self.quant.check(self.shape, f"weight of shape {self.shape}")

    def dtype_for(self, dtype) -> jnp.dtype:
        """The dtype this weight has in params of `dtype`."""
        return jnp.dtype(dtype if self.dtype is None else self.dtype)

    def abstract(self, dtype):
        """ShapeDtypeStruct(s) of the stored weight in params of `dtype`."""
        if self.quant is not None:
            return self.quant.stored(self.shape)
        return jax.ShapeDtypeStruct(self.shape, self.dtype_for(dtype))

    def logical_axes(self):
        """The logical axes of each stored array (a QuantizedArray of them when quantized)."""
        if self.quant is None:
            return self.axes
        return QuantizedArray(packed=(*self.axes, None), scale=self.axes)  # packed: [..., In/G, Out, G]

    def random(self, key: jax.Array, dtype, std: float):
        """A random weight of the declared kind."""
        if self.init == "ones":
            w = jnp.ones(self.shape, dtype)
        elif self.init == "uniform":
            w = 0.1 * jax.random.uniform(key, self.shape, jnp.float32)
        else:
            w = (std * jax.random.normal(key, self.shape, jnp.float32)).astype(dtype)
        w = w.astype(self.dtype_for(dtype))
        return w if self.quant is None else self.quant.quantize(w)


def is_weight(x) -> bool:
    return isinstance(x, Weight)


def _map(fn, decl, *rest):
    return jax.tree.map(fn, decl, *rest, is_leaf=is_weight)


def init(decl, key: jax.Array, dtype, std: float, num_keys: int):
    """Random params for a declaration tree; weight w draws split(key, num_keys)[w.seed]."""
    dtype = check_dtype(dtype)
    keys = jax.random.split(key, num_keys)
    return _map(lambda w: w.random(keys[w.seed], dtype, std), decl)


def abstract(decl, dtype):
    """`jax.ShapeDtypeStruct`s of every weight in params of `dtype` (no memory allocated)."""
    dtype = check_dtype(dtype)
    return _map(lambda w: w.abstract(dtype), decl)


def axes(decl):
    """Logical axis names per stored array, in the params' tree structure."""
    return _map(lambda w: w.logical_axes(), decl)


def cast(decl, params, dtype):
    """params with every unquantized, non-fixed-dtype weight cast to `dtype`. Quantized values
    stay; their scales, where held wider than declared (f32, as a float32 load keeps f32-stored
    ones), take the declared dtype when `dtype` is narrower than float32."""
    dtype = check_dtype(dtype)

    def one(w, a):
        if w.quant is None:
            return a.astype(w.dtype_for(dtype))
        if dtype != jnp.float32 and a.scale.dtype != jnp.dtype(w.quant.scale_dtype):
            return a.replace(scale=a.scale.astype(w.quant.scale_dtype))
        return a

    return _map(one, decl, params)


def leaves(decl) -> list[Weight]:
    return jax.tree.leaves(decl, is_leaf=is_weight)
