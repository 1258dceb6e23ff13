"""Dispatch for the drafter layer's QKV projection (see reference.py for the notation)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import struct

from ddtree_jax.pallas import runs_unpartitioned_kernel
from ddtree_jax.pallas.drafter_layer.kernel import DrafterLayerTiles, qkv_pallas, takes
from ddtree_jax.pallas.drafter_layer.reference import qkv_reference

AUTO_KERNEL = True
"""Whether "auto" takes the kernel on a GPU (False: the XLA path, for before / after runs:
`experiments/profile_round.py --set ddtree_jax.pallas.drafter_layer.api.AUTO_KERNEL=False`).
Read when a program is traced."""

AUTO_MAX_HIDDEN = 1024
""""auto" takes the kernel only for drafters this narrow or narrower: there the XLA path's
launches, not the weights' bytes, set the time. Measured on an H100 (session 49,
docs/benchmarks.md, `python3 -m ddtree_jax.pallas.drafter_layer.bench`): the shipped drafter's
QKV (hidden 384) 5.6 us against XLA's 10.1; Kimi-K2.5-DFlash's (hidden 7168) 0.120 ms against
0.063, its GEMM tiled by XLA over every SM where the kernel gives one program to each head."""

AVAILABLE = ("auto", "xla", "pallas", "mosaic")
""""mosaic" has no kernel of its own here: it takes the XLA path."""


@struct.dataclass
class JointQKV:
    """A layer's query, key and value weights as one [H, Nh, hd] matrix (q heads, k heads,
    v heads) and the per-head norm weights [Nh, hd] (q_norm, k_norm; ones on the v heads):
    what the kernel reads. Stacked layers give stacked leaves."""

    w: jax.Array
    head_norm: jax.Array

    @classmethod
    def of(cls, layer) -> JointQKV:
        """From a layer's (or a stack's) q, k, v [..., H, n, hd] and q_norm, k_norm [..., hd]."""
        nq, nkv = layer.q.shape[-2], layer.k.shape[-2]
        norms = [layer.q_norm, layer.k_norm, jnp.ones_like(layer.k_norm)]
        head_norm = jnp.concatenate(
            [
                jnp.broadcast_to(n[..., None, :], (*n.shape[:-1], c, n.shape[-1]))
                for n, c in zip(norms, (nq, nkv, nkv), strict=True)
            ],
            axis=-2,
        )
        return cls(w=jnp.concatenate([layer.q, layer.k, layer.v], axis=-2), head_norm=head_norm)


def uses_kernel(implementation: str, hidden: int, head_dim: int) -> bool:
    """Whether `drafter_qkv` runs the kernel: "pallas" where `takes` holds, "auto" also only on a
    GPU, for a drafter of hidden size <= `AUTO_MAX_HIDDEN`. Under a mesh, neither: the kernel is
    not partitioned, and XLA splits the projection by the weights' shardings."""
    auto = AUTO_KERNEL and hidden <= AUTO_MAX_HIDDEN
    return runs_unpartitioned_kernel(implementation, AVAILABLE, "drafter_layer", takes(hidden, head_dim), auto)


def drafter_qkv(
    x: jax.Array,  # [B, T, H]
    layer,  # DrafterLayerParams of one layer
    cos: jax.Array,  # [B, T, F] float32
    sin: jax.Array,  # [B, T, F] float32
    eps: float,
    *,
    joint: JointQKV | None = None,
    implementation: str = "xla",
    tiles: DrafterLayerTiles | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A drafter layer's attention inputs: q [B, T, Nq, hd], k, v [B, T, Nkv, hd] (x's dtype).

    Args:
      x: the layer's input (residual stream).
      layer: the layer's weights (input_norm, q, k, v, q_norm, k_norm).
      cos, sin: RoPE tables at the rows' positions.
      eps: the norms' epsilon.
      joint: the layer's `JointQKV` made once before a loop (None: made here when the kernel runs).
      implementation: "xla" (reference.py), "pallas" (the Triton-lowered kernel; the CPU
        interprets it), "auto" (`uses_kernel`), or "mosaic" (XLA).
      tiles: the kernel's `DrafterLayerTiles` (None: the defaults).
    """
    b, t, hidden = x.shape
    nq, hd = layer.q.shape[-2:]
    chex.assert_shape([cos, sin], (b, t, hd // 2))
    args = (layer.input_norm, layer.q, layer.k, layer.v, layer.q_norm, layer.k_norm)
    if not uses_kernel(implementation, hidden, hd):
        return qkv_reference(x, *args, cos, sin, eps)
    joint = JointQKV.of(layer) if joint is None else joint
    chex.assert_shape(joint.w, (hidden, None, hd))
    q, k, v = qkv_pallas(
        x.reshape(b * t, hidden),
        layer.input_norm,
        joint.w.astype(x.dtype),
        joint.head_norm,
        cos.reshape(b * t, -1),
        sin.reshape(b * t, -1),
        nq=nq,
        eps=eps,
        tiles=tiles or DrafterLayerTiles(),
        interpret=jax.default_backend() != "gpu",
    )
    return q.reshape(b, t, nq, hd), k.reshape(b, t, -1, hd), v.reshape(b, t, -1, hd)
