"""Pallas (Triton-lowered) drafter block attention: one launch for what XLA runs as ~9.

Notation as in reference.py; Tp = T rounded up to a power of two >= 16 (the Triton
lowering's smallest dot), BK the context keys per step.

Grid (B, Nq / Hg, J): program (b, h, j) holds query heads h Hg .. h Hg + Hg - 1 (Hg =
`DrafterAttentionTiles.head_group`, 1 by default) as [Hg Tp, hd] rows (row t Hg + g: token t
of its head g) and reads kv head h Hg // G, G = Nq / Nkv; with Hg > 1 a context tile is
loaded once for the Hg heads that share it. Split j = 0 attends the block's own keys (every
query sees its own token, so its running max is finite from the start); split j walks its
share of the context slots [lo, hi) in BK steps with an online softmax in float32, where hi
= ctx_len[b] and lo = max(0, min(positions[b]) - window + 1): the slots below lo are outside
every query's window, so a sliding layer reads ~window + BK slots whatever the cache
capacity (the XLA path reads all S). The last step's start is clamped to S - BK so that no
load leaves the cache; slots it re-reads are masked out. With J = 1 (`num_splits`: short
reaches) the program writes the output; with J > 1 (a full layer over a long cache) each
writes its normalized partial and log-sum-exp, and XLA merges the J partials
(`partials.merge`, as the MLA kernel's). Matmul operands stay in the input dtype (bf16 on
the GPU) with float32 accumulation, the weights cast to the values' dtype for P V, as the
reference does.

Checked against the reference in interpret mode on the CPU (tests/test_drafter_attention.py,
tests/test_kernel_shapes.py, which also lowers it to Triton IR for CUDA at full size) and
compiled on the GPU (`pytest -m gpu`, the bench, `experiments/profile_round.py`'s draft
stage). The drafter only proposes tokens, so its rounding never changes what the target
accepts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler, check_dot_tiles, dot_rows, partials

MASK_VALUE = -1e30
"""Finite, so that exp(MASK_VALUE - max) underflows to 0 instead of giving NaN."""

SPLIT_MIN_REACH = 1024
"""Reaches (context slots a query sees) up to this run one program per query head, unsplit."""
SPLIT_MIN_SLOTS = 256
"""Past `SPLIT_MIN_REACH`, a program walks at least this many slots. Measured on an H100 (session
36, docs/benchmarks.md): at a 4K cache on Kimi-K2.5-DFlash's TP-8 shard, 16 splits of 256 slots
took 0.0112 ms against 0.0142 for 8 of 512 (the choice at 512 here) and 0.0129 for 32; at all 64
heads the program count caps the splits at 8 either way."""
SPLIT_PROGRAMS = 512
"""Programs a split grid aims at, about four per SM of an H100 / H200 (132). Measured on an H100
over a 32K cache (session 36, docs/benchmarks.md): 512 programs were the fastest of the counts
tried at both Kimi-K2.5-DFlash shapes (8 heads: 64 splits, 0.0305 ms against 0.0385 at 264
programs; 64 heads: 8 splits, 0.150 against 0.197)."""


@dataclasses.dataclass(frozen=True)
class DrafterAttentionTiles:
    """Context keys per step and Triton launch parameters (validated on construction).

    Attributes:
      block_k: context slots per step (a power of two >= 16; shrunk to the cache when smaller).
      num_warps, num_stages: Triton launch parameters.
      head_group: query heads per program, Hg (a power of two dividing the heads per key /
        value head): with Hg > 1 a program holds Hg heads' Tp rows as one [Hg Tp, hd] tile, so
        each context tile is loaded once for the Hg heads instead of once per head.
    """

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    head_group: int = 1

    def __post_init__(self):
        check_dot_tiles(block_k=self.block_k)
        if not isinstance(self.head_group, int) or self.head_group < 1 or self.head_group & (self.head_group - 1):
            raise ValueError(f"head_group must be a power of two >= 1, got {self.head_group!r}")
        check_compiler(self.num_warps, self.num_stages)


def takes(q: jax.Array, k_ctx: jax.Array) -> bool:
    """Whether the kernel tiles these operands: head dim a power of two >= 16, a cache of >= 16 slots."""
    hd = q.shape[-1]
    return hd >= 16 and hd & (hd - 1) == 0 and k_ctx.shape[1] >= 16


def num_splits(reach: int, batch: int, heads: int, programs: int = SPLIT_PROGRAMS) -> int:
    """How many programs share the walk of one row's head group over `reach` context slots
    (`heads`: the head groups a row, Nq / Hg): 1 up to `SPLIT_MIN_REACH`, else enough that the
    grid has about `programs` programs, each walking at least `SPLIT_MIN_SLOTS` slots."""
    if reach <= SPLIT_MIN_REACH:
        return 1
    return max(1, min(pl.cdiv(reach, SPLIT_MIN_SLOTS), pl.cdiv(programs, batch * heads)))


def _kernel(meta_ref, pos_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, *out_refs, tokens, block_k, scale, splits):
    f32 = jnp.float32
    split = pl.program_id(2)
    lo, hi, window, causal = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    tp, hg, hd = q_ref.shape if q_ref.ndim == 3 else (q_ref.shape[0], 1, q_ref.shape[1])  # Hg = 1: [Tp, hd]
    rows = tp * hg  # row t * Hg + g: token t of the program's head g
    s_cap = kc_ref.shape[0]
    q = q_ref[...].reshape(rows, hd)
    pos_t = pos_ref[...]  # [Tp]
    pos = pos_t if hg == 1 else jnp.broadcast_to(pos_t[:, None], (tp, hg)).reshape(rows)  # each row's position

    # The block's own keys (in split 0 only): real tokens, and in a causal layer those not after
    # the query. Split 0's running max is then finite from the start; other splits' rows start
    # all masked (max MASK_VALUE, sum 0) and may stay so.
    u = jax.lax.broadcasted_iota(jnp.int32, (rows, tp), 1)
    own = (u < tokens) & ((causal == 0) | (pos_t[None, :] <= pos[:, None])) & (split == 0)
    s = jnp.dot(q, kb_ref[...].T, preferred_element_type=f32) * scale  # [Hg Tp, Tp]
    s = jnp.where(own, s, MASK_VALUE)
    m = jnp.max(s, axis=1)
    p = jnp.where(own, jnp.exp(s - m[:, None]), 0.0)
    l_sum = jnp.sum(p, axis=1)
    acc = jnp.dot(p.astype(vb_ref.dtype), vb_ref[...], preferred_element_type=f32)  # [Hg Tp, hd]

    # This split's share of the context slots [lo, hi), in whole steps.
    chunk = pl.cdiv(pl.cdiv(jnp.maximum(hi - lo, 0), splits), block_k) * block_k
    first = lo + split * chunk
    last = jnp.minimum(first + chunk, hi)

    def step(i, carry):
        m, l_sum, acc = carry
        nominal = first + i * block_k
        start = jnp.minimum(nominal, s_cap - block_k)
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        seen = (slot >= nominal) & (slot < last) & (pos[:, None] - slot < window)
        s = jnp.dot(q, kc_ref[pl.ds(start, block_k), :].T, preferred_element_type=f32) * scale
        s = jnp.where(seen, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        pv = jnp.dot(p.astype(vc_ref.dtype), vc_ref[pl.ds(start, block_k), :], preferred_element_type=f32)
        return m_new, l_sum * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    steps = pl.cdiv(jnp.maximum(last - first, 0), block_k)
    m, l_sum, acc = jax.lax.fori_loop(0, steps, step, (m, l_sum, acc))
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / l_sum[:, None]).astype(o_ref.dtype).reshape(o_ref.shape)
    else:  # a normalized partial and its log-sum-exp (-inf where the split saw no key), merged in XLA
        o_ref, lse_ref = out_refs
        seen_any = l_sum > 0
        o_ref[...] = (acc / jnp.where(seen_any, l_sum, 1.0)[:, None]).reshape(o_ref.shape)
        lse = jnp.where(seen_any, m + jnp.log(jnp.where(seen_any, l_sum, 1.0)), -jnp.inf)
        lse_ref[...] = lse.reshape(lse_ref.shape)


@functools.partial(jax.jit, static_argnames=("tiles", "splits", "interpret", "layer"))
def drafter_attention_pallas(
    q: jax.Array,  # [B, T, Nq, hd]
    k_ctx: jax.Array,  # [B, S, Nkv, hd]
    v_ctx: jax.Array,  # [B, S, Nkv, hd]
    ctx_len: jax.Array,  # [B] int32
    positions: jax.Array,  # [B, T] int32
    k_blk: jax.Array,  # [B, T, Nkv, hd]
    v_blk: jax.Array,  # [B, T, Nkv, hd]
    window: jax.Array | int,
    causal: jax.Array | bool,
    *,
    tiles: DrafterAttentionTiles = DrafterAttentionTiles(),
    splits: int = 1,
    interpret: bool = False,
    layer: int | None = None,
) -> jax.Array:  # [B, T, Nq, hd]
    """Same contract as `drafter_attention_reference` (tiles: `DrafterAttentionTiles`; splits:
    programs per query head, each walking a share of the context slots, `num_splits`). With
    `layer`, k_ctx and v_ctx are every layer's cache [Ld, B, S, Nkv, hd], read in place."""
    b, t, nq, hd = q.shape
    lead = () if layer is None else (layer,)  # the stacked cache's layer, fixed for every program
    s_cap, nkv = k_ctx.shape[len(lead) + 1], k_ctx.shape[len(lead) + 2]
    if not takes(q, jax.ShapeDtypeStruct(k_ctx.shape[len(lead) :], k_ctx.dtype)):
        raise ValueError(f"head dim {hd} must be a power of two >= 16 and the cache >= 16 slots, got {s_cap}")
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ValueError(f"splits must be an int >= 1, got {splits!r}")
    group = nq // nkv
    hg = tiles.head_group
    if group % hg:
        raise ValueError(f"head_group {hg} must divide the {group} query heads of each key / value head")
    tp = dot_rows(t)
    bk = min(tiles.block_k, 1 << (s_cap.bit_length() - 1))  # a power of two <= S
    if tp != t:  # padded rows are sliced off; padded block keys are masked (u < T)
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q, k_blk, v_blk = jnp.pad(q, pad), jnp.pad(k_blk, pad), jnp.pad(v_blk, pad)
        positions = jnp.pad(positions, [(0, 0), (0, tp - t)], mode="edge")
    window = jnp.asarray(window, jnp.int32)
    hi = jnp.clip(ctx_len, 0, s_cap).astype(jnp.int32)
    lo = jnp.maximum(jnp.min(positions, axis=1) - window + 1, 0)  # the lowest slot any query's window reaches
    meta = jnp.stack(
        [lo, hi, jnp.broadcast_to(window, (b,)), jnp.broadcast_to(jnp.asarray(causal, jnp.int32), (b,))], axis=1
    ).astype(jnp.int32)  # [B, 4]
    # Program (b, h, j) holds query heads h Hg .. h Hg + Hg - 1, which share key / value head h Hg // G.
    heads = None if hg == 1 else hg  # Hg = 1: the head dim squeezed, as the kernel was timed
    rows = pl.BlockSpec((None, tp, heads, hd), lambda i, h, j: (i, 0, h, 0))
    kv_blk = pl.BlockSpec((None, tp, None, hd), lambda i, h, j: (i, 0, h * hg // group, 0))
    kv_ctx = pl.BlockSpec(
        (*[None] * len(lead), None, s_cap, None, hd), lambda i, h, j: (*lead, i, 0, h * hg // group, 0)
    )
    if splits == 1:
        out_specs = rows
        out_shape = jax.ShapeDtypeStruct((b, tp, nq, hd), q.dtype)
    else:
        out_specs = [
            pl.BlockSpec((None, None, tp, heads, hd), lambda i, h, j: (i, j, 0, h, 0)),
            pl.BlockSpec((None, None, tp, heads), lambda i, h, j: (i, j, 0, h)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b, splits, tp, nq, hd), jnp.float32),
            jax.ShapeDtypeStruct((b, splits, tp, nq), jnp.float32),
        ]
    out = pl.pallas_call(
        functools.partial(_kernel, tokens=t, block_k=bk, scale=hd**-0.5, splits=splits),
        grid=(b, nq // hg, splits),
        in_specs=[
            pl.BlockSpec((None, 4), lambda i, h, j: (i, 0)),
            pl.BlockSpec((None, tp), lambda i, h, j: (i, 0)),
            rows,
            kv_ctx,
            kv_ctx,
            kv_blk,
            kv_blk,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(meta, positions.astype(jnp.int32), q, k_ctx, v_ctx, k_blk, v_blk)
    if splits > 1:
        out = partials.merge(*out).astype(q.dtype)  # [B, J, Tp, Nq, hd], [B, J, Tp, Nq] -> [B, Tp, Nq, hd]
    return out[:, :t]
