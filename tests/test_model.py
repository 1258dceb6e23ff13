"""Cache consistency: prefill + extend == one forward; tree extend == causal paths."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import model
from ddtree_jax.cache import KVCache
from ddtree_jax.config import YarnConfig
from tests.conftest import random_target, tiny

CFGS = {
    "default": tiny(rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=32)),
    "plain_q_all_moe": tiny(q_lora_rank=None, first_k_dense_replace=0),
}


WIDTH = 32

# Jitted once per config (op by op, every primitive of a forward compiles on its own).
prefill = jax.jit(model.prefill)
forward = jax.jit(model.forward, static_argnames=("tap_layers", "tap_final_norm"))
logits = jax.jit(model.logits)


@jax.jit
def _padded_forward(params, tokens, n):
    cache = KVCache.init(params.config, 1, 1)
    out = model.forward(params, tokens, jnp.arange(WIDTH)[None], cache, model.causal_mask(n[None], WIDTH))
    return model.logits(params, out.hidden)[0], out.kv


def full_forward(params, tokens):
    """Causal forward of one sequence from scratch (right-padded to WIDTH: one compile).

    Returns numpy (logits [n, V], latent kv [L, 1, n, *]) (sliced on the host: no compile per n).
    """
    n = len(tokens)
    padded = np.zeros((1, WIDTH), np.int32)
    padded[0, :n] = tokens
    lg, kv = _padded_forward(params, jnp.asarray(padded), jnp.asarray(n))
    return np.asarray(lg)[:n], jax.tree.map(lambda a: np.asarray(a)[:, :, :n], kv)


@pytest.mark.parametrize("name", list(CFGS))
def test_prefill_then_extend_one_at_a_time_equals_full_forward(name):
    params = random_target(CFGS[name], seed=3)
    tokens = np.random.default_rng(0).integers(0, 256, 14).tolist()
    want, _ = full_forward(params, tokens)
    split = 5
    cache = KVCache.init(params.config, 1, 20)
    first, cache = prefill(params, cache, jnp.asarray([tokens[:split]], jnp.int32), jnp.asarray([split]))

    @jax.jit
    def step(cache, token):
        out = model.forward(params, token[None, None], cache.lengths[:, None], cache, jnp.ones((1, 1, 1), bool))
        cache = cache.write(out.kv, cache.lengths[:, None]).replace(lengths=cache.lengths + 1)
        return model.logits(params, out.hidden)[0, 0], cache

    got = [first[0]]
    for i in range(split, len(tokens)):
        lg, cache = step(cache, jnp.int32(tokens[i]))
        got.append(lg)
    np.testing.assert_allclose(np.stack(got), want[split - 1 :], atol=2e-5, rtol=0)
    assert int(cache.lengths[0]) == len(tokens)


def random_tree(rng, n):
    """parents[i] < i (root = -1 for node 0), depths, ancestor-or-self matrix."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    depth = [0] * n
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        vis[i] = vis[parents[i]]
        vis[i, i] = True
    return parents, np.array(depth), vis


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("name", list(CFGS))
def test_tree_extend_equals_causal_paths(name):
    params = random_target(CFGS[name], seed=4)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 256, 7).tolist()
    n = 12
    parents, depth, vis = random_tree(rng, n)
    tree_tokens = rng.integers(0, 256, n)
    cache = KVCache.init(params.config, 1, 32)
    _, cache = prefill(params, cache, jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]))
    out = forward(
        params,
        jnp.asarray(tree_tokens[None], jnp.int32),
        jnp.asarray(len(prompt) + depth[None], jnp.int32),
        cache,
        jnp.asarray(vis[None]),
    )
    tree_logits = np.asarray(logits(params, out.hidden))[0]
    out_kv = jax.tree.map(np.asarray, out.kv)
    for i in range(n):
        path = path_to(parents, i)
        want, want_kv = full_forward(params, prompt + tree_tokens[path].tolist())
        np.testing.assert_allclose(tree_logits[i], want[-1], atol=2e-5, rtol=0)
        np.testing.assert_allclose(out_kv.c_kv[:, 0, i], want_kv.c_kv[:, 0, -1], atol=1e-5, rtol=0)
        np.testing.assert_allclose(out_kv.k_pe[:, 0, i], want_kv.k_pe[:, 0, -1], atol=1e-5, rtol=0)


def test_batch_rows_are_independent():
    """A padded mixed-length batch gives each row what it gives alone."""
    params = random_target(CFGS["default"], seed=5)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (9, 3, 6)]
    width = max(map(len, prompts))
    padded = np.zeros((3, width), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    cache = KVCache.init(params.config, 3, 16)
    got, cache = prefill(params, cache, jnp.asarray(padded), jnp.asarray([len(p) for p in prompts]))
    got = np.asarray(got)
    for i, p in enumerate(prompts):
        want, _ = full_forward(params, p)
        np.testing.assert_allclose(got[i], want[-1], atol=2e-5, rtol=0)


def test_taps_are_layer_outputs():
    params = random_target(CFGS["default"], seed=6)
    tokens = jnp.asarray([[5, 6, 7]], jnp.int32)
    cache = KVCache.init(params.config, 1, 3)
    args = (params, tokens, jnp.arange(3)[None], cache, model.causal_mask(jnp.asarray([3]), 3))
    out = model.forward(*args, tap_layers=(0, 2))
    assert out.taps.shape == (2, 1, 3, params.config.hidden_size)
    # HF's hidden_states[i + 1]: the last layer's tap is after the final norm, the hidden state.
    np.testing.assert_array_equal(out.taps[1], out.hidden)
    # tap_final_norm=False: its raw output, which final-normed is the hidden state; inner taps as before.
    raw = model.forward(*args, tap_layers=(0, 2), tap_final_norm=False)
    np.testing.assert_array_equal(raw.taps[0], out.taps[0])
    normed = model.rms_norm(raw.taps[1], params.final_norm, params.config.rms_norm_eps)
    np.testing.assert_allclose(normed, out.hidden, atol=1e-6)
    assert np.abs(raw.taps[1] - out.hidden).max() > 0.1
    with pytest.raises(ValueError, match="tap layer 3"):
        model.forward(*args, tap_layers=(3,))


def test_unrolled_layers_equal_the_layer_scan(monkeypatch):
    params = random_target(CFGS["default"], seed=7)
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    cache = KVCache.init(params.config, 1, 4)
    args = (params, tokens, jnp.arange(4)[None], cache, model.causal_mask(jnp.asarray([4]), 4))

    def run(max_layers):
        monkeypatch.setattr(model, "UNROLL_MAX_LAYERS", max_layers)
        # A fresh jit per setting: the constant is read when the forward is traced.
        out = jax.jit(lambda *a: model.forward(*a, tap_layers=(0, 1, 2)))(*args)
        # (stack length, unroll factor) of each layer scan ("fast": no row-tile loops beside them)
        jaxpr = jax.make_jaxpr(lambda *a: model.forward(*a, numerics="fast").hidden)(*args).jaxpr
        scans = [(e.params["length"], e.params["unroll"]) for e in jaxpr.eqns if e.primitive.name == "scan"]
        return out, scans

    scanned, scans = run(0)
    unrolled, unrolled_scans = run(params.config.num_hidden_layers)
    assert sum(n for n, _ in scans) == params.config.num_hidden_layers
    assert any(n > 1 for n, _ in scans)
    assert all(u == 1 for _, u in scans)
    assert [n for n, _ in unrolled_scans] == [n for n, _ in scans]
    assert all(u in (n, True) for n, u in unrolled_scans)
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_kernel_routed_experts_get_the_layer_stack_and_index(monkeypatch):
    """Where the routed experts take a Mosaic kernel, each MoE layer hands `moe_experts` the
    whole [L, E, ...] stacks and its own index (XLA would copy a slice first), in a layer scan
    (unrolled, the K2 shard's verify died on the GPU): the same output as the layer slices."""
    from ddtree_jax.pallas.moe import moe_experts

    params = random_target(CFGS["default"], seed=8)
    assert params.config.num_moe_layers > 1
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    cache = KVCache.init(params.config, 1, 4)
    args = (params, tokens, jnp.arange(4)[None], cache, model.causal_mask(jnp.asarray([4]), 4))
    forward = lambda *a: model.forward(*a, tap_layers=(0, 1, 2), numerics="fast")  # noqa: E731
    want = jax.jit(forward)(*args)
    calls = []

    def recorded(*a, layer=None, **kw):
        calls.append((a[3].ndim, layer is not None))
        return moe_experts(*a, layer=layer, **kw)  # the XLA path: slices the stack at `layer`

    monkeypatch.setattr(model, "moe_experts", recorded)
    monkeypatch.setattr(model, "resolve_moe", lambda *a, **kw: "mosaic")
    got = jax.jit(lambda *a: forward(*a))(*args)  # a new function: traced afresh
    assert calls == [(4, True)]  # traced once, in the scan's body
    jaxpr = jax.make_jaxpr(lambda *a: forward(*a).hidden)(*args).jaxpr
    assert [e.params["unroll"] for e in jaxpr.eqns if e.primitive.name == "scan"][-1] == 1
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cache_write_drops_out_of_range_slots():
    cfg = CFGS["default"]
    cache = KVCache.init(cfg, 2, 4)
    new = model.LatentKV(
        c_kv=jnp.ones((cfg.num_hidden_layers, 2, 2, cfg.kv_lora_rank)),
        k_pe=jnp.ones((cfg.num_hidden_layers, 2, 2, cfg.qk_rope_head_dim)),
    )
    out = jax.jit(KVCache.write)(cache, new, jnp.asarray([[0, 4], [3, 2]]))
    written = np.asarray(out.c_kv[0, :, :, 0])
    np.testing.assert_array_equal(written, [[1, 0, 0, 0], [0, 0, 1, 1]])


def test_bf16_forward_runs_and_is_close_to_f32():
    cfg = CFGS["default"]
    p32 = random_target(cfg, seed=7, std=0.05)
    p16 = jax.jit(model.cast_params, static_argnums=1)(p32, jnp.bfloat16)
    assert p16.moe_layers.mlp.router_bias.dtype == jnp.float32
    tokens = list(range(10, 20))
    want, _ = full_forward(p32, tokens)
    got, _ = full_forward(p16, tokens)
    assert got.dtype == jnp.float32
    rel = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(np.asarray(want))
    assert rel < 5e-2


def test_route_without_the_sort_equals_route_with_it(monkeypatch):
    """`route` with the rank top-k gives the same experts and weights as with lax.top_k, grouped
    (noaux_tc groups) and plain."""
    rng = np.random.default_rng(1)
    for n_group, topk_group in ((1, 1), (4, 2)):
        cfg = dataclasses.replace(
            tiny(), n_routed_experts=32, num_experts_per_tok=4, n_group=n_group, topk_group=topk_group
        )
        x = jnp.asarray(rng.normal(size=(40, cfg.hidden_size)), jnp.float32)
        router = jnp.asarray(rng.normal(size=(cfg.hidden_size, 32)) * 0.1, jnp.float32)
        bias = jnp.asarray(np.round(rng.normal(size=32), 1), jnp.float32)
        monkeypatch.setattr(model, "ROUTER_RANK_MAX_EXPERTS", 0)
        want = model.route(cfg, x, router, bias)
        monkeypatch.setattr(model, "ROUTER_RANK_MAX_EXPERTS", 64)
        got = model.route(cfg, x, router, bias)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_router_logits_as_a_reduction_are_the_dot_up_to_rounding(monkeypatch):
    """A few tokens' router logits as a float32 multiply and sum (ROUTER_REDUCE_MAX_TOKENS) pick
    the experts of the float64 product and weigh them within float32 rounding, as the dot does."""
    cfg = dataclasses.replace(tiny(), n_routed_experts=16, num_experts_per_tok=2)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(13, cfg.hidden_size))
    router = rng.normal(size=(cfg.hidden_size, 16)) * 0.1
    bias = np.round(rng.normal(size=16), 1)
    choice = 1 / (1 + np.exp(-(x @ router))) + bias  # float64
    want_idx = np.argsort(-choice, axis=1, kind="stable")[:, :2]
    args = [jnp.asarray(a, jnp.float32) for a in (x, router, bias)]
    for limit in (0, 64):  # the dot, the reduction
        monkeypatch.setattr(model, "ROUTER_REDUCE_MAX_TOKENS", limit)
        idx, w = model.route(cfg, *args)
        np.testing.assert_array_equal(np.asarray(idx), want_idx)
        s = 1 / (1 + np.exp(-(x @ router)))
        ws = np.take_along_axis(s, want_idx, 1)
        np.testing.assert_allclose(np.asarray(w), ws / ws.sum(1, keepdims=True) * cfg.routed_scaling_factor, rtol=1e-5)
