"""Pallas (Triton-lowered) drafter block attention: one launch for what XLA runs as ~9.

Notation as in reference.py; Tp = T rounded up to a power of two >= 16 (the Triton
lowering's smallest dot), BK the context keys per step.

Grid (B, Nq): program (b, h) holds query head h's Tp block rows [Tp, hd] and reads
kv head h // G. It first attends the block's own keys (every query sees its own token,
so the running max is finite from the start), then walks the context slots
[lo, hi) in BK steps with an online softmax in float32, where hi = ctx_len[b] and
lo = max(0, min(positions[b]) - window + 1): the slots below lo are outside every
query's window, so a sliding layer reads ~window + BK slots whatever the cache
capacity (the XLA path reads all S). The last step's start is clamped to S - BK so
that no load leaves the cache; slots it re-reads are masked out. Matmul operands stay
in the input dtype (bf16 on the GPU) with float32 accumulation, the weights cast to
the values' dtype for P V, as the reference does.

Checked against the reference in interpret mode on the CPU
(tests/test_drafter_attention.py) and on the GPU by `experiments/profile_round.py`'s
drafter stage; the drafter only proposes tokens, so its rounding never changes what the
target accepts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler, check_tiles

MASK_VALUE = -1e30
"""Finite, so that exp(MASK_VALUE - max) underflows to 0 instead of giving NaN."""


@dataclasses.dataclass(frozen=True)
class DrafterAttentionTiles:
    """Context keys per step and Triton launch parameters (validated on construction).

    Attributes:
      block_k: context slots per step (a power of two >= 16; shrunk to the cache when smaller).
      num_warps, num_stages: Triton launch parameters.
    """

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tiles(block_k=self.block_k)
        if self.block_k < 16:
            raise ValueError(f"block_k must be >= 16 (the Triton dot's smallest), got {self.block_k}")
        check_compiler(self.num_warps, self.num_stages)


def takes(q: jax.Array, k_ctx: jax.Array) -> bool:
    """Whether the kernel tiles these operands: head dim a power of two >= 16, a cache of >= 16 slots."""
    hd = q.shape[-1]
    return hd >= 16 and hd & (hd - 1) == 0 and k_ctx.shape[1] >= 16


def _kernel(meta_ref, pos_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, o_ref, *, tokens, block_k, scale):
    f32 = jnp.float32
    lo, hi, window, causal = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    tp = q_ref.shape[0]
    s_cap = kc_ref.shape[0]
    q = q_ref[...]  # [Tp, hd]
    pos = pos_ref[...]  # [Tp]

    # The block's own keys: real tokens only, and in a causal layer those not after the query.
    u = jax.lax.broadcasted_iota(jnp.int32, (tp, tp), 1)
    own = (u < tokens) & ((causal == 0) | (pos[None, :] <= pos[:, None]))
    s = jnp.dot(q, kb_ref[...].T, preferred_element_type=f32) * scale  # [Tp, Tp]
    s = jnp.where(own, s, MASK_VALUE)
    m = jnp.max(s, axis=1)
    p = jnp.where(own, jnp.exp(s - m[:, None]), 0.0)
    l_sum = jnp.sum(p, axis=1)
    acc = jnp.dot(p.astype(vb_ref.dtype), vb_ref[...], preferred_element_type=f32)  # [Tp, hd]

    def step(i, carry):
        m, l_sum, acc = carry
        nominal = lo + i * block_k
        start = jnp.minimum(nominal, s_cap - block_k)
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (tp, block_k), 1)
        seen = (slot >= nominal) & (slot < hi) & (pos[:, None] - slot < window)
        s = jnp.dot(q, kc_ref[pl.ds(start, block_k), :].T, preferred_element_type=f32) * scale
        s = jnp.where(seen, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
        pv = jnp.dot(p.astype(vc_ref.dtype), vc_ref[pl.ds(start, block_k), :], preferred_element_type=f32)
        return m_new, l_sum * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    steps = jnp.maximum(hi - lo + block_k - 1, 0) // block_k
    m, l_sum, acc = jax.lax.fori_loop(0, steps, step, (m, l_sum, acc))
    o_ref[...] = (acc / l_sum[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
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
    interpret: bool = False,
) -> jax.Array:  # [B, T, Nq, hd]
    """Same contract as `drafter_attention_reference` (tiles: `DrafterAttentionTiles`)."""
    b, t, nq, hd = q.shape
    s_cap, nkv = k_ctx.shape[1], k_ctx.shape[2]
    group = nq // nkv
    tp = max(16, pl.next_power_of_2(t))
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
    rows = pl.BlockSpec((None, tp, None, hd), lambda i, h: (i, 0, h, 0))
    kv_blk = pl.BlockSpec((None, tp, None, hd), lambda i, h: (i, 0, h // group, 0))
    kv_ctx = pl.BlockSpec((None, s_cap, None, hd), lambda i, h: (i, 0, h // group, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, tokens=t, block_k=bk, scale=hd**-0.5),
        grid=(b, nq),
        in_specs=[
            pl.BlockSpec((None, 4), lambda i, h: (i, 0)),
            pl.BlockSpec((None, tp), lambda i, h: (i, 0)),
            rows,
            kv_ctx,
            kv_ctx,
            kv_blk,
            kv_blk,
        ],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((b, tp, nq, hd), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(meta, positions.astype(jnp.int32), q, k_ctx, v_ctx, k_blk, v_blk)
    return out[:, :t]
