"""Dispatch for routed-expert computation (see reference.py for the notation)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ddtree_jax import sharding
from ddtree_jax.pallas import check_implementation, check_rank, mosaic_interpret, on_hopper
from ddtree_jax.pallas.moe.kernel import moe_experts_pallas
from ddtree_jax.pallas.moe.mosaic import MosaicMoETiles, moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_xla, moe_pairs_in_tiles
from ddtree_jax.pallas.moe.w4a16 import check_w4a16, moe_experts_w4a16
from ddtree_jax.quant import QuantizedArray, nbytes

AVAILABLE = ("auto", "xla", "pallas", "mosaic")


AUTO_MIN_BYTES = 64 * 2**20
""""auto" takes a Mosaic kernel for routed experts of at least this many bytes (one
layer's gate + up + down, INT4 ones as stored): where streaming the weights sets the time,
as on Kimi-K2's shapes where it was measured (docs/benchmarks.md). Smaller, launch-bound
models (the shipped pair's experts are 1.5 MB a layer) keep the XLA path their figures were
measured on."""


def _mosaic_takes(gate, up, down, activations=jnp.bfloat16) -> bool:
    """Whether "auto" takes a Mosaic kernel: at least `AUTO_MIN_BYTES` of experts, either
    dense bf16 / f16 with H and I multiples of `mosaic.py`'s tiles, or INT4 ones the W4A16
    kernel tiles (`check_w4a16`) under bf16 `activations` (the kernel computes in bf16).

    In the model a layer's experts reach the kernel as the whole layer stack and an index
    (`layer=`): handed the layer's slice, XLA copied it first, which made the 4-layer K2
    shard's verify slower with the W4A16 kernel than without (docs/scaling.md).
    """
    if nbytes((gate, up, down)) < AUTO_MIN_BYTES:
        return False
    if isinstance(gate, QuantizedArray):
        if activations != jnp.bfloat16 or gate.group_size != 32:  # other groups: not run compiled yet
            return False
        try:
            check_w4a16(gate, down)
        except ValueError:
            return False
        return True
    tiles = MosaicMoETiles()
    return gate.dtype in (jnp.bfloat16, jnp.float16) and all(
        d % tiles.block_n == 0 and d % tiles.block_k == 0 for d in gate.shape[-2:]
    )


def resolve(implementation: str, gate, up, down, activations=jnp.bfloat16, stacked: bool = False) -> str:
    """The implementation `moe_experts` runs for these experts and activations' dtype: "auto"
    made concrete. `stacked`: gate / up / down are layer stacks [L, E, ...], judged by one layer."""
    check_implementation(implementation, AVAILABLE, "moe_experts")
    if implementation == "auto":
        if stacked:
            gate, up, down = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), (gate, up, down))
        return "mosaic" if on_hopper() and _mosaic_takes(gate, up, down, activations) else "xla"
    return implementation


def moe_experts(
    x: jax.Array,  # [T, H]
    idx: jax.Array,  # [T, K] int32 expert ids
    w: jax.Array,  # [T, K] float32 routing weights
    gate: jax.Array,  # [E, H, I]
    up: jax.Array,  # [E, H, I]
    down: jax.Array,  # [E, I, H]
    *,
    layer: jax.Array | None = None,
    implementation: str = "xla",
) -> jax.Array:  # [T, H]
    """Weighted sum of each token's top-K SwiGLU experts.

    Args:
      x: token activations.
      idx: the K experts chosen for each token.
      w: their routing weights (already normalised and scaled).
      gate, up, down: stacked expert weights, [in, out] per expert, dense or INT4
        (`quant.QuantizedArray`; not "pallas"); with `layer`, stacks of layers [L, E, ...].
      layer: None, or an int32 scalar that picks one layer of the [L, E, ...] stacks. The
        Mosaic kernels read that layer's experts in place; handed the slice instead, XLA
        copies it into a buffer of its own before the call (experiments/moe_layer_stack.py).
      implementation: "xla" (weight gather or ragged_dot, see reference.py), "pallas"
        (the grouped Triton-style kernel in kernel.py), "mosaic" (the Mosaic GPU kernels:
        mosaic.py for dense weights, H and I multiples of its tiles; w4a16.py for INT4 ones,
        bf16 activations) or "auto" ("mosaic" on a Hopper GPU for experts a kernel tiles, of
        `AUTO_MIN_BYTES` or more, else "xla": see `_mosaic_takes`). The kernels run in interpret mode on a CPU backend. Under a mesh context (`sharding.use_mesh`) whose rules
        split the "experts" axis, each runs expert-parallel, one shard of experts per device.

    Returns:
      [T, H] in x's dtype.
    """
    for name, a in (("x", x), ("idx", idx), ("w", w)):
        check_rank("moe_experts", name, a, 2)
    if len(gate.shape) != 3 + (layer is not None):
        raise ValueError(
            f"moe_experts: gate of shape {gate.shape} with layer={layer}: [E, H, I] without a layer, [L, E, H, I] with one"
        )
    implementation = resolve(implementation, gate, up, down, x.dtype, stacked=layer is not None)
    int4 = isinstance(gate, QuantizedArray)
    if int4 and implementation == "pallas":
        raise NotImplementedError(
            "moe_experts: INT4 experts run with implementation='xla', 'mosaic' or 'auto', not 'pallas' "
            "(the W4A16 kernel is Mosaic GPU only)"
        )
    if layer is not None and implementation != "mosaic":  # XLA fuses the slice into its consumers
        gate, up, down = jax.tree.map(lambda a: a[layer], (gate, up, down))
        layer = None
    t, h = x.shape
    e, _, i = gate.shape[-3:]
    k = idx.shape[1]
    chex.assert_shape(idx, (t, k))
    chex.assert_shape(w, (t, k))
    lead = gate.shape[:-3]
    if gate.shape[-2] != h:  # up and down are checked against x below; gate alone was not
        raise ValueError(f"moe_experts: gate of shape {gate.shape} does not take x of shape {x.shape} (H={h})")
    chex.assert_shape(up, (*lead, e, h, i))
    chex.assert_shape(down, (*lead, e, i, h))
    chex.assert_type(idx, jnp.int32)
    if t * k == 0:  # no pairs: the kernels' grids would be empty (the interpreter failed on them)
        return jnp.zeros_like(x)
    if implementation == "pallas":
        kernel = functools.partial(moe_experts_pallas, interpret=jax.default_backend() == "cpu")
        dropped = -1
    elif implementation == "mosaic":
        mosaic = moe_experts_w4a16 if int4 else moe_experts_mosaic
        kernel, dropped = functools.partial(mosaic, interpret=mosaic_interpret()), -1
    else:
        kernel, dropped = moe_experts_xla, None  # None: one past the local experts (sorts last, no group)
    spec = sharding.kernel_spec(("experts", None, None), gate.shape[-3:])
    axis = None if spec is None else spec[0]
    if axis is None:  # no mesh, experts not split by its rules, or E not divisible: one call
        return kernel(x, idx, w, gate, up, down, **({} if layer is None else {"layer": layer}))
    # Expert parallel by hand: left to GSPMD, the XLA path's weight gather and grouped
    # GEMM all-gather every expert to every device (issue 15's compiled plan).
    layers = () if layer is None else (layer,)
    return _expert_parallel(kernel, axis, dropped, bool(layers))(x, idx, w, gate, up, down, *layers)


def _expert_parallel(kernel, axis: str, dropped: int | None, stacked: bool):
    """The kernel per shard of the experts over mesh `axis`: each computes the pairs
    routed to its own experts (the others get weight 0 and expert id `dropped`, or the
    local expert count for None) and the partial sums are added over the axis. Tokens
    are replicated to every shard. `stacked`: the weights are [L, E, ...] stacks and a
    layer index follows them."""

    def local(x, idx, w, gate, up, down, *layer):
        e = gate.shape[-3]
        mine, ids = _local_ids(idx, e, axis, e if dropped is None else dropped)
        extra = {"layer": layer[0]} if layer else {}
        y = kernel(x, ids, jnp.where(mine, w, 0.0), gate, up, down, **extra)
        return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)

    return _over_expert_shards(local, axis, 3, stacked)


def _local_ids(idx: jax.Array, e: int, axis: str, other: int) -> tuple[jax.Array, jax.Array]:
    """(whether each routed id is one of this shard's `e` experts, its local id or `other`)."""
    first = jax.lax.axis_index(axis) * e
    mine = (idx >= first) & (idx < first + e)
    return mine, jnp.where(mine, idx - first, other)


def _over_expert_shards(local, axis: str, replicated: int, stacked: bool):
    """shard_map of `local`(`replicated` replicated operands, gate, up, down[, layer]): the
    expert weights split over mesh `axis` (their second axis when `stacked` [L, E, ...]), the
    result replicated."""
    rep = PartitionSpec()
    experts = PartitionSpec(None, axis) if stacked else PartitionSpec(axis)
    specs = (rep,) * replicated + (experts,) * 3 + ((rep,) if stacked else ())
    # check_vma=False: pallas_call outputs carry no varying-axes annotation.
    return jax.shard_map(local, in_specs=specs, out_specs=rep, check_vma=False)


def moe_pairs(
    x: jax.Array, idx: jax.Array, gate, up, down, tile: int, layer: jax.Array | None = None
) -> jax.Array:  # [T, K, H]
    """`moe_pairs_in_tiles` (the "exact" numerics' routed experts), expert-parallel under a
    mesh context whose rules split the "experts" axis.

    Each device computes the pairs routed to its own experts; on it the others' pairs are
    zeros, and the sum over the axis adds each pair's one output to zeros, so the result
    is one device's exactly (a -0.0 output comes back 0.0) (left to GSPMD, every device gathered every expert's
    weights at every layer: 6.6 GB a round on a 2-GPU Kimi-K2 slice, docs/scaling.md).

    x [T, H], idx [T, K] int32, gate / up [E, H, I], down [E, I, H] (dense or INT4); with
    `layer`, every layer's stacks [L, E, ...] and the layer to run.
    """
    layers = () if layer is None else (layer,)
    spec = sharding.kernel_spec(("experts", None, None), gate.shape[-3:])
    axis = None if spec is None else spec[0]
    if axis is None:
        return moe_pairs_in_tiles(x, idx, gate, up, down, tile, *layers)

    def local(x, idx, gate, up, down, *layer):
        _, ids = _local_ids(idx, gate.shape[-3], axis, gate.shape[-3])
        ys = moe_pairs_in_tiles(x, ids, gate, up, down, tile, *layer)
        return jax.lax.psum(ys, axis)  # the others' pairs are zeros here (ids past the experts)

    return _over_expert_shards(local, axis, 2, bool(layers))(x, idx, gate, up, down, *layers)
