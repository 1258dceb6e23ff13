"""Pallas (Triton-lowered) log-softmax top k of the drafter's logits: one launch a tree.

Notation as in reference.py; Vp = V rounded up to a power of two (padding: -inf logits), Kp =
K rounded up to a power of two.

Grid (R,). Program r holds row r whole in registers: the temperature's scaling, the row's
maximum and log-sum-exp (two reductions), then K rounds of selection, each two reductions:
the largest remaining value (as an int32 key that orders like the IEEE total order, so NaN
and -inf rank as `lax.top_k` ranks them), then the lowest id holding it; that entry is marked
taken. The value comes back from the key exactly. XLA runs the same as a softmax kernel, a
scaling and two chunked sorts (session 51: 13 kernels and 31 us a DDTree(12) tree on an H100, the
three sorts 5.6 us each); selection costs 2 K reductions of a row, so it pays for small K.

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
    """Triton launch parameters (validated on construction); a program is a whole row.

    Attributes:
      num_warps, num_stages: Triton launch parameters.
      one_pass: select each rank with one argmax reduction (ties to the lower id, as Pallas
        lowers it) and read the K values back from the logits after, instead of a max and a min
        reduction a rank (on an H100, session 52: 15.6 us against 16.4 for 15 x 8192 rows at
        K = 12, 31.0 against 33.0 at K = 32; the same ids and values).
    """

    num_warps: int = 8
    num_stages: int = 1
    one_pass: bool = True

    def __post_init__(self):
        check_compiler(self.num_warps, self.num_stages)


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
