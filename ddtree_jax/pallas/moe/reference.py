"""Pure-jnp routed-expert computation.

Notation: T tokens, H hidden, E experts, I expert intermediate size, K experts
per token. Expert e computes down_e(silu(x @ gate_e) * (x @ up_e)); token t's
output is sum_k w[t, k] * expert_{idx[t, k]}(x_t).

`moe_experts_reference` runs every expert on every token (simple, obviously
right; the test oracle). `moe_pairs_in_tiles` is the "exact" numerics' path
(numerics.py): each pair's expert output from fixed-shape tiles of one expert. The XLA path in `moe_experts_xla` takes a weight gather
when few (token, expert) pairs are live (decode), the reference's dense pass for up to
`DENSE_MAX_TOKENS` tokens (tree verify), and a sort + `jax.lax.ragged_dot` grouped GEMM,
doing only the routed work, beyond (prefill).

INT4 experts (`quant.QuantizedArray`) are dequantized to x's dtype where they are
used: the reference dequantizes all of them; the XLA path only the gathered
experts (decode), or for the grouped GEMM the whole stack when it is small
(`INT4_DEQUANT_ALL_BYTES`), else `INT4_EXPERT_CHUNK` experts at a time.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ddtree_jax.layers import einsum
from ddtree_jax.quant import QuantizedArray

GATHER_MAX_PAIRS_PER_EXPERT = 1
"""Use the weight gather when T * K <= this * E: it then streams no more weight than a dense pass."""
DENSE_MAX_TOKENS = 128
"""Above the gather, up to this many tokens every expert runs on every token (the
reference's batched GEMMs, E / K times the routed FLOPs) instead of sort + ragged_dot.
Both read every expert's weights once; the dense FLOPs stay below the time of that read
while T < peak FLOP/s / HBM bytes/s (~240 on an H200 for bf16 weights), and the dense
path launches no sort, gather or scatter: a tree verify's MoE in a launch-bound round."""
DENSE_FLAT = True
"""The dense pass as GEMMs over every expert's columns, the expert sum inside the last one
(`_moe_dense_flat`), instead of the reference's batched GEMMs per expert and its separate
weighted combine. H100, shipped pair: a DDTree(32) round 2.5% cheaper, budget 12 unchanged
(docs/benchmarks.md, forty-fourth session). The same pass as one Triton-lowered kernel (a
program per expert and block of its columns, float32 partials summed after; commit 27ce913) was
slower on an H100: 13.0 us against this path's 10.0 at 13 tokens, 18.2 against 12.2 at 33
(fiftieth session)."""
INT4_EXPERT_CHUNK = 8
"""INT4 experts the grouped XLA path dequantizes at a time, in a scan over chunks..."""
INT4_DEQUANT_ALL_BYTES = 64 * 2**20
"""...unless the whole stack, dequantized, takes at most this many bytes: then it is one
grouped GEMM with no loop (a loop costs a launch-bound model a host round trip per chunk)."""


def _dense(a, dtype):
    return a.dequantize(dtype) if isinstance(a, QuantizedArray) else a


def _routing(idx: jax.Array, w: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(comb, chosen), both [T, E]: float32 with w[t, k] at column idx[t, k], and whether token
    t chose expert e. Ids outside [0, E) choose nothing."""
    hit = idx[:, :, None] == jnp.arange(num_experts)  # [T, K, E]
    return jnp.sum(hit.astype(jnp.float32) * w[..., None], axis=1), jnp.any(hit, axis=1)


def moe_experts_reference(x, idx, w, gate, up, down):
    """x [T, H], idx [T, K] int, w [T, K] f32, gate/up [E, H, I], down [E, I, H] -> [T, H]."""
    f32 = jnp.float32
    gate, up, down = (_dense(a, x.dtype) for a in (gate, up, down))
    h_gate = einsum("th,ehi->eti", x, gate).astype(x.dtype)
    h_up = einsum("th,ehi->eti", x, up).astype(x.dtype)
    act = (jax.nn.silu(h_gate) * h_up).astype(x.dtype)
    y = einsum("eti,eih->eth", act, down).astype(x.dtype)
    comb, chosen = _routing(idx, w, gate.shape[0])  # [T, E]
    # An expert no token chose adds nothing, even where its weights (and so y) are not finite.
    y = jnp.where(chosen.T[..., None], y, 0)
    return jnp.sum(comb.T[..., None] * y.astype(f32), axis=0).astype(x.dtype)


def _moe_dense_flat(x, idx, w, gate, up, down):
    """Every expert on every token, as GEMMs over all experts' columns at once: x [T, H]
    against gate / up as [H, E * I], then each token's activations scaled by its routing
    weight (0 for experts it did not choose) against down as [E * I, H], which sums the
    experts in the GEMM's float32 accumulator. The reference rounds each expert's output to
    x's dtype before its weighted float32 sum; here the scaled activations are rounded
    instead. Unchosen experts' activations are zeroed, but an unchosen expert's non-finite
    `down` weights still make every token's output non-finite (the loaders refuse them)."""
    e = gate.shape[0]
    gate, up, down = (_dense(a, x.dtype) for a in (gate, up, down))
    comb, chosen = _routing(idx, w, e)  # [T, E]
    h_gate = einsum("th,ehi->tei", x, gate).astype(x.dtype)
    h_up = einsum("th,ehi->tei", x, up).astype(x.dtype)
    act = (jax.nn.silu(h_gate) * h_up).astype(jnp.float32) * comb[:, :, None]
    act = jnp.where(chosen[:, :, None], act, 0).astype(x.dtype)
    return einsum("tei,eih->th", act, down).astype(x.dtype)


def _take(a, idx, dtype):
    """a[idx] of an expert stack; INT4 experts are gathered packed, then dequantized."""
    if isinstance(a, QuantizedArray):
        return QuantizedArray(packed=a.packed[idx], scale=a.scale[idx]).dequantize(dtype)
    return a[idx]


def _moe_gather(x, idx, w, gate, up, down):
    e = gate.shape[0]
    # Ids >= E mark dropped pairs (another shard's experts): they read expert E - 1, add nothing.
    g, u, d = (_take(a, jnp.minimum(idx, e - 1), x.dtype) for a in (gate, up, down))  # [T, K, H, I]
    h_gate = einsum("th,tkhi->tki", x, g).astype(x.dtype)
    h_up = einsum("th,tkhi->tki", x, u).astype(x.dtype)
    act = (jax.nn.silu(h_gate) * h_up).astype(x.dtype)
    y = jnp.where((idx < e)[..., None], einsum("tki,tkih->tkh", act, d).astype(x.dtype), 0)
    return weighted_sum(w, y)


def _sort_pairs(x, idx):
    """The (token, expert) pairs sorted by expert: (order [T*K], x of each pair [T*K, H])."""
    order = jnp.argsort(idx.reshape(-1), stable=True)
    return order, x[order // idx.shape[1]]


def _ragged_swiglu(xs, gate, up, down, sizes):
    """down(silu(xs @ gate) * (xs @ up)) per group of consecutive rows: [M, H] -> [M, H] in xs' dtype."""
    f32, dtype = jnp.float32, xs.dtype
    h_gate = jax.lax.ragged_dot(xs, gate, sizes, preferred_element_type=f32).astype(dtype)
    h_up = jax.lax.ragged_dot(xs, up, sizes, preferred_element_type=f32).astype(dtype)
    act = (jax.nn.silu(h_gate) * h_up).astype(dtype)
    return jax.lax.ragged_dot(act, down, sizes, preferred_element_type=f32).astype(dtype)


def _unsort(ys, order, t: int, k: int):
    """Pair outputs in `_sort_pairs`' order [T*K, H] -> [T, K, H] in (token, slot) order."""
    return jnp.zeros_like(ys).at[order].set(ys).reshape(t, k, -1)


def _combine_sorted(ys, order, w):
    """Pair outputs in sorted order [T*K, H] -> each token's routing-weighted sum [T, H]."""
    return weighted_sum(w, _unsort(ys, order, *w.shape))


def weighted_sum(w, y):
    """sum_k w[t, k] * y[t, k] in float32: w [T, K] f32, y [T, K, H] -> [T, H] in y's dtype.

    A multiply and a sum, not an einsum: on the GPU XLA runs a float32 einsum as a TF32
    batched GEMM (rounding w to 10 bits; 26 ms of a MEDIUM training step), where this is one
    exact float32 fusion.
    """
    return jnp.sum(w[..., None] * y.astype(jnp.float32), axis=1).astype(y.dtype)


def _moe_ragged(x, idx, w, gate, up, down):
    order, xs = _sort_pairs(x, idx)
    # Pairs with ids >= E (dropped: another shard's) sort last, outside every group.
    sizes = jnp.bincount(idx.reshape(-1), length=gate.shape[0]).astype(jnp.int32)
    ys = _ragged_swiglu(xs, gate, up, down, sizes)
    ys = jnp.where((jnp.arange(ys.shape[0]) < jnp.sum(sizes))[:, None], ys, 0)
    return _combine_sorted(ys, order, w)


def _moe_ragged_int4(x, idx, w, gate, up, down):
    """The grouped GEMM over INT4 experts: all dequantized at once when small, else
    INT4_EXPERT_CHUNK of them at a time.

    The (token, expert) pairs are sorted by expert; each chunk's pairs are a contiguous
    run, rolled to the front so that `ragged_dot` sees them as its first groups.
    """
    e = gate.shape[0]
    if sum(math.prod(a.shape) for a in (gate, up, down)) * jnp.dtype(x.dtype).itemsize <= INT4_DEQUANT_ALL_BYTES:
        return _moe_ragged(x, idx, w, *(a.dequantize(x.dtype) for a in (gate, up, down)))
    c = min(INT4_EXPERT_CHUNK, e)
    n_chunks = -(-e // c)
    order, xs = _sort_pairs(x, idx)
    sizes = jnp.bincount(idx.reshape(-1), length=n_chunks * c).astype(jnp.int32).reshape(n_chunks, c)
    starts = jnp.cumsum(jnp.sum(sizes, axis=1)) - jnp.sum(sizes, axis=1)

    def pad(a):  # the expert axis to n_chunks * c (padding experts get no pairs)
        extra = n_chunks * c - e
        return jax.tree.map(lambda v: jnp.pad(v, [(0, extra)] + [(0, 0)] * (v.ndim - 1)), a)

    gate, up, down = pad(gate), pad(up), pad(down)

    def chunk(ys, j):
        def part(a):
            return jax.tree.map(lambda v: jax.lax.dynamic_slice_in_dim(v, j * c, c), a).dequantize(x.dtype)

        out = _ragged_swiglu(jnp.roll(xs, -starts[j], axis=0), part(gate), part(up), part(down), sizes[j])
        rows = jnp.arange(out.shape[0]) < jnp.sum(sizes[j])
        return ys + jnp.roll(jnp.where(rows[:, None], out, 0), starts[j], axis=0), None

    ys, _ = jax.lax.scan(chunk, jnp.zeros_like(xs), jnp.arange(n_chunks))
    return _combine_sorted(ys, order, w)


def moe_experts_xla(x, idx, w, gate, up, down):
    """Same result as the reference, doing only the routed work. Pairs with idx >= E (and
    weight 0) are dropped: the expert-parallel wrapper marks another shard's pairs so."""
    t, k = idx.shape
    if t * k <= GATHER_MAX_PAIRS_PER_EXPERT * gate.shape[0]:
        return _moe_gather(x, idx, w, gate, up, down)
    if t <= DENSE_MAX_TOKENS:
        return (_moe_dense_flat if DENSE_FLAT else moe_experts_reference)(x, idx, w, gate, up, down)
    if isinstance(gate, QuantizedArray):
        return _moe_ragged_int4(x, idx, w, gate, up, down)
    return _moe_ragged(x, idx, w, gate, up, down)


def moe_pairs_in_tiles(x, idx, gate, up, down, tile: int, layer: jax.Array | None = None):
    """Each (token, expert) pair's expert output, computed in tiles of `tile` pairs of one expert.

    The "exact" numerics' routed experts (numerics.py): the pairs are sorted by expert, each
    expert's run padded to whole tiles, and a loop over the experts in use, within it a loop
    over their tiles, runs one expert's SwiGLU on a [tile, H] block, so every pair's output
    comes from ops of one shape whatever T and the routing are, and only the routed work is
    done (the reference's dense pass runs E / K times that). Each expert's weights are taken
    once for all its tiles: XLA:CPU copies a weight a dot reads out of a stack.

    x [T, H], idx [T, K] int (ids outside [0, E) give zeros), gate / up [E, H, I], down
    [E, I, H] (dense or INT4) -> [T, K, H] in x's dtype. With `layer`, the weights are every
    layer's stacks ([L, E, ...]) and `layer` picks one: each expert is read from the stack in
    place, not from a copy of the whole layer's slice.
    """
    t, k = idx.shape
    e, h = gate.shape[-3], x.shape[1]
    pairs = t * k
    n_tiles = -(-pairs // tile) + e  # each expert's run rounds up by less than a tile
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    expert = jnp.where(valid, flat, e)  # invalid pairs sort last, into no tile
    order, x_sorted = _sort_pairs(x, expert.reshape(t, k))
    sizes = jnp.bincount(expert, length=e + 1)[:e]
    tiles = -(-sizes // tile)
    first_tile = jnp.cumsum(tiles) - tiles
    first_pair = jnp.cumsum(sizes) - sizes
    sorted_expert = expert[order]
    e_c = jnp.minimum(sorted_expert, e - 1)
    rank = jnp.arange(pairs) - first_pair[e_c]
    row = jnp.where(sorted_expert < e, first_tile[e_c] * tile + rank, n_tiles * tile)  # past the end: dropped
    xs = jnp.zeros((n_tiles * tile, h), x.dtype).at[row].set(x_sorted, mode="drop")
    in_use = jnp.nonzero(sizes > 0, size=e, fill_value=0)[0]  # [E] the experts with pairs first

    def one_expert(j, ys):
        ex = in_use[j]
        at = ex if layer is None else (layer, ex)
        g, u, d = (_take(a, at, x.dtype) for a in (gate, up, down))  # INT4 dequantized here

        def one_tile(i, ys):
            xt = jax.lax.dynamic_slice_in_dim(xs, i * tile, tile)
            act = (jax.nn.silu(einsum("th,hi->ti", xt, g)) * einsum("th,hi->ti", xt, u)).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(ys, einsum("ti,ih->th", act, d).astype(x.dtype), i * tile, 0)

        return jax.lax.fori_loop(first_tile[ex], first_tile[ex] + tiles[ex], one_tile, ys)

    ys = jax.lax.fori_loop(0, jnp.sum(sizes > 0), one_expert, jnp.zeros_like(xs))
    out = ys.at[row].get(mode="fill", fill_value=0)  # invalid pairs' row is past the end: zeros
    return _unsort(out, order, t, k)
