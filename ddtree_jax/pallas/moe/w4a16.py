"""Mosaic GPU (Hopper: TMA, wgmma) grouped SwiGLU experts with INT4 weights, bf16 activations (W4A16).

Notation as in reference.py (T tokens, H hidden, I expert intermediate, E experts, K
experts per token, G inputs per scale group); BT (token, expert) pairs per row block, NB
row blocks, BO output rows per program (64 or 128), BK the contraction chunk of one pipeline
step (`W4A16Tiles`).

Weights come in the grouped INT4 layout of `quant.QuantizedArray`: values [E, In / G, Out, G]
int4 (signed) and scales [E, In / G, Out]. The products are computed transposed ("swap AB"):
the weights are wgmma's A operand, [BO, G] per group, and the tokens its B operand, so a row
block is as small as 16 pairs (wgmma's N) rather than the 64 rows of wgmma's M.

* gate / up, grid (NB, I / BO): program (b, j) streams, through a TMA pipeline of `stages`
  slots, the [BK / G, BO, G] int4 chunks of gate[e] and up[e] for its output rows, their
  scales and x_b's [BT, BK] chunk. Per group it loads the [BO, G] int4 tile into registers,
  converts it to bf16 and multiplies each row by its scale (the same rounding as the
  reference's dequantization: the product of an int4 and a bf16 is exact in float32), and
  accumulates W^T x^T into a [BO, BT] float32 accumulator with wgmma (A from registers,
  B = x^T, a transposed view of the K-major token tile in shared memory). The epilogue stores
  silu(g) * u in the accumulators' orientation, act^T [NB, I, BT].
* down, grid (NB, H / BO): down[e]^T act_b^T the same way (B = act^T's [BK, BT] tile), y^T
  [NB, H, BT], transposed back in XLA.

The token tiles use a swizzle of at most 64 bytes, since wgmma steps through K in units of
the swizzle's width and each step is one group of 32 inputs; so G is a multiple of 32, BT a
multiple of 16 (a 32-byte row of act^T), outputs a multiple of BO.

Blocks of e = -1 (dropped pairs, or past the used ones) skip everything; no later step reads
their rows. The combine (each token's K rows weighted by w, float32) runs in XLA.

Mosaic GPU's interpreter (jax 0.11.2) takes no register operand for wgmma: in interpret mode
each dequantized tile goes through shared memory first; the compiled kernel keeps it in
registers. Tested against the reference in interpret mode on the CPU (tests/test_moe_kernel.py)
and compiled under the gpu marker (tests/test_kernel_shapes.py); timed by
experiments/sweep_w4a16.py and experiments/bench_kernels.py on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.pallas.moe.kernel import combine, group_by_expert
from ddtree_jax.pallas.moe.mosaic import _expert_view, _params, _store, _swiglu
from ddtree_jax.quant import QuantizedArray

SMEM_BUDGET = 200 * 1024
"""Shared memory the pipeline may take (an H200 block has 227 KiB): `stages` shrinks to fit."""


@dataclasses.dataclass(frozen=True)
class W4A16Tiles:
    """Tiles of `moe_experts_w4a16`.

    Attributes:
      block_t: pairs per row block (wgmma's N: a multiple of 16, at most 256; 16 is the least a
        32-byte swizzled row of act^T holds); None picks the power of two at or above the mean
        pairs per expert, within [16, 128].
      block_o: output rows per program (wgmma's M: 64 or 128).
      groups_per_step: scale groups of G inputs per pipeline step (BK = this * G).
      stages: pipeline slots in shared memory (TMA loads in flight).
    """

    block_t: int | None = None
    block_o: int = 64
    groups_per_step: int = 4
    stages: int = 2

    def __post_init__(self):
        if self.block_t is not None and not (16 <= self.block_t <= 256 and self.block_t % 16 == 0):
            raise ValueError(f"W4A16Tiles.block_t must be a multiple of 16 in [16, 256] or None, got {self.block_t}")
        if self.block_o not in (64, 128):
            raise ValueError(f"W4A16Tiles.block_o must be 64 or 128, got {self.block_o}")
        if self.groups_per_step < 1:
            raise ValueError(f"W4A16Tiles.groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.stages < 1:
            raise ValueError(f"W4A16Tiles.stages must be >= 1, got {self.stages}")

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


def _grouped_matmul_t(body_out, x, weights, block_expert, layer, tiles, interpret):
    """One kernel: for each row block b and output tile j, the products W[e]^T x_b^T (float32
    [BO, BT]) of each INT4 weight W in `weights`, handed to `body_out(accumulators) -> tile`
    and stored to out[b, j * BO : (j + 1) * BO, :] ([NB, Out, BT]).

    x: the block rows, [NB * BT, In] with BT = `x.shape[0] // NB` (wgmma's B operand read
    K-major through a transposed view), or [NB, In, BT] (act^T of the first kernel).
    layer: None, or [1] int32 when the weights are layer stacks [L, E, ...]: W = stack[layer].
    """
    *_, n_groups, n_out, g = weights[0].packed.shape
    kdim = n_groups * g
    gps = min(tiles.groups_per_step, n_groups)
    bk = gps * g
    nb = block_expert.shape[0]
    k_major = x.ndim == 2
    bt = x.shape[0] // nb if k_major else x.shape[2]
    bo = tiles.block_o
    per_stage = bt * bk * 2 + len(weights) * gps * bo * (g // 2 + 2)
    stages = max(1, min(tiles.stages, SMEM_BUDGET // per_stage))

    def body(expert_gmem, *refs):
        layer_gmem = None
        if layer is not None:
            layer_gmem, *refs = refs
        x_gmem, *w_gmem, out_gmem = refs
        b, j = jax.lax.axis_index("b"), jax.lax.axis_index("j")
        e = expert_gmem[b]

        @pl.when(e >= 0)
        def _():
            def acc_scope(*accs, a_smem=None):
                def step(_, x_smem, *w_smem):
                    for gi in range(gps):
                        rows = pl.ds(gi * g, g)
                        xt = plgpu.transpose_ref(x_smem.at[:, rows], (1, 0)) if k_major else x_smem.at[0, rows, :]
                        for n, acc in enumerate(accs):
                            q_smem, s_smem = w_smem[2 * n], w_smem[2 * n + 1]
                            # The product of an int4 and a bf16 scale is exact in float32: rounded to
                            # bf16 once, as the reference's dequantization rounds it.
                            a = q_smem[gi].astype(jnp.bfloat16) * s_smem[gi][:, None]  # [BO, G]
                            if a_smem is not None:  # the interpreter takes no register operand
                                a_smem[...] = a
                                plgpu.commit_smem()
                                a = a_smem
                            plgpu.wgmma(acc, a, xt)  # [BO, G] @ [G, BT]
                    plgpu.wgmma_wait(0)

                if k_major:
                    specs = [plgpu.BlockSpec((bt, bk), lambda k: (b, k), transforms=_transforms(bk))]
                else:
                    specs = [plgpu.BlockSpec((1, bk, bt), lambda k: (b, k, 0), transforms=_transforms(bt))]
                for _ in weights:
                    specs.append(plgpu.BlockSpec((gps, bo, g), lambda k: (k, j, 0)))
                    specs.append(plgpu.BlockSpec((gps, bo), lambda k: (k, j)))
                plgpu.emit_pipeline(step, grid=(kdim // bk,), in_specs=specs, max_concurrent_steps=stages)(
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


def check_w4a16(gate: QuantizedArray, down: QuantizedArray, tiles: W4A16Tiles = W4A16Tiles()) -> None:
    """Raises ValueError unless the kernel takes experts of these shapes with these tiles."""
    for name, q in (("gate / up", gate), ("down", down)):
        *_, n_groups, n_out, g = q.packed.shape
        if n_out % tiles.block_o or g % 32:
            raise ValueError(
                f"moe_experts_w4a16: {name} needs outputs a multiple of block_o={tiles.block_o} and INT4 groups "
                f"of a multiple of 32 inputs, got {n_out} outputs and groups of {g}"
            )
        if n_groups % min(tiles.groups_per_step, n_groups):
            raise ValueError(
                f"moe_experts_w4a16: {name} has In / G = {n_groups} groups, not a multiple of "
                f"groups_per_step={tiles.groups_per_step}"
            )


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
    tiles: W4A16Tiles = W4A16Tiles(),
    interpret=None,
):
    """Same contract as `moe_experts_reference`: [T, H] in x's dtype.

    `layer`: None, or an int32 scalar when gate / up / down are layer stacks [L, E, ...]:
    the kernels read layer `layer`'s experts in place. `interpret`: None compiles for the
    GPU; Mosaic GPU's `InterpretGPUParams()` runs the kernels on the CPU.
    """
    check_w4a16(gate, down, tiles)
    e = gate.shape[-3]
    if layer is not None:
        layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    t, h = x.shape
    k = idx.shape[1]
    bt = tiles.rows_per_block(t * k, e)
    pos, block_expert = group_by_expert(idx, e, bt)
    rows = block_expert.shape[0] * bt
    xs = jnp.zeros((rows, h), jnp.bfloat16).at[pos].set(jnp.repeat(x.astype(jnp.bfloat16), k, axis=0))
    act_t = _grouped_matmul_t(_swiglu, xs, (gate, up), block_expert, layer, tiles, interpret)  # [NB, I, BT]
    ys_t = _grouped_matmul_t(lambda y: y, act_t, (down,), block_expert, layer, tiles, interpret)  # [NB, H, BT]
    return combine(jnp.swapaxes(ys_t, 1, 2).reshape(rows, h), pos, idx, w, h, x.dtype)
