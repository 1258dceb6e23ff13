"""Mosaic GPU (Hopper: TMA, wgmma) grouped SwiGLU experts with INT4 weights, bf16 activations (W4A16).

Notation as in reference.py (T tokens, H hidden, I expert intermediate, E experts, K
experts per token, G inputs per scale group); BT (token, expert) pairs per row block, NB
row blocks, BO output rows per warpgroup (64 or 128), C consumer warpgroups (0: none, the
program's one warpgroup does everything), BK the contraction chunk of one pipeline step
(`W4A16Tiles`).

Weights come in the grouped INT4 layout of `quant.QuantizedArray`: values [E, In / G, Out, G]
int4 (signed) and scales [E, In / G, Out]. The products are computed transposed ("swap AB"):
the weights are wgmma's A operand, [BO, G] per group, and the tokens its B operand, so a row
block is as small as 16 pairs (wgmma's N) rather than the 64 rows of wgmma's M.

* gate / up, grid (NB, I / (max(1, C) * BO)): program (b, j) streams, through a TMA pipeline
  of `stages` slots, the [BK / G, max(1, C) * BO, G] int4 chunks of gate[e] and up[e] for its
  output rows, their scales and x_b's [BT, BK] chunk. Per group it loads a [BO, G] int4 tile
  into registers, converts it to bf16 and multiplies each row by its scale (the same
  rounding as the reference's dequantization: the product of an int4 and a bf16 is exact in
  float32), and accumulates W^T x^T into a [BO, BT] float32 accumulator with wgmma (A from
  registers, B = x^T, a transposed view of the K-major token tile in shared memory). The
  epilogue stores silu(g) * u in the accumulators' orientation, act^T [NB, I, BT].
* down, grid (NB, H / (max(1, C) * BO)): down[e]^T act_b^T the same way (B = act^T's
  [BK, BT] tile), y^T [NB, H, BT], transposed back in XLA.

Two schedules of a program (`W4A16Tiles.consumers`); by default `moe_experts_w4a16` takes
the first for trees and decode and the second with two consumers where row blocks hold 128
pairs (`default_tiles`):

* C = 0: one warpgroup issues the TMA loads (`plgpu.emit_pipeline`), converts and
  multiplies, and waits for each step's wgmma before the step's slot is refilled.
* C = 1 or 2, warp specialized (`plgpu.emit_pipeline_warp_specialized`): a producer
  warpgroup keeps the ring of `stages` slots loading; each consumer warpgroup converts and
  multiplies its own BO of the program's C * BO output rows, the C sharing one token tile
  (its bytes read once per C * BO weight rows rather than per BO). A consumer waits for a
  step's wgmmas before it releases the slot and converts the next step's weights: A is in
  registers, and a wgmma left in flight across the loop's back edge (as the bf16 kernel
  leaves one) read registers the next conversion reused: wrong entries at 8192 tokens on an
  H200 in 972 of 1000 calls, none of 1000 with the wait (experiments/ws_fault.py,
  docs/results/s27/ws_fault_h200.json). Slots are handed over by the pipeline's barriers: a
  "produced" barrier per slot (the TMA's bytes arrived) and a "consumed" one (every consumer
  is done with it). The pipeline moves registers from the producer (40 a thread left) to the
  consumers, which leaves room for one program an SM, where the one-warpgroup schedule fits
  several.

The token tiles use a swizzle of at most 64 bytes, since wgmma steps through K in units of
the swizzle's width and each step is one group of 32 inputs; so G is a multiple of 32, BT a
multiple of 16 (a 32-byte row of act^T), outputs a multiple of max(1, C) * BO.

Blocks of e = -1 (dropped pairs, or past the used ones) skip everything; no later step reads
their rows. The combine (each token's K rows weighted by w, float32) runs in XLA.

Mosaic GPU's interpreter (jax 0.11.2) takes no register operand for wgmma: in interpret mode
each dequantized tile goes through shared memory first; the compiled kernel keeps it in
registers. The interpreter also runs wgmma synchronously and ignores `wgmma_wait`, so it
cannot see such a hazard: only compiled runs can. Tested against the reference in interpret
mode on the CPU (tests/test_moe_kernel.py) and compiled under the gpu marker
(tests/test_kernel_shapes.py); timed by experiments/sweep_w4a16.py and
experiments/bench_kernels.py on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.pallas.moe.kernel import combine, group_by_expert
from ddtree_jax.pallas.moe.mosaic import (
    PRODUCER_REGISTERS,
    _body_refs,
    _expert_view,
    _params,
    _store,
    _swiglu,
    _ws_consumer,
)
from ddtree_jax.quant import QuantizedArray

SMEM_BUDGET = 200 * 1024
"""Shared memory the pipeline may take (an H200 block has 227 KiB): `stages` shrinks to fit."""


def consumer_registers(consumers: int) -> int:
    """Registers per thread a consumer warpgroup gets (`setmaxnreg`), as
    `plgpu.emit_pipeline_warp_specialized` shares out the SM's 512 a thread of one warpgroup
    after the producer's `PRODUCER_REGISTERS`: 232 at C = 2, 256 at C = 1."""
    return int(min(256, (512 - PRODUCER_REGISTERS) // consumers) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class W4A16Tiles:
    """Tiles of `moe_experts_w4a16`.

    Attributes:
      block_t: pairs per row block (wgmma's N: a multiple of 16, at most 256; 16 is the least a
        32-byte swizzled row of act^T holds); None picks the power of two at or above the mean
        pairs per expert, within [16, 128].
      block_o: output rows per warpgroup (wgmma's M: 64 or 128).
      groups_per_step: scale groups of G inputs per pipeline step (BK = this * G).
      stages: pipeline slots in shared memory (TMA loads in flight).
      consumers: 0 runs a program in one warpgroup (loads, conversion and wgmma in turn);
        1 or 2 warp-specialize it: a producer warpgroup for the loads and that many consumer
        warpgroups, `block_o` output rows each (see the module docstring).
    """

    block_t: int | None = None
    block_o: int = 64
    groups_per_step: int = 4
    stages: int = 2
    consumers: int = 0

    def __post_init__(self):
        if self.block_t is not None and not (16 <= self.block_t <= 256 and self.block_t % 16 == 0):
            raise ValueError(f"W4A16Tiles.block_t must be a multiple of 16 in [16, 256] or None, got {self.block_t}")
        if self.block_o not in (64, 128):
            raise ValueError(f"W4A16Tiles.block_o must be 64 or 128, got {self.block_o}")
        if self.groups_per_step < 1:
            raise ValueError(f"W4A16Tiles.groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.stages < 1:
            raise ValueError(f"W4A16Tiles.stages must be >= 1, got {self.stages}")
        if self.consumers not in (0, 1, 2):
            raise ValueError(f"W4A16Tiles.consumers must be 0, 1 or 2, got {self.consumers}")
        if self.block_t is not None:
            self.check_registers(self.block_t)

    def check_registers(self, block_t: int) -> None:
        """Raises ValueError when a warp-specialized consumer's gate / up accumulators alone (two
        float32 [BO, BT] over its 128 threads: 2 * BO * BT / 128 registers a thread) take its
        whole register budget (`consumer_registers`). block_o=128, block_t=128, consumers=2
        (256 of 232) returned NaN at 520 and 8192 tokens on an H200 (2026-12-03), where the
        same tiles with one warpgroup (consumers=0, no setmaxnreg, 255 a thread) were correct,
        only 2.2x slower (spilled); block_t <= 32 (64 registers) and block_o=64 at block_t=128
        (128) were correct warp specialized."""
        if not self.consumers:
            return
        acc, budget = 2 * self.block_o * block_t // 128, consumer_registers(self.consumers)
        if acc >= budget:
            raise ValueError(
                f"W4A16Tiles(block_o={self.block_o}, consumers={self.consumers}) at block_t={block_t}: the gate / up "
                f"accumulators take {acc} registers a thread, the consumer warpgroup has {budget}; measured on an "
                "H200 (2026-12-03) to return NaN at block_o=128, block_t=128, consumers=2. Use block_o=64, a smaller "
                "block_t, or consumers=0"
            )

    @property
    def program_rows(self) -> int:
        """Output rows per program: `block_o` for each of its warpgroups that multiply."""
        return self.block_o * max(1, self.consumers)

    def rows_per_block(self, pairs: int, experts: int) -> int:
        """BT for `pairs` (token, expert) pairs over `experts` experts."""
        if self.block_t is not None:
            return self.block_t
        mean = max(1, pairs // max(experts, 1))
        return min(128, max(16, 1 << (mean - 1).bit_length()))


def _transforms(minor: int):
    """Tiling and swizzle of a bf16 shared-memory tile whose rows hold `minor` elements. wgmma
    steps through K in units of the swizzle's width, so it is at most 64 bytes: one group of
    G = 32 inputs per wgmma."""
    width = min(64, 2 * minor)
    return plgpu.TilingTransform((8, width // 2)), plgpu.SwizzleTransform(width)


def _in_specs(k_major, b, j, bt, gps, rows, g, n_weights):
    """Pipeline blocks of one program (b, j): the token tile, then each weight's int4 values
    [gps, rows, G] and scales [gps, rows]."""
    bk = gps * g
    if k_major:
        specs = [plgpu.BlockSpec((bt, bk), lambda k: (b, k), transforms=_transforms(bk))]
    else:
        specs = [plgpu.BlockSpec((1, bk, bt), lambda k: (b, k, 0), transforms=_transforms(bt))]
    for _ in range(n_weights):
        specs.append(plgpu.BlockSpec((gps, rows, g), lambda k: (k, j, 0)))
        specs.append(plgpu.BlockSpec((gps, rows), lambda k: (k, j)))
    return specs


def _step_products(accs, x_smem, w_smem, rows, k_major, a_smem):
    """Issues one pipeline step's wgmmas without waiting for them: for each of its groups and
    each weight n, accs[n] += A @ x^T[group], A the weight's dequantized [BO, G] tile.

    x_smem: the step's token tile; w_smem: each weight's values and scales, [gps, R, G] and
    [gps, R]; rows: the BO of the R rows this warpgroup multiplies; a_smem: None (compiled: A
    from registers) or a [BO, G] bf16 tile the interpreter reads A from.
    """
    gps, _, g = w_smem[0].shape
    for gi in range(gps):
        span = pl.ds(gi * g, g)
        xt = plgpu.transpose_ref(x_smem.at[:, span], (1, 0)) if k_major else x_smem.at[0, span, :]  # [G, BT]
        for n, acc in enumerate(accs):
            q_smem, s_smem = w_smem[2 * n], w_smem[2 * n + 1]
            # The product of an int4 and a bf16 scale is exact in float32: rounded to bf16 once, as
            # the reference's dequantization rounds it.
            a = q_smem[gi, rows].astype(jnp.bfloat16) * s_smem[gi, rows][:, None]  # [BO, G]
            if a_smem is not None:  # the interpreter takes no register operand
                a_smem[...] = a
                plgpu.commit_smem()
                a = a_smem
            plgpu.wgmma(acc, a, xt)  # [BO, G] @ [G, BT]


def _geometry(x, weights, block_expert):
    """(groups In / G, outputs, G, NB, whether x is K-major [NB * BT, In], BT)."""
    *_, n_groups, n_out, g = weights[0].packed.shape
    nb = block_expert.shape[0]
    k_major = x.ndim == 2
    bt = x.shape[0] // nb if k_major else x.shape[2]
    return n_groups, n_out, g, nb, k_major, bt


def _grouped_matmul_t(body_out, x, weights, block_expert, layer, tiles, interpret):
    """One kernel: for each row block b and output tile j, the products W[e]^T x_b^T (float32
    [BO, BT]) of each INT4 weight W in `weights`, handed to `body_out(accumulators) -> tile`
    and stored to out[b, j * BO : (j + 1) * BO, :] ([NB, Out, BT]). One warpgroup a program.

    x: the block rows, [NB * BT, In] with BT = `x.shape[0] // NB` (wgmma's B operand read
    K-major through a transposed view), or [NB, In, BT] (act^T of the first kernel).
    layer: None, or [1] int32 when the weights are layer stacks [L, E, ...]: W = stack[layer].
    """
    n_groups, n_out, g, nb, k_major, bt = _geometry(x, weights, block_expert)
    gps = min(tiles.groups_per_step, n_groups)
    bo = tiles.block_o
    per_stage = bt * gps * g * 2 + len(weights) * gps * bo * (g // 2 + 2)
    stages = max(1, min(tiles.stages, SMEM_BUDGET // per_stage))

    def body(expert_gmem, *refs):
        layer_gmem, x_gmem, w_gmem, out_gmem = _body_refs(layer, refs)
        b, j = jax.lax.axis_index("b"), jax.lax.axis_index("j")
        e = expert_gmem[b]

        @pl.when(e >= 0)
        def _():
            def acc_scope(*accs, a_smem=None):
                def step(_, x_smem, *w_smem):
                    _step_products(accs, x_smem, w_smem, slice(None), k_major, a_smem)
                    plgpu.wgmma_wait(0)

                specs = _in_specs(k_major, b, j, bt, gps, bo, g, len(weights))
                plgpu.emit_pipeline(step, grid=(n_groups // gps,), in_specs=specs, max_concurrent_steps=stages)(
                    x_gmem, *[_expert_view(ref, e, layer_gmem) for ref in w_gmem]
                )
                return tuple(acc[...] for acc in accs)

            accs_spec = [plgpu.ACC((bo, bt), jnp.float32)] * len(weights)
            if interpret is None:
                accs = pl.run_scoped(acc_scope, *accs_spec)
            else:  # the interpreter allows no other allocation in the accumulators' scope

                def staged(a_smem):
                    return pl.run_scoped(functools.partial(acc_scope, a_smem=a_smem), *accs_spec)

                accs = pl.run_scoped(staged, plgpu.SMEM((bo, g), jnp.bfloat16))
            tile = body_out(*accs).astype(out_gmem.dtype)  # [BO, BT]
            _store(tile, out_gmem.at[b], pl.ds(j * bo, bo), slice(None))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((nb, n_out, bt), jnp.bfloat16),
        grid=(nb, n_out // bo),
        grid_names=("b", "j"),
        compiler_params=_params(),
        interpret=interpret,
    )
    lead = () if layer is None else (layer,)
    return kernel(block_expert, *lead, x, *[a for wq in weights for a in (wq.packed, wq.scale)])


def _grouped_matmul_t_ws(body_out, x, weights, block_expert, layer, tiles, interpret):
    """`_grouped_matmul_t` warp specialized: a producer warpgroup for the TMA loads and
    C = `tiles.consumers` consumer warpgroups, the c-th computing out[b, (j * C + c) * BO :
    (j * C + c + 1) * BO, :] ([NB, Out, BT]). Same arguments."""
    n_groups, n_out, g, nb, k_major, bt = _geometry(x, weights, block_expert)
    gps = min(tiles.groups_per_step, n_groups)
    bo, wgs = tiles.block_o, tiles.consumers
    rows = wgs * bo
    out_bytes = wgs * bo * bt * 2  # the epilogue's tiles, allocated beside the ring
    per_stage = bt * gps * g * 2 + len(weights) * gps * rows * (g // 2 + 2)
    stages = max(1, min(tiles.stages, (SMEM_BUDGET - out_bytes) // per_stage))

    def body(expert_gmem, *refs):
        layer_gmem, x_gmem, w_gmem, out_gmem = _body_refs(layer, refs)
        b, j = jax.lax.axis_index("b"), jax.lax.axis_index("j")
        wg = jax.lax.axis_index("wg")  # consumers 0 .. C - 1, then the producer
        e = expert_gmem[b]
        gmem = (x_gmem, *[_expert_view(ref, e, layer_gmem) for ref in w_gmem])

        def pipeline(step, consumer):
            return plgpu.emit_pipeline_warp_specialized(
                step,
                grid=(n_groups // gps,),
                memory_registers=PRODUCER_REGISTERS,
                in_specs=_in_specs(k_major, b, j, bt, gps, rows, g, len(weights)),
                max_concurrent_steps=stages,
                wg_axis="wg",
                num_compute_wgs=wgs,
                compute_context=consumer,
            )

        def scope(ring, out_smem, a_smem=None):
            def step(_, x_smem, *refs):
                *w_smem, accs = refs
                staged = None if a_smem is None else a_smem.at[wg]
                _step_products(accs, x_smem, w_smem, pl.ds(wg * bo, bo), k_major, staged)
                # Every wgmma done before the next step: A is in registers, and one still in flight
                # at the loop's back edge read registers that the next step's conversion reuses
                # (972 of 1000 calls wrong at 8192 tokens on an H200: experiments/ws_fault.py).
                plgpu.wgmma_wait(0)
                return accs

            # A consumer's own slice of the shared epilogue tile ([BO, BT]): in a multithreaded
            # kernel shared memory is allocated by all warpgroups together.
            dst = out_gmem.at[b, pl.ds(j * rows + wg * bo, bo)]
            consumer = _ws_consumer(body_out, (bo, bt), len(weights), out_smem.at[wg], dst)

            @pl.when(e >= 0)
            def _():
                pipeline(step, consumer)(*gmem, allocations=ring)

        scratch = dict(out_smem=plgpu.SMEM((wgs, bo, bt), jnp.bfloat16))
        if interpret is not None:  # no register operand; its wgmma is synchronous: one tile a consumer
            scratch["a_smem"] = plgpu.SMEM((wgs, bo, g), jnp.bfloat16)
        ring = pipeline(None, None).get_allocations(*gmem)  # tiles and barriers, whatever the bodies
        pl.run_scoped(scope, ring=ring, **scratch, collective_axes="wg")

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((nb, n_out, bt), jnp.bfloat16),
        grid=(nb, n_out // rows),
        grid_names=("b", "j"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=_params(),
        interpret=interpret,
    )
    lead = () if layer is None else (layer,)
    return kernel(block_expert, *lead, x, *[a for wq in weights for a in (wq.packed, wq.scale)])


def check_w4a16(gate: QuantizedArray, down: QuantizedArray, tiles: W4A16Tiles = W4A16Tiles()) -> None:
    """Raises ValueError unless the kernel takes experts of these shapes and scales with these tiles."""
    for name, q in (("gate / up", gate), ("down", down)):
        if q.scale.dtype != jnp.bfloat16:
            raise ValueError(f"moe_experts_w4a16: {name} needs bfloat16 group scales, got {q.scale.dtype}")
        *_, n_groups, n_out, g = q.packed.shape
        if n_out % tiles.program_rows or g % 32:
            per = f" x consumers={tiles.consumers}" if tiles.consumers else ""
            raise ValueError(
                f"moe_experts_w4a16: {name} needs outputs a multiple of block_o={tiles.block_o}{per} and INT4 "
                f"groups of a multiple of 32 inputs, got {n_out} outputs and groups of {g}"
            )
        if n_groups % min(tiles.groups_per_step, n_groups):
            raise ValueError(
                f"moe_experts_w4a16: {name} has In / G = {n_groups} groups, not a multiple of "
                f"groups_per_step={tiles.groups_per_step}"
            )


TREE_TILES = W4A16Tiles()
"""Tiles for trees and decode (tens to hundreds of tokens): one warpgroup a program."""
PREFILL_TILES = W4A16Tiles(stages=4, consumers=2)
"""Tiles where row blocks hold 128 pairs (more than 64 pairs an expert on average: prefill,
batched trees): two consumer warpgroups share each token tile. One H200, an EP-8 shard of
Kimi-K2's experts (docs/results/s27/w4a16_ws2.json): 1.44 ms against TREE_TILES' 1.64 at 520
tokens, 14.9 against 17.0 at 8192; 2-3% slower at 17 and 129 tokens."""


def default_tiles(pairs: int, gate: QuantizedArray, down: QuantizedArray) -> W4A16Tiles:
    """`PREFILL_TILES` where their row blocks would hold 128 pairs and they take these experts'
    shapes, else `TREE_TILES`."""
    experts = gate.shape[-3]
    if TREE_TILES.rows_per_block(pairs, experts) >= 128:
        try:
            check_w4a16(gate, down, PREFILL_TILES)
            return PREFILL_TILES
        except ValueError:
            pass
    return TREE_TILES


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_experts_w4a16(
    x,  # [T, H]
    idx,  # [T, K] int32
    w,  # [T, K] float32
    gate: QuantizedArray,  # [E, H, I], grouped INT4
    up: QuantizedArray,  # [E, H, I]
    down: QuantizedArray,  # [E, I, H]
    *,
    layer=None,
    tiles: W4A16Tiles | None = None,
    interpret=None,
):
    """Same contract as `moe_experts_reference`: [T, H] in x's dtype.

    `layer`: None, or an int32 scalar when gate / up / down are layer stacks [L, E, ...]:
    the kernels read layer `layer`'s experts in place. `tiles`: None picks them by the number
    of (token, expert) pairs (`default_tiles`). `interpret`: None compiles for the GPU; Mosaic
    GPU's `InterpretGPUParams()` runs the kernels on the CPU.
    """
    if tiles is None:
        tiles = default_tiles(idx.shape[0] * idx.shape[1], gate, down)
    check_w4a16(gate, down, tiles)
    e = gate.shape[-3]
    if layer is not None:
        layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    t, h = x.shape
    k = idx.shape[1]
    bt = tiles.rows_per_block(t * k, e)
    tiles.check_registers(bt)  # block_t=None resolves here
    pos, block_expert = group_by_expert(idx, e, bt)
    rows = block_expert.shape[0] * bt
    xs = jnp.zeros((rows, h), jnp.bfloat16).at[pos].set(jnp.repeat(x.astype(jnp.bfloat16), k, axis=0))
    matmul = _grouped_matmul_t_ws if tiles.consumers else _grouped_matmul_t
    act_t = matmul(_swiglu, xs, (gate, up), block_expert, layer, tiles, interpret)  # [NB, I, BT]
    ys_t = matmul(lambda y: y, act_t, (down,), block_expert, layer, tiles, interpret)  # [NB, H, BT]
    return combine(jnp.swapaxes(ys_t, 1, 2).reshape(rows, h), pos, idx, w, h, x.dtype, e)
