"""numerics="exact": a token's logits are a function of its own prefix alone.

Bitwise (not allclose) comparisons: across cache capacities, across the number and
layout of the other new tokens in a forward (AR step, DFlash chain, DDTree tree,
prefill), alone vs in a padded batch. Near-tie routing configs (duplicated router
columns, a 1e-6 perturbation) turn any 1-ulp difference into different experts and
soon into different tokens, so the generate-level checks fail if a reduction's order
depends on array sizes again; each also checks that numerics="fast" does diverge on
the same inputs, so the check itself has teeth.
"""

import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import decode, model, numerics, tree
from ddtree_jax.cache import KVCache
from ddtree_jax.drafters import OracleDrafter, dflash
from ddtree_jax.evaluation import first_difference
from ddtree_jax.generate import generate
from ddtree_jax.pallas.mla_attention import mla_attention
from tests.conftest import random_target, tiny


def test_resolve_defaults_and_errors():
    assert numerics.resolve(None, jnp.float32) == "exact"
    assert numerics.resolve(None, jnp.bfloat16) == "fast"
    assert numerics.resolve(None, jnp.float32, "pallas") == "fast"
    assert numerics.resolve("fast", jnp.float32) == "fast"
    with pytest.raises(ValueError, match="unknown numerics 'exactly'"):
        numerics.resolve("exactly", jnp.float32)
    with pytest.raises(ValueError, match="XLA path only"):
        numerics.resolve("exact", jnp.float32, "pallas")


def _rowwise(x, w1, w2, g):
    """Dots, a row reduction, exp and a softmax: each rounds by shape under XLA:CPU."""
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g
    h = jax.nn.silu(h @ w1) * jnp.exp(-jnp.abs(h @ w1))
    return jax.nn.softmax(h @ w2, axis=-1)


def test_tile_rows_computes_each_row_the_same_whatever_the_other_rows():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((70, 96)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((96, 200)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((200, 96)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal(96), jnp.float32)
    tiled = jax.jit(lambda x: numerics.tile_rows(lambda t: _rowwise(t, w1, w2, g), x))
    plain = jax.jit(lambda x: _rowwise(x, w1, w2, g))
    alone = np.asarray(tiled(x[5:6]))[0]
    perm = np.asarray(rng.permutation(70))
    where = int(np.argmax(perm == 5))
    for rows in (x[:9], x[:33], x, x[perm]):
        i = 5 if rows.shape[0] < 70 or rows is x else where
        np.testing.assert_array_equal(np.asarray(tiled(rows))[i], alone)
    # The reason for the tiles: untiled, row 5's bits change with the number of rows.
    assert any((np.asarray(plain(x[:m]))[5] != np.asarray(plain(x[5:6]))[0]).any() for m in (9, 33, 70))


# ----------------------------------------------------------------------------------
# Attention


def _attention_inputs(rng, b, t, s, n=4, r=32, p=8):
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return dict(q_lat=f(b, t, n, r), q_pe=f(b, t, n, p), new_ckv=f(b, t, r), new_kpe=f(b, t, p)), f(b, s, r), f(b, s, p)


def _exact(inp, ckv, kpe, lengths, mask, positions, span=None):
    return mla_attention(
        inp["q_lat"],
        inp["q_pe"],
        ckv,
        kpe,
        lengths,
        inp["new_ckv"],
        inp["new_kpe"],
        mask,
        scale=0.3,
        implementation="exact",
        positions=positions,
        span=span,
    )


@pytest.mark.parametrize("int4", [False, True], ids=["dense", "int4"])
def test_moe_pairs_in_tiles_match_the_reference_and_not_the_other_pairs(int4):
    """Each pair's output in "exact" mode: the reference's routed experts once weighted and summed,
    zeros for ids outside [0, E), and bitwise the same whatever the other tokens and their routing
    (an expert with no tokens, all pairs on one expert, a run longer than a tile)."""
    from ddtree_jax.pallas.moe.reference import moe_experts_reference, moe_pairs_in_tiles, weighted_sum
    from ddtree_jax.quant import Int4

    rng = np.random.default_rng(1)
    e, h, i, k = 6, 64, 32, 2
    x = jnp.asarray(rng.standard_normal((21, h)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((e, h, i)) * 0.2, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((e, i, h)) * 0.2, jnp.float32)
    if int4:
        gate, up, down = (Int4(32).quantize(a) for a in (gate, up, down))
    w = jnp.asarray(rng.uniform(0.1, 1.0, (21, k)), jnp.float32)
    idx = jnp.asarray(rng.choice(e - 1, (21, k)), jnp.int32)  # expert e - 1 gets no token
    pairs = jax.jit(functools.partial(moe_pairs_in_tiles, tile=4))
    ys = pairs(x, idx, gate, up, down)
    want = moe_experts_reference(x, idx, w, gate, up, down)
    np.testing.assert_allclose(weighted_sum(w, ys), want, rtol=1e-5, atol=1e-5)
    alone = np.asarray(pairs(x[3:4], idx[3:4], gate, up, down))
    for rows, ids in ((x, idx), (x[:9], jnp.zeros_like(idx[:9]).at[3].set(idx[3])), (x[:4], idx[:4])):
        np.testing.assert_array_equal(np.asarray(pairs(rows, ids, gate, up, down))[3], alone[0])
    dropped = idx.at[0, 1].set(e).at[1, 0].set(-1)
    got = np.asarray(pairs(x, dropped, gate, up, down))
    assert not got[0, 1].any() and not got[1, 0].any()
    np.testing.assert_array_equal(got[2:], np.asarray(ys)[2:])
    # Every layer's stacks and a layer index (the scanned layers read them in place): the same bits.
    stack = lambda a: jax.tree.map(lambda v: jnp.stack([v[::-1], v]), a)  # noqa: E731  layer 1 is `a`
    on_stack = jax.jit(functools.partial(moe_pairs_in_tiles, tile=4))(
        x, idx, stack(gate), stack(up), stack(down), layer=jnp.int32(1)
    )
    np.testing.assert_array_equal(np.asarray(on_stack), np.asarray(ys))


def test_exact_attention_matches_the_reference_and_not_the_capacity():
    """Prefill-like causal new tokens after caches of different lengths (block edges included)."""
    rng = np.random.default_rng(1)
    b, t, s = 3, 10, 200
    inp, ckv, kpe = _attention_inputs(rng, b, t, s)
    lengths = jnp.asarray([0, 61, 130], jnp.int32)
    mask = model.causal_mask(jnp.full((b,), t), t)
    positions = lengths[:, None] + jnp.arange(t)[None]
    out = _exact(inp, ckv, kpe, lengths, mask, positions)
    ref = mla_attention(inp["q_lat"], inp["q_pe"], ckv, kpe, lengths, inp["new_ckv"], inp["new_kpe"], mask, scale=0.3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # Capacity 150 with garbage (NaN) past each row's length: the same bits.
    junk = jnp.arange(150)[None, :, None] >= lengths[:, None, None]
    small = _exact(
        inp, jnp.where(junk, jnp.nan, ckv[:, :150]), jnp.where(junk, jnp.nan, kpe[:, :150]), lengths, mask, positions
    )
    np.testing.assert_array_equal(np.asarray(small), np.asarray(out))


def test_exact_attention_depends_on_the_visible_keys_alone():
    """A tree node's output equals the same query run as an AR step over a cache holding its ancestors."""
    rng = np.random.default_rng(2)
    t0 = small_tree_mask()
    inp, ckv, kpe = _attention_inputs(rng, 1, 6, 256)
    length = jnp.asarray([63], jnp.int32)  # the tree straddles the 64-position block edge
    depths = jnp.asarray([[0, 1, 1, 2, 2, 2]])
    out = _exact(inp, ckv, kpe, length, t0, length[:, None] + depths, span=3)
    for node, ancestors in ((3, [0, 1]), (5, [0, 2]), (2, [0])):
        # The ancestors committed at their positions, the node alone as the new token.
        c, k = ckv, kpe
        for d, a in enumerate(ancestors):
            c = c.at[0, 63 + d].set(inp["new_ckv"][0, a])
            k = k.at[0, 63 + d].set(inp["new_kpe"][0, a])
        one = {key: v[:, node : node + 1] for key, v in inp.items()}
        n_len = jnp.asarray([63 + len(ancestors)], jnp.int32)
        alone = _exact(one, c, k, n_len, jnp.ones((1, 1, 1), bool), n_len[:, None])
        np.testing.assert_array_equal(np.asarray(alone)[0, 0], np.asarray(out)[0, node])


def small_tree_mask():
    """root -> {1, 2}; 1 -> 3; 2 -> {4, 5}."""
    parents = [-1, 0, 0, 1, 2, 2]
    vis = np.eye(6, dtype=bool)
    for i in range(6):
        j = parents[i]
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return jnp.asarray(vis[None])


# ----------------------------------------------------------------------------------
# Model and generate on near-tie configs


def near_tie_target(cfg, seed: int, eps: float = 1e-7) -> model.TargetParams:
    """Random weights whose router has each odd expert a copy of the even one before it,
    perturbed by eps: twins' scores tie to ~1e-7, so 1-ulp input changes swap them. With an
    odd top-k, some twin pair straddles the cut at every token."""
    params = random_target(cfg, seed=seed)
    moe = params.moe_layers.mlp
    noise = eps * jax.random.normal(jax.random.PRNGKey(seed + 1), moe.router[..., 1::2].shape)
    router = moe.router.at[..., 1::2].set(moe.router[..., 0::2] + noise)
    bias = moe.router_bias.at[..., 1::2].set(moe.router_bias[..., 0::2])
    mlp = moe.replace(router=router, router_bias=bias)
    return params.replace(moe_layers=params.moe_layers.replace(mlp=mlp))


NEAR_TIE = tiny(n_group=1, topk_group=1, num_experts_per_tok=1, max_position_embeddings=512)


@pytest.fixture(scope="module")
def target():
    return near_tie_target(NEAR_TIE, seed=3)


@functools.partial(jax.jit, static_argnames=("numerics_mode", "capacity"))
def _step_logits(params, prompt, numerics_mode, capacity):
    cache = KVCache.init(params.config, 1, capacity)
    n = prompt.shape[1] - 1
    _, cache = model.prefill(params, cache, prompt[:, :-1], jnp.asarray([n]), numerics=numerics_mode)
    out, _ = model.append(params, cache, prompt[:, -1:], jnp.asarray([1]), numerics=numerics_mode)
    return model.logits(params, out.hidden[:, 0], numerics=numerics_mode)


def _token_logits(params, prompt, numerics_mode, capacity):
    """Logits of the token after `prompt` by prefill + one AR step, at a given capacity."""
    return np.asarray(_step_logits(params, jnp.asarray([prompt], jnp.int32), numerics_mode, capacity))


def test_forward_logits_are_bitwise_equal_across_capacity_and_call_shape(target):
    prompt = list(np.random.default_rng(4).integers(0, 256, 150))
    base = _token_logits(target, prompt, "exact", 151)
    np.testing.assert_array_equal(_token_logits(target, prompt, "exact", 300), base)
    # The same token as a prefill row (prompt whole, padded) and as a tree node.
    cache = KVCache.init(target.config, 2, 320)
    ids = np.zeros((2, 200), np.int32)
    ids[1, :150] = prompt
    ids[0, :7] = prompt[:7]
    out, _ = jax.jit(model.append)(target, cache, jnp.asarray(ids), jnp.asarray([7, 150]))
    np.testing.assert_array_equal(np.asarray(model.logits(target, out.hidden[1, 149])), base[0])
    cache = KVCache.init(target.config, 1, 256)
    _, cache = jax.jit(model.prefill)(target, cache, jnp.asarray([prompt[:148]], jnp.int32), jnp.asarray([148]))
    # root = prompt[148]; node 1 = prompt[149] (the path), node 2 a sibling.
    toks = jnp.asarray([[prompt[148], prompt[149], 3]], jnp.int32)
    t3 = tree.DraftTree(
        tokens=toks,
        parents=jnp.asarray([[-1, 0, 0]]),
        depths=jnp.asarray([[0, 1, 1]]),
        valid=jnp.ones((1, 3), bool),
        visibility=jnp.asarray([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool),
        max_depth=1,
    )
    out = jax.jit(decode.verify)(target, cache, t3)
    np.testing.assert_array_equal(np.asarray(model.logits(target, out.hidden[0, 1])), base[0])
    # Teeth: the fast path's bits do move with the capacity.
    fast = [_token_logits(target, prompt, "fast", c) for c in (151, 300)]
    assert (fast[0] != fast[1]).any()


PROMPTS = [list(range(3, 40)), [250, 7, 7, 9], list(np.random.default_rng(5).integers(0, 256, 77))]
NEW = 64


def test_greedy_tokens_are_bitwise_equal_across_capacity_method_and_batch(target):
    """PROMPTS[0]'s greedy tokens under every layout that must not matter (default capacity: 128)."""
    dcfg = dflash.drafter_config_for(target.config, num_hidden_layers=1, block_size=8)
    dparams = dflash.init_params(dcfg, jax.random.PRNGKey(7), std=0.2)
    kw = dict(max_new_tokens=NEW, stop_token_ids=())
    oracle = OracleDrafter(block_size=6, noise=2.0)
    runs = {  # name: (row of PROMPTS[0], generate's args and kwargs)
        "ar": (0, (PROMPTS[:1],), {}),
        "ar batched, capacity +15": (2, (PROMPTS[1:] + PROMPTS[:1],), dict(cache_capacity=128 + 15)),
        "ar capacity +64": (0, (PROMPTS[:1],), dict(cache_capacity=128 + 64)),
        "dflash": (0, (dparams, PROMPTS[:1]), dict(method="dflash")),
        "ddtree batched": (1, (dparams, PROMPTS[1:2] + PROMPTS[:1]), dict(method="ddtree")),
        "ddtree oracle batched, capacity 201": (
            1,
            (oracle, [PROMPTS[2], PROMPTS[0]]),
            dict(method="ddtree", tree_budget=12, cache_capacity=201),
        ),
    }

    def tokens(name, numerics_mode):
        row, args, extra = runs[name]
        return generate(target, *args, numerics=numerics_mode, **kw, **extra).to_lists()[row]

    want = tokens("ar", "exact")
    assert len(want) == NEW
    for name in runs:
        first = first_difference(want, tokens(name, "exact"))
        assert first is None, f"{name} departs from AR at new token {first}"
    # Teeth: the same comparisons split under "fast" (capacity, method, batch).
    fast = tokens("ar", "fast")
    for name in ("ar batched, capacity +15", "ddtree batched"):
        assert first_difference(fast, tokens(name, "fast")) is not None, f"{name} should differ under fast"


def test_exact_is_the_float32_default_and_bf16_runs_fast(target):
    # NEW tokens: the exact loop is the one the test above compiled for its "ar" run.
    r32 = generate(target, PROMPTS[:1], max_new_tokens=NEW, stop_token_ids=())
    assert (
        r32.to_lists()
        == generate(target, PROMPTS[:1], max_new_tokens=NEW, stop_token_ids=(), numerics="exact").to_lists()
    )
    bf = model.cast_params(target, jnp.bfloat16)
    out = generate(bf, PROMPTS[:1], max_new_tokens=8, stop_token_ids=())
    assert len(out.to_lists()[0]) == 8
    with pytest.raises(ValueError, match="XLA path only"):
        generate(target, PROMPTS[:1], max_new_tokens=4, numerics="exact", implementation="pallas")


def test_exact_numerics_with_many_experts_plain_queries_and_no_shared_expert():
    """Near-tie routing over 32 experts large enough that "exact" mode runs them as pairs in
    tiles of one expert (`numerics.routed_in_pair_tiles`)."""
    cfg = dataclasses.replace(
        NEAR_TIE,
        n_routed_experts=32,
        num_experts_per_tok=3,
        moe_intermediate_size=256,
        q_lora_rank=None,
        n_shared_experts=0,
    )
    assert numerics.routed_in_pair_tiles(32, 3, cfg.hidden_size, 256)
    params = near_tie_target(cfg, seed=11)
    kw = dict(max_new_tokens=40, stop_token_ids=())
    ar = generate(params, PROMPTS[:1], **kw).to_lists()[0]
    oracle = OracleDrafter(block_size=5, noise=1.5)
    assert (
        generate(params, oracle, PROMPTS[:2], method="ddtree", tree_budget=9, cache_capacity=117, **kw).to_lists()[0]
        == ar
    )


def test_shipped_pair_float32_is_bitwise_exact_for_512_tokens():
    """The shipped pair in float32 on stdlib source: AR alone at the default capacity against
    DDTree(64) in a padded batch at a capacity that is no multiple of 64 (three differences at
    once: method, batch row and capacity; the near-tie tests take them one at a time). DFlash is
    the near-tie test's."""
    from ddtree_jax.shipped import load_shipped

    shipped = load_shipped(dtype="float32")
    with open(textwrap.__file__) as f:
        ids = shipped.tokenizer.encode(f.read(), bos=True)
    prompt, other = ids[:300], ids[1000:1041]
    kw = dict(max_new_tokens=512, stop_token_ids=())
    want = generate(shipped.target, [prompt], **kw).to_lists()[0]
    tree = generate(
        shipped.target, shipped.drafter, [other, prompt], method="ddtree", cache_capacity=873, **kw
    ).to_lists()[1]
    assert len(want) == 512
    first = first_difference(want, tree)
    assert first is None, f"batched DDTree at capacity 873 departs from AR at new token {first}"
