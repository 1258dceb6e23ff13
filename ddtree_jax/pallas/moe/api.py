"""Dispatch for routed-expert computation (see reference.py for the notation)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ddtree_jax import sharding
from ddtree_jax.pallas import check_implementation, mosaic_interpret, on_hopper
from ddtree_jax.pallas.moe.kernel import moe_experts_pallas
from ddtree_jax.pallas.moe.mosaic import MosaicMoETiles, moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_xla
from ddtree_jax.pallas.moe.w4a16 import moe_experts_w4a16
from ddtree_jax.quant import QuantizedArray, nbytes

AVAILABLE = ("auto", "xla", "pallas", "mosaic")


AUTO_MIN_BYTES = 64 * 2**20
""""auto" takes a Mosaic kernel for routed experts of at least this many bytes (one
layer's gate + up + down, INT4 ones as stored): where streaming the weights sets the time,
as on Kimi-K2's shapes where it was measured (docs/benchmarks.md). Smaller, launch-bound
models (the shipped pair's experts are 1.5 MB a layer) keep the XLA path their figures were
measured on."""


def _mosaic_takes(gate, up, down) -> bool:
    """Whether "auto" takes the Mosaic kernel: dense bf16 / f16 weights, H and I multiples of
    its tiles, at least `AUTO_MIN_BYTES` of them.

    INT4 experts stay on the XLA path under "auto", though the W4A16 kernel alone runs a
    Kimi-K2 shard's routed experts 5-10x faster (docs/benchmarks.md): in the model each
    layer's experts reach the kernel as a slice of the layer stack, which XLA copies into a
    buffer of its own first, and on the 4-layer K2 shard that made the verify 1.3-5.9x
    slower than the XLA path (docs/scaling.md). "mosaic" takes the W4A16 kernel.
    """
    if nbytes((gate, up, down)) < AUTO_MIN_BYTES or isinstance(gate, QuantizedArray):
        return False
    tiles = MosaicMoETiles()
    return gate.dtype in (jnp.bfloat16, jnp.float16) and all(
        d % tiles.block_n == 0 and d % tiles.block_k == 0 for d in gate.shape[1:]
    )


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
      gate, up, down: stacked expert weights, [in, out] per expert, dense or INT4
        (`quant.QuantizedArray`; not "pallas").
      implementation: "xla" (weight gather or ragged_dot, see reference.py), "pallas"
        (the grouped Triton-style kernel in kernel.py), "mosaic" (the Mosaic GPU kernels:
        mosaic.py for dense weights, H and I multiples of its tiles; w4a16.py for INT4 ones,
        bf16 activations) or "auto" ("mosaic" on a Hopper GPU for dense bf16 / f16 experts it
        tiles of `AUTO_MIN_BYTES` or more, else "xla": see `_mosaic_takes`). The kernels run in interpret mode on a CPU backend. Under a mesh context (`sharding.use_mesh`) whose rules
        split the "experts" axis, each runs expert-parallel, one shard of experts per device.

    Returns:
      [T, H] in x's dtype.
    """
    check_implementation(implementation, AVAILABLE, "moe_experts")
    if implementation == "auto":
        implementation = "mosaic" if on_hopper() and _mosaic_takes(gate, up, down) else "xla"
    int4 = isinstance(gate, QuantizedArray)
    if int4 and implementation == "pallas":
        raise NotImplementedError(
            "moe_experts: INT4 experts run with implementation='xla', 'mosaic' or 'auto', not 'pallas' "
            "(the W4A16 kernel is Mosaic GPU only)"
        )
    t, h = x.shape
    e, _, i = gate.shape
    k = idx.shape[1]
    chex.assert_shape(idx, (t, k))
    chex.assert_shape(w, (t, k))
    chex.assert_shape(up, (e, h, i))
    chex.assert_shape(down, (e, i, h))
    chex.assert_type(idx, jnp.int32)
    if implementation == "pallas":
        kernel = functools.partial(moe_experts_pallas, interpret=jax.default_backend() == "cpu")
        dropped = -1
    elif implementation == "mosaic":
        kernel, dropped = (
            functools.partial(moe_experts_w4a16 if int4 else moe_experts_mosaic, interpret=mosaic_interpret()),
            -1,
        )
    else:
        kernel, dropped = moe_experts_xla, None  # None: one past the local experts (sorts last, no group)
    spec = sharding.kernel_spec(("experts", None, None), gate.shape)
    axis = None if spec is None else spec[0]
    if axis is None:  # no mesh, experts not split by its rules, or E not divisible: one call
        return kernel(x, idx, w, gate, up, down)
    # Expert parallel by hand: left to GSPMD, the XLA path's weight gather and grouped
    # GEMM all-gather every expert to every device (issue 15's compiled plan).
    return _expert_parallel(kernel, axis, dropped)(x, idx, w, gate, up, down)


def _expert_parallel(kernel, axis: str, dropped: int | None):
    """The kernel per shard of the experts over mesh `axis`: each computes the pairs
    routed to its own experts (the others get weight 0 and expert id `dropped`, or the
    local expert count for None) and the partial sums are added over the axis. Tokens
    are replicated to every shard."""

    def local(x, idx, w, gate, up, down):
        e = gate.shape[0]
        first = jax.lax.axis_index(axis) * e
        mine = (idx >= first) & (idx < first + e)
        other = e if dropped is None else dropped
        y = kernel(x, jnp.where(mine, idx - first, other), jnp.where(mine, w, 0.0), gate, up, down)
        return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)

    rep, experts = PartitionSpec(), PartitionSpec(axis)
    specs = (rep, rep, rep, experts, experts, experts)
    # check_vma=False: pallas_call outputs carry no varying-axes annotation.
    return jax.shard_map(local, in_specs=specs, out_specs=rep, check_vma=False)
