"""The drafter layer's QKV projection in XLA: the math `drafters.dflash` runs, and the kernel's reference.

Notation: M rows (batch x block tokens), H hidden, Nq query heads, Nkv key / value heads,
Nh = Nq + 2 Nkv, hd head dim, F = hd // 2 rotary frequencies.
"""

from __future__ import annotations

import jax

from ddtree_jax.layers import apply_rope, linear, rms_norm


def qkv_reference(
    x: jax.Array,  # [B, T, H]
    input_norm: jax.Array,  # [H]
    q: jax.Array,  # [H, Nq, hd]
    k: jax.Array,  # [H, Nkv, hd]
    v: jax.Array,  # [H, Nkv, hd]
    q_norm: jax.Array,  # [hd]
    k_norm: jax.Array,  # [hd]
    cos: jax.Array,  # [B, T, F] float32
    sin: jax.Array,  # [B, T, F] float32
    eps: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A Qwen3 attention's inputs: rms_norm(x) projected to q, k, v [B, T, n, hd] (x's dtype);
    q and k each rms-normed per head and rotated (rotate-half RoPE)."""
    h = rms_norm(x, input_norm, eps)
    return (_normed_rotated(h, q, q_norm, cos, sin, eps), *keys_values(h, k, v, k_norm, cos, sin, eps))


def keys_values(
    h: jax.Array,  # [B, T, H]
    k: jax.Array,  # [H, Nkv, hd]
    v: jax.Array,  # [H, Nkv, hd]
    k_norm: jax.Array,  # [hd]
    cos: jax.Array,  # [B, T, F] float32
    sin: jax.Array,  # [B, T, F] float32
    eps: float,
) -> tuple[jax.Array, jax.Array]:
    """k (rms-normed per head, rotated) and v [B, T, Nkv, hd] of inputs h: a block's, or the
    drafter's context vectors (`dflash.extend_context`)."""
    return _normed_rotated(h, k, k_norm, cos, sin, eps), linear(h, v)


def _normed_rotated(h, w, norm, cos, sin, eps):
    """h projected by w [H, n, hd], rms-normed per head (weight norm [hd]) and rotated."""
    return apply_rope(rms_norm(linear(h, w), norm, eps), cos, sin)
