"""Mosaic GPU (Hopper: TMA, wgmma) grouped SwiGLU experts, bf16.

Notation as in reference.py / kernel.py (T tokens, H hidden, I expert intermediate,
E experts, K experts per token, M = T * K pairs, BM rows per row block, NB row blocks).

The layout is kernel.py's (`group_by_expert`): pairs sorted by expert, each expert's
group padded to a multiple of BM rows, so that every row block belongs to one expert and
a block of dropped pairs or past the used ones is marked -1. BM = 64 (one warpgroup's
wgmma row tile) times the warpgroups that multiply (`MosaicMoETiles.block_m`). Two
kernels, each a grid of (row block, output tile) programs:

* gate / up, grid (NB, I / BN): program (b, j) reads its expert e, streams x_b's
  [BM, BK] chunks and gate[e] / up[e]'s [BK, BN] chunks through a TMA pipeline of
  `stages` slots in shared memory, accumulates both products with wgmma into two
  float32 accumulators in registers, and stores silu(g) * u in bf16 (TMA store);
* down, grid (NB, H / BN): act_b @ down[e] the same way, one accumulator.

Two schedules of a program (`MosaicMoETiles.consumers`):

* C = 0: one warpgroup issues the TMA loads (`plgpu.emit_pipeline`) and the wgmmas, and
  waits for each step's wgmmas before the step's slot is refilled.
* C = 1 or 2, warp specialized (`plgpu.emit_pipeline_warp_specialized`), for the
  compute-bound regime (prefill): a producer warpgroup keeps the ring of `stages` slots
  loading; consumer warpgroup c multiplies rows [64 c, 64 c + 64) of the program's
  BM = 64 C, so at C = 2 the consumers share each weight tile (its bytes read once per
  128 rows rather than per 64) and each keeps its accumulators in registers (gate / up:
  two 64 x BN float32 ones, 128 registers a thread at BN = 128). A consumer leaves a
  step's wgmmas running while it waits for the next step's loads and issues them, and
  releases a slot one step late (the slot's `delay_release`), once the wgmmas that read
  it are done. The pipeline's barriers hand slots over: a "produced" barrier per slot
  (the TMA's bytes arrived) and a "consumed" one (every consumer is done with it). The
  producer keeps 40 registers a thread and leaves the rest to the consumers (232 each at
  C = 2). Compiled, C = 2 is refused (`refuse_two_consumers`: it crashed once on an H200,
  not reproduced since).

Shared memory per program with BN = 128, BK = 64 (bf16), as Mosaic counts it lowering for
sm_90: a slot of gate / up holds BM x BK + 2 x BK x BN elements (40 KiB at BM = 64, 48 KiB
at 128), one of down BM x BK + BK x BN (24 / 32 KiB). C = 0 allocates its epilogue tile
once the ring is freed; C > 0 beside the ring (BM x BN: 32 KiB at C = 2), since a consumer
stores its tile while the other may still multiply. At 4 stages: 160 / 96 KiB (gate / up,
down) at C = 0, 224 / 160 KiB at C = 2 (an H200 block may take 227: 5 stages do not fit).

Blocks with e = -1 skip everything and leave their rows unwritten; no later step reads
them. The combine (each token's K rows weighted by w, float32) runs in XLA, as in
kernel.py. Needs H and I multiples of BK and BN (Kimi-K2's 7168 and 2048 are).

Tested against the reference in Mosaic GPU's interpret mode on the CPU
(tests/test_moe_kernel.py), which runs wgmma synchronously: the wgmmas kept in flight are
only exercised compiled (tests/test_kernel_shapes.py under the gpu marker). Timed by
ddtree_jax/pallas/moe/bench.py on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.pallas.moe.kernel import combine, group_by_expert

BLOCK_M = 64
"""Rows a warpgroup multiplies: the row tile of one wgmma."""

PRODUCER_REGISTERS = 40
"""Registers per thread of the warp-specialized kernel's producer warpgroup (it only issues TMA)."""


@dataclasses.dataclass(frozen=True)
class MosaicMoETiles:
    """Tiles of `moe_experts_mosaic`.

    Attributes:
      block_n: output columns per program (of I for gate / up, of H for down).
      block_k: the contraction chunk streamed per pipeline step.
      stages: pipeline slots in shared memory (TMA loads in flight).
      consumers: 0 runs a program in one warpgroup (loads and wgmma in turn); 1 or 2
        warp-specialize it: a producer warpgroup for the loads and that many consumer
        warpgroups, 64 rows of the program's row block each (see the module docstring).
        Compiled, `moe_experts_mosaic` refuses 2: it crashed once on an H200.
      release_delay: warp specialized, the steps a consumer keeps its wgmmas in flight before
        it releases their slot: 1 (the default) overlaps a step's wgmmas with the next step's
        wait; 0 waits for them before the release (with one stage there is nothing to overlap).
    """

    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    consumers: int = 0
    release_delay: int = 1

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v % 16:
                raise ValueError(f"MosaicMoETiles.{name} must be a positive multiple of 16, got {v}")
        if self.stages < 1:
            raise ValueError(f"MosaicMoETiles.stages must be >= 1, got {self.stages}")
        if self.consumers not in (0, 1, 2):
            raise ValueError(f"MosaicMoETiles.consumers must be 0, 1 or 2, got {self.consumers}")
        if self.release_delay not in (0, 1):
            raise ValueError(f"MosaicMoETiles.release_delay must be 0 or 1, got {self.release_delay}")

    @property
    def block_m(self) -> int:
        """Rows per block (BM): `BLOCK_M` for each warpgroup that multiplies."""
        return BLOCK_M * max(1, self.consumers)


def _params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _store_through(smem, tile: jax.Array, dst) -> None:
    """A register tile to the global memory ref `dst` through the shared memory ref `smem`
    (TMA store)."""
    smem[...] = tile
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0)


def _store(tile: jax.Array, out_gmem, rows, cols) -> None:
    """A register tile to out_gmem[rows, cols] through shared memory allocated here."""
    pl.run_scoped(lambda smem: _store_through(smem, tile, out_gmem.at[rows, cols]), plgpu.SMEM(tile.shape, tile.dtype))


def _ws_consumer(body_out, acc_shape: tuple[int, int], n_acc: int, tile_smem, dst):
    """The compute context of a warp-specialized pipeline's consumer warpgroup: `n_acc` float32
    accumulators of `acc_shape` in registers through the pipeline's steps, then
    `body_out(*accumulators)` stored to `dst` through the consumer's own `tile_smem`."""

    def consumer(run):
        def acc_scope(*accs):
            run(accs)
            return tuple(a[...] for a in accs)

        accs = pl.run_scoped(acc_scope, *[plgpu.ACC(acc_shape, jnp.float32)] * n_acc)
        _store_through(tile_smem, body_out(*accs).astype(tile_smem.dtype), dst)

    return consumer


def _body_refs(layer, refs):
    """A grouped-matmul kernel body's refs after the block -> expert map: (the [1] layer index,
    or None when `layer` is None, the row blocks, [each weight], the output)."""
    layer_gmem = None
    if layer is not None:
        layer_gmem, *refs = refs
    x_gmem, *w_gmem, out_gmem = refs
    return layer_gmem, x_gmem, w_gmem, out_gmem


def _expert_view(ref, e, layer_gmem):
    """ref[e] of an expert stack, or ref[layer, e] of a layer stack when `layer_gmem` ([1]
    int32) is given. The layer's slice is taken here rather than in XLA: handed a slice, XLA
    copies it into a buffer of its own before the call (experiments/moe_layer_stack.py)."""
    return ref.at[e] if layer_gmem is None else ref.at[layer_gmem[0], e]


def _grouped_matmul(body_out, n_out: int, x: jax.Array, weights: tuple, block_expert, layer, tiles, interpret):
    """One kernel: for each row block b and output tile j, the expert's products x_b @ w[e][:, j]
    for each w in `weights`, handed to `body_out(accumulators) -> tile` and stored.

    layer: None, or [1] int32 when the weights are layer stacks [L, E, ...]: w = stack[layer].
    """
    rows, kdim = x.shape
    bn, bk = tiles.block_n, tiles.block_k
    nb = rows // BLOCK_M

    def body(expert_gmem, *refs):
        layer_gmem, x_gmem, w_gmem, out_gmem = _body_refs(layer, refs)
        b, j = jax.lax.axis_index("b"), jax.lax.axis_index("j")
        e = expert_gmem[b]

        @pl.when(e >= 0)
        def _():
            def acc_scope(*accs):
                def step(_, x_smem, *w_smem):
                    for acc, ws in zip(accs, w_smem, strict=True):
                        plgpu.wgmma(acc, x_smem, ws)
                    plgpu.wgmma_wait(0)

                specs = [plgpu.BlockSpec((BLOCK_M, bk), lambda k: (b, k))]
                specs += [plgpu.BlockSpec((bk, bn), lambda k: (k, j))] * len(w_gmem)
                plgpu.emit_pipeline(step, grid=(kdim // bk,), in_specs=specs, max_concurrent_steps=tiles.stages)(
                    x_gmem, *(_expert_view(w, e, layer_gmem) for w in w_gmem)
                )
                return tuple(a[...] for a in accs)

            accs = pl.run_scoped(acc_scope, *[plgpu.ACC((BLOCK_M, bn), jnp.float32)] * len(w_gmem))
            _store(body_out(*accs).astype(out_gmem.dtype), out_gmem, pl.ds(b * BLOCK_M, BLOCK_M), pl.ds(j * bn, bn))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        grid=(nb, n_out // bn),
        grid_names=("b", "j"),
        compiler_params=_params(),
        interpret=interpret,
    )
    return kernel(block_expert, *(() if layer is None else (layer,)), x, *weights)


def _grouped_matmul_ws(body_out, n_out: int, x: jax.Array, weights: tuple, block_expert, layer, tiles, interpret):
    """`_grouped_matmul` warp specialized: a producer warpgroup for the TMA loads and
    C = `tiles.consumers` consumer warpgroups, the c-th computing rows [b * BM + 64 c,
    b * BM + 64 c + 64) of output tile j, BM = 64 C. Same arguments."""
    rows, kdim = x.shape
    bn, bk, wgs = tiles.block_n, tiles.block_k, tiles.consumers
    bm = tiles.block_m
    # A slot is released one step late, so that the wgmmas which read it may still run; with
    # one slot there is nothing to overlap.
    delay = min(tiles.release_delay, tiles.stages - 1)

    def body(expert_gmem, *refs):
        layer_gmem, x_gmem, w_gmem, out_gmem = _body_refs(layer, refs)
        b, j = jax.lax.axis_index("b"), jax.lax.axis_index("j")
        wg = jax.lax.axis_index("wg")  # consumers 0 .. C - 1, then the producer
        e = expert_gmem[b]
        gmem = (x_gmem, *(_expert_view(w, e, layer_gmem) for w in w_gmem))

        def pipeline(step, consumer):
            specs = [plgpu.BlockSpec((bm, bk), lambda k: (b, k), delay_release=delay)]
            specs += [plgpu.BlockSpec((bk, bn), lambda k: (k, j), delay_release=delay)] * len(w_gmem)
            return plgpu.emit_pipeline_warp_specialized(
                step,
                grid=(kdim // bk,),
                memory_registers=PRODUCER_REGISTERS,
                in_specs=specs,
                max_concurrent_steps=tiles.stages,
                wg_axis="wg",
                num_compute_wgs=wgs,
                compute_context=consumer,
            )

        def scope(ring, out_smem):
            own = pl.ds(wg * BLOCK_M, BLOCK_M)  # this consumer's rows of the block

            def step(_, x_smem, *refs):
                *w_smem, accs = refs
                for acc, ws in zip(accs, w_smem, strict=True):
                    plgpu.wgmma(acc, x_smem.at[own], ws)  # [64, BK] @ [BK, BN]
                # Each wgmma commits a group of its own: this step's stay in flight through the
                # next step's barrier wait; the step before's are done, so its slot may be released.
                plgpu.wgmma_wait(delay * len(accs))
                return accs

            # A consumer's own slice of the shared epilogue tile ([64, BN]): in a multithreaded
            # kernel shared memory is allocated by all warpgroups together.
            dst = out_gmem.at[pl.ds(b * bm + wg * BLOCK_M, BLOCK_M), pl.ds(j * bn, bn)]
            consumer = _ws_consumer(body_out, (BLOCK_M, bn), len(w_gmem), out_smem.at[wg], dst)

            @pl.when(e >= 0)
            def _():
                pipeline(step, consumer)(*gmem, allocations=ring)

        ring = pipeline(None, None).get_allocations(*gmem)  # tiles and barriers, whatever the bodies
        out_smem = plgpu.SMEM((wgs, BLOCK_M, bn), x.dtype)
        pl.run_scoped(scope, ring=ring, out_smem=out_smem, collective_axes="wg")

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        grid=(rows // bm, n_out // bn),
        grid_names=("b", "j"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=_params(),
        interpret=interpret,
    )
    return kernel(block_expert, *(() if layer is None else (layer,)), x, *weights)


def _swiglu(g, u):
    return g / (1.0 + jnp.exp(-g)) * u


def refuse_two_consumers(kernel: str, tiles, interpret) -> None:
    """Raises ValueError for a compiled warp-specialized schedule of two consumer warpgroups.

    The bf16 kernel (tiles 128,64,4,2) ran one call and 20 timed calls on 17 tokens (top-8 of
    48 experts, H=7168, I=2048) on an H200 (2026-12-03) and the next failed with
    CUDA_ERROR_LAUNCH_FAILED (docs/results/s19/moe_all.log). Not reproduced since: 1000 calls
    each at 17 and 8192 tokens, one-step and no release delay, all equal to the one-warpgroup
    kernel (experiments/ws_fault.py, docs/results/s27/ws_fault_h200.json). Refused until the
    crash is explained. (The W4A16 kernel's two-consumer failure was found and fixed: see
    w4a16.py.)
    """
    if tiles.consumers == 2 and interpret is None:
        raise ValueError(
            f"{kernel}: consumers=2 ({tiles}) is refused compiled: it crashed once on an H200 (2026-12-03, "
            "CUDA_ERROR_LAUNCH_FAILED), cause unknown; use consumers=0 or 1 (or interpret mode)"
        )


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_experts_mosaic(
    x,  # [T, H]
    idx,  # [T, K] int32
    w,  # [T, K] float32
    gate,  # [E, H, I]
    up,  # [E, H, I]
    down,  # [E, I, H]
    *,
    layer=None,
    tiles: MosaicMoETiles = MosaicMoETiles(),
    interpret=None,
):
    """Same contract as `moe_experts_reference`: [T, H] in x's dtype.

    `layer`: None, or an int32 scalar when gate / up / down are layer stacks [L, E, ...]:
    the kernels read layer `layer`'s experts in place. `interpret`: None compiles for the
    GPU; Mosaic GPU's `InterpretGPUParams()` runs the kernels on the CPU.
    """
    h = x.shape[1]
    e, _, i = gate.shape[-3:]
    refuse_two_consumers("moe_experts_mosaic", tiles, interpret)
    if layer is not None:
        layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    k = idx.shape[1]
    for name, dim in (("H", h), ("I", i)):
        for tile in ("block_n", "block_k"):
            if dim % getattr(tiles, tile):
                raise ValueError(
                    f"moe_experts_mosaic needs {name}={dim} to be a multiple of {tile}={getattr(tiles, tile)}"
                )
    dtype = gate.dtype
    pos, block_expert = group_by_expert(idx, e, tiles.block_m)
    rows = block_expert.shape[0] * tiles.block_m
    xs = jnp.zeros((rows, h), dtype).at[pos].set(jnp.repeat(x.astype(dtype), k, axis=0))  # [NB * BM, H]
    matmul = _grouped_matmul_ws if tiles.consumers else _grouped_matmul
    act = matmul(_swiglu, i, xs, (gate, up), block_expert, layer, tiles, interpret)  # [NB * BM, I]
    ys = matmul(lambda y: y, h, act, (down.astype(dtype),), block_expert, layer, tiles, interpret)  # [NB * BM, H]
    return combine(ys, pos, idx, w, h, x.dtype, e)
