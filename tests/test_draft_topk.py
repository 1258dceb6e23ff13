"""The drafter's log-softmax top-K kernel (DDTree's per-depth ranks): Triton-lowered, interpret
mode on the CPU, against the float32 reference; its dispatch and the trees built with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import tree
from ddtree_jax.pallas.draft_topk import api
from ddtree_jax.pallas.draft_topk.kernel import MAX_VOCAB, DraftTopKTiles, log_softmax_top_k_pallas, takes
from ddtree_jax.pallas.draft_topk.reference import log_softmax_top_k_reference


def _rows(seed, r, v, step=1 / 8):
    """Logits [R, V] on a grid of `step`, so that rows hold exact ties."""
    x = 3.0 * np.random.default_rng(seed).normal(size=(r, v))
    return jnp.asarray(np.round(x / step) * step, jnp.float32)


def _same(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "r, v, k, temperature",
    [
        (15, 1024, 12, None),  # a DDTree(12) tree's rows, unscaled
        (15, 1024, 16, 0.8),  # the CLI's tree temperature at T = 0
        (3, 1000, 32, 0.5),  # V not a power of two: padded with -inf
        (2, 37, 37, 2.0),  # K = V: every entry ranked
        (1, 64, 1, None),  # the argmax
    ],
)
@pytest.mark.parametrize("one_pass", [False, True])
def test_kernel_matches_reference(r, v, k, temperature, one_pass):
    x = _rows(r + v + k, r, v)
    t = None if temperature is None else jnp.float32(temperature)
    got = log_softmax_top_k_pallas(x, t, k=k, tiles=DraftTopKTiles(one_pass=one_pass), interpret=True)
    assert got[0].shape == got[1].shape == (r, k) and got[1].dtype == jnp.int32
    _same(got, log_softmax_top_k_reference(x, k, t))


@pytest.mark.parametrize("v, k", [(8192, 12), (1000, 32), (600, 1), (37, 37)])
def test_xla_path_is_the_reference(v, k):
    """The dispatch's XLA path (two stages of sorts where the row is long) gives the reference's
    ids and values exactly, ties and -inf included."""
    x = np.array(_rows(v + k, 6, v, step=1 / 2))
    x[0, : v // 3] = -np.inf
    x = jnp.asarray(x).reshape(2, 3, v)
    got = api.log_softmax_top_k(x, k, jnp.float32(0.8), implementation="xla")
    want = log_softmax_top_k_reference(x, k, jnp.float32(0.8))
    assert got[1].shape == (2, 3, k) and got[1].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_infinities_and_nan_rank_as_top_k_does():
    """-inf entries (tokens the drafter rules out) rank last, ties to the lower id, even when K
    reaches into them; a row with a NaN ranks it first, as `lax.top_k` does, and comes out NaN."""
    x = np.full((3, 64), -np.inf, np.float32)
    x[0, [5, 9, 40]] = [1.0, 3.0, 1.0]  # three finite entries, K = 6 takes three -inf ones
    x[1] = np.arange(64, dtype=np.float32) % 7  # ties everywhere
    x[2, :] = 0.5
    x[2, 17] = np.nan
    x = jnp.asarray(x)
    want = log_softmax_top_k_reference(x, 6)
    for one_pass in (False, True):
        got = log_softmax_top_k_pallas(x, None, k=6, tiles=DraftTopKTiles(one_pass=one_pass), interpret=True)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # NaN == NaN, -inf == -inf
        assert np.asarray(got[1])[0].tolist() == [9, 5, 40, 0, 1, 2]


def test_dispatch_takes_and_bad_k():
    assert takes(8192, 12) and takes(MAX_VOCAB, 1)
    assert not takes(MAX_VOCAB + 1, 12) and not takes(8, 9) and not takes(8192, 0)
    assert api.uses_kernel("pallas", 8192, 32)
    assert not api.uses_kernel("auto", 8192, 12)  # the CPU
    assert not api.uses_kernel("xla", 8192, 12) and not api.uses_kernel("mosaic", 8192, 12)
    mesh = jax.sharding.AbstractMesh((2,), ("model",))
    with jax.sharding.use_abstract_mesh(mesh):
        assert not api.uses_kernel("pallas", 8192, 12)
    x = _rows(0, 2, 64)
    for k in (0, 65):
        with pytest.raises(ValueError, match=f"k must be in \\[1, 64\\].*got {k}"):
            api.log_softmax_top_k(x, k, implementation="pallas")
    with pytest.raises(ValueError, match="implementation"):
        api.log_softmax_top_k(x, 2, implementation="cuda")
    with pytest.raises(ValueError, match="num_warps"):
        DraftTopKTiles(num_warps=3)
    # Leading axes kept: [B, D, V] -> [B, D, K].
    lead = _rows(1, 6, 64).reshape(2, 3, 64)
    got = api.log_softmax_top_k(lead, 4, jnp.float32(0.7), implementation="pallas")
    assert got[1].shape == (2, 3, 4)
    _same(got, log_softmax_top_k_reference(lead, 4, jnp.float32(0.7)))


@pytest.mark.parametrize("budget, method", [(12, "enumerate"), (16, "beam"), (5, "auto"), (32, "enumerate")])
def test_trees_built_on_the_kernel_are_the_xla_trees(budget, method):
    """`build_ddtree` with the kernel's ranks: the same tree as on XLA's chunked top-K (traced
    and fixed tree temperatures). Continuous logits: where two paths' summed log-probabilities
    tie exactly, the kernel's last-bit rounding may order them the other way (kernel.py)."""
    logits = jnp.asarray(3.0 * np.random.default_rng(budget).normal(size=(2, 15, 1024)), jnp.float32)
    roots = jnp.asarray([3, 7], jnp.int32)
    for temperature in (1.0, 0.8, jnp.float32(0.6)):
        want = tree.build_ddtree(logits, roots, budget, method=method, temperature=temperature, implementation="xla")
        got = tree.build_ddtree(logits, roots, budget, method=method, temperature=temperature, implementation="pallas")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bench_smoke(capsys):
    from ddtree_jax.pallas.draft_topk import bench

    bench.main(["--smoke", "--reps", "1", "--shapes", "shipped_budget12"])
    out = capsys.readouterr().out
    for impl in ("reference", "xla", "pallas", "pallas_one_pass"):
        assert f"| shipped_budget12 | {impl} |" in out
