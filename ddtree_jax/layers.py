"""Small numerical building blocks shared by the target and the drafter.

Notation: B batch, T tokens, P rope dim (even), F = P // 2 rotary frequencies.
Norms, RoPE tables and softmax run in float32 whatever the parameter dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax.config import TargetConfig, YarnConfig, yarn_get_mscale

LATENT_NORM_EPS = 1e-6
"""HF builds q_a_layernorm and kv_a_layernorm with the default eps, not config.rms_norm_eps."""


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype before the weight (as HF does).

    A row whose mean square overflows float32 comes out NaN (not the zeros that
    x * rsqrt(inf) gives), so that an overflowing activation is reported, not hidden.
    """
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = jnp.where(jnp.isinf(ms), jnp.nan, xf * jax.lax.rsqrt(ms + eps))
    return weight * xf.astype(x.dtype)


@struct.dataclass
class OutMajor:
    """A 2-D weight [in, out] held as its transpose (`linear` takes either form)."""

    t: jax.Array  # [out, in]


def linear(x: jax.Array, w: jax.Array | OutMajor) -> jax.Array:
    """x @ w with float32 accumulation, result in x's dtype. w: [in, ...out], or `OutMajor`."""
    if isinstance(w, OutMajor):
        return jnp.einsum("...i,oi->...o", x, w.t, preferred_element_type=jnp.float32).astype(x.dtype)
    out = jnp.tensordot(x, w, axes=1, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 accumulation; the result is float32.

    XLA:CPU lacks some batched bf16 x bf16 -> f32 dots, so on the CPU the operands
    are widened first: bf16 products are exact in f32, so the math is unchanged.
    """
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.promote_types(a.dtype, jnp.float32)), b.astype(jnp.promote_types(b.dtype, jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)). gate, up: [H, I]; down: [I, H]."""
    return linear(jax.nn.silu(linear(x, gate)) * linear(x, up), down)


def rope_inv_freq(dim: int, theta: float, yarn: YarnConfig | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim // 2] and the cos/sin attention factor (HF's formula, float32)."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if yarn is None:
        return inv_freq, 1.0
    factor = yarn.factor
    attention_factor = yarn.attention_factor
    if attention_factor is None:
        if yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, yarn.mscale) / yarn_get_mscale(factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        orig = yarn.original_max_position_embeddings
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1.0 - ramp
    interpolation = (1.0 / (factor * pos_freqs)).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(cfg: TargetConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [B, T, F] float32 for integer positions [B, T] (attention factor folded in)."""
    inv_freq, attn_factor = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * attn_factor, jnp.sin(freqs) * attn_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE. x: [B, T, ..., P]; cos, sin: [B, T, F]. Returns x's dtype.

    Checkpoints with `rope_interleave` have their rope weight columns permuted at
    load time (evens first, then odds), which turns HF's interleaved rotation into
    this one exactly; the forward pass therefore has a single RoPE layout.
    """
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------
# Layer stacks inside a decode loop


@struct.dataclass
class Unstacked:
    """A layer stack split into one pytree per layer, for an unrolled layer loop.

    Weights are stored stacked (every leaf [L, ...]). Unrolled inside a decode loop,
    each layer's static slice of a stack is a device copy per round on the GPU (XLA
    materialises a slice that a GEMM reads; 107 copies in the shipped pair's DDTree
    round, docs/benchmarks.md). Split once before the loop, the slices are made once.
    """

    layers: tuple  # L pytrees, each one layer's leaves

    def __len__(self) -> int:
        return len(self.layers)


def unstack(stack) -> Unstacked:
    """Stacked pytree (every leaf [L, ...]) -> Unstacked of L per-layer pytrees."""
    return Unstacked(tuple(jax.tree.map(lambda a, i=i: a[i], stack) for i in range(layer_count(stack))))


def layer_count(stack) -> int:
    """L, the layers of a stacked pytree (every leaf [L, ...]) or of an Unstacked one."""
    return len(stack) if isinstance(stack, Unstacked) else jax.tree.leaves(stack)[0].shape[0]


def layer_structure(stack):
    """A stacked layer pytree itself, or an Unstacked one's layer 0: either has one layer's
    pytree structure (for isinstance checks on its parts; no array is sliced)."""
    return stack.layers[0] if isinstance(stack, Unstacked) else stack


def scan_layers(body, carry, xs, *, unroll: bool):
    """`lax.scan(body, carry, xs, unroll=unroll)`, where `xs` may hold `Unstacked` layer
    pytrees (always run unrolled: layer i takes the i-th pytree, every other leaf its
    static slice i)."""
    split = [x for x in jax.tree.leaves(xs, is_leaf=lambda a: isinstance(a, Unstacked)) if isinstance(x, Unstacked)]
    if not split:
        return jax.lax.scan(body, carry, xs, unroll=unroll)
    n = len(split[0])

    def layer(i):
        return jax.tree.map(
            lambda a: a.layers[i] if isinstance(a, Unstacked) else a[i], xs, is_leaf=lambda a: isinstance(a, Unstacked)
        )

    ys = []
    for i in range(n):
        carry, y = body(carry, layer(i))
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)
