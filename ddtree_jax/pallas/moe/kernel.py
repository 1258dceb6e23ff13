"""Pallas (Triton-style) grouped SwiGLU experts ("megablocks" layout).

Notation as in reference.py (T tokens, H hidden, I expert intermediate, E experts,
K experts per token); M = T * K (token, expert) pairs, BM rows per row block, NB row
blocks, BI / BH output tiles over I / H, BK the reduction chunk of both matmuls.

Layout, in XLA (`group_by_expert`): the M pairs are sorted by expert and each
expert's group is padded to a multiple of BM rows, so every row block belongs to
one expert. The number of used blocks depends on the routing, so the grid uses the
static bound NB = floor((M + min(E + 1, M) * (BM - 1)) / BM) (each non-empty group
pads fewer than BM rows; group E holds dropped pairs, ids outside [0, E), such as the experts
of other shards under expert parallelism). `block_expert[b]` is block b's expert,
or -1 for a block of dropped pairs or past the used ones. Token rows are scattered into this layout (padding rows are
zero).

Two kernels, each with the row block on the fastest grid axis so that the blocks
of one expert run side by side and share its weight tiles in L2:

* gate / up, grid (NB, I / BI): program (b, j) reads its expert e from
  `block_expert` and computes act = silu(x_b @ gate[e][:, j]) * (x_b @ up[e][:, j])
  for its BM rows, accumulating over H in BK chunks (float32) and storing act in
  the weight dtype.
* down, grid (NB, H / BH): program (b, n) computes act_b @ down[e][:, n],
  accumulating over I in BK chunks (float32).

The stacked weights are passed whole and indexed with the dynamic expert id inside
the kernel (a pointer offset on the GPU); blocks with e = -1 skip the matmuls, read
no weights and leave their output rows unwritten, and no later step reads those rows.
Padding rows inside a used block are zero, give act = 0, and are never read either.
Back in XLA, each token gathers its K output rows and sums them weighted by w in
float32 (deterministic, no atomics). Matmul operands stay in the input dtype (bf16
on the GPU) with float32 accumulation.

Shared memory per program with the default tiles (BM 16, BI = BH = 128, BK 64, bf16)
is about 34 KiB per pipeline stage for gate / up (an x chunk and two weight chunks)
and 18 KiB for down, so about 100 KiB at 3 stages. H and I that are not multiples of
the tiles are zero-padded in XLA, which copies the expert weights on every call:
Kimi-K2 (H = 7168, I = 2048) needs no padding with the default tiles.

Checked against the reference in interpret mode on the CPU (tests/test_moe_kernel.py,
tests/test_kernel_shapes.py) and compiled on the GPU (`pytest -m gpu`); GPU figures in
docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler, check_tiles


def num_row_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the row blocks of the padded layout: each non-empty expert pads < BM rows."""
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m


def dropped(idx: jax.Array, num_experts: int) -> jax.Array:
    """Which pairs the kernels drop: expert ids outside [0, num_experts)."""
    return (idx < 0) | (idx >= num_experts)


def group_by_expert(idx: jax.Array, num_experts: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """Rows of the expert-sorted, block-padded layout.

    Args:
      idx: [T, K] int32 expert ids; an id outside [0, E) drops the pair (no compute, weight 0),
        as on the XLA path.
      num_experts: E.
      block_m: rows per block (BM).

    Returns:
      pos: [T * K] int32, the layout row of pair t * K + k.
      block_expert: [NB] int32, the expert of each row block, -1 past the used blocks.
    """
    pairs = idx.size
    # Dropped pairs (idx < 0, e.g. experts on another shard, or idx >= E) form one more group,
    # E, whose blocks are marked -1 like unused ones: they are laid out but never computed.
    # (An id >= E left as it was fell outside the bincount and broke the layout: NaN rows.)
    flat = jnp.where(dropped(idx, num_experts).reshape(-1), num_experts, idx.reshape(-1))  # [M]
    nb = num_row_blocks(pairs, num_experts + 1, block_m)
    sizes = jnp.bincount(flat, length=num_experts + 1).astype(jnp.int32)  # [E + 1]
    blocks = pl.cdiv(sizes, block_m)  # [E + 1]
    block_end = jnp.cumsum(blocks)  # [E + 1]
    first_row = (block_end - blocks) * block_m  # [E + 1] first layout row of each group
    first_pair = jnp.cumsum(sizes) - sizes  # [E + 1] first sorted position of each group
    order = jnp.argsort(flat, stable=True)  # [M] pair ids grouped by expert
    sorted_expert = flat[order]
    rank = jnp.arange(pairs, dtype=jnp.int32) - first_pair[sorted_expert]
    pos = jnp.zeros((pairs,), jnp.int32).at[order].set(first_row[sorted_expert] + rank)
    block_expert = jnp.searchsorted(block_end, jnp.arange(nb, dtype=jnp.int32), side="right").astype(jnp.int32)
    return pos, jnp.where(block_expert < num_experts, block_expert, -1)


def _gate_up_kernel(expert_ref, x_ref, gate_ref, up_ref, act_ref, *, block_k):
    e = expert_ref[0]

    @pl.when(e >= 0)
    def _compute():
        f32 = jnp.float32
        bm, bi = act_ref.shape

        def step(c, carry):
            g, u = carry
            start = pl.multiple_of(c * block_k, block_k)
            xc = x_ref[:, pl.ds(start, block_k)]  # [BM, BK]
            g += jnp.dot(xc, gate_ref[e, pl.ds(start, block_k), :], preferred_element_type=f32)
            u += jnp.dot(xc, up_ref[e, pl.ds(start, block_k), :], preferred_element_type=f32)
            return g, u

        zeros = jnp.zeros((bm, bi), f32)
        g, u = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros, zeros))
        act_ref[...] = (jax.nn.silu(g) * u).astype(act_ref.dtype)


def _down_kernel(expert_ref, act_ref, down_ref, y_ref, *, block_k):
    e = expert_ref[0]

    @pl.when(e >= 0)
    def _compute():
        def step(c, acc):
            start = pl.multiple_of(c * block_k, block_k)
            a = act_ref[:, pl.ds(start, block_k)]  # [BM, BK]
            return acc + jnp.dot(a, down_ref[e, pl.ds(start, block_k), :], preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, act_ref.shape[1] // block_k, step, jnp.zeros(y_ref.shape, jnp.float32))
        y_ref[...] = acc.astype(y_ref.dtype)


def _pad_to(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Zero-pads trailing edges; returns a itself when already that shape (no weight copy)."""
    if a.shape == shape:
        return a
    return jnp.pad(a, [(0, s - d) for d, s in zip(a.shape, shape, strict=True)])


@dataclasses.dataclass(frozen=True)
class MoETiles:
    """Tiles and launch parameters of `moe_experts_pallas` (validated on construction).

    Powers of two (the Triton lowering needs power-of-two loads, and 16 or more for
    its dots); block_i, block_h and block_k shrink to the next power of two of I, H
    and min(H, I) when those are smaller.

    Attributes:
      block_m: (token, expert) pairs per row block; every block holds one expert's pairs.
      block_i, block_h: output tiles of the up / down projections.
      block_k: the contraction step.
      num_warps, num_stages: Triton launch parameters.
    """

    block_m: int = 16
    block_i: int = 128
    block_h: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(block_m=self.block_m, block_i=self.block_i, block_h=self.block_h, block_k=self.block_k)
        check_compiler(self.num_warps, self.num_stages)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_experts_pallas(
    x,  # [T, H]
    idx,  # [T, K] int32
    w,  # [T, K] float32
    gate,  # [E, H, I]
    up,  # [E, H, I]
    down,  # [E, I, H]
    *,
    tiles: MoETiles = MoETiles(),
    interpret: bool = False,
):
    """Same contract as `moe_experts_reference`: [T, H] in x's dtype (tiles: `MoETiles`)."""
    block_m, block_i, block_h, block_k = tiles.block_m, tiles.block_i, tiles.block_h, tiles.block_k
    num_warps, num_stages = tiles.num_warps, tiles.num_stages
    t, h = x.shape
    e, _, i = gate.shape
    k = idx.shape[1]
    bi = min(block_i, pl.next_power_of_2(i))
    bh = min(block_h, pl.next_power_of_2(h))
    bk = min(block_k, pl.next_power_of_2(min(h, i)))
    # Powers of two: the larger tile is a multiple of the smaller.
    h_pad = pl.cdiv(h, max(bh, bk)) * max(bh, bk)
    i_pad = pl.cdiv(i, max(bi, bk)) * max(bi, bk)
    dtype = gate.dtype
    gate = _pad_to(gate, (e, h_pad, i_pad))
    up = _pad_to(up, (e, h_pad, i_pad))
    down = _pad_to(down.astype(dtype), (e, i_pad, h_pad))

    pos, block_expert = group_by_expert(idx, e, block_m)
    nb = block_expert.shape[0]
    rows = nb * block_m
    x_rows = jnp.repeat(_pad_to(x, (t, h_pad)).astype(dtype), k, axis=0)  # [M, H_pad], pair t * K + k
    xs = jnp.zeros((rows, h_pad), dtype).at[pos].set(x_rows)  # [NB * BM, H_pad]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    expert_spec = pl.BlockSpec((1,), lambda b, j: (b,))

    act = pl.pallas_call(
        functools.partial(_gate_up_kernel, block_k=bk),
        grid=(nb, i_pad // bi),
        in_specs=[
            expert_spec,
            pl.BlockSpec((block_m, h_pad), lambda b, j: (b, 0)),
            pl.BlockSpec((e, h_pad, bi), lambda b, j: (0, 0, j)),
            pl.BlockSpec((e, h_pad, bi), lambda b, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, bi), lambda b, j: (b, j)),
        out_shape=jax.ShapeDtypeStruct((rows, i_pad), dtype),
        compiler_params=params,
        interpret=interpret,
    )(block_expert, xs, gate, up)  # [NB * BM, I_pad]

    ys = pl.pallas_call(
        functools.partial(_down_kernel, block_k=bk),
        grid=(nb, h_pad // bh),
        in_specs=[
            expert_spec,
            pl.BlockSpec((block_m, i_pad), lambda b, n: (b, 0)),
            pl.BlockSpec((e, i_pad, bh), lambda b, n: (0, 0, n)),
        ],
        out_specs=pl.BlockSpec((block_m, bh), lambda b, n: (b, n)),
        out_shape=jax.ShapeDtypeStruct((rows, h_pad), x.dtype),
        compiler_params=params,
        interpret=interpret,
    )(block_expert, act, down)  # [NB * BM, H_pad]

    return combine(ys, pos, idx, w, h, x.dtype, e)


def combine(ys: jax.Array, pos: jax.Array, idx: jax.Array, w: jax.Array, h: int, dtype, num_experts: int) -> jax.Array:
    """[T, H]: each token's K rows of the layout's output ys [NB * BM, >= H], weighted by w, summed in float32."""
    t, k = idx.shape
    y = ys[pos, :h].reshape(t, k, h).astype(jnp.float32)
    # Rows of dropped pairs were never written: select, not multiply (0 * garbage may be NaN).
    y = jnp.where(dropped(idx, num_experts)[..., None], 0.0, y)
    # An elementwise sum, not an einsum: a float32 matmul could run in TF32 on the GPU.
    return jnp.sum(w.astype(jnp.float32)[..., None] * y, axis=1).astype(dtype)
