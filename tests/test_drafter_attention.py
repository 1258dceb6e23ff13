"""The drafter's block attention: the Triton-lowered kernel (interpret mode on the CPU) against
the float32 reference, its dispatch, and the drafter and decode loop running it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate
from ddtree_jax.pallas.drafter_attention.api import drafter_attention
from ddtree_jax.pallas.drafter_attention.kernel import DrafterAttentionTiles, drafter_attention_pallas
from ddtree_jax.pallas.drafter_attention.reference import drafter_attention_reference
from ddtree_jax.pallas.shapes import DRAFTER_ATTENTION_SHAPES
from tests.conftest import random_target, tiny

FULL = 2**31 - 1


def case(rng, b, t, nq, nkv, hd, s, lengths, starts, dtype=jnp.float32):
    """Operands of one call: the block of row i at positions starts[i] .. starts[i] + t - 1."""

    def f(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    positions = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
    return (
        f(b, t, nq, hd),
        f(b, s, nkv, hd),
        f(b, s, nkv, hd),
        jnp.asarray(lengths, jnp.int32),
        positions,
        f(b, t, nkv, hd),
        f(b, t, nkv, hd),
    )


@pytest.mark.parametrize(
    "b, t, nq, nkv, hd, s, lengths, starts, window, causal, block_k",
    [
        (1, 16, 6, 1, 64, 300, [200], [200], 128, False, 64),  # the shipped drafter, ragged last step
        (1, 16, 6, 1, 64, 300, [300], [300], FULL, False, 64),  # a full layer over a full cache
        (2, 5, 4, 2, 32, 100, [0, 77], [0, 77], FULL, True, 32),  # T padded to 16; an empty context
        (3, 16, 8, 8, 16, 40, [40, 3, 17], [40, 3, 17], 20, False, 64),  # S < block_k: shrunk to 32
        (2, 1, 2, 1, 16, 64, [10, 64], [10, 64], 4, True, 16),  # one block token
        (2, 16, 4, 1, 16, 96, [50, 96], [60, 100], 16, True, 16),  # blocks past the context; window = T
        (1, 16, 2, 2, 128, 17, [17], [17], FULL, False, 64),  # K2.5 head dim, S not a power of two
    ],
)
def test_kernel_matches_reference(b, t, nq, nkv, hd, s, lengths, starts, window, causal, block_k):
    args = case(np.random.default_rng(s + t), b, t, nq, nkv, hd, s, lengths, starts)
    want = drafter_attention_reference(*args, window, causal)
    got = drafter_attention_pallas(*args, window, causal, tiles=DrafterAttentionTiles(block_k=block_k), interpret=True)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    "b, t, nq, nkv, hd, s, lengths, starts, window, causal, head_group, splits",
    [
        (1, 16, 8, 1, 128, 300, [280], [280], FULL, False, 8, 1),  # K2.5-DFlash's TP-8 shard: 8 heads a program
        (1, 16, 8, 1, 128, 300, [280], [280], FULL, False, 8, 3),  # the same, its walk split
        (2, 5, 8, 2, 32, 100, [0, 77], [0, 77], 20, True, 4, 2),  # two kv heads, T padded, a window
        (2, 16, 8, 2, 16, 64, [50, 64], [60, 64], 16, True, 2, 1),  # half a group a program
    ],
)
def test_head_group_kernel_matches_reference(b, t, nq, nkv, hd, s, lengths, starts, window, causal, head_group, splits):
    """Query heads sharing a key / value head in one program (`head_group`): the reference's output."""
    args = case(np.random.default_rng(s + head_group), b, t, nq, nkv, hd, s, lengths, starts)
    want = drafter_attention_reference(*args, window, causal)
    tiles = DrafterAttentionTiles(block_k=32, head_group=head_group)
    got = drafter_attention_pallas(*args, window, causal, tiles=tiles, splits=splits, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="head_group 16 must divide"):
        drafter_attention_pallas(*args, window, causal, tiles=DrafterAttentionTiles(head_group=16), interpret=True)
    with pytest.raises(ValueError, match="head_group must be a power of two"):
        DrafterAttentionTiles(head_group=3)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize(
    "b, t, nq, nkv, hd, s, lengths, starts, window, causal",
    [
        (2, 16, 4, 2, 32, 300, [280, 0], [280, 0], FULL, False),  # a row with no context: splits > 0 empty
        (3, 5, 2, 1, 16, 100, [100, 33, 7], [100, 40, 7], 50, True),  # ragged rows, a window, fewer steps than splits
    ],
)
def test_split_kernel_matches_reference(b, t, nq, nkv, hd, s, lengths, starts, window, causal, splits):
    """The context walk shared by `splits` programs a head, partials merged: the reference's output."""
    args = case(np.random.default_rng(s + splits), b, t, nq, nkv, hd, s, lengths, starts)
    want = drafter_attention_reference(*args, window, causal)
    got = drafter_attention_pallas(
        *args, window, causal, tiles=DrafterAttentionTiles(block_k=16), splits=splits, interpret=True
    )
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="splits must be an int >= 1"):
        drafter_attention_pallas(*args, window, causal, splits=0, interpret=True)


def test_num_splits():
    from ddtree_jax.pallas.drafter_attention.kernel import SPLIT_MIN_REACH, num_splits

    assert num_splits(128, 1, 6) == 1 and num_splits(SPLIT_MIN_REACH, 1, 64) == 1
    assert num_splits(32768, 1, 8) == 64  # Kimi-K2.5-DFlash's TP-8 shard: ~512 programs
    assert num_splits(32768, 1, 64) == 8
    assert num_splits(2048, 1, 8) == 8  # at least 256 slots a program
    assert num_splits(4096, 1, 8) == 16 and num_splits(4096, 1, 64) == 8
    assert num_splits(32768, 8, 64) == 1


def test_kernel_bf16_and_traced_window():
    """bf16 operands within a few bf16 ulps of the float32 reference; window and causal traced."""
    rng = np.random.default_rng(3)
    args = case(rng, 2, 16, 6, 1, 64, 200, [150, 40], [150, 40], jnp.bfloat16)
    want = drafter_attention_reference(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args], 64, 0)
    fn = jax.jit(lambda w, c: drafter_attention_pallas(*args, w, c, interpret=True))
    got = fn(jnp.int32(64), jnp.bool_(False))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)


def test_dispatch():
    rng = np.random.default_rng(0)
    args = case(rng, 1, 16, 4, 2, 24, 32, [20], [20])
    ref = drafter_attention_reference(*args, 8, True)
    for impl in ("xla", "mosaic", "auto"):  # auto on the CPU: the XLA path
        np.testing.assert_array_equal(drafter_attention(*args, window=8, causal=True, implementation=impl), ref)
    with pytest.raises(ValueError, match="head dim 24"):
        drafter_attention(*args, window=8, causal=True, implementation="pallas")
    with pytest.raises(ValueError, match="head dim 24"):
        drafter_attention_pallas(*args, 8, True, interpret=True)
    with pytest.raises(ValueError, match="got 8"):  # a cache of 8 slots
        drafter_attention_pallas(*case(rng, 1, 4, 2, 1, 16, 8, [5], [5]), 8, True, interpret=True)
    with pytest.raises(ValueError, match="implementation must be one of"):
        drafter_attention(*args, window=8, causal=True, implementation="triton")
    with pytest.raises(ValueError, match="multiple of key / value heads"):
        drafter_attention(*case(rng, 1, 4, 3, 2, 16, 32, [5], [5]), window=8, causal=True)
    with pytest.raises(ValueError, match="block_k must be >= 16"):
        DrafterAttentionTiles(block_k=8)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions, got shape \(16, 4, 24\)"):
        drafter_attention(args[0][0], *args[1:], window=8, causal=True)
    # A block of no tokens: zeros on every path (the kernel's padding of the block failed on it).
    empty = case(rng, 2, 0, 4, 2, 16, 32, [5, 9], [5, 9])
    for impl in ("xla", "pallas", "auto"):
        got = drafter_attention(*empty, window=8, causal=True, implementation=impl)
        assert got.shape == (2, 0, 4, 16), impl


def test_auto_rule():
    """ "auto" takes the kernel on a GPU only for tileable operands and, under a mesh, shards that
    hold their query heads' key / value heads (the split itself: tests/test_sharding.py)."""
    from ddtree_jax.pallas.drafter_attention.api import uses_kernel

    q, kc = jnp.zeros((1, 16, 6, 64)), jnp.zeros((1, 32768, 1, 64))
    assert uses_kernel("auto", q, kc, on_gpu=True)
    assert not uses_kernel("auto", q, kc, on_gpu=False)
    assert not uses_kernel("auto", q, kc, on_gpu=True, heads_fit=False)
    assert not uses_kernel("auto", q[..., :24], kc[..., :24], on_gpu=True)
    assert not uses_kernel("auto", q, kc[:, :8], on_gpu=True)  # < 16 slots
    assert not uses_kernel("xla", q, kc, on_gpu=True)
    assert uses_kernel("pallas", q, kc, on_gpu=False, heads_fit=False)


def test_head_group_rule(monkeypatch):
    """`head_group`: the largest power of two dividing the heads a KV head whose rows fit
    MAX_GROUP_ROWS, where the slots walked (reach x batch x KV heads) reach GROUP_MIN_SLOTS; 1
    with GROUP_HEADS off. Dispatched, the reference's output."""
    from ddtree_jax.pallas.drafter_attention import api

    assert [api.head_group(g, 16) for g in (1, 6, 8, 16)] == [1, 2, 8, 8]
    assert api.head_group(8, 17) == 4  # 32 padded tokens a head
    assert api.head_group(8, 16, api.GROUP_MIN_SLOTS - 1) == 1 and api.head_group(8, 16, api.GROUP_MIN_SLOTS) == 8
    # The named shapes where 8 heads a program measured faster on an H200 (session 38) are
    # exactly those the rule groups.
    grouped = {
        name
        for name, sh in DRAFTER_ATTENTION_SHAPES.items()
        if api.head_group(
            sh.heads // sh.kv_heads, sh.tokens, min(sh.window or sh.cache, sh.cache) * sh.batch * sh.kv_heads
        )
        > 1
    }
    assert grouped == {"kimi_k25_dflash_32k", "kimi_k25_dflash_128k", "kimi_k25_dflash_tp8_128k"}, grouped
    monkeypatch.setattr(api, "GROUP_HEADS", False)
    assert api.head_group(8, 16) == 1
    monkeypatch.setattr(api, "GROUP_HEADS", True)
    launched = []  # the tiles and splits the dispatch hands the kernel

    def spy(*a, tiles, splits, **kw):
        launched.append((tiles.head_group, splits))
        return drafter_attention_pallas(*a, tiles=tiles, splits=splits, **kw)

    monkeypatch.setattr(api, "drafter_attention_pallas", spy)
    args = case(np.random.default_rng(5), 2, 16, 8, 2, 32, 64, [40, 64], [40, 64])
    want = drafter_attention_reference(*args, 24, True)
    # 64 slots x 2 rows x 2 KV heads: too few to group.
    np.testing.assert_allclose(
        drafter_attention(*args, window=24, causal=True, implementation="pallas"), want, atol=2e-6
    )
    monkeypatch.setattr(api, "GROUP_MIN_SLOTS", 0)
    got = drafter_attention(*args, window=24, causal=True, implementation="pallas")
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    # Then 4 heads a KV head, all in one program; the splits counted over the 2 programs a row.
    assert launched == [(1, api.num_splits(64, 2, 8)), (4, api.num_splits(64, 2, 2))], launched


def _drafter(target_cfg, window, causal, seed=0, head_dim=16):
    cfg = dflash.drafter_config_for(target_cfg, num_hidden_layers=2, block_size=4, head_dim=head_dim)
    cfg = dataclasses.replace(cfg.with_sliding_window(window), is_causal=causal)
    return dflash.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


@pytest.mark.parametrize("window, causal", [(6, False), (None, True)])
def test_draft_with_the_kernel(window, causal):
    """`dflash.draft` on the kernel gives the XLA path's logits (float32)."""
    cfg = tiny()
    target = random_target(cfg, seed=4)
    params = _drafter(cfg, window, causal)
    cache = dflash.DrafterCache.init(params.config, 2, 24)
    rng = np.random.default_rng(5)
    feats = jnp.asarray(rng.standard_normal((2, 20, params.config.n_taps * cfg.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
    cache = dflash.extend_context(params, cache, feats, positions, positions < jnp.array([[17], [9]]))
    block = jnp.asarray([[7, 3, 3, 3], [11, 3, 3, 3]], jnp.int32)
    block_pos = cache.lengths[:, None] + jnp.arange(4, dtype=jnp.int32)
    args = (params, cache, target.embed, target.unembed, block, block_pos)
    want = dflash.draft(*args, implementation="xla")
    np.testing.assert_allclose(dflash.draft(*args, implementation="pallas"), want, atol=2e-5, rtol=2e-5)
    # The decode loop's drafter (layers unrolled): the kernel reads each layer of the stacked
    # context cache in place, with the same logits.
    looped = dflash.DFlashDrafter(params=params, block_size=4).for_loop().params
    got = dflash.draft(looped, *args[1:], implementation="pallas")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_a_stacked_cache_is_read_in_place_by_layer(monkeypatch):
    """`drafter_attention(..., layer=l)` over every layer's cache [Ld, B, S, Nkv, hd]: the kernel
    takes the whole stack and the static layer (no slice), and gives that layer's attention; a
    traced layer, or the XLA path, slices it first."""
    from ddtree_jax.pallas.drafter_attention import api

    rng = np.random.default_rng(3)
    q, k, v, lens, pos, kb, vb = case(rng, 2, 16, 4, 2, 16, 48, [30, 48], [30, 48])
    k_all = jnp.stack([k * 0.5, k, -k])
    v_all = jnp.stack([v * 2.0, v, v + 1.0])
    want = drafter_attention_reference(q, k, v, lens, pos, kb, vb, 16, False)
    seen = []
    real = api.drafter_attention_pallas

    def spy(*a, **kw):
        seen.append((a[1].ndim, kw.get("layer")))
        return real(*a, **kw)

    monkeypatch.setattr(api, "drafter_attention_pallas", spy)
    kw = dict(window=16, causal=False)
    got = drafter_attention(q, k_all, v_all, lens, pos, kb, vb, implementation="pallas", layer=1, **kw)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    assert seen == [(5, 1)]
    traced = jax.jit(
        lambda li: drafter_attention(q, k_all, v_all, lens, pos, kb, vb, implementation="pallas", layer=li, **kw)
    )
    np.testing.assert_allclose(traced(jnp.int32(1)), want, atol=2e-6, rtol=2e-6)
    assert seen[1:] == [(4, None)]
    np.testing.assert_allclose(
        drafter_attention(q, k_all, v_all, lens, pos, kb, vb, implementation="xla", layer=1, **kw), want, atol=2e-6
    )


@pytest.mark.parametrize("head_dim", [16, 32])
def test_greedy_ddtree_equals_ar_with_the_kernel(head_dim):
    """generate(implementation="pallas"): the DFlash drafter on the kernel (at head dim 32 its
    QKV projection too, `pallas.drafter_layer`), the routed experts on theirs; greedy DDTree
    gives AR's tokens, and the drafter's kernels the XLA path's proposals."""
    cfg = tiny()
    target = random_target(cfg, seed=2)
    drafter = _drafter(cfg, 8, False, seed=1, head_dim=head_dim)
    prompts = [[5, 17, 33, 2, 9, 40, 41], [9]]
    kw = dict(max_new_tokens=8)
    ar = generate(target, None, prompts, **kw).to_lists()
    runs = {
        impl: generate(target, drafter, prompts, method="ddtree", tree_budget=5, implementation=impl, **kw)
        for impl in ("xla", "pallas")
    }
    for r in runs.values():
        assert r.to_lists() == ar
    np.testing.assert_array_equal(runs["pallas"].accept_lengths, runs["xla"].accept_lengths)


def test_bench_smoke(capsys):
    from ddtree_jax.pallas.drafter_attention import bench

    bench.main(["--smoke", "--reps", "1", "--shapes", "shipped_ctx512", "kimi_k25_dflash_tp8_32k"])
    out = capsys.readouterr().out
    for name in ("shipped_ctx512", "kimi_k25_dflash_tp8_32k"):
        for impl in ("xla", "pallas"):
            assert f"| {name} | {impl} |" in out


@pytest.mark.parametrize("head_group, splits", [(1, 1), (2, 3)])
def test_the_kernel_on_a_stacked_cache_matches_each_layers_reference(head_group, splits):
    """`drafter_attention_pallas(..., layer=l)`: grouped heads and split walks read layer l of
    [Ld, B, S, Nkv, hd] and nothing of the others."""
    rng = np.random.default_rng(11)
    q, k, v, lens, pos, kb, vb = case(rng, 2, 16, 4, 2, 16, 64, [50, 64], [50, 70])
    k_all = jnp.stack([k + 3.0, k, k - 1.0])
    v_all = jnp.stack([-v, v * 3.0, v])
    tiles = DrafterAttentionTiles(head_group=head_group)
    for layer, (kl, vl) in enumerate(zip(k_all, v_all, strict=True)):
        want = drafter_attention_reference(q, kl, vl, lens, pos, kb, vb, 24, True)
        got = drafter_attention_pallas(
            q, k_all, v_all, lens, pos, kb, vb, 24, True, tiles=tiles, splits=splits, interpret=True, layer=layer
        )
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
