"""Mosaic GPU (Hopper: TMA, wgmma, warp specialization) absorbed-MLA attention over the cache.

Notation as in reference.py (B batch, T new tokens, N heads, S cache capacity, R latent
width, P rope width); Q = T * N query rows (row t * N + n is head n of token t), BQ = 64
rows per query tile (one wgmma row tile), BK cache slots per pipeline step, NS cache
splits of C slots each, R2 = R / 2.

The cache part runs in one `plgpu.kernel` on a grid (B, Q / BQ, NS) of three warpgroups:

* the memory warpgroup loads the query tile once (q_lat as two [BQ, R2] halves, q_pe)
  and streams the split's cache tiles, c_kv as two [BK, R2] halves and k_pe, through a
  TMA ring of `stages` slots; a slot is reloaded when both compute warpgroups released it;
* each of the two compute warpgroups computes the scores of the whole tile,
  S = q_lat c_kv^T + q_pe k_pe^T ([BQ, BK], float32), runs the online softmax in
  registers, and accumulates P @ c_kv[:, its half]: the [BQ, R] float32 accumulator
  does not fit one warpgroup's registers, so the 512 value columns are split in two
  (FlashMLA's layout) and both halves come from the same TMA load of the tile.

Each program writes its normalized partial output (in the cache's dtype, through the
query tile's shared memory once both warpgroups are done with it) and its log-sum-exp.
The new tokens (T keys under the tree or causal mask) form one more partial, combined
with the cache's by log-sum-exp (`partials.merge` in XLA, or `merge.merge_partials`, one
Triton-lowered launch, with `merge.MERGE_KERNEL`; with `merge.MERGE_EXTENDED` it also
scores an AR step's key). Where T <= `MosaicMLATiles.new_in_kernel` it comes from the
kernel itself: one more split per query tile streams the new keys
(padded to Tp, a multiple of BK) through the same ring, masked by bits (row r's word w,
bit j: key 32 w + j visible; one int32 word per 32 keys, loaded beside each tile), so
that the whole call is the kernel and the merge. Otherwise XLA computes it (`_new_partial`).
Splits are sized so that the grid's waves over the SMs end soonest (`num_splits`). Slots at
or past cache_len[b] are masked; whole tiles past it are never loaded.

The scores are computed by both compute warpgroups (the QK^T half of the FLOPs twice):
simple, and free while the cache stream bounds the time (decode); it caps the
compute-bound case at 1088 / 1664 of the tensor-core rate.

Tested against the reference in Mosaic GPU's interpret mode on the CPU
(tests/test_mla_kernel.py); timed by ddtree_jax/pallas/mla_attention/bench.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_jax.pallas import partials
from ddtree_jax.pallas.mla_attention import merge
from ddtree_jax.pallas.mla_attention.reference import MASK_VALUE

BLOCK_Q = 64
"""Query rows per tile: the row tile of one warpgroup's wgmma."""
LOG2E = math.log2(math.e)
INTERPRET_NEW_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
"""XLA:CPU flag the interpreter needs for the new tokens' split: under XLA's default CPU
scheduler a compute warpgroup's reads of the mask words run ahead of its barrier waits and
the interpreter's warpgroups deadlock (seen on this project's 2-core machine)."""
H200_SMS = 132
"""SMs of an H200: the wave `num_splits` fills where the device does not say (CPU interpret)."""


def new_split_runs(interpret) -> bool:
    """Whether the new tokens' split can run: compiled, or interpreted under INTERPRET_NEW_FLAG."""
    return interpret is None or INTERPRET_NEW_FLAG in os.environ.get("XLA_FLAGS", "")


@dataclasses.dataclass(frozen=True)
class MosaicMLATiles:
    """Tiles of `mla_attention_mosaic` (validated on construction).

    Attributes:
      block_k: cache slots per pipeline step (a multiple of 64: Mosaic GPU infers no
        layout for the [64, 32] score tile; the cache capacity must be a multiple of it).
      stages: TMA ring slots in shared memory (block_k * (R + P) * 2 bytes each; with the
        query tile's 72 KiB, at most 227 KiB in all: 2 slots of 64 at Kimi-K2's widths).
      num_splits: cache splits; None picks `num_splits`.
      new_in_kernel: the most new tokens whose keys the kernel attends itself (one more
        split per query tile); more, or 0, and XLA computes their partial. Their mask
        travels as bits: T x N rows x Tp / 32 words, so prefill's thousands stay in XLA.
    """

    block_k: int = 64
    stages: int = 2
    num_splits: int | None = None
    new_in_kernel: int = 0

    def __post_init__(self):
        if not isinstance(self.block_k, int) or self.block_k < 64 or self.block_k % 64:
            raise ValueError(f"MosaicMLATiles.block_k must be a positive multiple of 64, got {self.block_k!r}")
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"MosaicMLATiles.stages must be a positive int, got {self.stages!r}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int) or self.num_splits < 1):
            raise ValueError(f"MosaicMLATiles.num_splits must be None or a positive int, got {self.num_splits!r}")
        if not isinstance(self.new_in_kernel, int) or self.new_in_kernel < 0:
            raise ValueError(f"MosaicMLATiles.new_in_kernel must be an int >= 0, got {self.new_in_kernel!r}")


PROGRAM_OVERHEAD_BLOCKS = 2
"""A program's fixed work in cache blocks of its split's stream: the query tile's load
(R + P wide, as a block of the cache) and the partial output's store (R wide)."""


XLA_PARTIAL_BLOCKS = 4
"""XLA's new-token partial and its merge term in cache-block time: eight launches, 13.4 us at
32K (session 29's profile), where a program streams a block in about 3 us (0.126 ms over 39
modeled blocks, TP-8 65-token tree, session 31)."""


def _rounds(programs: int, cache_blocks: int, ns: int, new_blocks: int, sms: int) -> int:
    """Modeled time of a grid, in cache blocks: waves of one program per SM x (the longest
    program's blocks + `PROGRAM_OVERHEAD_BLOCKS`); `new_blocks` > 0 adds the new tokens' split
    to each of the `programs` query tiles."""
    longest = max(-(-cache_blocks // ns), new_blocks)
    return -(-programs * (ns + int(new_blocks > 0)) // sms) * (longest + PROGRAM_OVERHEAD_BLOCKS)


def _sms(sms: int | None) -> int:
    return sms or getattr(jax.devices()[0], "core_count", None) or H200_SMS


def num_splits(batch: int, query_tiles: int, cache_blocks: int, sms: int | None = None, new_blocks: int = 0) -> int:
    """Cache splits that finish the grid soonest: the fewest that minimize waves x (blocks a
    split + `PROGRAM_OVERHEAD_BLOCKS`), waves = batch * query_tiles * splits over the SMs,
    rounded up, at most two waves when splitting.

    One program runs per SM (its shared memory takes the SM), so a grid of 136 programs on 132
    SMs takes two rounds of the whole split: 17 tree tokens x 64 heads (17 query tiles) over a
    32K cache (512 blocks) run 15 splits (255 programs, two waves of 35 blocks), not the 8 that
    filling the SMs once would give (136 programs, two waves of 64).

    `new_blocks` > 0: each query tile runs one more program, the new tokens' split of that
    many blocks (`MosaicMLATiles.new_in_kernel`); it shares the waves.
    """
    sms = _sms(sms)
    programs = batch * query_tiles
    most = max(1, min(cache_blocks, -(-2 * sms // programs) - int(new_blocks > 0)))
    return min(range(1, most + 1), key=lambda ns: (_rounds(programs, cache_blocks, ns, new_blocks, sms), ns))


def new_split_pays(
    batch: int, tokens: int, heads: int, cache_slots: int, tiles: MosaicMLATiles, sms: int | None = None
) -> bool:
    """Whether the kernel should attend T = `tokens` new tokens itself (`tiles.new_in_kernel`):
    1 < T <= new_in_kernel and the extra split adds at most `XLA_PARTIAL_BLOCKS` to the
    modeled rounds (`num_splits`' model), the cost of XLA's partial that it replaces.

    Measured on an H200 at a 32K cache (docs/benchmarks.md, session 31): the new split saves
    4-10% on TP-8 trees (8 heads x 17 / 65 tokens: 3 / 9 query tiles; modeled +0 / +3 blocks),
    costs 6-9% on AR (one new key, where XLA's partial is one cheap row), and 32% on 65 tokens
    x 64 heads (65 query tiles: the extra programs cut the splits; modeled +88 blocks).
    """
    if not 1 < tokens <= tiles.new_in_kernel:
        return False
    sms, bk = _sms(sms), tiles.block_k
    query_tiles = -(-tokens * heads // BLOCK_Q)
    blocks, new_blocks = cache_slots // bk, -(-tokens // bk)

    def best(nb):
        return _rounds(batch * query_tiles, blocks, num_splits(batch, query_tiles, blocks, sms, nb), nb, sms)

    return best(new_blocks) <= best(0) + XLA_PARTIAL_BLOCKS


def _swizzled(minor: int, dtype):
    """Tiled, swizzled shared-memory layout (what wgmma reads without bank conflicts)
    for rows of `minor` elements: the widest swizzle of 32 / 64 / 128 bytes they fill."""
    width = min(128, minor * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, width // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(width)


def _accumulate(acc, a, b_ref, a_smem, interpret):
    """acc + a @ b_ref by wgmma, a from registers, in place in the accumulator's registers.

    Mosaic GPU's interpreter (jax 0.11.2) takes neither `run_state` nor a register
    operand, so interpret mode stores `a` to `a_smem` and adds a fresh product: the same
    sum, by the route the interpreter has.
    """
    if interpret is not None:
        a_smem[...] = a
        plgpu.commit_smem()

        def product(ref):
            plgpu.wgmma(ref, a_smem, b_ref)
            return ref[...]

        return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))

    def in_place(ref):
        plgpu.wgmma(ref, a, b_ref)

    return pl.run_state(in_place)(plgpu.ACC.init(acc))


def _partials(q_lat, q_pe, ckv, kpe, lens, layer, new, *, scale, tiles, interpret):
    """The kernel: q_lat [B, Qp, R], q_pe [B, Qp, P], every layer's cache [L, B, S, R] /
    [L, B, S, P] of which layer `layer` ([1] int32) is read, lens [B] int32 (any value: clamped
    to [0, S] here);
    `new` None or the new tokens' (keys [B, Tp, R] / [B, Tp, P], bits [B, WB + Tp / 32, Qp]
    int32 whose first WB = BK / 32 words are 0) -> (o [B, NS', Qp, R] in the cache dtype,
    lse [B, NS', Qp] float32, natural log): NS cache splits, then with `new` the new tokens'.

    With `new` every tile comes with WB mask words a row: a cache split's are the zero words
    (a slot is then visible by its position alone), the new split's the keys' bits (visible by
    them alone: its position bound is -1), so one test serves both without a branch."""
    b, qp, r = q_lat.shape
    s, p = ckv.shape[2], kpe.shape[-1]
    r2, bk, stages = r // 2, tiles.block_k, tiles.stages
    nq, blocks = qp // BLOCK_Q, s // bk
    wb = bk // 32
    new_blocks = 0 if new is None else new[0].shape[1] // bk
    ns = tiles.num_splits or num_splits(b, nq, blocks, new_blocks=new_blocks)
    chunk = -(-blocks // ns) * bk
    dtype = ckv.dtype
    with_new = new is not None
    copies = 3 + with_new  # TMA copies a ring slot waits for

    def kernel(lens_ref, layer_ref, ql_ref, qpe_ref, ckv_ref, kpe_ref, *rest):
        if with_new:
            nckv_ref, nkpe_ref, bits_ref, o_ref, lse_ref, smem, bars = rest
        else:
            o_ref, lse_ref, smem, bars = rest
        q_smem, qpe_smem, c_smem, pe_smem, p_smem, bits_smem = smem
        q_bar, ring_bar, free_bar, done_bar = bars
        bi, j, k = jax.lax.axis_index("b"), jax.lax.axis_index("q"), jax.lax.axis_index("split")
        wg = jax.lax.axis_index("wg")
        rows = pl.ds(j * BLOCK_Q, BLOCK_Q)
        lo = k * chunk
        # Clamped here rather than by XLA before the call: one launch less.
        hi = jnp.minimum(jnp.minimum(lo + chunk, s), lens_ref[bi])
        li = layer_ref[0]
        steps = (jnp.maximum(hi - lo, 0) + bk - 1) // bk
        if with_new:
            is_new = k == ns
            hi = jnp.where(is_new, -1, hi)
            steps = jnp.where(is_new, new_blocks, steps)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_bar)
            f32 = jnp.float32
            m = plgpu.layout_cast(jnp.full((BLOCK_Q,), MASK_VALUE, f32), plgpu.Layout.WGMMA.reduce(1))
            denom = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), f32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, r2), f32), plgpu.Layout.WGMMA)

            def step(i, carry):
                acc, m, denom = carry
                slot = jax.lax.rem(i, stages)
                plgpu.barrier_wait(ring_bar.at[slot])

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem.at[0], c_smem.at[slot, 0].T)
                    plgpu.wgmma(s_ref, q_smem.at[1], c_smem.at[slot, 1].T)
                    plgpu.wgmma(s_ref, qpe_smem, pe_smem.at[slot].T)
                    plgpu.wgmma_wait(0)
                    return s_ref[...]

                sc = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, bk), f32)) * (scale * LOG2E)
                col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, bk), 1, layout=plgpu.Layout.WGMMA)
                visible = col + (lo + i * bk) < hi
                if with_new:
                    visible = visible | _mask_bits(bits_smem.at[slot], col)
                sc = jnp.where(visible, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                prob = jnp.exp2(sc - jax.lax.broadcast_in_dim(m_new, sc.shape, [0]))
                denom = denom * alpha + prob.sum(axis=1)
                acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
                p_here = None if p_smem is None else p_smem.at[wg]
                acc = _accumulate(acc, prob.astype(dtype), c_smem.at[slot, wg], p_here, interpret)
                plgpu.barrier_arrive(free_bar.at[slot])
                return acc, m_new, denom

            acc, m, denom = jax.lax.fori_loop(0, steps, step, (acc, m, denom))
            # Both warpgroups are done reading the query tile: its halves take the output.
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
            safe = jnp.where(denom > 0, denom, 1.0)
            q_smem.at[wg][...] = (acc / jax.lax.broadcast_in_dim(safe, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[bi, k, rows, pl.ds(wg * r2, r2)])

            @pl.when(wg == 0)
            def _():  # straight from registers: a 256-byte buffer would take 1 KiB of shared memory
                lse_ref.at[bi, k, rows][...] = jnp.where(denom > 0, (m + jnp.log2(safe)) / LOG2E, -jnp.inf)

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for h in range(2):
                plgpu.copy_gmem_to_smem(ql_ref.at[bi, rows, pl.ds(h * r2, r2)], q_smem.at[h], q_bar)
            plgpu.copy_gmem_to_smem(qpe_ref.at[bi, rows], qpe_smem, q_bar)

            def tile(c_ref, pe_ref, first, slot):
                key_rows = pl.ds(first, bk)
                for h in range(2):
                    plgpu.copy_gmem_to_smem(
                        c_ref.at[bi, key_rows, pl.ds(h * r2, r2)], c_smem.at[slot, h], ring_bar.at[slot]
                    )
                plgpu.copy_gmem_to_smem(pe_ref.at[bi, key_rows], pe_smem.at[slot], ring_bar.at[slot])

            # The layer's cache, read in place in the stack (a slice would reach here as a copy).
            cache_ckv, cache_kpe = ckv_ref.at[li], kpe_ref.at[li]

            def load(i, slot):
                if not with_new:
                    tile(cache_ckv, cache_kpe, lo + i * bk, slot)
                    return
                pl.when(k < ns)(lambda: tile(cache_ckv, cache_kpe, lo + i * bk, slot))
                # Clamped: the ring's first loads are traced for every split, and a static start
                # past the new keys fails the trace even where `steps` never runs it.
                pl.when(is_new)(lambda: tile(nckv_ref, nkpe_ref, jnp.minimum(i * bk, new_blocks * bk - bk), slot))
                # A cache split's words are the zero ones in front; the new split's follow.
                words = pl.ds(jnp.where(is_new, (i + 1) * wb, 0), wb)
                plgpu.copy_gmem_to_smem(bits_ref.at[bi, words, rows], bits_smem.at[slot], ring_bar.at[slot])

            for i in range(stages):
                pl.when(i < steps)(functools.partial(load, i, i))

            @pl.loop(0, steps - stages)
            def _(i):
                slot = jax.lax.rem(i, stages)
                plgpu.barrier_wait(free_bar.at[slot])
                load(i + stages, slot)

            # The last `stages` releases load nothing; waiting them out leaves no barrier phase
            # unobserved (the interpreter checks that, so its tests reach splits longer than the ring).
            @pl.loop(jnp.maximum(steps - stages, 0), steps)
            def _(i):
                plgpu.barrier_wait(free_bar.at[jax.lax.rem(i, stages)])

    def entry(*refs):
        smem = (
            plgpu.SMEM((2, BLOCK_Q, r2), dtype, transforms=_swizzled(r2, dtype)),
            plgpu.SMEM((BLOCK_Q, p), dtype, transforms=_swizzled(p, dtype)),
            plgpu.SMEM((stages, 2, bk, r2), dtype, transforms=_swizzled(r2, dtype)),
            plgpu.SMEM((stages, bk, p), dtype, transforms=_swizzled(p, dtype)),
            # P's buffers, for the interpreter only (see `_accumulate`).
            None if interpret is None else plgpu.SMEM((2, BLOCK_Q, bk), dtype, transforms=_swizzled(bk, dtype)),
            # A slot's mask words: 512 bytes of the 11 KiB left at Kimi-K2's widths.
            plgpu.SMEM((stages, wb, BLOCK_Q), jnp.int32) if with_new else None,
        )
        bars = (
            plgpu.Barrier(num_arrivals=3),  # the three query copies
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # a slot's copies
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both compute warpgroups released it
            plgpu.Barrier(num_arrivals=2),  # both done with the query tile
        )
        pl.run_scoped(lambda *scoped: kernel(*refs, *scoped), smem, bars, collective_axes="wg")

    splits = ns + with_new
    return plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((b, splits, qp, r), dtype),
            jax.ShapeDtypeStruct((b, splits, qp), jnp.float32),
        ),
        grid=(b, nq, splits),
        grid_names=("b", "q", "split"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(lens, layer, q_lat, q_pe, ckv, kpe, *(new or ()))


def _mask_bits(words_ref, col):
    """Visibility of a tile's keys [BQ, BK] from its rows' mask words ([BK / 32, BQ] int32 in
    shared memory): key c of the tile is bit c % 32 of word c // 32."""
    row = functools.partial(jax.lax.broadcast_in_dim, shape=col.shape, broadcast_dimensions=[0])
    word = row(plgpu.load(words_ref.at[0], layout=plgpu.Layout.WGMMA.reduce(1)))
    for g in range(1, words_ref.shape[0]):
        word = jnp.where(col >= 32 * g, row(plgpu.load(words_ref.at[g], layout=plgpu.Layout.WGMMA.reduce(1))), word)
    # Shifts by col % 32 only: a shift by 32 or more is undefined on the GPU.
    return (jax.lax.shift_right_logical(word, col & 31) & 1) != 0


def _mask_words(new_mask, n, tp, qp, lead):
    """new_mask [B, T, T] -> [B, lead + Tp / 32, Qp] int32: `lead` zero words, then row
    t * N + n's word w, bit j set iff token t sees key 32 w + j (rows past T * N: none)."""
    b, t, _ = new_mask.shape
    padded = jnp.pad(new_mask, ((0, 0), (0, 0), (0, tp - t))).reshape(b, t, tp // 32, 32)
    words = jnp.sum(padded.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(words, jnp.int32)  # [B, T, W]
    rows = jnp.broadcast_to(words[:, :, None], (b, t, n, tp // 32)).reshape(b, t * n, tp // 32)
    rows = jnp.pad(rows, ((0, 0), (0, qp - t * n), (0, 0)))
    return jnp.pad(rows.transpose(0, 2, 1), ((0, 0), (lead, 0), (0, 0)))


def _new_partial(q_lat, q_pe, new_ckv, new_kpe, new_mask, scale):
    """The new tokens' keys in XLA, float32: (o [B, T, N, R] normalized, lse [B, T, N])."""
    f32 = jnp.float32
    if new_ckv.shape[1] == 1:
        # One key (AR): its softmax weight is 1 and its log-sum-exp the score itself, so the
        # partial is one reduction over the R + P columns (one launch), not two products and a
        # logsumexp.
        q = jnp.concatenate([q_lat, q_pe], axis=-1).astype(f32)  # [B, 1, N, R + P]
        k = jnp.concatenate([new_ckv, new_kpe], axis=-1)[:, :, None].astype(f32)
        lse = jnp.where(new_mask[:, :, :1], jnp.sum(q * k, axis=-1) * scale, MASK_VALUE)  # [B, 1, N]
        return jnp.broadcast_to(new_ckv[:, :, None].astype(f32), q_lat.shape), lse
    s = jnp.einsum("btnr,bur->btnu", q_lat.astype(f32), new_ckv.astype(f32))
    s += jnp.einsum("btnp,bup->btnu", q_pe.astype(f32), new_kpe.astype(f32))
    s = jnp.where(new_mask[:, :, None, :], s * scale, MASK_VALUE)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("btnu,bur->btnr", jnp.exp(s - lse[..., None]), new_ckv.astype(f32))
    return o, lse


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def mla_attention_mosaic(
    q_lat,  # [B, T, N, R]
    q_pe,  # [B, T, N, P]
    cache_ckv,  # [B, S, R], or [L, B, S, R] with `layer`
    cache_kpe,  # [B, S, P], or [L, B, S, P]
    cache_len,  # [B]
    new_ckv,  # [B, T, R]
    new_kpe,  # [B, T, P]
    new_mask,  # [B, T, T]
    *,
    scale: float,
    tiles: MosaicMLATiles = MosaicMLATiles(),
    interpret=None,
    layer=None,  # int32 scalar: the layer of a stacked cache, read in place
):
    """Same contract as `mla_attention_reference`; float32 output [B, T, N, R].

    `interpret`: None compiles for the GPU (bf16 or f16 cache); Mosaic GPU's
    `InterpretGPUParams()` runs the kernel on the CPU (any float dtype).
    Needs R a multiple of 128, P of 64, S of tiles.block_k (the error names them). With
    T <= tiles.new_in_kernel the kernel attends the new tokens too (module docstring).
    """
    b, t, n, r = q_lat.shape
    if layer is None:  # one layer's cache: a stack of one (a bitcast, no copy)
        cache_ckv, cache_kpe, layer = cache_ckv[None], cache_kpe[None], 0
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    s, p = cache_ckv.shape[2], q_pe.shape[-1]
    for name, dim, multiple in (("R", r, 128), ("P", p, 64), ("S", s, tiles.block_k)):
        if dim % multiple:
            raise ValueError(f"mla_attention_mosaic needs {name}={dim} to be a multiple of {multiple}")
    dtype = cache_ckv.dtype
    if interpret is None and dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"mla_attention_mosaic compiles for a bf16 or f16 cache on the GPU, got {dtype}")
    q = t * n
    qp = -(-q // BLOCK_Q) * BLOCK_Q

    def rows(x):  # [B, T, N, X] -> [B, Qp, X]
        return jnp.pad(x.reshape(b, q, x.shape[-1]).astype(dtype), ((0, 0), (0, qp - q), (0, 0)))

    lens = cache_len.astype(jnp.int32)  # clamped to [0, S] in the kernel
    new = None
    if t <= tiles.new_in_kernel:  # the new tokens as the kernel's last split
        bk = tiles.block_k
        tp = -(-t // bk) * bk

        def keys(x):  # [B, T, X] -> [B, Tp, X]
            return jnp.pad(x.astype(dtype), ((0, 0), (0, tp - t), (0, 0)))

        if not new_split_runs(interpret):
            raise ValueError(
                f"mla_attention_mosaic in interpret mode with T={t} <= new_in_kernel={tiles.new_in_kernel} "
                f"needs XLA_FLAGS={INTERPRET_NEW_FLAG} set before jax starts (else its warpgroups deadlock)"
            )
        new = (keys(new_ckv), keys(new_kpe), _mask_words(new_mask, n, tp, qp, bk // 32))
    q_rows = rows(q_lat), rows(q_pe)
    o, lse = _partials(*q_rows, cache_ckv, cache_kpe, lens, layer, new, scale=scale, tiles=tiles, interpret=interpret)
    merged = merge.MERGE_KERNEL and merge.takes(o)
    key = None  # AR into the merge kernel: the one new key's score is computed there
    if merged and merge.MERGE_EXTENDED and new is None and t == 1 and merge.takes_key(r, p):
        key = (*q_rows, new_ckv, new_kpe, new_mask[:, 0, 0])
    new_part = None
    if new is None and key is None:
        # The new tokens see the queries as the kernel does: rounded to the cache dtype.
        new_part = _new_partial(q_lat.astype(dtype), q_pe.astype(dtype), new_ckv, new_kpe, new_mask, scale)
    if merged:
        shared = 1
        if new_part is not None and t == 1:  # the one key's output is its c_kv for every head
            new_part, shared = (new_ckv.astype(jnp.float32), new_part[1].reshape(b, q)), n
        elif new_part is not None:
            new_part = (new_part[0].reshape(b, q, r), new_part[1].reshape(b, q))
        kw = dict(rows=q, shared=shared, scale=scale, interpret=interpret is not None)
        return merge.merge_partials(o, lse, new_part, key, **kw).reshape(b, t, n, r)
    splits = o.shape[1]
    o = o[:, :, :q].reshape(b, splits, t, n, r)
    lse = lse[:, :, :q].reshape(b, splits, t, n)
    return partials.merge(o, lse, new_part)
