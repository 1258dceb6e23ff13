"""`lax.top_k` without a sort, for short rows.

On the GPU XLA lowers `lax.top_k` to a sort kernel (a few microseconds each even for a few
hundred entries), one launch that nothing fuses with. Ranking by comparing every pair of a row,
[..., n, n], is a reduction that XLA may fuse with the row's producer; whether it costs less
than the sort is not yet measured (the one GPU run with it on, session 45, did not finish), so
its callers keep it off by default. Same values, same indices, same order as `lax.top_k`:
largest first under the IEEE total order (NaN above +inf, -NaN below -inf, 0.0 above -0.0),
ties to the lower index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
