"""The Mosaic GPU MLA attention kernel (interpret mode on the CPU) against the pure-jnp reference.

The Triton-lowered kernel was removed once the Mosaic one beat it at every measured shape
(docs/benchmarks.md); implementation="pallas" runs attention on the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.mla_attention import mla_attention
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
from ddtree_jax.tree import build_ddtree


def case(rng, b, t, n, r, p, s, lens, mask, dtype=jnp.float32):
    def f(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return (
        f(b, t, n, r),
        f(b, t, n, p),
        f(b, s, r),
        f(b, s, p),
        jnp.asarray(lens, jnp.int32),
        f(b, t, r),
        f(b, t, p),
        mask,
    )


def test_pallas_means_the_xla_path_for_attention():
    """implementation="pallas" (the Triton-lowered kernels: only the routed experts' is left)
    gives attention on the XLA path, and generate with it the XLA path's tokens."""
    from tests.conftest import random_target, tiny

    rng = np.random.default_rng(1)
    mask = jnp.ones((1, 2, 2), bool)
    args = case(rng, 1, 2, 2, 8, 4, 6, [3], mask)
    np.testing.assert_array_equal(
        mla_attention(*args, scale=0.5, implementation="pallas"), mla_attention(*args, scale=0.5)
    )
    _greedy_ar_and_ddtree_match_xla(random_target(tiny(), seed=2), "pallas", max_new_tokens=6)


def test_ranks_are_named_and_no_queries_give_zeros():
    """A q_lat of the wrong rank is named; no new tokens give an empty result on every path
    ("exact" failed on them: a max over no keys)."""
    rng = np.random.default_rng(2)
    args = case(rng, 2, 0, 2, 8, 4, 6, [3, 6], jnp.ones((2, 0, 0), bool))
    positions = jnp.zeros((2, 0), jnp.int32)
    for impl in ("xla", "exact", "pallas", "auto"):
        got = mla_attention(*args, scale=0.5, implementation=impl, positions=positions)
        assert got.shape == (2, 0, 2, 8) and got.dtype == jnp.float32, impl
    with pytest.raises(ValueError, match=r"q_lat must have 4 dimensions, got shape \(0, 2, 8\)"):
        mla_attention(args[0][0], *args[1:], scale=0.5)


def test_joined_keys_are_the_split_pass(monkeypatch):
    """The XLA path over the cache and the new keys joined (`JOIN_MAX_BYTES`) gives the
    reference's attention: a built tree's mask, empty and full caches, a bf16 cache, jitted;
    one new token and caches over the bound keep the split pass."""
    from ddtree_jax.pallas.mla_attention import reference
    from tests.conftest import random_target, tiny

    rng = np.random.default_rng(7)
    tree = build_ddtree(jax.random.normal(jax.random.PRNGKey(3), (2, 15, 40)), jnp.zeros((2,), jnp.int32), 12)
    monkeypatch.setattr(reference, "JOIN_MAX_BYTES", 1 << 20)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = case(rng, 2, 13, 3, 16, 8, 24, [0, 24], tree.visibility, dtype)
        want = mla_attention_reference(*args, 0.3)
        got = jax.jit(lambda *a: mla_attention(*a, scale=0.3))(*args)
        np.testing.assert_allclose(got, want, atol=1e-5 if dtype == jnp.float32 else 2e-2, rtol=1e-5)
    # float32 new keys beside a bf16 cache keep their bits, as in the split pass.
    mixed = list(case(rng, 2, 13, 3, 16, 8, 24, [0, 24], tree.visibility, jnp.bfloat16))
    mixed[5], mixed[6] = mixed[5].astype(jnp.float32) * 1.001, mixed[6].astype(jnp.float32) * 1.001
    np.testing.assert_allclose(
        mla_attention(*mixed, scale=0.3), mla_attention_reference(*mixed, 0.3), atol=1e-5, rtol=1e-5
    )
    one = case(rng, 1, 1, 2, 8, 4, 6, [3], jnp.ones((1, 1, 1), bool))
    np.testing.assert_array_equal(mla_attention(*one, scale=0.5), mla_attention_reference(*one, 0.5))
    monkeypatch.setattr(reference, "JOIN_MAX_BYTES", 1)
    np.testing.assert_array_equal(mla_attention(*args, scale=0.3), mla_attention_reference(*args, 0.3))
    # The model's "fast" forward of a tree's tokens takes it (the "exact" one has its own pass).
    from ddtree_jax import model

    params = random_target(tiny(), seed=3)
    cache = model.KVCache.init(params.config, 1, 16)
    _, cache = model.append(params, cache, jnp.asarray([[5, 17, 33, 2, 9]], jnp.int32), jnp.asarray([5], jnp.int32))
    tokens, positions = jnp.asarray([[250, 1, 7, 7]], jnp.int32), jnp.arange(5, 9, dtype=jnp.int32)[None]
    causal = jnp.tril(jnp.ones((1, 4, 4), bool))
    runs = []
    for limit in (0, 1 << 20):
        monkeypatch.setattr(reference, "JOIN_MAX_BYTES", limit)
        runs.append(model.forward(params, tokens, positions, cache, causal, numerics="fast").hidden)
    np.testing.assert_allclose(runs[1], runs[0], atol=1e-5, rtol=1e-5)


def _greedy_ar_and_ddtree_match_xla(params, implementation, max_new_tokens):
    """Greedy AR and DDTree (oracle drafter) with `implementation` give the XLA path's tokens."""
    from ddtree_jax.drafters import OracleDrafter
    from ddtree_jax.generate import generate

    prompts = [[5, 17, 33, 2], [9]]
    xla = generate(params, prompts, max_new_tokens=max_new_tokens).to_lists()
    kw = dict(max_new_tokens=max_new_tokens, implementation=implementation)
    assert generate(params, prompts, **kw).to_lists() == xla
    tree = generate(params, OracleDrafter(block_size=3), prompts, method="ddtree", tree_budget=4, **kw)
    assert tree.to_lists() == xla


def test_bench_smoke(capsys):
    from ddtree_jax.pallas.mla_attention import bench

    bench.main(["--smoke", "--reps", "1", "--shapes", "kimi_k2_tp8_tree16"])
    out = capsys.readouterr().out
    assert "| kimi_k2_tp8_tree16 | xla |" in out and "| kimi_k2_tp8_tree16 | mosaic | skipped" in out
    for bad in ("64,2", "64,2,0,1,5", "64,2,x", "64,2,0,-1"):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", "--mosaic-tiles", bad])
    assert f"--mosaic-tiles '{bad}'" in capsys.readouterr().err


# ---- the Mosaic GPU kernel, in Mosaic GPU's interpret mode ----------------------------------


def _mosaic(*args, scale, **tiles):
    from ddtree_jax.pallas.mla_attention.mosaic import MosaicMLATiles, mla_attention_mosaic

    return mla_attention_mosaic(*args, scale=scale, tiles=MosaicMLATiles(**tiles), interpret=mosaic_interpret())


@pytest.mark.parametrize(
    ("b", "t", "n", "s", "lens", "splits", "dtype", "new_in_kernel"),
    [
        # ragged: a partial last tile, an empty cache, empty splits; bf16 operands
        (2, 3, 5, 256, [100, 0], 3, jnp.bfloat16, 0),
        (1, 1, 128, 128, [128], None, jnp.float32, 0),  # AR decode at 128 heads: two query tiles, the full cache
        (3, 2, 1, 192, [1, 64, 191], 2, jnp.float32, 0),  # one head; lengths at and next to tile edges
        # one split of 6 blocks: the 2-slot ring refilled (5 and 3 steps for the two lengths)
        (2, 2, 3, 384, [300, 130], 1, jnp.float32, 0),
        # The new tokens as the kernel's last split: the first case again (a row whose only keys
        # are new ones), AR at 128 heads, and 70 tokens x 2 heads: 3 query tiles whose rows
        # straddle tokens, 2 mask words a tile, the new split's 2 tiles.
        (2, 3, 5, 256, [100, 0], 3, jnp.bfloat16, 64),
        (1, 1, 128, 128, [128], None, jnp.float32, 1),
        (1, 70, 2, 64, [40], None, jnp.float32, 70),
    ],
)
def test_mosaic_matches_reference(b, t, n, s, lens, splits, dtype, new_in_kernel):
    rng = np.random.default_rng(b * 10 + t)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
    args = case(rng, b, t, n, 128, 64, s, lens, mask, dtype)
    want = mla_attention_reference(*args, 0.05)
    got = _mosaic(*args, scale=0.05, num_splits=splits, new_in_kernel=new_in_kernel)
    # bf16: partial outputs stored in bf16, one rounding of values of size ~1
    tol = dict(atol=3e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got, want, **tol)


@pytest.mark.parametrize("new_in_kernel", [0, 64])
def test_mosaic_reads_a_layer_of_the_stacked_cache_in_place(monkeypatch, new_in_kernel):
    """`layer=l` over every layer's cache [L, B, S, R]: the kernel takes the whole stack and
    the (traced) layer, and gives that layer's attention; the XLA path slices it first."""
    from ddtree_jax.pallas.mla_attention import mosaic

    rng = np.random.default_rng(5)
    mask = jnp.asarray(np.tril(np.ones((3, 3), bool))[None].repeat(2, 0))
    q_lat, q_pe, ckv, kpe, lens, nckv, nkpe, mask = case(rng, 2, 3, 2, 128, 64, 128, [70, 128], mask)
    ckv_all, kpe_all = jnp.stack([ckv - 1.0, ckv * 0.5, ckv]), jnp.stack([-kpe, kpe * 2.0, kpe])
    want = [
        mla_attention_reference(q_lat, q_pe, c, k, lens, nckv, nkpe, mask, 0.05)
        for c, k in zip(ckv_all, kpe_all, strict=True)
    ]
    tiles = mosaic.MosaicMLATiles(new_in_kernel=new_in_kernel)
    stacked = (q_lat, q_pe, ckv_all, kpe_all, lens, nckv, nkpe, mask)
    for layer in range(3):
        got = mosaic.mla_attention_mosaic(
            *stacked, scale=0.05, tiles=tiles, interpret=mosaic_interpret(), layer=jnp.int32(layer)
        )
        np.testing.assert_allclose(got, want[layer], atol=2e-5, rtol=1e-5)
    # Through the dispatch (no mesh): the stack and the layer reach the kernel, no slice.
    from ddtree_jax.pallas.mla_attention import api

    seen = []
    real = api.mla_attention_mosaic

    def spy(q_lat, q_pe, cache_ckv, *rest, **kw):
        seen.append((cache_ckv.ndim, kw.get("layer") is not None))
        return real(q_lat, q_pe, cache_ckv, *rest, **kw)

    monkeypatch.setattr(api, "mla_attention_mosaic", spy)
    got = mla_attention(*stacked, scale=0.05, implementation="mosaic", layer=jnp.int32(2))
    np.testing.assert_allclose(got, want[2], atol=2e-5, rtol=1e-5)
    assert seen == [(4, True)]
    got = mla_attention(*stacked, scale=0.05, implementation="xla", layer=jnp.int32(1))
    np.testing.assert_allclose(got, want[1], atol=2e-5, rtol=1e-5)


def test_mosaic_ar_with_its_key_masked_and_lengths_outside_the_cache():
    """One new token (XLA's one-key partial): visible, masked out, and over cache lengths past
    S and below 0, which the kernel clamps to [0, S] itself."""
    rng = np.random.default_rng(11)
    mask = jnp.asarray([True, False, True]).reshape(3, 1, 1)
    args = case(rng, 3, 1, 3, 128, 64, 192, [300, 30, -5], mask)
    got = _mosaic(*args, scale=0.05, num_splits=2)
    np.testing.assert_allclose(got, mla_attention_reference(*args, 0.05), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("new_in_kernel", [0, 129])
def test_mosaic_with_a_real_129_node_tree(new_in_kernel):
    """129 tree tokens (query rows past two tiles) under the mask of a built tree; in the
    kernel, the tree's keys are 3 tiles (the 2-slot ring refilled) of 2 mask words each."""
    rng = np.random.default_rng(5)
    logits = jax.random.normal(jax.random.PRNGKey(1), (1, 15, 40))
    tree = build_ddtree(logits, jnp.zeros((1,), jnp.int32), 128)
    t = tree.tokens.shape[1]
    assert t == 129
    args = case(rng, 1, t, 1, 128, 64, 64, [37], tree.visibility)
    want = mla_attention_reference(*args, 0.05)
    got = _mosaic(*args, scale=0.05, stages=1 if new_in_kernel == 0 else 2, new_in_kernel=new_in_kernel)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("new_in_kernel", [0, 12])
def test_mosaic_rows_whose_keys_all_lie_in_later_blocks(new_in_kernel):
    """A diagonal mask: new token t sees only itself; with an empty cache row, its only key is
    the new one, after every cache tile."""
    rng = np.random.default_rng(3)
    t = 12
    args = case(rng, 2, t, 2, 128, 64, 64, [0, 9], jnp.eye(t, dtype=bool)[None].repeat(2, 0))
    got = _mosaic(*args, scale=0.05, new_in_kernel=new_in_kernel)
    np.testing.assert_allclose(got, mla_attention_reference(*args, 0.05), atol=2e-5, rtol=1e-5)


def test_mask_words_are_the_masks_bits():
    """Row t * N + n's word w holds token t's visibility of keys 32 w .. 32 w + 31, after the
    zero words every cache split reads; padded rows see nothing."""
    from ddtree_jax.pallas.mla_attention.mosaic import _mask_words

    rng = np.random.default_rng(7)
    b, t, n, tp, qp, lead = 2, 40, 3, 64, 128, 2
    mask = rng.uniform(size=(b, t, t)) < 0.5
    words = np.asarray(_mask_words(jnp.asarray(mask), n, tp, qp, lead)).view(np.uint32)
    assert words.shape == (b, lead + tp // 32, qp)
    assert not words[:, :lead].any() and not words[:, :, t * n :].any()
    bits = (words[:, lead:, :, None] >> np.arange(32, dtype=np.uint32)) & 1  # [B, W, Qp, 32]
    seen = bits.transpose(0, 2, 1, 3).reshape(b, qp, tp)[:, : t * n, :t].astype(bool)
    np.testing.assert_array_equal(seen, np.repeat(mask, n, axis=1))


def test_new_in_kernel_in_interpret_mode_names_the_flag_it_needs(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    rng = np.random.default_rng(0)
    args = case(rng, 1, 1, 2, 128, 64, 64, [3], jnp.ones((1, 1, 1), bool))
    with pytest.raises(ValueError, match="xla_cpu_enable_concurrency_optimized_scheduler=false"):
        _mosaic(*args, scale=0.1, new_in_kernel=1)


def test_mosaic_shapes_and_tiles_are_checked():
    from ddtree_jax.pallas.mla_attention.mosaic import MosaicMLATiles

    rng = np.random.default_rng(0)
    mask = jnp.ones((1, 1, 1), bool)
    with pytest.raises(ValueError, match="R=64 to be a multiple of 128"):
        _mosaic(*case(rng, 1, 1, 2, 64, 64, 64, [3], mask), scale=0.1)
    with pytest.raises(ValueError, match="S=96 to be a multiple of 64"):
        _mosaic(*case(rng, 1, 1, 2, 128, 64, 96, [3], mask), scale=0.1)
    with pytest.raises(ValueError, match="block_k must be a positive multiple of 64, got 32"):
        MosaicMLATiles(block_k=32)
    with pytest.raises(ValueError, match="stages must be a positive int"):
        MosaicMLATiles(stages=0)
    with pytest.raises(ValueError, match="num_splits"):
        MosaicMLATiles(num_splits=0)
    with pytest.raises(ValueError, match="new_in_kernel must be an int >= 0, got -1"):
        MosaicMLATiles(new_in_kernel=-1)


def test_num_splits_ends_the_waves_soonest():
    """Splits chosen against one program per SM: never a small second wave (measured on an
    H200: 17 query tiles in 8 splits = 136 programs took 0.32 ms, in 15 splits 0.20 ms;
    docs/results/s27/mla_splits_h200.json)."""
    from ddtree_jax.pallas.mla_attention.mosaic import num_splits

    assert num_splits(1, 1, 512, sms=132) == 128  # AR at 32K: 4 blocks a split, one wave
    assert num_splits(8, 1, 512, sms=132) == 16  # batch 8: 128 programs, not 17 x 8 = 136
    assert num_splits(1, 65, 512, sms=132) == 2  # a 65-token tree: 130 programs, not 195
    assert num_splits(1, 17, 512, sms=132) == 15  # two full waves of 35 blocks, not 2 x 64
    assert num_splits(1, 129, 512, sms=132) == 1
    assert num_splits(1, 600, 512, sms=132) == 1  # past two waves: no split
    assert num_splits(1, 1, 3, sms=132) == 3  # never more splits than blocks
    for programs, blocks in ((1, 1), (3, 64), (40, 2048), (132, 512), (7, 100)):
        ns = num_splits(1, programs, blocks, sms=132)
        assert 1 <= ns <= blocks
    # The new tokens' split shares the waves: at batch 8, 16 cache splits would be 136 programs;
    # 32 (264, two full waves of 16 blocks) beat 15 (one wave of 35). AR at batch 1 keeps 128
    # (129 programs), a 17-token tree takes 14 (17 x 15 = 255).
    assert num_splits(8, 1, 512, sms=132, new_blocks=1) == 32
    assert num_splits(1, 1, 512, sms=132, new_blocks=1) == 128
    assert num_splits(1, 17, 512, sms=132, new_blocks=1) == 14


def test_the_new_split_where_it_pays(monkeypatch):
    """The model's calls put the new tokens in the kernel only where the H200 measured a gain:
    more than one token and no extra wave (TP-8 trees yes; AR and 65 tokens x 64 heads no)."""
    from ddtree_jax.pallas.mla_attention import api
    from ddtree_jax.pallas.mla_attention.mosaic import MosaicMLATiles, new_split_pays

    on = MosaicMLATiles(new_in_kernel=256)
    assert new_split_pays(1, 17, 8, 32768, on, sms=132)  # 3 query tiles: the same single wave
    assert new_split_pays(1, 65, 8, 32768, on, sms=132)  # 9 tiles: +3 modeled blocks
    assert not new_split_pays(1, 65, 64, 32768, on, sms=132)  # 65 tiles: fewer cache splits
    assert not new_split_pays(1, 1, 64, 32768, on, sms=132)  # AR: XLA's one row is cheaper
    assert not new_split_pays(1, 257, 8, 32768, on, sms=132)  # past new_in_kernel
    assert not new_split_pays(1, 17, 8, 32768, MosaicMLATiles(), sms=132)

    seen = []
    monkeypatch.setattr(api, "mla_attention_mosaic", lambda *a, tiles, **k: seen.append(tiles.new_in_kernel))
    monkeypatch.setattr(api, "MOSAIC_NEW_IN_KERNEL", 256)
    rng = np.random.default_rng(0)
    for t in (1, 3):
        args = case(rng, 1, t, 2, 128, 64, 64, [5], jnp.ones((1, t, t), bool), jnp.float32)
        api.mla_attention(*args, scale=0.5, implementation="mosaic")
    # Interpreted without XLA's CPU flag the new split would deadlock: XLA's partial instead.
    monkeypatch.setenv("XLA_FLAGS", "")
    api.mla_attention(*args, scale=0.5, implementation="mosaic")
    assert seen == [0, 256, 0]


@pytest.mark.clears_jax_caches
def test_generate_with_the_mosaic_kernels(monkeypatch, request):
    """Greedy AR and DDTree with both Mosaic kernels (attention and experts) in float32
    interpret mode give the XLA path's tokens, with the model's default new-token policy: the
    prefill (4 tokens) and the trees (5 nodes) attend their own keys in the kernel, the AR
    steps (one key) take XLA's partial (`new_split_pays`)."""
    from ddtree_jax.pallas.mla_attention import api
    from tests.conftest import random_target, tiny

    kernel, seen = api.mla_attention_mosaic, set()

    def recorded(*args, tiles, **kw):
        seen.add((args[0].shape[1], tiles.new_in_kernel))
        return kernel(*args, tiles=tiles, **kw)

    monkeypatch.setattr(api, "mla_attention_mosaic", recorded)
    # Programs traced before would be found again by their arguments alone, unrecorded.
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)

    # Widths the kernels tile: R % 128, P % 64 (attention), H and I % 128 (experts).
    cfg = tiny(num_hidden_layers=2, hidden_size=128, moe_intermediate_size=128, kv_lora_rank=128, qk_rope_head_dim=64)
    _greedy_ar_and_ddtree_match_xla(random_target(cfg, seed=4), "mosaic", max_new_tokens=5)
    new = api.MOSAIC_NEW_IN_KERNEL
    assert {(4, new), (1, 0)} <= seen and all(n == (new if t > 1 else 0) for t, n in seen), seen


def test_auto_takes_the_xla_path_off_hopper_and_for_float32():
    from ddtree_jax import numerics
    from ddtree_jax.pallas import on_hopper

    assert not on_hopper()  # the CPU backend
    rng = np.random.default_rng(2)
    args = case(rng, 1, 2, 2, 128, 64, 64, [5], jnp.ones((1, 2, 2), bool), jnp.bfloat16)
    np.testing.assert_array_equal(
        mla_attention(*args, scale=0.5, implementation="auto"), mla_attention(*args, scale=0.5, implementation="xla")
    )
    assert numerics.resolve(None, jnp.float32, "auto") == "exact"
    assert numerics.resolve(None, jnp.bfloat16, "auto") == "fast"
    assert numerics.resolve(None, jnp.float32, "mosaic") == "fast"
    with pytest.raises(ValueError, match="not implementation='mosaic'"):
        numerics.resolve("exact", jnp.float32, "mosaic")
    with pytest.raises(ValueError, match="implementation must be one of"):
        mla_attention(*args, scale=0.5, implementation="cuda")


# ---- the partials' merge as one Triton-lowered kernel (merge.MERGE_KERNEL) ------------------


@pytest.mark.parametrize(
    ("with_new", "k"),
    [("none", 8), ("none", 5), ("none", 200), ("rows", 8), ("rows", 3), ("shared", 8), ("key", 8), ("key", 6)],
)
def test_merge_kernel_matches_the_xla_merge(monkeypatch, with_new, k):
    """merge_partials against partials.merge (the XLA merge) for K a power of two or not
    (MERGE_EXTENDED): empty partials (-inf), an all-empty row, the new tokens' partial per row or
    one shared by a token's heads (AR), or the one AR key scored in the kernel (visible in one
    row of the batch, masked in the other)."""
    from ddtree_jax.pallas.mla_attention import merge
    from ddtree_jax.pallas.mla_attention.mosaic import _new_partial
    from ddtree_jax.pallas.partials import merge as xla_merge

    rng = np.random.default_rng(7)
    b, qp, r, p = 2, 16, 256, 64
    t, n = (1, 12) if with_new in ("key", "shared") else (3, 4)
    q = t * n
    o = jnp.asarray(rng.normal(size=(b, k, qp, r)), jnp.bfloat16)
    lse = jnp.asarray(rng.normal(size=(b, k, qp)) * 3, jnp.float32).at[0, 1].set(-jnp.inf).at[1, :, 2].set(-jnp.inf)
    new = key = want_new = None
    shared = 1
    if with_new in ("rows", "shared"):
        shared = q if with_new == "shared" else 1
        new_o = jnp.asarray(rng.normal(size=(b, q // shared, r)), jnp.float32)
        new = (new_o, jnp.asarray(rng.normal(size=(b, q)), jnp.float32))
        want_new = (jnp.broadcast_to(new_o, (b, q, r)).reshape(b, t, n, r), new[1].reshape(b, t, n))
    elif with_new == "key":
        q_lat, q_pe = (jnp.asarray(rng.normal(size=(b, qp, d)), jnp.bfloat16) for d in (r, p))
        ckv, kpe = (jnp.asarray(rng.normal(size=(b, 1, d)), jnp.bfloat16) for d in (r, p))
        visible = jnp.asarray([True, False])
        key = (q_lat, q_pe, ckv, kpe, visible)
        mask = jnp.broadcast_to(visible[:, None, None], (b, 1, 1))
        want_new = _new_partial(q_lat[:, None, :q], q_pe[:, None, :q], ckv, kpe, mask, 0.05)
    want = xla_merge(o[:, :, :q].reshape(b, k, t, n, r), lse[:, :, :q].reshape(b, k, t, n), want_new)

    def merged():
        kw = dict(rows=q, shared=shared, scale=0.05, interpret=True)
        return merge.merge_partials(o, lse, new, key, **kw).reshape(b, t, n, r)

    if k & (k - 1):
        monkeypatch.setattr(merge, "MERGE_EXTENDED", False)
        with pytest.raises(ValueError, match=f"K={k}"):
            merged()
        monkeypatch.setattr(merge, "MERGE_EXTENDED", True)
    np.testing.assert_allclose(merged(), want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(merge, "MERGE_EXTENDED", True)
    if key is not None:  # whole rows are Triton blocks: R and P powers of two
        odd = (q_lat, q_pe[..., :48], ckv, kpe[..., :48], visible)
        with pytest.raises(ValueError, match="R=256, P=48"):
            merge.merge_partials(o, lse, None, odd, rows=q, interpret=True)
    with pytest.raises(ValueError, match="K=257"):
        merge.merge_partials(jnp.zeros((1, 257, 16, r)), jnp.zeros((1, 257, 16)), rows=q, interpret=True)


@pytest.mark.clears_jax_caches
@pytest.mark.parametrize("extended", [False, True])
@pytest.mark.parametrize(("t", "new_in_kernel"), [(1, 0), (3, 0), (3, 64)])
def test_mosaic_with_the_merge_kernel(monkeypatch, t, new_in_kernel, extended):
    """The Mosaic kernel's partials merged by the Triton kernel: the reference's output, with the
    new tokens' partial from XLA, the kernel's own, or (MERGE_EXTENDED) at AR the key scored in
    the merge. K = 4 takes the merge kernel; K = 5 only with MERGE_EXTENDED, else the XLA merge."""
    from ddtree_jax.pallas.mla_attention import merge

    monkeypatch.setattr(merge, "MERGE_KERNEL", True)
    monkeypatch.setattr(merge, "MERGE_EXTENDED", extended)
    jax.clear_caches()  # the flags are read when traced
    calls = []
    kernel = merge.merge_partials

    def spy(o, *a, **kw):
        calls.append((o.shape[1], a))
        return kernel(o, *a, **kw)

    monkeypatch.setattr(merge, "merge_partials", spy)
    rng = np.random.default_rng(21 + t)
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(2, 0))
    args = case(rng, 2, t, 3, 128, 64, 256, [200, 0], mask)
    for k in (4, 5):  # partials, with the new tokens' split where the kernel attends them
        calls.clear()
        got = _mosaic(*args, scale=0.05, num_splits=k - (new_in_kernel > 0), new_in_kernel=new_in_kernel)
        np.testing.assert_allclose(got, mla_attention_reference(*args, 0.05), atol=2e-5, rtol=1e-5)
        assert [c[0] for c in calls] == ([k] if k == 4 or extended else []), calls
        if calls and t == 1:  # at AR: the key scored in the merge (extended) or XLA's partial
            _, new, key = calls[0][1]  # (lse, new, key)
            assert (key is not None, new is None) == (extended, extended)
