"""Pallas (Triton-lowered) dense pass of a few tokens through every expert, one launch.

Notation as in reference.py; Mp = T rounded up to a power of two >= 16 (the Triton lowering's
smallest dot), BI expert-intermediate columns a program, BK hidden columns a step, NJ = I / BI.

What it replaces: `reference._moe_dense_flat`, the XLA path for T tokens with E / K < T <=
`reference.DENSE_MAX_TOKENS` (a tree verify's MoE), which XLA runs as a gate / up GEMM, the
SwiGLU and routing weights, and a down GEMM: several launches, each a skinny GEMM that reads
the weights at a fraction of the memory bandwidth on the shipped pair's shapes.

Grid (E, NJ). Program (e, j) takes expert e's columns j BI .. j BI + BI - 1 of gate and up
and the same rows of down:

    act = where(chosen[:, e], (silu(x @ gate[e][:, j]) * (x @ up[e][:, j])) * comb[:, e], 0)
    partial[e NJ + j] = act @ down[e][j, :]                                       [Mp, H] f32

with the dots accumulated in float32 over H in BK steps, and the products rounded to the
weights' dtype where `_moe_dense_flat` rounds them. An expert no token chose reads no weights
and writes zeros. XLA then sums the E NJ partials in float32 (deterministic: no atomics) and
rounds once. Pairs with ids outside [0, E) choose nothing.

Checked against the reference in interpret mode on the CPU (tests/test_moe_kernel.py) and
timed against the XLA path by `python3 -m ddtree_jax.pallas.moe.bench --dense`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler, check_tiles
from ddtree_jax.pallas.moe.reference import routing


@dataclasses.dataclass(frozen=True)
class DenseMoETiles:
    """Tile sizes and Triton launch parameters (validated on construction).

    Attributes:
      block_i: expert-intermediate columns a program (shrunk to the largest power of two dividing I).
      block_k: hidden columns a step of the gate / up dots and a column block of the down dot
        (shrunk likewise for H).
      num_warps, num_stages: Triton launch parameters.
    """

    block_i: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(block_i=self.block_i, block_k=self.block_k)
        for name in ("block_i", "block_k"):
            if getattr(self, name) < 16:
                raise ValueError(f"{name} must be >= 16 (the Triton dot's smallest), got {getattr(self, name)}")
        check_compiler(self.num_warps, self.num_stages)


def takes(hidden: int, intermediate: int) -> bool:
    """Whether the kernel tiles experts of this width: H and I multiples of 16."""
    return hidden % 16 == 0 and intermediate % 16 == 0


def padded_rows(tokens: int) -> int:
    """Mp: tokens rounded up to a power of two >= 16."""
    return max(16, pl.next_power_of_2(tokens))


def _divisor_block(size: int, block: int) -> int:
    """The largest power of two <= block that divides size (>= 16 where `takes` holds)."""
    while size % block:
        block //= 2
    return block


def _dense_kernel(x_ref, comb_ref, chosen_ref, gate_ref, up_ref, down_ref, out_ref, *, block_k):
    f32 = jnp.float32
    dtype = gate_ref.dtype
    hidden = x_ref.shape[1]
    rows, block_i = x_ref.shape[0], gate_ref.shape[1]
    chosen = chosen_ref[...]  # [Mp] int32, 1 where the row chose this expert
    used = jnp.max(chosen) > 0  # (the Triton lowering has no reduce_or)
    steps = hidden // block_k

    @pl.when(used)
    def _compute():
        def step(c, carry):
            g, u = carry
            k0 = pl.multiple_of(c * block_k, block_k)
            xb = x_ref[:, pl.ds(k0, block_k)]
            g = g + jnp.dot(xb, gate_ref[pl.ds(k0, block_k), :], preferred_element_type=f32)
            u = u + jnp.dot(xb, up_ref[pl.ds(k0, block_k), :], preferred_element_type=f32)
            return g, u

        zero = jnp.zeros((rows, block_i), f32)
        g, u = jax.lax.fori_loop(0, steps, step, (zero, zero))
        # `_moe_dense_flat`'s roundings: each projection, the SwiGLU product, the weighted act.
        g = g.astype(dtype).astype(f32)
        u = u.astype(dtype).astype(f32)
        swiglu = (jax.nn.silu(g).astype(dtype).astype(f32) * u).astype(dtype).astype(f32)
        act = jnp.where(chosen[:, None] > 0, swiglu * comb_ref[...][:, None], 0.0).astype(dtype)
        for n in range(steps):  # H in BK-column blocks of the down dot
            cols = pl.ds(n * block_k, block_k)
            out_ref[:, cols] = jnp.dot(act, down_ref[:, cols], preferred_element_type=f32)

    @pl.when(~used)
    def _skip():
        for n in range(steps):
            out_ref[:, pl.ds(n * block_k, block_k)] = jnp.zeros((rows, block_k), f32)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_dense_pallas(
    x: jax.Array,  # [T, H]
    idx: jax.Array,  # [T, K] int32
    w: jax.Array,  # [T, K] float32
    gate: jax.Array,  # [E, H, I] in x's dtype
    up: jax.Array,  # [E, H, I]
    down: jax.Array,  # [E, I, H]
    *,
    tiles: DenseMoETiles = DenseMoETiles(),
    interpret: bool = False,
) -> jax.Array:  # [T, H] in x's dtype
    """`reference._moe_dense_flat` (every expert on every token, the unchosen weighted 0) in
    one kernel launch and one float32 sum; dense weights of x's dtype."""
    t, hidden = x.shape
    e, _, inter = gate.shape
    if not takes(hidden, inter):
        raise ValueError(f"moe_dense_pallas: H {hidden} and I {inter} must be multiples of 16")
    for name, a in (("gate", gate), ("up", up), ("down", down)):
        if a.dtype != x.dtype:
            raise ValueError(f"moe_dense_pallas: {name} is {a.dtype}, x is {x.dtype}: dense weights of x's dtype")
    mp = padded_rows(t)
    bi = _divisor_block(inter, tiles.block_i)
    nj = inter // bi
    comb, chosen = routing(idx, w, e)  # [T, E]
    pad = ((0, 0), (0, mp - t))  # padded rows choose nothing
    comb_t = jnp.pad(comb.T, pad)
    chosen_t = jnp.pad(chosen.T.astype(jnp.int32), pad)
    xp = jnp.pad(x, ((0, mp - t), (0, 0)))
    per_expert = pl.BlockSpec((None, mp), lambda ei, j: (ei, 0))
    partials = pl.pallas_call(
        functools.partial(_dense_kernel, block_k=_divisor_block(hidden, tiles.block_k)),
        grid=(e, nj),
        in_specs=[
            pl.BlockSpec((mp, hidden), lambda ei, j: (0, 0)),
            per_expert,
            per_expert,
            pl.BlockSpec((None, hidden, bi), lambda ei, j: (ei, 0, j)),
            pl.BlockSpec((None, hidden, bi), lambda ei, j: (ei, 0, j)),
            pl.BlockSpec((None, bi, hidden), lambda ei, j: (ei, j, 0)),
        ],
        out_specs=pl.BlockSpec((None, mp, hidden), lambda ei, j: (ei * nj + j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((e * nj, mp, hidden), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(xp, comb_t, chosen_t, gate, up, down)
    return jnp.sum(partials, axis=0)[:t].astype(x.dtype)
