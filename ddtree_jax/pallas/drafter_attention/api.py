"""Dispatch for the drafter's block attention (see reference.py for the notation)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ddtree_jax import sharding
from ddtree_jax.pallas import check_implementation, check_rank, dot_rows
from ddtree_jax.pallas.drafter_attention.kernel import (
    SPLIT_MIN_SLOTS,
    SPLIT_PROGRAMS,
    DrafterAttentionTiles,
    drafter_attention_pallas,
    num_splits,
    takes,
)
from ddtree_jax.pallas.drafter_attention.reference import drafter_attention_reference

AUTO_KERNEL = True
"""Whether "auto" takes the kernel on a GPU (False: the XLA path, for before / after runs:
`experiments/profile_round.py --set ddtree_jax.pallas.drafter_attention.api.AUTO_KERNEL=False`).
Read when a program is traced. Measured on an H100 (session 36, docs/benchmarks.md,
`python3 -m ddtree_jax.pallas.drafter_attention.bench`): the kernel beat XLA at every named
shape, from the shipped drafter's window (4.6 us against 12.8) to a full 128K cache with
Kimi-K2.5-DFlash's heads (0.550 ms against 1.167; its TP-8 shard 0.083 against 0.241)."""

GROUP_HEADS = True
"""Whether the kernel's default tiles put the query heads that share a key / value head in one
program (`DrafterAttentionTiles.head_group`, `head_group`), so that a context tile is loaded once
for them, not once per head (Kimi-K2.5-DFlash: 8 heads a KV head), where the grouped grid still
fills (`GROUP_MIN_SLOTS`). Read when traced."""

GROUP_MIN_SLOTS = SPLIT_PROGRAMS * SPLIT_MIN_SLOTS
"""Heads are grouped only where the slots the programs walk, summed over rows and KV heads
(reach x batch x KV heads), are at least this: enough for `SPLIT_PROGRAMS` grouped programs of
`SPLIT_MIN_SLOTS` slots each. One H200 (session 38, `python3 -m
ddtree_jax.pallas.drafter_attention.bench --reps 20 --head-group 1 8`,
docs/results/s38/drafter_head_group_h200.log), 8 heads a program against 1, Kimi-K2.5-DFlash:
faster at 1M and 256K such slots (128K / 32K caches, 8 KV heads: 0.558 -> 0.389 ms, 0.148 ->
0.134) and at 128K (its TP-8 shard at 128K: 0.083 -> 0.080); slower below (32K: TP-8 at 32K
0.030 -> 0.036; 4K and TP-8 at 4K 0.025 -> 0.034, 0.011 -> 0.026), where the grouped grid has
too few programs or too short a walk each."""

MAX_GROUP_ROWS = 128
"""The most rows (heads x padded block tokens) `head_group` puts in one program."""

AVAILABLE = ("auto", "xla", "pallas", "mosaic")
""""mosaic" has no kernel of its own here: it takes the XLA path, as the generate-level
choice "mosaic" means the Mosaic kernels where they exist."""


def uses_kernel(implementation: str, q: jax.Array, k_ctx: jax.Array, on_gpu: bool, heads_fit: bool = True):
    """Whether `drafter_attention` runs the kernel: "pallas" always; "auto" on a GPU where
    `kernel.takes` the operands and, under a mesh, each shard holds its query heads' key / value
    heads (`heads_fit`)."""
    if implementation == "pallas":
        return True
    return implementation == "auto" and AUTO_KERNEL and on_gpu and heads_fit and takes(q, k_ctx)


def head_group(group: int, tokens: int, kv_slots: int | None = None) -> int:
    """Query heads per program for `group` heads a KV head and a block of `tokens`: the largest
    power of two dividing the group whose rows fit `MAX_GROUP_ROWS`; 1 unless `GROUP_HEADS` and
    `kv_slots` (reach x batch x KV heads; None: any) is at least `GROUP_MIN_SLOTS`."""
    if not GROUP_HEADS or (kv_slots is not None and kv_slots < GROUP_MIN_SLOTS):
        return 1
    tp = dot_rows(tokens)
    hg = 1
    while group % (2 * hg) == 0 and 2 * hg * tp <= MAX_GROUP_ROWS:
        hg *= 2
    return hg


def _shard_specs(mesh, args, nq: int, nkv: int):
    """The kernel's shard_map specs of `args` under `mesh`, and whether a shard's query heads find
    their key / value heads (the mesh splits both alike, or there is one, kept whole)."""
    heads = ("batch", None, "heads", None)  # q, and the keys / values of the context and the block
    axes = (heads, heads, heads, ("batch",), ("batch", None), heads, heads)
    specs = tuple(sharding.kernel_spec(a, x.shape) for a, x in zip(axes, args, strict=True))
    q_split = int(np.prod([mesh.shape[a] for a in jax.tree.leaves(specs[0][2])], dtype=int))
    kv_split = int(np.prod([mesh.shape[a] for a in jax.tree.leaves(specs[1][2])], dtype=int))
    fit = kv_split == q_split or (kv_split == 1 and nkv == 1)
    return specs, fit, (q_split, kv_split)


def drafter_attention(
    q: jax.Array,  # [B, T, Nq, hd]
    k_ctx: jax.Array,  # [B, S, Nkv, hd]
    v_ctx: jax.Array,  # [B, S, Nkv, hd]
    ctx_len: jax.Array,  # [B] int32
    positions: jax.Array,  # [B, T] int32
    k_blk: jax.Array,  # [B, T, Nkv, hd]
    v_blk: jax.Array,  # [B, T, Nkv, hd]
    *,
    window: jax.Array | int,
    causal: jax.Array | bool,
    reach: int | None = None,
    implementation: str = "auto",
    tiles: DrafterAttentionTiles | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:  # [B, T, Nq, hd] in q's dtype
    """One drafter layer's block attention: block queries over the context cache and the block.

    Args:
      q: block queries (RoPE'd).
      k_ctx, v_ctx: the layer's context cache; slot s holds position s. With `layer`: every
        layer's, [Ld, B, S, Nkv, hd].
      ctx_len: context slots filled per row (slots >= ctx_len are not seen).
      positions: the block tokens' positions.
      k_blk, v_blk: the block's own keys and values.
      window: context slots with position - slot < window are seen (2**31 - 1: all).
      causal: whether block key u is seen only by queries at positions >= its own.
      reach: the most context slots one query can see (static: min(window, S) where the window
        is known when tracing; None: S): how many programs share a head's walk.
      implementation: "xla" (reference.py), "pallas" (the Triton-lowered kernel; the CPU
        interprets it; under a mesh, per shard of batch and heads), "auto" (the kernel on a GPU
        where `kernel.takes` the shapes and, under a mesh, each shard holds the key / value
        heads of its query heads, else XLA; `uses_kernel`), or "mosaic" (no Mosaic kernel: XLA).
      tiles: the kernel's `DrafterAttentionTiles` (None: the defaults).
      layer: which layer of a stacked cache to attend. The kernel reads a static one in place
        (per shard under a mesh); otherwise that layer's slice is taken first. Sliced, it reached the
        kernel as a copy XLA made every round, of every slot of the cache.

    Returns:
      The attention output per query head.
    """
    check_implementation(implementation, AVAILABLE, "drafter_attention")
    check_rank("drafter_attention", "q", q, 4)
    check_rank("drafter_attention", "k_ctx", k_ctx, 4 if layer is None else 5)
    lead = k_ctx.shape[:-4]  # (Ld,) with `layer`; the checks below see one layer's shapes
    b, t, nq, hd = q.shape
    s, nkv = k_ctx.shape[-3], k_ctx.shape[-2]
    chex.assert_shape([k_ctx, v_ctx], (*lead, b, s, nkv, hd))
    chex.assert_shape([k_blk, v_blk], (b, t, nkv, hd))
    chex.assert_shape(ctx_len, (b,))
    chex.assert_shape(positions, (b, t))
    if nq % nkv:
        raise ValueError(f"query heads ({nq}) must be a multiple of key / value heads ({nkv})")
    if q.size == 0:  # no queries: the kernel's padding of the block has no edge to repeat
        return jnp.zeros(q.shape, q.dtype)
    span = s if reach is None else min(reach, s)
    on_gpu = jax.default_backend() == "gpu"
    mesh = sharding.context_mesh()
    one = jax.ShapeDtypeStruct(k_ctx.shape[-4:], k_ctx.dtype)  # one layer's cache
    shapes = (q, one, one, ctx_len, positions, k_blk, v_blk)
    specs, fit, (q_split, kv_split) = (None, True, (1, 1)) if mesh is None else _shard_specs(mesh, shapes, nq, nkv)
    kernel = uses_kernel(implementation, q, one, on_gpu, fit)
    in_place = kernel and isinstance(layer, int | np.integer) and 0 <= layer < k_ctx.shape[0]
    if layer is not None and not in_place:
        k_ctx, v_ctx = k_ctx[layer], v_ctx[layer]
    args = (q, k_ctx, v_ctx, ctx_len, positions, k_blk, v_blk)
    if not kernel:
        return drafter_attention_reference(*args, window, causal)
    if not takes(q, one):
        raise ValueError(
            f"drafter_attention: the pallas kernel needs a head dim that is a power of two >= 16 and a cache of "
            f">= 16 slots, got head dim {hd} and {s} slots; use implementation='xla'"
        )
    if not fit:
        axes = jax.tree.leaves(specs[0][2])  # the mesh axes that split the query heads
        named = " x ".join(f"{a!r} of size {mesh.shape[a]}" for a in axes)
        raise ValueError(
            f"drafter_attention: the {nkv} key / value heads are not divisible by mesh axis{'es' * (len(axes) > 1)} "
            f"{named}, which split{'s' * (len(axes) == 1)} the {nq} query heads {q_split} ways (the key / value "
            f"heads {kv_split} ways), so a shard's query heads would not find their own; use implementation='xla'"
        )

    def fn(*a):
        return _run_kernel(*a, window, causal, span=span, tiles=tiles, layer=int(layer) if in_place else None)

    if mesh is None:
        return fn(*args)
    if in_place:  # the stack's layer axis kept whole on every shard
        specs = (specs[0], P(None, *specs[1]), P(None, *specs[2]), *specs[3:])
    # check_vma=False: pallas_call outputs carry no varying-axes annotation.
    return jax.shard_map(fn, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


def _run_kernel(q, k_ctx, v_ctx, ctx_len, positions, k_blk, v_blk, window, causal, *, span, tiles, layer=None):
    """The kernel, its head grouping and splits from the (per-shard) rows and heads."""
    rows, t, heads, kv_heads = q.shape[0], q.shape[1], q.shape[2], k_blk.shape[2]
    group = head_group(heads // kv_heads, t, span * rows * kv_heads)
    chosen = tiles or DrafterAttentionTiles(head_group=group)
    splits = num_splits(span, rows, heads // chosen.head_group)
    kw = dict(tiles=chosen, splits=splits, interpret=jax.default_backend() != "gpu", layer=layer)
    return drafter_attention_pallas(q, k_ctx, v_ctx, ctx_len, positions, k_blk, v_blk, window, causal, **kw)
