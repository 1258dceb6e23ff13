"""`topk.rank_top_k` and `topk.chunked_top_k` against `lax.top_k`: values, indices and order, ties
and non-finite values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import topk
from ddtree_jax.topk import rank_top_k


@pytest.mark.parametrize(("n", "k"), [(1, 1), (16, 2), (64, 6), (256, 32), (300, 300)])
def test_rank_top_k_is_lax_top_k_ties_and_non_finite_included(n, k):
    """Rows of heavy ties, -inf and +inf, NaN of both signs, 0.0 beside -0.0 and bf16: the same
    values and indices as lax.top_k (total order, ties to the lower index)."""
    rng = np.random.default_rng(n * 7 + k)
    x = rng.integers(-2, 3, size=(6, n)).astype(np.float32)  # five values: ties everywhere
    x[1, : n // 2] = -np.inf
    x[2, rng.integers(0, n, 3)] = np.inf
    x[3] = rng.normal(size=n)
    x[4, rng.integers(0, n, 3)] = np.nan
    x[4, rng.integers(0, n, 2)] = -np.nan
    x[5] = np.where(rng.random(n) < 0.5, 0.0, -0.0)
    for dtype in (jnp.float32, jnp.bfloat16):
        xs = jnp.asarray(x, dtype)
        got, want = rank_top_k(xs, k), jax.lax.top_k(xs, k)
        assert got[0].dtype == dtype and got[1].dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))


def test_rank_top_k_breaks_ties_toward_the_lower_index():
    """A constant row gives 0, 1, ..., k - 1 (the reverse order would be a wrong answer), under
    jit with leading axes."""
    got = jax.jit(rank_top_k, static_argnums=1)(jnp.zeros((2, 3, 10)), 4)[1]
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(np.arange(4), (2, 3, 4)))


@pytest.mark.parametrize("k", [0, 5])
def test_rank_top_k_rejects_k_outside_the_row(k):
    with pytest.raises(ValueError, match=f"k must be in \\[1, 4\\] for rows of 4, got {k}"):
        rank_top_k(jnp.zeros((2, 4)), k)


@pytest.mark.parametrize("rank_max", [0, 1024])
@pytest.mark.parametrize(("n", "k"), [(600, 32), (8192, 32), (3576, 64), (513, 256), (1000, 1), (166, 12)])
def test_chunked_top_k_is_lax_top_k(n, k, rank_max, monkeypatch):
    """Same values and indices as one `lax.top_k`, ties (few distinct values) and -inf included,
    with the stages sorted (rank_max 0, the default) or ranked."""
    monkeypatch.setattr(topk, "RANK_TOP_K_MAX", rank_max)
    rng = np.random.default_rng(n + k)
    x = np.round(rng.normal(size=(3, 2, n)) * 2) / 2  # ~15 distinct values: many ties
    x[0, 0, rng.integers(0, n, n // 3)] = -np.inf
    x[1, 1, :] = -np.inf  # a row of ties only
    x = jnp.asarray(x, jnp.float32)
    want = jax.lax.top_k(x, k)
    got = topk.chunked_top_k(x, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
