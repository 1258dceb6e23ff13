"""Mosaic GPU (Hopper: TMA, wgmma) grouped SwiGLU experts, bf16.

Notation as in reference.py / kernel.py (T tokens, H hidden, I expert intermediate,
E experts, K experts per token, M = T * K pairs, BM rows per row block, NB row blocks).

The layout is kernel.py's (`group_by_expert`): pairs sorted by expert, each expert's
group padded to a multiple of BM = 64 rows (one wgmma row tile), so that every row
block belongs to one expert and a block of dropped pairs or past the used ones is
marked -1. Two kernels, each a grid of (row block, output tile) programs of one
warpgroup:

* gate / up, grid (NB, I / BN): program (b, j) reads its expert e, streams x_b's
  [BM, BK] chunks and gate[e] / up[e]'s [BK, BN] chunks through a TMA pipeline of
  `stages` slots in shared memory, accumulates both products with wgmma into two
  float32 accumulators in registers, and stores silu(g) * u in bf16 (TMA store);
* down, grid (NB, H / BN): act_b @ down[e] the same way, one accumulator.

Blocks with e = -1 skip everything and leave their rows unwritten; no later step reads
them. The combine (each token's K rows weighted by w, float32) runs in XLA, as in
kernel.py. Needs H and I multiples of BK and BN (Kimi-K2's 7168 and 2048 are).

Tested against the reference in Mosaic GPU's interpret mode on the CPU
(tests/test_moe_kernel.py); timed by ddtree_jax/pallas/moe/bench.py on the GPU.
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
"""Rows per block: the row tile of one warpgroup's wgmma."""


@dataclasses.dataclass(frozen=True)
class MosaicMoETiles:
    """Tiles of `moe_experts_mosaic`.

    Attributes:
      block_n: output columns per program (of I for gate / up, of H for down).
      block_k: the contraction chunk streamed per pipeline step.
      stages: pipeline slots in shared memory (TMA loads in flight).
    """

    block_n: int = 128
    block_k: int = 64
    stages: int = 4

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v % 16:
                raise ValueError(f"MosaicMoETiles.{name} must be a positive multiple of 16, got {v}")
        if self.stages < 1:
            raise ValueError(f"MosaicMoETiles.stages must be >= 1, got {self.stages}")


def _params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _store(tile: jax.Array, out_gmem, rows, cols) -> None:
    """A register tile to out_gmem[rows, cols] through shared memory (TMA store)."""

    def scope(smem):
        smem[...] = tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM(tile.shape, tile.dtype))


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
        layer_gmem = None
        if layer is not None:
            layer_gmem, *refs = refs
        x_gmem, *w_gmem, out_gmem = refs
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


def _swiglu(g, u):
    return g / (1.0 + jnp.exp(-g)) * u


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
    pos, block_expert = group_by_expert(idx, e, BLOCK_M)
    rows = block_expert.shape[0] * BLOCK_M
    xs = jnp.zeros((rows, h), dtype).at[pos].set(jnp.repeat(x.astype(dtype), k, axis=0))  # [NB * BM, H]
    act = _grouped_matmul(_swiglu, i, xs, (gate, up), block_expert, layer, tiles, interpret)  # [NB * BM, I]
    ys = _grouped_matmul(lambda y: y, h, act, (down.astype(dtype),), block_expert, layer, tiles, interpret)
    return combine(ys, pos, idx, w, h, x.dtype)
