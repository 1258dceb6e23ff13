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
    q = apply_rope(rms_norm(linear(h, q), q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(linear(h, k), k_norm, eps), cos, sin)
    return q, k, linear(h, v)
