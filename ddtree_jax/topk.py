"""`lax.top_k` with fewer or smaller sorts: in two stages for long rows, by ranks for short ones.

Every function here gives the same values, the same indices and the same order as `lax.top_k`:
largest first under the IEEE total order (NaN above +inf, -NaN below -inf, 0.0 above -0.0),
ties to the lower index.

`chunked_top_k` (long rows, e.g. DDTree's [B, D, V] drafter log-probabilities): on the GPU XLA
runs `lax.top_k` with k > 16 as a sort of the whole row (32 us for [15, 8192] on an H200), and
also for k <= 16 one `lax.top_k` cost more than two stages (an H100, session 49,
docs/benchmarks.md: DDTree(12)'s tree 0.111 ms a call against 0.035). Each chunk of
`TOP_K_CHUNK` entries keeps its top k, then one top k picks among those.

`rank_top_k` (short rows): on the GPU XLA lowers `lax.top_k` to a sort kernel (a few
microseconds each even for a few hundred entries), one launch that nothing fuses with. Ranking
by comparing every pair of a row, [..., n, n], is a reduction that XLA may fuse with the row's
producer. Its callers keep it off by default: where it was timed it did not pay
(`RANK_TOP_K_MAX`, `model.ROUTER_RANK_MAX_EXPERTS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOP_K_CHUNK = 256
"""`chunked_top_k` over more than 2 x this many entries runs in two stages (0: one `lax.top_k`)."""
RANK_TOP_K_MAX = 0
"""Each stage of `chunked_top_k` over at most this many entries ranks them (`rank_top_k`)
instead of sorting them (0: always sort). On the GPU each sort is a kernel of its own, three a
DDTree(12) round at 5.6-5.8 us each on an H100 (session 43). Off: on an H100 (session 47,
docs/benchmarks.md) ranking at 1024 made DDTree(32)'s tree 0.62 ms a call against 0.05 ms
sorted, and each program 50 s to compile. On the CPU too the O(n^2) comparisons cost more than
the sort."""


def _total_order_key(x: jax.Array) -> jax.Array:
    """int32 keys [..., n] that compare as x does under the IEEE total order (float32 x)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    # Negative floats' bits grow as the value falls: flipping all but the sign bit reverses them.
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def rank_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis by pairwise ranks: (values [..., k], indices
    [..., k] int32). Costs O(n^2) per row (x [..., n], float32 or narrower), so for short rows.
    """
    n = x.shape[-1]
    if not 0 < k <= n:
        raise ValueError(f"k must be in [1, {n}] for rows of {n}, got {k}")
    key = _total_order_key(x)
    pos = jnp.arange(n, dtype=jnp.int32)
    mine, rival = key[..., :, None], key[..., None, :]  # candidate i, rival j
    ahead = (rival > mine) | ((rival == mine) & (pos[None, :] < pos[:, None]))  # [..., i, j]
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)  # [..., n]: a permutation of 0..n-1
    hit = rank[..., :, None] == jnp.arange(k, dtype=jnp.int32)  # [..., n, k]
    idx = jnp.sum(jnp.where(hit, pos[:, None], 0), axis=-2, dtype=jnp.int32)  # [..., k]
    return jnp.take_along_axis(x, idx, axis=-1), idx


def top_k(x: jax.Array, k: int, rank_max: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis: by `rank_top_k` where rows have at most
    `rank_max` entries (0: never), else by the sort."""
    return rank_top_k(x, k) if x.shape[-1] <= rank_max else jax.lax.top_k(x, k)


def chunked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis in two stages (see the module docstring).

    Ties keep the lower index first: within a chunk by its stable order, across chunks because
    the survivors are laid out chunk by chunk. Padding (-inf, past the end) comes after every
    real entry and is never picked while k <= n. Each stage over at most `RANK_TOP_K_MAX`
    entries ranks them instead of sorting.
    """
    n, c = x.shape[-1], TOP_K_CHUNK
    if not 0 < k <= c or n <= 2 * c:
        return top_k(x, k, RANK_TOP_K_MAX)
    m = -(-n // c)
    lead = x.shape[:-1]
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, m * c - n)], constant_values=-jnp.inf)
    part, local = top_k(padded.reshape(*lead, m, c), k, RANK_TOP_K_MAX)  # [..., m, k]
    index = (local + c * jnp.arange(m, dtype=local.dtype)[:, None]).reshape(*lead, m * k)
    values, pick = top_k(part.reshape(*lead, m * k), k, RANK_TOP_K_MAX)
    return values, jnp.take_along_axis(index, pick, axis=-1)
