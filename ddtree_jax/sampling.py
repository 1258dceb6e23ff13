"""Token choice from logits: greedy, or temperature + top-k + top-p sampling.

The filters follow HF's warpers in HF's order (temperature, then top-k, then
top-p), so `generate` samples the distribution an HF user would expect. The
same `filtered_logits` serves AR sampling and tree acceptance, which is what
keeps speculative sampling lossless.

`SamplingConfig` is what a caller asks for, checked; inside a jitted program it
becomes a `Sampler`, whose temperature and top-p are traced scalars: one program
serves every temperature and top-p (only greedy or not, top-k, and whether top-p
filters at all shape it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax.checks import check_int


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature == 0 means greedy (argmax).

    Attributes:
      temperature: softmax temperature, >= 0.
      top_k: keep the k most likely tokens (0 = all).
      top_p: keep the smallest set whose probability reaches top_p (1.0 = all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
            # Plain floats: the config is a static (hashed) argument of the jitted loop.
            object.__setattr__(self, name, float(value))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check_float32_positive("temperature", self.temperature, zero_means="0 for greedy")
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, minimum=0))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def nucleus(self) -> bool:
        """Whether top-p removes anything (top_p < 1)."""
        return self.top_p < 1

    @property
    def signature(self) -> tuple[bool, int, bool]:
        """(greedy, top_k, nucleus): what shapes a program's sampling (`Sampler.of`)."""
        return self.greedy, self.top_k, self.nucleus

    def values(self) -> np.ndarray:
        """[temperature, top_p] float32: the traced rest (`Sampler.of`)."""
        return np.asarray([self.temperature, self.top_p], np.float32)


@struct.dataclass
class Sampler:
    """A `SamplingConfig` inside a jitted program: temperature and top-p traced, the rest static."""

    temperature: jax.Array  # [] float32 (unused when greedy)
    top_p: jax.Array  # [] float32 (unused unless nucleus)
    greedy: bool = struct.field(pytree_node=False)
    top_k: int = struct.field(pytree_node=False)
    nucleus: bool = struct.field(pytree_node=False)

    @classmethod
    def of(cls, signature: tuple[bool, int, bool], values: jax.Array) -> Sampler:
        """From `SamplingConfig.signature` (static) and `.values()` ([2] float32, traced)."""
        greedy, top_k, nucleus = signature
        return cls(temperature=values[0], top_p=values[1], greedy=greedy, top_k=top_k, nucleus=nucleus)


def check_float32_positive(name: str, value: float, zero_means: str) -> None:
    """Raises ValueError for a value > 0 below float32's smallest normal number (~1.2e-38): the
    logits are divided by it in float32, where it is 0 or subnormal (which a device may flush
    to 0)."""
    tiny = float(np.finfo(np.float32).tiny)
    if 0 < value < tiny:
        raise ValueError(
            f"{name} {value!r} is below float32's smallest normal number {tiny:.3g}, and the logits are divided "
            f"by it in float32; use {zero_means}"
        )


def scaled_logits(logits: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """Float32 logits [..., V] / temperature, less their row maximum first: the same softmax,
    but a small temperature (1e-40, or 1e-37 on logits of 100) gives -inf to the tokens below
    the maximum instead of overflowing every logit to inf (NaN probabilities)."""
    x = logits.astype(jnp.float32)
    return (x - jnp.max(x, axis=-1, keepdims=True)) / temperature


def filtered_logits(logits: jax.Array, cfg: SamplingConfig | Sampler) -> jax.Array:
    """Float32 logits [..., V] after temperature, top-k and top-p (removed tokens = -inf)."""
    x = scaled_logits(logits, cfg.temperature)
    if 0 < cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.nucleus:
        order = jnp.argsort(-x, axis=-1, stable=True)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < cfg.top_p  # always keeps the most likely token
        keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def choose(logits: jax.Array, key: jax.Array, cfg: SamplingConfig | Sampler) -> jax.Array:
    """Next tokens [...] int32 from logits [..., V]: argmax if greedy, else a sample."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, cfg), axis=-1).astype(jnp.int32)
