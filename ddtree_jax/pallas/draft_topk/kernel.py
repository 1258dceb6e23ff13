"""Pallas (Triton-lowered) log-softmax top k of the drafter's logits: one launch a tree, or two.

Notation as in reference.py; Vp = V rounded up to a power of two (padding: -inf logits), Kp =
K rounded up to a power of two.

Grid (R,). Program r holds row r whole in registers: the temperature's scaling, the row's
maximum and log-sum-exp (two reductions), then K rounds of selection, each two reductions:
the largest remaining value (as an int32 key that orders like the IEEE total order, so NaN
and -inf rank as `lax.top_k` ranks them), then the lowest id holding it; that entry is marked
taken. The value comes back from the key exactly. XLA runs the same as a softmax kernel, a
scaling and two chunked sorts (session 51: 13 kernels and 31 us a DDTree(12) tree on an H100, the
three sorts 5.6 us each); selection costs 2 K reductions of a row, so it pays for small K.

With `DraftTopKTiles.chunk`, grid (R, Vp / chunk): each program computes its row's maximum and
log-sum-exp (block by block, the same in every program of the row), ranks its chunk by the
log-probabilities' keys and keeps its top K (keys and ids); a second launch, grid (R,), selects
the top K of the row's candidates. Each selection reduces a chunk, not a row, and a row has many
programs; the order is the one-launch kernel's (equal keys: chunks come in row order, and each
chunk's picks in id order).

Rounding: the log-sum-exp is summed in the kernel's order, so values may differ from XLA's in
the last bits, and a near-tie may then rank the other way. The tree only shapes what the
drafter proposes; which tokens are accepted is the target's choice either way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ddtree_jax.pallas import check_compiler

MAX_VOCAB = 16384
"""Longest row the kernel holds in registers (Vp entries over num_warps x 32 threads)."""


@dataclasses.dataclass(frozen=True)
class DraftTopKTiles:
    """Triton launch parameters (validated on construction).

    Attributes:
      num_warps, num_stages: Triton launch parameters (of each launch).
      one_pass: select each rank with one argmax reduction (ties to the lower id, as Pallas
        lowers it) and read the K values back from the logits after, instead of a max and a min
        reduction a rank (on an H100, session 52: 15.6 us against 16.4 for 15 x 8192 rows at
        K = 12, 31.0 against 33.0 at K = 32; the same ids and values).
      chunk: 0: a program a row (one launch). Else a power of two: a program a chunk of this
        many entries of a row (raised to Kp, at most Vp), which ranks its chunk by the row's
        log-probabilities and keeps its top K, then a second launch merges a row's Vp / chunk
        x K candidates (`_chunk_kernel`, `_merge_kernel`): selection over short rows, many
        programs a row. Not yet timed on a GPU: off.
    """

    num_warps: int = 8
    num_stages: int = 1
    one_pass: bool = True
    chunk: int = 0

    def __post_init__(self):
        check_compiler(self.num_warps, self.num_stages)
        c = self.chunk
        if not isinstance(c, int) or isinstance(c, bool) or c < 0 or c & (c - 1):
            raise ValueError(f"chunk must be 0 or a power of two, got {c!r}")


def takes(vocab: int, k: int) -> bool:
    """Whether the kernel runs a row of `vocab` logits for `k` ranks: 1 <= k <= vocab <= MAX_VOCAB."""
    return 1 <= k <= vocab <= MAX_VOCAB


def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys that compare as float32 x does under the IEEE total order (an involution)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _top_k_kernel(t_ref, x_ref, values_ref, ids_ref, *, k, scale, one_pass):
    f32, i32 = jnp.float32, jnp.int32

    def log_prob(x, shift):  # the same float ops on a row or on the picked entries
        if scale:
            x = (x - shift[0]) / t_ref[0]
        return x - shift[1] - shift[2]

    x = x_ref[...].astype(f32)  # [Vp]
    top = jnp.max(x)
    scaled = (x - top) / t_ref[0] if scale else x
    m = jnp.max(scaled)
    shift = (top, m, jnp.log(jnp.sum(jnp.exp(scaled - m))))
    key = _order_key(log_prob(x, shift))
    vp, kp = x.shape[0], values_ref.shape[0]
    ids = jax.lax.broadcasted_iota(i32, (vp,), 0)
    slots = jax.lax.broadcasted_iota(i32, (kp,), 0)
    lowest = jnp.iinfo(jnp.int32).min
    if one_pass:
        # Taken entries drop to `lowest`, below every key (the one -NaN pattern whose key it is
        # ranks as the next one up).
        key = jnp.maximum(key, lowest + 1)

        def select(j, carry):
            taken, top_id = carry
            pick = jnp.argmax(jnp.where(taken, lowest, key)).astype(i32)
            return taken | (ids == pick), jnp.where(slots == j, pick, top_id)

        _, top_id = jax.lax.fori_loop(0, k, select, (jnp.zeros((vp,), jnp.bool_), jnp.zeros((kp,), i32)))
        values_ref[...] = log_prob(x_ref[top_id].astype(f32), shift)
        ids_ref[...] = top_id
        return

    def select(j, carry):
        taken, top_key, top_id = carry
        best = jnp.max(jnp.where(taken, lowest, key))
        pick = jnp.min(jnp.where((key == best) & ~taken, ids, vp))
        return taken | (ids == pick), jnp.where(slots == j, best, top_key), jnp.where(slots == j, pick, top_id)

    start = (jnp.zeros((vp,), jnp.bool_), jnp.full((kp,), lowest, i32), jnp.zeros((kp,), i32))
    _, top_key, top_id = jax.lax.fori_loop(0, k, select, start)
    values_ref[...] = jax.lax.bitcast_convert_type(_order_key(top_key), f32)
    ids_ref[...] = top_id


def _row_shift(t_ref, x_ref, vp: int, block: int, scale: bool):
    """The row's (maximum, maximum after scaling, log-sum-exp after scaling), as `_top_k_kernel`
    computes them, read block by block (every program of a row computes the same)."""
    f32, nb = jnp.float32, vp // block

    def over(fn, combine, start):
        return jax.lax.fori_loop(
            0, nb, lambda i, acc: combine(acc, fn(x_ref[pl.ds(i * block, block)].astype(f32))), start
        )

    top = over(jnp.max, jnp.maximum, jnp.float32(-jnp.inf))
    scaled = (lambda x: (x - top) / t_ref[0]) if scale else (lambda x: x)
    m = over(lambda x: jnp.max(scaled(x)), jnp.maximum, jnp.float32(-jnp.inf)) if scale else top
    total = over(lambda x: jnp.sum(jnp.exp(scaled(x) - m)), jnp.add, jnp.float32(0.0))
    return top, m, jnp.log(total)


def _select(key, k: int, kp: int):
    """Positions [Kp] of the k largest int32 keys (> int32 min), ties to the lower position, by
    one argmax a rank; slots past k hold position 0."""
    i32, lowest = jnp.int32, jnp.iinfo(jnp.int32).min
    pos = jax.lax.broadcasted_iota(i32, key.shape, 0)
    slots = jax.lax.broadcasted_iota(i32, (kp,), 0)

    def pick(j, carry):
        taken, top = carry
        best = jnp.argmax(jnp.where(taken, lowest, key)).astype(i32)
        return taken | (pos == best), jnp.where(slots == j, best, top)

    return jax.lax.fori_loop(0, k, pick, (jnp.zeros(key.shape, jnp.bool_), jnp.zeros((kp,), i32)))[1]


def _chunk_kernel(t_ref, x_ref, keys_ref, ids_ref, *, k, chunk, scale, log_softmax):
    """Program (r, c): chunk c of row r ranked by the row's log-probabilities (or, without
    `log_softmax`, by its values) as int32 order keys; its top K keys and row ids, slots past K
    below every key."""
    i32, vp, kp = jnp.int32, x_ref.shape[0], keys_ref.shape[0]
    if log_softmax:
        top, m, lse = _row_shift(t_ref, x_ref, vp, chunk, scale)

    def key_of(x):  # the same float ops on the chunk and on the picked entries
        x = x.astype(jnp.float32)
        if log_softmax:
            x = ((x - top) / t_ref[0] if scale else x) - m - lse
        return jnp.maximum(_order_key(x), jnp.iinfo(i32).min + 1)  # int32 min: a taken entry

    start = pl.program_id(1) * chunk
    at = start + _select(key_of(x_ref[pl.ds(start, chunk)]), k, kp)
    slots = jax.lax.broadcasted_iota(i32, (kp,), 0)
    keys_ref[...] = jnp.where(slots < k, key_of(x_ref[at]), jnp.iinfo(i32).min)
    ids_ref[...] = jnp.where(slots < k, at, vp)


def _merge_kernel(keys_ref, ids_ref, values_ref, out_ids_ref, *, k):
    """Program r: the top K of row r's chunk candidates. Among equal keys the lower position is
    the lower id (chunks in row order, each chunk's picks in id order among equal keys)."""
    at = _select(keys_ref[...], k, values_ref.shape[0])
    values_ref[...] = jax.lax.bitcast_convert_type(_order_key(keys_ref[at]), jnp.float32)
    out_ids_ref[...] = ids_ref[at]


def _chunked(logits, t, *, k, scale, tiles, interpret, log_softmax=True):
    """The two launches of `DraftTopKTiles.chunk` over padded rows [R, Vp]: (values, ids) [R, Kp]."""
    r, vp = logits.shape
    kp = pl.next_power_of_2(k)
    chunk = min(vp, max(tiles.chunk, kp))
    c = vp // chunk
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    i32 = jnp.int32
    keys, ids = pl.pallas_call(
        functools.partial(_chunk_kernel, k=k, chunk=chunk, scale=scale, log_softmax=log_softmax),
        grid=(r, c),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), pl.BlockSpec((None, vp), lambda i, j: (i, 0))],
        out_specs=[pl.BlockSpec((None, None, kp), lambda i, j: (i, j, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((r, c, kp), i32)] * 2,
        compiler_params=params,
        interpret=interpret,
    )(t, logits)
    n = c * kp
    return pl.pallas_call(
        functools.partial(_merge_kernel, k=k),
        grid=(r,),
        in_specs=[pl.BlockSpec((None, n), lambda i: (i, 0))] * 2,
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), i32)],
        compiler_params=params,
        interpret=interpret,
    )(keys.reshape(r, n), ids.reshape(r, n))


MAX_ROW = 1 << 15
"""Longest row `top_k_pallas` takes (DDTree's eligible paths: `tree.MAX_ENUMERATED_PATHS`)."""
MAX_ROW_K = 64
"""Most ranks `top_k_pallas` takes (a selection costs one reduction of a chunk a rank)."""


def takes_row(n: int, k: int) -> bool:
    """Whether `top_k_pallas` takes rows of `n` values for `k` ranks."""
    return 1 <= k <= min(n, MAX_ROW_K) and n <= MAX_ROW


@functools.partial(jax.jit, static_argnames=("k", "tiles", "interpret"))
def top_k_pallas(
    x: jax.Array,  # [R, N] float
    *,
    k: int,
    tiles: DraftTopKTiles = DraftTopKTiles(chunk=512, num_warps=2),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # values [R, K] float32, ids [R, K] int32
    """`lax.top_k(x, k)` of float rows by the two launches of `DraftTopKTiles.chunk` (its chunk
    0 taken as 512), ranked by the values themselves (no log-softmax): the same ids and order,
    the values as float32."""
    n = x.shape[1]
    if not takes_row(n, k):
        raise ValueError(f"top_k_pallas: needs 1 <= k <= min(N, {MAX_ROW_K}) and N <= {MAX_ROW}, got k={k}, N={n}")
    np2 = pl.next_power_of_2(n)
    if np2 != n:
        x = jnp.pad(x, ((0, 0), (0, np2 - n)), constant_values=-jnp.inf)
    tiles = tiles if tiles.chunk else dataclasses.replace(tiles, chunk=512)
    one = jnp.ones((1,), jnp.float32)
    values, ids = _chunked(x, one, k=k, scale=False, tiles=tiles, interpret=interpret, log_softmax=False)
    return values[:, :k], ids[:, :k]


@functools.partial(jax.jit, static_argnames=("k", "tiles", "interpret"))
def log_softmax_top_k_pallas(
    logits: jax.Array,  # [R, V]
    temperature: jax.Array | None,  # float32 scalar, or None: unscaled
    *,
    k: int,
    tiles: DraftTopKTiles = DraftTopKTiles(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # values [R, K] float32, ids [R, K] int32
    """`reference.log_softmax_top_k_reference` over rows [R, V]."""
    r, v = logits.shape
    if not takes(v, k):
        raise ValueError(f"log_softmax_top_k_pallas: needs 1 <= k <= V <= {MAX_VOCAB}, got k={k}, V={v}")
    vp, kp = pl.next_power_of_2(v), pl.next_power_of_2(k)
    if vp != v:
        logits = jnp.pad(logits, ((0, 0), (0, vp - v)), constant_values=-jnp.inf)
    scale = temperature is not None
    t = jnp.reshape(jnp.asarray(1.0 if temperature is None else temperature, jnp.float32), (1,))
    if tiles.chunk:
        values, ids = _chunked(logits, t, k=k, scale=scale, tiles=tiles, interpret=interpret)
        return values[:, :k], ids[:, :k]
    values, ids = pl.pallas_call(
        functools.partial(_top_k_kernel, k=k, scale=scale, one_pass=tiles.one_pass),
        grid=(r,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((None, vp), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
    )(t, logits)
    return values[:, :k], ids[:, :k]
