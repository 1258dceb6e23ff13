"""Sharded generation on 8 virtual CPU devices equals single-device generation.

XLA_FLAGS must be set before jax is imported, so the check runs in a subprocess.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from ddtree_jax import config, sharding
from ddtree_jax.drafters import dflash
from tests.conftest import tiny, xla_flags

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from ddtree_jax import sharding
    from ddtree_jax.cache import KVCache
    from ddtree_jax.drafters import dflash
    from ddtree_jax.generate import generate
    from tests.conftest import random_target, tiny

    assert jax.device_count() == 8, jax.devices()
    cfg = tiny(num_attention_heads=8, n_routed_experts=8, n_group=2, topk_group=1)
    target = random_target(cfg, seed=3, jit=True)  # one compile, not one per op: 4 s on 8 devices
    dcfg = dflash.drafter_config_for(cfg, num_hidden_layers=1, block_size=4, num_key_value_heads=8)
    dparams = dflash.init_params(dcfg, jax.random.PRNGKey(1), std=0.3)
    # Eight rows: the mesh divides the batch, so the latent cache is split by sequence.
    prompts = [[5, 17, 33, 2, 9], [250, 1], [7, 7, 7], [1, 2, 3, 4, 5, 6, 7], [9], [40, 41], [3, 1, 4, 1, 5], [8] * 6]
    kw = dict(max_new_tokens=12, stop_token_ids=())
    ref_ar = generate(target, prompts, **kw).to_lists()
    ref_tree = generate(target, dparams, prompts, method="ddtree", tree_budget=6, **kw)

    for data, model in ((1, 8), (2, 4)):
        mesh = sharding.make_mesh(data=data, model=model)
        st = sharding.shard_target(target, mesh)
        sd = sharding.shard_drafter(dparams, mesh)
        # The weights really are split over "model".
        assert st.moe_layers.mlp.gate.sharding.spec == P(None, "model", None, None), st.moe_layers.mlp.gate.sharding
        assert st.moe_layers.attn.w_uk.sharding.spec == P(None, "model", None, None)
        assert st.lm_head.sharding.spec == P(None, "model")
        assert sd.layers.q.sharding.spec == P(None, None, "model", None)
        assert len(st.embed.addressable_shards) == 8
        with sharding.use_mesh(mesh):
            cache = jax.jit(lambda: KVCache.init(cfg, len(prompts), 32))()
        want = jax.sharding.NamedSharding(mesh, P(None, ("data", "model"), None, None))
        assert cache.c_kv.sharding.is_equivalent_to(want, 4), cache.c_kv.sharding
        # The loop's joint context key / value matrix keeps the layers' split of the kv heads.
        with sharding.use_mesh(mesh):
            joint = jax.jit(lambda d: dflash.DFlashDrafter(params=d, block_size=4).for_loop().context_kv.weight)(sd)
        assert joint.sharding.spec == P(None, None, None, "model"), joint.sharding
        assert generate(st, prompts, **kw).to_lists() == ref_ar, (data, model)
        tree = generate(st, sd, prompts, method="ddtree", tree_budget=6, **kw)
        assert tree.to_lists() == ref_ar, (data, model)
        assert np.asarray(tree.accept_lengths).tolist() == np.asarray(ref_tree.accept_lengths).tolist()
    print("SHARDED OK")
    """
)


PALLAS_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from ddtree_jax import sharding
    from ddtree_jax.generate import generate
    from ddtree_jax.pallas.mla_attention import mla_attention
    from ddtree_jax.pallas.moe.api import moe_experts
    from ddtree_jax.pallas.moe.reference import moe_experts_reference
    from tests.conftest import random_target, tiny

    mesh = sharding.make_mesh(data=2, model=4)
    cfg = tiny(num_attention_heads=8, n_routed_experts=8, n_group=2, topk_group=1)
    target = random_target(cfg, seed=4, jit=True)
    st = sharding.shard_target(target, mesh)

    # The dispatch functions run the kernels per shard (shard_map) under the mesh.
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    x, w = f(6, 16), jnp.asarray(rng.uniform(size=(6, 3)), jnp.float32)
    idx = jnp.asarray(np.argsort(rng.uniform(size=(6, 8)), axis=1)[:, :3], jnp.int32)
    gate, up, down = f(8, 16, 12) * 0.3, f(8, 16, 12) * 0.3, f(8, 12, 16) * 0.3
    moe = jax.jit(lambda *a: moe_experts(*a, implementation="pallas"))
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(moe)(x, idx, w, gate, up, down))
        got = moe(x, idx, w, gate, up, down)
    np.testing.assert_allclose(got, moe_experts_reference(x, idx, w, gate, up, down), atol=1e-4, rtol=1e-4)
    q = (f(2, 3, 8, 16), f(2, 3, 8, 4))
    kv = (f(2, 10, 16), f(2, 10, 4), jnp.asarray([7, 10], jnp.int32), f(2, 3, 16), f(2, 3, 4))
    mask = jnp.tril(jnp.ones((3, 3), bool))[None].repeat(2, 0)
    # Attention's kernel is Mosaic GPU's alone, whose interpreter hangs under an 8-device
    # shard_map on the CPU: a stand-in with its contract (the reference) takes its place.
    import ddtree_jax.pallas.mla_attention.api as mla_api
    from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
    mla_api.mla_attention_mosaic = lambda *a, scale, tiles=None, interpret=None: mla_attention_reference(*a, scale)
    mla = jax.jit(lambda *a: mla_attention(*a, scale=0.3, implementation="mosaic"))
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(mla)(*q, *kv, mask))
        got = mla(*q, *kv, mask)
    np.testing.assert_allclose(got, mla_attention(*q, *kv, mask, scale=0.3), atol=1e-4, rtol=1e-4)
    # Batch 8: the cache split by sequence, one per device; each device gathers all heads of its
    # sequence (all-to-all), attends, and sends the heads back.
    q8 = (f(8, 3, 8, 16), f(8, 3, 8, 4))
    kv8 = (f(8, 10, 16), f(8, 10, 4), jnp.asarray([0, 1, 2, 3, 7, 8, 9, 10], jnp.int32), f(8, 3, 16), f(8, 3, 4))
    mask8 = mask[:1].repeat(8, 0)
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(mla)(*q8, *kv8, mask8))
        got = mla(*q8, *kv8, mask8)
    assert "P(('data', 'model'), None, None)" in jaxpr and jaxpr.count("all_to_all") >= 3, jaxpr
    assert got.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", None, "model", None)), 4)
    np.testing.assert_allclose(got, mla_attention(*q8, *kv8, mask8, scale=0.3), atol=1e-4, rtol=1e-4)
    # Every layer's cache [L, B, S, *] and a traced layer, as the model hands them: each shard's
    # kernel gets the whole stack of its rows and the index, and attends that layer.
    seen = []

    def stacked_stand_in(*a, scale, tiles=None, interpret=None, layer=None):
        seen.append((a[2].shape, None if layer is None else layer.shape))
        a = list(a)
        if layer is not None:
            a[2], a[3] = a[2][layer], a[3][layer]
        return mla_attention_reference(*a, scale)

    mla_api.mla_attention_mosaic = stacked_stand_in
    mla_at = jax.jit(lambda li, *a: mla_attention(*a, scale=0.3, implementation="mosaic", layer=li))
    for qs, (ckv, kpe, *rest), m in ((q, kv, mask), (q8, kv8, mask8)):
        stack = [jnp.stack([x * 0.5, x, -x]) for x in (ckv, kpe)]
        with jax.set_mesh(mesh):
            got = mla_at(jnp.int32(1), *qs, *stack, *rest, m)
        assert seen[-1] == ((3, 1, 10, 16), ()), seen  # batch 2 over data, or 8 by sequence: one row here
        np.testing.assert_allclose(got, mla_attention(*qs, ckv, kpe, *rest, m, scale=0.3), atol=1e-4, rtol=1e-4)

    # The drafter's block attention kernel per shard of batch and heads: kv heads split with the
    # query heads (8 / 4 over model=4), or one kv head kept whole; kv heads the mesh cannot split
    # as the query heads are refused.
    from ddtree_jax.pallas.drafter_attention import api as drafter_api
    from ddtree_jax.pallas.drafter_attention.api import _shard_specs, drafter_attention
    from ddtree_jax.pallas.drafter_attention.reference import drafter_attention_reference
    pos = jnp.asarray([[20], [9]], jnp.int32) + jnp.arange(16, dtype=jnp.int32)
    # Then with a shard's heads that share a KV head in one program (GROUP_HEADS: 2 a program).
    drafter_api.GROUP_MIN_SLOTS = 0  # these small shapes group too
    for nkv, grouped in ((4, False), (1, False), (4, True), (1, True)):
        drafter_api.GROUP_HEADS = grouped
        da = (f(2, 16, 8, 16), f(2, 32, nkv, 16), f(2, 32, nkv, 16), jnp.asarray([20, 9], jnp.int32), pos,
              f(2, 16, nkv, 16), f(2, 16, nkv, 16))
        dfn = jax.jit(lambda *a: drafter_attention(*a, window=12, causal=True, implementation="pallas"))
        with jax.set_mesh(mesh):
            assert _shard_specs(mesh, da, 8, nkv)[1]  # "auto" on a GPU would take the kernel here
            assert "shard_map" in str(jax.make_jaxpr(dfn)(*da))
            got = dfn(*da)
        np.testing.assert_allclose(got, drafter_attention_reference(*da, 12, True), atol=1e-5, rtol=1e-5)
    # Every layer's context cache [Ld, B, S, Nkv, hd] and a static layer, as the drafter hands
    # them: each shard's kernel reads that layer in the stack of its rows and heads.
    kernel_calls, real_kernel = [], drafter_api.drafter_attention_pallas

    def spy(q, k, *a, **kw):
        kernel_calls.append((k.shape, kw["layer"]))
        return real_kernel(q, k, *a, **kw)

    drafter_api.drafter_attention_pallas = spy
    k_all, v_all = (jnp.stack([x, -x, x * 0.5]) for x in da[1:3])
    dfn = jax.jit(lambda q, k, v, *a: drafter_attention(q, k, v, *a, window=12, causal=True, implementation="pallas", layer=2))
    with jax.set_mesh(mesh):
        got = dfn(da[0], k_all, v_all, *da[3:])
    assert kernel_calls == [((3, 1, 32, 1, 16), 2)], kernel_calls  # rows over data, the one kv head whole
    want = drafter_attention_reference(da[0], k_all[2], v_all[2], *da[3:], 12, True)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    drafter_api.drafter_attention_pallas = real_kernel
    drafter_api.GROUP_HEADS = False
    da2 = (f(2, 16, 8, 16), f(2, 32, 2, 16), f(2, 32, 2, 16), jnp.asarray([20, 9], jnp.int32), pos,
           f(2, 16, 2, 16), f(2, 16, 2, 16))
    with jax.set_mesh(mesh):
        assert not _shard_specs(mesh, da2, 8, 2)[1]  # "auto": XLA here
        try:
            drafter_attention(*da2, window=12, causal=True, implementation="pallas")
            raise AssertionError("a kv-head split unlike the query heads' was not refused")
        except ValueError as e:
            assert "would not find their own" in str(e), e
        auto = drafter_attention(*da2, window=12, causal=True)  # auto on the CPU: the XLA path
    np.testing.assert_allclose(auto, drafter_attention_reference(*da2, 12, True), atol=1e-5, rtol=1e-5)

    # The XLA path's routed experts run expert-parallel by hand too (GSPMD alone all-gathers
    # every expert): weight gather (T * K <= E), the dense pass and the grouped GEMM (dense
    # pass off), bf16 and INT4 weights.
    from ddtree_jax.pallas.moe import reference
    from ddtree_jax.quant import Int4
    q4 = [Int4(group_size=8).quantize(a) for a in (f(8, 16, 16), f(8, 16, 16), f(8, 16, 16))]
    for dense_max in (reference.DENSE_MAX_TOKENS, 0):
        reference.DENSE_MAX_TOKENS = dense_max
        moe_xla = jax.jit(lambda *a: moe_experts(*a, implementation="xla"))
        for t, weights in ((2, (gate, up, down)), (6, (gate, up, down)), (2, q4), (6, q4)):
            args = (x[:t], idx[:t], w[:t], *weights)
            with jax.set_mesh(mesh):
                assert "shard_map" in str(jax.make_jaxpr(moe_xla)(*args))
                got = moe_xla(*args)
            np.testing.assert_allclose(got, moe_experts_reference(*args), atol=1e-4, rtol=1e-4)

    # Layer stacks [L, E, ...] with an index, as the model hands a Mosaic kernel its routed
    # experts, split over the stacks' expert axis. Mosaic GPU's interpreter hangs under an
    # 8-device shard_map on the CPU, so a stand-in with the kernel's contract (the dense
    # reference on stack[layer]) takes the W4A16 kernel's place and records its operands.
    import ddtree_jax.pallas.moe.api as moe_api
    seen = []

    def stand_in(x, idx, w, gate, up, down, layer=None, interpret=None):
        seen.append((gate.packed.shape, layer.shape))
        return moe_experts_reference(x, idx, w, *[jax.tree.map(lambda a: a[layer], s) for s in (gate, up, down)])

    moe_api.moe_experts_w4a16 = stand_in
    x4 = jnp.asarray(rng.normal(size=(6, 128)), jnp.bfloat16)
    stacks = [Int4(group_size=32).quantize(f(2, 8, a, b) * 0.1) for a, b in ((128, 64), (128, 64), (64, 128))]
    stacked = jax.jit(lambda li, *s: moe_experts(x4, idx, w, *s, layer=li, implementation="mosaic"))
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(stacked)(jnp.int32(1), *stacks))
        got = stacked(jnp.int32(1), *stacks).astype(jnp.float32)
    assert seen[-1] == ((2, 2, 4, 64, 32), ()), seen  # 2 layers of 8 / 4 experts, one index per shard
    layer1 = [jax.tree.map(lambda a: a[1], s) for s in stacks]
    want = moe_experts_reference(x4, idx, w, *layer1).astype(jnp.float32)
    np.testing.assert_allclose(got, want, atol=1e-2 * float(jnp.max(jnp.abs(want))), rtol=0)

    # generate on sharded weights with the kernels gives the single-device XLA tokens; so does
    # the fast XLA path, dense and INT4. The reference: the single-device XLA path in "fast"
    # numerics (the kernels' own), the dense loop below: one loop fewer to compile than an
    # "exact" reference.
    prompts = [[5, 17, 33, 2, 9], [250, 1]]
    kw = dict(max_new_tokens=5, stop_token_ids=())
    ref = generate(target, prompts, numerics="fast", **kw).to_lists()
    assert generate(st, prompts, implementation="pallas", **kw).to_lists() == ref
    from ddtree_jax import model
    for params in (target, model.quantize_experts(target, group_size=8)):
        want = generate(params, prompts, numerics="fast", **kw).to_lists()
        assert generate(sharding.shard_target(params, mesh), prompts, numerics="fast", **kw).to_lists() == want

    # Custom rules reach the kernels: experts over "data", heads kept whole.
    rules = dict(sharding.RULES, experts="data", heads=None)
    custom = sharding.shard_target(target, mesh, rules)
    assert custom.moe_layers.mlp.gate.sharding.spec == P(None, "data", None, None)
    placed = sharding.placed_rules(custom)
    assert placed["experts"] == "data" and placed["heads"] is None, placed
    with sharding.use_mesh(mesh, placed):
        assert sharding.kernel_spec(("experts", None, None), gate.shape) == P("data", None, None)
        assert sharding.kernel_spec(("batch", None, "heads", None), q[0].shape) == P("data", None, None, None)
        fresh = jax.jit(lambda *a: moe_experts(*a, implementation="pallas"))  # jit caches by mesh, not rules
        got = fresh(x, idx, w, gate, up, down)
    np.testing.assert_allclose(got, moe_experts_reference(x, idx, w, gate, up, down), atol=1e-4, rtol=1e-4)
    assert generate(custom, prompts, implementation="pallas", **kw).to_lists() == ref
    print("SHARDED PALLAS OK")
    """
)


EXACT_SCRIPT = textwrap.dedent(
    """
    # Lookups and experts the SPMD partitioner would gather whole run vocabulary- and
    # expert-parallel by hand, bitwise equal to one device: the embedding (GPU compiles of a
    # 2-GPU AR step all-gathered it every step) and the "exact" numerics' routed pairs
    # (every expert all-gathered at every layer), found on two H200s (docs/scaling.md).
    import re
    import jax, jax.numpy as jnp, numpy as np
    from ddtree_jax import model, sharding
    from ddtree_jax.generate import generate, lower
    from ddtree_jax.numerics import routed_in_pair_tiles
    from ddtree_jax.pallas.moe.api import moe_pairs
    from ddtree_jax.pallas.moe.reference import moe_pairs_in_tiles
    from ddtree_jax.quant import Int4
    from tests.conftest import random_target, tiny

    mesh = sharding.make_mesh(data=1, model=8)
    rng = np.random.default_rng(5)

    def gathered(fn, *args):  # bytes of each all-gather in the compiled program
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        sizes = re.findall(r"= [a-z0-9]+\\[([0-9,]*)\\][^=]* all-gather(?:-start)?\\(", hlo)
        return [int(np.prod([int(d) for d in s.split(",") if d])) for s in sizes]

    table = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    bits = lambda a: np.asarray(a, np.float32).view(np.uint32)  # bitwise (no -0.0 in these)
    placed = jax.device_put(table, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None)))
    ids = jnp.asarray([[0, 7, 8, 63, -1, -64, 64, 1000], [9, 9, 17, 40, 41, 55, 2, 3]], jnp.int32)
    with sharding.use_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(sharding.embed_rows)(placed, ids))
        got = jax.jit(sharding.embed_rows)(placed, ids)
        assert all(n < table.size // 2 for n in gathered(sharding.embed_rows, placed, ids))
    assert (bits(got) == bits(table[ids])).all()

    x = jnp.asarray(rng.normal(size=(12, 32)), jnp.float32)
    idx = jnp.asarray(np.argsort(rng.uniform(size=(12, 16)), axis=1)[:, :3], jnp.int32)
    dense = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((16, 32, 24), (16, 32, 24), (16, 24, 32))]
    int4 = [Int4(group_size=8).quantize(a) for a in dense]
    for weights in (dense, int4):
        want = moe_pairs_in_tiles(x, idx, *weights, 8)
        spec = jax.sharding.PartitionSpec("model")
        placed = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in weights]
        fn = lambda x, idx, *w: moe_pairs(x, idx, *w, 8)
        with sharding.use_mesh(mesh):
            got = jax.jit(fn)(x, idx, *placed)
            assert all(n < 16 * 24 * 32 // 8 for n in gathered(fn, x, idx, *placed)), gathered(fn, x, idx, *placed)
        assert (bits(got) == bits(want)).all()

    # The whole loop in "exact" numerics, on a model whose routed experts run in pair tiles.
    cfg = tiny(hidden_size=128, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=2, vocab_size=512)
    assert routed_in_pair_tiles(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, 128)
    target = model.quantize_experts(random_target(cfg, seed=6, jit=True), group_size=32)
    st = sharding.shard_target(target, mesh)
    prompts = [[5, 17, 33, 2, 9, 300, 511, 7]]
    kw = dict(max_new_tokens=6, stop_token_ids=())
    assert generate(st, prompts, **kw).to_lists() == generate(target, prompts, **kw).to_lists()
    hlo = lower(st, None, prompts, **kw).compile().as_text()
    sizes = re.findall(r"= [a-z0-9]+\\[([0-9,]*)\\][^=]* all-gather(?:-start)?\\(", hlo)
    big = [s for s in sizes if np.prod([int(d) for d in s.split(",") if d]) >= 128 * 128]
    assert not big, big  # an expert's or the embedding's weights: none travel
    print("SHARDED EXACT OK")
    """
)


def _run_on_8_devices(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, cwd=ROOT)


# Each script given as an argument, in order, in one process; a failing one prints its traceback
# under its name and the next still runs.
RUN_EACH = textwrap.dedent(
    """
    import sys, traceback
    for i, script in enumerate(sys.argv[1:]):
        try:
            exec(script, {"__name__": f"script{i}"})
        except BaseException:
            print(f"--- script {i} failed ---", file=sys.stderr)
            traceback.print_exc()
    """
)


@pytest.fixture(scope="module")
def sharded_runs():
    """SCRIPT, then PALLAS_SCRIPT (it patches kernels), then EXACT_SCRIPT in one process: one start of jax on 8
    devices and one round of op-by-op compiles instead of two (152 s -> 137 s alone here)."""
    return _run_on_8_devices(RUN_EACH, SCRIPT, PALLAS_SCRIPT, EXACT_SCRIPT)


def _why(proc: subprocess.CompletedProcess, i: int) -> str:
    """Script i's traceback, else (a crash) the end of stderr."""
    mark = f"--- script {i} failed ---"
    return proc.stderr[proc.stderr.index(mark) :][:4000] if mark in proc.stderr else proc.stderr[-4000:]


def test_sharded_generate_equals_single_device(sharded_runs):
    assert "SHARDED OK" in sharded_runs.stdout, _why(sharded_runs, 0)


def test_sharded_pallas_kernels_run_per_shard_and_match(sharded_runs):
    assert "SHARDED PALLAS OK" in sharded_runs.stdout, _why(sharded_runs, 1)


def test_sharded_lookups_and_exact_pairs_gather_no_weights(sharded_runs):
    assert "SHARDED EXACT OK" in sharded_runs.stdout, _why(sharded_runs, 2)


PLACEMENT_SCRIPT = textwrap.dedent(
    """
    # Lowered or refused only, never compiled: a few seconds on 8 CPU devices.
    import jax
    from ddtree_jax import sharding
    from ddtree_jax.drafters import dflash
    from ddtree_jax.generate import generate, lower
    from tests.conftest import random_target, tiny

    cfg = tiny(num_attention_heads=8, n_routed_experts=8, n_group=2, topk_group=1, num_hidden_layers=1)
    target = random_target(cfg, seed=3)
    dcfg = dflash.drafter_config_for(cfg, num_hidden_layers=1, block_size=4, num_key_value_heads=8)
    dparams = dflash.init_params(dcfg, jax.random.PRNGKey(1))
    d, kw = jax.devices(), dict(max_new_tokens=2, stop_token_ids=(), method="dflash")
    low, high = sharding.make_mesh(1, 4, d[:4]), sharding.make_mesh(1, 4, d[4:])
    st = sharding.shard_target(target, low)
    # Target and drafter on other devices: jit's "incompatible devices" before, naming one weight.
    on_low = "the target's weights are on devices [0, 1, 2, 3] (a mesh of {'data': 1, 'model': 4})"
    for t, dr, want in (
        (st, sharding.shard_drafter(dparams, high), on_low + " but the drafter's on devices [4, 5, 6, 7] (a mesh"),
        (st, jax.device_put(dparams, d[5]), on_low + " but the drafter's on device [5]:"),
        (jax.device_put(target, d[0]), jax.device_put(dparams, d[1]), "on device [0] but the drafter's on device [1]"),
    ):
        try:
            generate(t, dr, [[1, 2]], **kw)
            raise AssertionError(f"not refused: {want}")
        except ValueError as e:
            assert want in str(e), e
    # Supported: another mesh over the same devices, an uncommitted drafter, one device for both.
    wide, square = sharding.make_mesh(1, 8), sharding.make_mesh(2, 4)
    lower(sharding.shard_target(target, wide), sharding.shard_drafter(dparams, square), [[1, 2]], **kw)
    lower(st, dparams, [[1, 2]], **kw)
    lower(jax.device_put(target, d[2]), jax.device_put(dparams, d[2]), [[1, 2]], **kw)
    print("PLACEMENT OK")
    """
)

KV_SPLIT_SCRIPT = textwrap.dedent(
    """
    # The drafter attention kernel's refusal of KV heads the mesh cannot split names the mesh axis.
    import jax, jax.numpy as jnp
    from ddtree_jax import sharding
    from ddtree_jax.pallas.drafter_attention.api import drafter_attention

    f = lambda *s: jnp.zeros(s, jnp.float32)
    pos = jnp.zeros((2, 16), jnp.int32)
    da = (f(2, 16, 8, 16), f(2, 32, 2, 16), f(2, 32, 2, 16), jnp.asarray([20, 9], jnp.int32), pos,
          f(2, 16, 2, 16), f(2, 16, 2, 16))
    with jax.set_mesh(sharding.make_mesh(2, 4)):
        try:
            drafter_attention(*da, window=12, causal=True, implementation="pallas")
            raise AssertionError("a kv-head split unlike the query heads' was not refused")
        except ValueError as e:
            assert "the 2 key / value heads are not divisible by mesh axis 'model' of size 4" in str(e), e
    print("KV SPLIT OK")
    """
)


def test_target_and_drafter_on_other_devices_are_refused_naming_both():
    """Target on devices 0-3, drafter on 4-7 or on one other device: jit's "incompatible devices"
    named one weight of each; another mesh over the same devices keeps working."""
    proc = _run_on_8_devices(PLACEMENT_SCRIPT)
    assert "PLACEMENT OK" in proc.stdout, proc.stderr[-4000:]


def test_drafter_kv_heads_the_mesh_cannot_split_are_refused_naming_the_axis():
    proc = _run_on_8_devices(KV_SPLIT_SCRIPT)
    assert "KV SPLIT OK" in proc.stdout, proc.stderr[-4000:]


def test_logical_axes_cover_every_weight_of_the_full_size_models():
    """Abstract shapes only: every Kimi-K2 / DeepSeek-V3 / plain-q weight gets axes of its rank."""
    import jax

    from ddtree_jax import model

    mesh = type("FakeMesh", (), {"shape": {"data": 1, "model": 8}})()
    for cfg in (config.KIMI_K2, config.DEEPSEEK_V3, tiny(q_lora_rank=None, tie_word_embeddings=True)):
        shapes = model.abstract_params(cfg)
        axes = sharding.logical_axes(shapes)
        specs = jax.tree.map(lambda a, ax: sharding.spec_for(ax, a.shape, mesh), shapes, axes)
        if cfg is config.KIMI_K2:
            # 384 experts and 64 heads split 8 ways; the latent projection stays whole.
            assert specs.moe_layers.mlp.gate[1] == "model"
            assert specs.moe_layers.attn.q_b[2] == "model"
            assert specs.moe_layers.attn.kv_a == jax.sharding.PartitionSpec(None, None, None)


def test_spec_keeps_undividable_dims_replicated():
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(__import__("jax").devices()[:1]).reshape(1, 1), sharding.MESH_AXES)
    assert sharding.spec_for(("heads", None), (4, 3), mesh) == PartitionSpec("model", None)
    fake = type("FakeMesh", (), {"shape": {"data": 2, "model": 8}})()
    assert sharding.spec_for(("heads", "embed"), (12, 64), fake) == PartitionSpec(None, None)
    assert sharding.spec_for(("vocab", "embed"), (16, 64), fake) == PartitionSpec("model", None)
    # A tuple rule splits over the product, drops trailing axes until it divides, and an axis
    # one dimension took is not reused.
    cache = (None, "cache_batch", None, None)
    assert sharding.spec_for(cache, (2, 16, 8, 4), fake) == PartitionSpec(None, ("data", "model"), None, None)
    assert sharding.spec_for(cache, (2, 4, 8, 4), fake) == PartitionSpec(None, ("data",), None, None)
    assert sharding.spec_for(cache, (2, 1, 8, 4), fake) == PartitionSpec(None, None, None, None)
    q = ("cache_batch", None, "heads", None)
    assert sharding.spec_for(q, (16, 1, 8, 4), fake) == PartitionSpec(("data", "model"), None, None, None)
    assert sharding.spec_for(q, (2, 1, 8, 4), fake) == PartitionSpec(("data",), None, "model", None)
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(data=3, model=5)
    for bad, error, match in (
        (dict(data=0), ValueError, "mesh data size must be >= 1, got 0"),
        (dict(data=1, model=-1), ValueError, "mesh model size must be >= 1, got -1"),
        (dict(data=1.5), TypeError, "mesh data size must be an int, got 1.5"),
        (dict(data=1, model=True), TypeError, "mesh model size must be an int, got True"),
    ):
        with pytest.raises(error, match=match):
            sharding.make_mesh(**bad)
    with pytest.raises(ValueError, match="at least one device"):
        sharding.make_mesh(devices=[])


def test_rules_naming_no_axis_of_the_mesh_are_refused():
    """A misspelt mesh axis in custom rules was skipped: every weight it names stayed replicated,
    with no word (the tokens were right; a full-size model would not fit)."""
    import numpy as np
    from jax.sharding import Mesh

    from tests.conftest import random_target, tiny

    tiny_params = random_target(tiny(), seed=5)

    mesh = Mesh(np.array(__import__("jax").devices()[:1]).reshape(1, 1), sharding.MESH_AXES)
    with pytest.raises(ValueError, match=r"rule 'heads' -> 'tensor' names 'tensor', which is not an axis .*'data'"):
        sharding.shard_target(tiny_params, mesh, dict(sharding.RULES, heads="tensor"))
    with pytest.raises(ValueError, match=r"rule 'cache_batch' -> \('data', 'modle'\) names 'modle'"):
        sharding.shardings({}, {}, mesh, dict(sharding.RULES, cache_batch=("data", "modle")))
    with pytest.raises(ValueError, match="rule 'experts': 3 is not a mesh axis name"):
        sharding.shardings({}, {}, mesh, dict(sharding.RULES, experts=3))
    other = Mesh(np.array(__import__("jax").devices()[:1]).reshape(1, 1), ("x", "y"))  # default rules name none
    with pytest.raises(ValueError, match=r"names 'data', which is not an axis of the mesh \(its axes: \('x', 'y'\)\)"):
        sharding.shard_target(tiny_params, other)
    sharding.shard_target(tiny_params, mesh, dict(sharding.RULES, experts="data", heads=None))  # valid: placed


def test_drafter_axes_fit():

    dcfg = dflash.drafter_config_for(config.KIMI_K2, num_hidden_layers=3)
    shapes = dflash.abstract_params(dcfg)
    axes = sharding.logical_axes(shapes)
    assert axes.layers.q == ("layers", "embed", "heads", None)


LOAD_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, tracemalloc
    import jax, numpy as np
    from ddtree_jax import checkpoint, sharding
    from ddtree_jax.drafters import dflash

    def peak_host_bytes(load):  # numpy / Python heap high-water mark during load() (not device buffers)
        tracemalloc.start()
        out = jax.block_until_ready(load())
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return out, peak

    path = sys.argv[1]
    mesh = sharding.make_mesh(data=2, model=4)
    jax.block_until_ready(jax.device_put(np.zeros(4), jax.devices()[0]))  # runtime start-up, outside
    peaks = {}
    for name in ("dense", "int4"):
        d = os.path.join(path, name)
        params, peaks[name] = peak_host_bytes(lambda: checkpoint.load_target(d, mesh=mesh))
        host, peaks[name + "_host"] = peak_host_bytes(lambda: checkpoint.load_target(d))
        want = sharding.shard_target(host, mesh)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
            assert a.sharding == b.sharding, (a.sharding, b.sharding)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert params.moe_layers.mlp.gate.packed.sharding.spec[1] == "model"
    d, peaks["drafter"] = peak_host_bytes(lambda: dflash.load_drafter(os.path.join(path, "drafter"), mesh=mesh))
    want = sharding.shard_drafter(dflash.load_drafter(os.path.join(path, "drafter")), mesh)
    for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(want), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("PEAKS", json.dumps(peaks))
    print("LOADED ONTO SHARDS OK")
    """
)


def test_loading_onto_shards_equals_placing_after_loading(tmp_path):
    """load_target / load_drafter(mesh=...) read each tensor straight onto its shards: the same
    values and placements as shard_target(load_target(...)), dense and INT4, from many files,
    while the host holds about one tensor at a time (the host load holds the whole model)."""
    import json

    import jax
    import safetensors

    from ddtree_jax import checkpoint, model
    from tests.conftest import tiny

    # ~12.5 MB in 129 tensors (273 with INT4 experts); the largest, embed / lm_head, 4 MB.
    cfg = tiny(hidden_size=256, vocab_size=4096, num_hidden_layers=4, num_attention_heads=8, n_group=2, topk_group=1)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    checkpoint.save_hf(params, tmp_path / "dense", max_shard_bytes=nbytes // 6)
    checkpoint.save_hf(model.quantize_experts(params), tmp_path / "int4", max_shard_bytes=nbytes // 6)
    dcfg = dflash.drafter_config_for(cfg, num_hidden_layers=1, block_size=4, num_key_value_heads=8)
    dflash.save_drafter_hf(dflash.init_params(dcfg, jax.random.PRNGKey(1)), tmp_path / "drafter")
    largest = 0
    for f in (tmp_path / "dense").glob("*.safetensors"):
        with safetensors.safe_open(f, "numpy") as h:
            largest = max(largest, *(h.get_tensor(k).nbytes for k in h.keys()))  # noqa: SIM118 (not a dict)
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "LOADED ONTO SHARDS OK" in proc.stdout, proc.stderr[-4000:]
    peaks = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PEAKS "))[6:])
    assert largest == 4 * 4096 * 256 and nbytes > 2.5 * largest
    for name in ("dense", "int4", "drafter"):
        assert peaks[name] < 1.5 * largest, (name, peaks[name], largest)  # about one tensor
    for name in ("dense", "int4"):
        assert peaks[name + "_host"] > 0.9 * nbytes * (0.5 if name == "int4" else 1), peaks  # the measure has teeth
