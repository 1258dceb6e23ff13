"""Tree construction vs a brute-force reference, ties included."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_jax import topk, tree

build = jax.jit(tree.build_ddtree, static_argnums=2, static_argnames="method")
METHODS = ("enumerate", "beam")


def reference_tree(logp: np.ndarray, budget: int):
    """All rank paths sorted by (score desc, rank path asc); the first `budget`.

    logp [D, V] float32. Ranks follow a stable descending sort (lower token id first
    on ties), and scores are summed depth by depth in float32, as the builder does.
    """
    d, v = logp.shape
    k = min(budget, v)
    order = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    paths = []
    for depth in range(1, d + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            score = np.float32(0)
            for i, r in enumerate(ranks):
                score = np.float32(score + logp[i, order[i, r]]) if i else logp[0, order[0, r]]
            paths.append((-float(score), ranks))
    paths.sort()
    chosen = [p for _, p in paths[:budget]]
    index = {p: i + 1 for i, p in enumerate(chosen)}
    tokens = [int(order[len(p) - 1, p[-1]]) for p in chosen]
    parents = [index.get(p[:-1], 0) for p in chosen]
    depths = [len(p) for p in chosen]
    return tokens, parents, depths


def check_against_reference(logits: np.ndarray, budget: int, method: str = "auto"):
    b, d, v = logits.shape
    roots = jnp.arange(b, dtype=jnp.int32) + 3
    t = jax.tree.map(np.asarray, build(jnp.asarray(logits), roots, budget, method=method))  # indexed on the host
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    n_paths = sum(min(budget, v) ** i for i in range(1, d + 1))
    for row in range(b):
        tokens, parents, depths = reference_tree(logp[row], budget)
        n = len(tokens)
        assert n == min(budget, n_paths)
        assert np.asarray(t.valid[row]).tolist() == [True] * (n + 1) + [False] * (budget - n)
        assert int(t.tokens[row, 0]) == row + 3 and int(t.parents[row, 0]) == -1
        assert np.asarray(t.tokens[row, 1 : n + 1]).tolist() == tokens
        assert np.asarray(t.parents[row, 1 : n + 1]).tolist() == parents
        assert np.asarray(t.depths[row, 1 : n + 1]).tolist() == depths
        check_visibility(np.asarray(t.parents[row]), np.asarray(t.valid[row]), np.asarray(t.visibility[row]))


def check_visibility(parents, valid, vis):
    n = len(parents)
    for i in range(n):
        want = np.zeros(n, bool)
        want[i] = True
        if valid[i]:
            j = parents[i]
            while j >= 0:
                assert j < i or i == 0
                want[j] = True
                j = parents[j]
        assert vis[i].tolist() == want.tolist(), i


@settings(max_examples=12, deadline=None)  # each new shape is a compile of the builder
@given(
    d=st.integers(1, 4),
    v=st.integers(2, 6),
    budget=st.sampled_from([1, 2, 3, 5, 8, 15, 30]),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    method=st.sampled_from(METHODS),
)
def test_matches_reference_with_ties(d, v, budget, levels, seed, method):
    """Integer logits from a few levels make many exact ties within and across depths."""
    logits = np.random.default_rng(seed).integers(0, levels, size=(2, d, v)).astype(np.float32)
    check_against_reference(logits, budget, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("d", "v", "budget"), [(3, 7, 16), (4, 5, 64), (2, 300, 40), (5, 3, 100)])
def test_matches_reference_random(d, v, budget, method):
    logits = np.random.default_rng(d * v + budget).normal(size=(3, d, v)).astype(np.float32) * 2
    check_against_reference(logits, budget, method)


@pytest.mark.parametrize("method", METHODS)
def test_peaked_drafter_gives_zero_logprob_ties(method):
    """log p = 0 exactly: a child ties its parent and must still come after it."""
    logits = np.full((1, 3, 4), -200.0, np.float32)
    logits[0, :, 1] = 0.0
    check_against_reference(logits, 5, method)


@pytest.mark.parametrize("budget", [16, 33, 64])
@pytest.mark.parametrize("levels", [3, None])
def test_enumerate_equals_beam_at_drafter_shapes(budget, levels):
    """Depth 15, vocab 512: too big for the brute force, so the two builders check each other
    (with integer logits from 3 levels, ties everywhere; and with continuous logits)."""
    rng = np.random.default_rng(budget)
    logits = rng.integers(0, levels, (2, 15, 512)) * 2.0 if levels else rng.normal(size=(2, 15, 512))
    logits[:, :, :3] += 9.0  # a few dominant tokens per depth (tied in the integer case): deep trees
    logits = jnp.asarray(logits, jnp.float32)
    roots = jnp.asarray([5, 6], jnp.int32)
    a = build(logits, roots, budget, method="enumerate")
    b = build(logits, roots, budget, method="beam")
    for field in ("tokens", "parents", "depths", "valid", "visibility"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert int(a.depths.max()) > 3  # deep enough to exercise many levels


def test_eligible_paths_are_exactly_those_with_few_predecessors():
    """The enumerated set: every rank path with sum_j prod_{i<=j}(r_i + 1) <= budget, in
    lexicographic order (prefix first), each with its parent's index."""
    for budget, d, k in [(5, 3, 2), (8, 4, 3), (16, 5, 16), (30, 4, 6)]:
        ranks, depth, parent = tree._eligible_paths(budget, d, k)
        want = []
        for n in range(1, d + 1):
            for path in itertools.product(range(k), repeat=n):
                cost = np.cumprod(np.asarray(path) + 1).sum()
                if cost <= budget:
                    want.append(path)
        got = [tuple(row[:n].tolist()) for row, n in zip(ranks, depth, strict=True)]
        assert got == sorted(want)
        assert all((p < 0) == (len(g) == 1) and (p < 0 or got[p] == g[:-1]) for g, p in zip(got, parent, strict=True))
    assert tree._eligible_paths(128, 15, 128) is None  # past MAX_ENUMERATED_PATHS: the beam builds it


def test_enumerated_paths_says_which_builder_auto_uses():
    assert tree.enumerated_paths(5, 3, 2) == len(tree._eligible_paths(5, 3, 2)[1])
    assert tree.enumerated_paths(16, 15, 3) == len(tree._eligible_paths(16, 15, 3)[1])  # ranks < V
    # Where it answers None, enumeration refuses (and "auto" falls back to the beam).
    assert tree.enumerated_paths(128, 15, 256) is None
    with pytest.raises(ValueError, match="eligible paths"):
        tree.build_ddtree(jnp.zeros((1, 15, 256)), jnp.zeros((1,), jnp.int32), 128, method="enumerate")
    with pytest.raises(ValueError, match="budget"):
        tree.enumerated_paths(0, 15, 256)
    with pytest.raises(ValueError, match="depth=0"):
        tree.enumerated_paths(8, 0, 256)


def test_enumerate_refuses_budgets_it_cannot_list():
    with pytest.raises(ValueError, match="eligible paths"):
        tree.build_ddtree(jnp.zeros((1, 15, 256)), jnp.zeros((1,), jnp.int32), 128, method="enumerate")
    with pytest.raises(ValueError, match="method"):
        tree.build_ddtree(jnp.zeros((1, 2, 4)), jnp.zeros((1,), jnp.int32), 4, method="heap")


@pytest.mark.parametrize("budget", [16, 64, 257, 1024])
def test_large_budgets_are_well_formed(budget):
    b, d, v = 2, 15, 4096
    logits = jax.random.normal(jax.random.PRNGKey(budget), (b, d, v)) * 3
    t = build(logits, jnp.zeros((b,), jnp.int32), budget)
    assert t.tokens.shape == (b, budget + 1)
    parents, depths, valid = (np.asarray(x) for x in (t.parents, t.depths, t.valid))
    assert valid.all()
    idx = np.arange(1, budget + 1)
    assert (parents[:, 1:] < idx).all()
    assert (depths[:, 1:] == np.take_along_axis(depths, parents[:, 1:], 1) + 1).all()
    assert depths.max() <= d
    # Pop order: scores non-increasing.
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for row in range(b):
        score = np.zeros(budget + 1)
        for i in range(1, budget + 1):
            score[i] = score[parents[row, i]] + logp[row, depths[row, i] - 1, t.tokens[row, i]]
        assert (np.diff(score[1:]) <= 1e-4).all()
    # Siblings carry distinct tokens (the acceptance walk relies on it).
    for row in range(b):
        pairs = set(zip(parents[row, 1:].tolist(), np.asarray(t.tokens[row, 1:]).tolist(), strict=True))
        assert len(pairs) == budget


def test_chain_and_root_only():
    logits = jnp.asarray([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]])
    t = tree.build_chain(logits, jnp.asarray([9]))
    assert np.asarray(t.tokens).tolist() == [[9, 1, 0]]
    assert np.asarray(t.parents).tolist() == [[-1, 0, 1]]
    assert np.asarray(t.visibility[0]).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    r = tree.root_only(jnp.asarray([4, 5]))
    assert r.tokens.shape == (2, 1) and np.asarray(r.visibility).all()


@pytest.mark.parametrize(
    ("budget", "error"), [(0, ValueError), (-1, ValueError), (1025, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_budget(budget, error):
    with pytest.raises(error, match="budget"):
        tree.build_ddtree(jnp.zeros((1, 2, 4)), jnp.zeros((1,), jnp.int32), budget)


def test_tree_temperature_sharpens_the_drafter_before_the_tree_is_chosen():
    """Depth 1: a 0.6, b 0.4; depth 2: c 0.55, d 0.45. Two nodes at t = 1 take a and b (0.6,
    0.4 > a-c 0.33); at t = 0.5 (p^2, renormalized) a-c's 0.69 x 0.60 = 0.41 beats b's 0.31."""
    p = np.array([[[0.6, 0.4, 1e-9, 1e-9], [1e-9, 1e-9, 0.55, 0.45]]])
    logits, roots = jnp.asarray(np.log(p), jnp.float32), jnp.asarray([3], jnp.int32)
    for method in ("enumerate", "beam"):
        flat = tree.build_ddtree(logits, roots, 2, method=method)
        assert (
            flat.tokens.tolist() == tree.build_ddtree(logits, roots, 2, method=method, temperature=1.0).tokens.tolist()
        )
        sharp = tree.build_ddtree(logits, roots, 2, method=method, temperature=0.5)
        assert np.asarray(flat.tokens).tolist() == [[3, 0, 1]] and np.asarray(flat.parents).tolist() == [[-1, 0, 0]]
        assert np.asarray(sharp.tokens).tolist() == [[3, 0, 2]] and np.asarray(sharp.parents).tolist() == [[-1, 0, 1]]
        same = tree.build_ddtree(logits / 0.5, roots, 2, method=method)
        assert np.asarray(same.tokens).tolist() == np.asarray(sharp.tokens).tolist()
        # A traced temperature (generate's: one program for every value) builds the same trees.
        traced = jax.jit(lambda t, m=method: tree.build_ddtree(logits, roots, 2, method=m, temperature=t))
        assert np.asarray(traced(jnp.float32(0.5)).tokens).tolist() == np.asarray(sharp.tokens).tolist()
        assert np.asarray(traced(jnp.float32(1.0)).tokens).tolist() == np.asarray(flat.tokens).tolist()


@pytest.mark.parametrize(
    ("temperature", "error"),
    [(0, ValueError), (-0.5, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("0.8", TypeError),
     (True, TypeError)],
)  # fmt: skip
def test_bad_tree_temperature(temperature, error):
    with pytest.raises(error, match="tree temperature"):
        tree.build_ddtree(jnp.zeros((1, 2, 4)), jnp.zeros((1,), jnp.int32), 2, temperature=temperature)


@pytest.mark.parametrize("budget", [12, 32])
def test_ranked_top_k_builds_the_same_tree(budget, monkeypatch):
    """`build_ddtree` with its top-k stages ranked (`RANK_TOP_K_MAX`) gives the sorted stages'
    tree, field by field, on drafter logits with tied entries."""
    rng = np.random.default_rng(budget)
    logits = jnp.asarray(np.round(rng.normal(size=(2, 15, 1000)) * 4) / 4, jnp.float32)
    roots = jnp.asarray([5, 7], jnp.int32)
    want = tree.build_ddtree(logits, roots, budget)
    monkeypatch.setattr(topk, "RANK_TOP_K_MAX", 1024)
    got = tree.build_ddtree(logits, roots, budget)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
