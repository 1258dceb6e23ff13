"""Pallas (Triton-lowered) drafter layer QKV projection: one launch for what XLA runs as several.

Notation as in reference.py; Mp = M rounded up to a power of two >= 16 (the Triton lowering's
smallest dot), BM rows a program, BK hidden columns a step.

Grid (Nh, Mp / BM). Program (h, r) projects rows r BM .. r BM + BM - 1 onto head h of
the joined weights [H, Nh, hd] (q heads, then k, then v), in BK steps over the hidden size. The
input norm's weight multiplies x before the dot and its row scale rsqrt(mean(x^2) + eps) the
result after it, so that one pass over x gives both. A q or k head is then rms-normed over its
hd columns and rotated: the two halves of the head are two dots (weight columns 0 .. F - 1 and
F .. hd - 1), so the rotation needs no shuffle in registers. Each program stores into the one
output (q, k or v) its head belongs to.

The MLP stays on XLA: the same fold for its norm, gate / up and SwiGLU (one kernel, then XLA's
`down`) took 8.7 us on an H100 against XLA's 8.9 for the whole MLP of the shipped drafter
(session 49, docs/benchmarks.md), no gain to keep a kernel for.

Rounding: everything after the dots stays float32 until the one store, where the XLA path rounds
to the weights' dtype after each projection and norm. The drafter only proposes tokens, so its
rounding never changes what the target accepts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler, check_dot_tiles, dot_rows


@dataclasses.dataclass(frozen=True)
class DrafterLayerTiles:
    """Tile sizes and Triton launch parameters (validated on construction).

    Attributes:
      block_k: hidden columns a step (shrunk to the largest power of two dividing H).
      block_rows: rows a program (shrunk to Mp).
      num_warps, num_stages: Triton launch parameters.
    """

    block_k: int = 128
    block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_dot_tiles(block_k=self.block_k, block_rows=self.block_rows)
        check_compiler(self.num_warps, self.num_stages)


def takes(hidden: int, head_dim: int) -> bool:
    """Whether the kernel tiles this layer: H a multiple of 16, hd a power of two >= 32."""
    return hidden % 16 == 0 and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def _divisor_block(size: int, block: int) -> int:
    """The largest power of two <= block that divides size (>= 16 where `takes` holds)."""
    while size % block:
        block //= 2
    return block


def _inv_rms(ms, eps):
    """rsqrt(ms + eps) [BM, 1] of mean squares ms [BM]; NaN where ms overflowed, as `layers.rms_norm`."""
    return jnp.where(ms == jnp.inf, jnp.nan, jax.lax.rsqrt(ms + eps))[:, None]


def _normed_halves(x_ref, g_ref, w_ref, *, block_k, eps):
    """rms_norm(x) (weight g) times the two column halves of the head's weights w [H, hd],
    float32 [BM, hd / 2] each, in BK steps over H."""
    f32 = jnp.float32
    rows = x_ref.shape[0]
    hidden, hd = w_ref.shape
    halves = (pl.ds(0, hd // 2), pl.ds(hd // 2, hd // 2))

    def step(i, carry):
        ss, a1, a2 = carry
        k0 = pl.multiple_of(i * block_k, block_k)
        xb = x_ref[:, pl.ds(k0, block_k)].astype(f32)
        xg = (xb * g_ref[pl.ds(k0, block_k)].astype(f32)[None, :]).astype(w_ref.dtype)
        d1, d2 = (jnp.dot(xg, w_ref[pl.ds(k0, block_k), c], preferred_element_type=f32) for c in halves)
        return ss + jnp.sum(xb * xb, axis=1), a1 + d1, a2 + d2

    zero = jnp.zeros((rows, hd // 2), f32)
    ss, a1, a2 = jax.lax.fori_loop(0, hidden // block_k, step, (jnp.zeros((rows,), f32), zero, zero))
    scale = _inv_rms(ss / hidden, eps)
    return a1 * scale, a2 * scale


def _qkv_kernel(x_ref, g_ref, w_ref, hn_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *, nq, nkv, block_k, eps):
    f32 = jnp.float32
    head = pl.program_id(0)
    hd = w_ref.shape[1]
    half = hd // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    y1, y2 = _normed_halves(x_ref, g_ref, w_ref, block_k=block_k, eps=eps)
    r = _inv_rms((jnp.sum(y1 * y1, axis=1) + jnp.sum(y2 * y2, axis=1)) / hd, eps)
    n1 = y1 * r * hn_ref[lo].astype(f32)[None, :]
    n2 = y2 * r * hn_ref[hi].astype(f32)[None, :]
    cos, sin = cos_ref[...], sin_ref[...]
    rotated = (n1 * cos - n2 * sin, n2 * cos + n1 * sin)

    def store(ref, halves):
        ref[:, lo] = halves[0].astype(ref.dtype)
        ref[:, hi] = halves[1].astype(ref.dtype)

    # Every program's output blocks name some head of q, k and v; it stores into its own only.
    pl.when(head < nq)(lambda: store(q_ref, rotated))
    pl.when((head >= nq) & (head < nq + nkv))(lambda: store(k_ref, rotated))
    pl.when(head >= nq + nkv)(lambda: store(v_ref, (y1, y2)))


@functools.partial(jax.jit, static_argnames=("nq", "eps", "tiles", "interpret"))
def qkv_pallas(
    x: jax.Array,  # [M, H]
    input_norm: jax.Array,  # [H]
    w: jax.Array,  # [H, Nh, hd]: q heads, k heads, v heads
    head_norm: jax.Array,  # [Nh, hd]: q_norm on q heads, k_norm on k heads (v rows unused)
    cos: jax.Array,  # [M, F] float32
    sin: jax.Array,  # [M, F] float32
    *,
    nq: int,
    eps: float,
    tiles: DrafterLayerTiles = DrafterLayerTiles(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [M, Nq, hd], k, v [M, Nkv, hd] in x's dtype
    """`reference.qkv_reference` on rows [M, H] and joined weights (`api.JointQKV`)."""
    m, hidden = x.shape
    _, nh, hd = w.shape
    nkv = (nh - nq) // 2
    if nq < 1 or nkv < 1 or nq + 2 * nkv != nh:
        raise ValueError(f"joined weights of {nh} heads do not split as {nq} query heads + 2 x key / value heads")
    if not takes(hidden, hd):
        raise ValueError(f"qkv_pallas: hidden {hidden} must be a multiple of 16 and head dim {hd} a power of two >= 32")
    mp = dot_rows(m)
    bm = min(mp, tiles.block_rows)
    if mp != m:  # padded rows are zeros: finite, sliced off
        x, cos, sin = (jnp.pad(a, ((0, mp - m), (0, 0))) for a in (x, cos, sin))
    half = hd // 2
    rows = pl.BlockSpec((bm, hidden), lambda h, r: (r, 0))
    tables = pl.BlockSpec((bm, half), lambda h, r: (r, 0))

    def out(n, first):
        return pl.BlockSpec((bm, None, hd), lambda h, r: (r, jnp.clip(h - first, 0, n - 1), 0))

    q, k, v = pl.pallas_call(
        functools.partial(_qkv_kernel, nq=nq, nkv=nkv, block_k=_divisor_block(hidden, tiles.block_k), eps=eps),
        grid=(nh, mp // bm),
        in_specs=[
            rows,
            pl.BlockSpec((hidden,), lambda h, r: (0,)),
            pl.BlockSpec((hidden, None, hd), lambda h, r: (0, h, 0)),
            pl.BlockSpec((None, hd), lambda h, r: (h, 0)),
            tables,
            tables,
        ],
        out_specs=[out(nq, 0), out(nkv, nq), out(nkv, nq + nkv)],
        out_shape=[jax.ShapeDtypeStruct((mp, n, hd), x.dtype) for n in (nq, nkv, nkv)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(x, input_norm, w, head_norm, cos.astype(jnp.float32), sin.astype(jnp.float32))
    return (q, k, v) if mp == m else (q[:m], k[:m], v[:m])
