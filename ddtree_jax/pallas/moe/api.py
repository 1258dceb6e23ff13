"""Dispatch for routed-expert computation (see reference.py for the notation)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from ddtree_jax.pallas import check_implementation
from ddtree_jax.pallas.moe.kernel import moe_experts_pallas
from ddtree_jax.pallas.moe.reference import moe_experts_xla

AVAILABLE = ("xla", "pallas")


def moe_experts(
    x: jax.Array,  # [T, H]
    idx: jax.Array,  # [T, K] int32 expert ids
    w: jax.Array,  # [T, K] float32 routing weights
    gate: jax.Array,  # [E, H, I]
    up: jax.Array,  # [E, H, I]
    down: jax.Array,  # [E, I, H]
    *,
    implementation: str = "xla",
) -> jax.Array:  # [T, H]
    """Weighted sum of each token's top-K SwiGLU experts.

    Args:
      x: token activations.
      idx: the K experts chosen for each token.
      w: their routing weights (already normalised and scaled).
      gate, up, down: stacked expert weights, [in, out] per expert.
      implementation: "xla" (weight gather or ragged_dot, see reference.py) or
        "pallas" (the grouped Triton-style kernel in kernel.py; on a CPU backend
        it runs in interpret mode).

    Returns:
      [T, H] in x's dtype.
    """
    check_implementation(implementation, AVAILABLE, "moe_experts")
    t, h = x.shape
    e, _, i = gate.shape
    k = idx.shape[1]
    chex.assert_shape(idx, (t, k))
    chex.assert_shape(w, (t, k))
    chex.assert_shape(up, (e, h, i))
    chex.assert_shape(down, (e, i, h))
    chex.assert_type(idx, jnp.int32)
    if implementation == "pallas":
        return moe_experts_pallas(x, idx, w, gate, up, down, interpret=jax.default_backend() == "cpu")
    return moe_experts_xla(x, idx, w, gate, up, down)
