"""INT4 routed experts (compressed-tensors pack-quantized, as Kimi-K2-Thinking / K2.5 ship them)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import ddtree_jax as dj
from ddtree_jax import checkpoint, compressed, model, quant
from ddtree_jax.config import ConfigError
from ddtree_jax.hf import CheckpointError
from ddtree_jax.pallas.moe.reference import moe_experts_reference, moe_experts_xla
from tests.conftest import HERE, hf_python, random_target, rewrite, same, tiny

PROMPTS = [[5, 17, 33, 2, 9], [250, 1]]


@pytest.fixture(scope="module")
def quantized():
    return model.quantize_experts(random_target(tiny(), seed=21))


def test_dequantize_experts_inverts_quantize_experts_up_to_rounding():
    dense = random_target(tiny(), seed=3)
    back = model.dequantize_experts(model.quantize_experts(dense, group_size=32))
    assert back.config == dense.config
    for name in ("gate", "up", "down"):
        a, b = getattr(dense.moe_layers.mlp, name), getattr(back.moe_layers.mlp, name)
        assert not isinstance(b, quant.QuantizedArray) and b.dtype == jnp.float32
        err = np.abs(np.asarray(a) - np.asarray(b))
        # Round to nearest: at most half a step, a step being the group's max |w| / 7.
        groups = np.abs(np.asarray(a)).reshape(*a.shape[:-2], -1, 32, a.shape[-1]).max(axis=-2, keepdims=True)
        bound = np.broadcast_to(groups / 7 / 2, (*groups.shape[:-2], 32, *groups.shape[-1:])).reshape(a.shape)
        assert np.all(err <= bound * 1.05 + 1e-8), name  # 1.05: the scale is stored bf16
        assert err.max() > 0
    assert same(back.dense_layers, dense.dense_layers) and same(back.moe_layers.attn, dense.moe_layers.attn)
    with pytest.raises(ValueError, match="not INT4"):
        model.dequantize_experts(dense)


def test_quantized_checkpoint_round_trips_and_says_so(quantized, tmp_path):
    checkpoint.save_hf(quantized, tmp_path)
    with open(tmp_path / "config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj"
    h, i = quantized.config.hidden_size, quantized.config.moe_intermediate_size
    assert stored[name + ".weight_packed"].shape == (i, h // 8) and stored[name + ".weight_packed"].dtype == np.int32
    assert stored[name + ".weight_scale"].shape == (i, h // 32)
    assert stored[name + ".weight_shape"].tolist() == [i, h]
    assert "model.layers.1.self_attn.o_proj.weight" in stored  # attention stays dense
    back = checkpoint.load_target(tmp_path)
    assert isinstance(back.moe_layers.mlp.gate, quant.QuantizedArray)
    assert same(back, quantized)


def test_scales_stored_wider_than_bf16_load_exactly_in_float32(quantized, tmp_path):
    """compressed-tensors writes an f32 model's group scales in f32. Loaded in float32 they stay
    f32 (rounded to bf16 they moved the logits by ~4e-3); in bf16 they are rounded like every
    other weight; the W4A16 kernel, which reads bf16 scales, refuses f32 ones by name."""
    from ddtree_jax.pallas.moe.w4a16 import check_w4a16

    checkpoint.save_hf(quantized, tmp_path)
    wider = np.float32(1 + 2**-12)  # no bf16 value: 8 bits of mantissa

    def widen(t):
        for k in [k for k in t if k.endswith(".weight_scale")]:
            t[k] = np.asarray(t[k], np.float32) * wider

    rewrite(tmp_path, widen)
    f32 = checkpoint.load_target(tmp_path, dtype="float32")
    gate = f32.moe_layers.mlp.gate
    assert gate.scale.dtype == np.float32
    want = np.asarray(quantized.moe_layers.mlp.gate.scale, np.float32) * wider
    np.testing.assert_array_equal(np.asarray(gate.scale), want)
    assert np.array_equal(gate.packed, quantized.moe_layers.mlp.gate.packed)
    g, u, d = (jax.tree.map(lambda a: a[0], getattr(f32.moe_layers.mlp, n)) for n in ("gate", "up", "down"))
    dense = [x.dequantize() for x in (g, u, d)]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, quantized.config.hidden_size)), jnp.float32)
    idx, w = jnp.asarray([[0, 1], [2, 3], [1, 4]], jnp.int32), jnp.full((3, 2), 0.5, jnp.float32)
    np.testing.assert_allclose(
        moe_experts_xla(x, idx, w, g, u, d), moe_experts_reference(x, idx, w, *dense), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="needs bfloat16 group scales, got float32"):
        check_w4a16(g, d)
    assert model.cast_params(f32, "bfloat16").moe_layers.mlp.gate.scale.dtype == jnp.bfloat16
    assert model.cast_params(f32, "float32").moe_layers.mlp.gate.scale.dtype == jnp.float32
    checkpoint.save_checkpoint(f32, tmp_path / "orbax")  # restored as loaded: f32 in float32
    assert same(checkpoint.restore_checkpoint(tmp_path / "orbax"), f32)
    restored = checkpoint.restore_checkpoint(tmp_path / "orbax", dtype="bfloat16")
    assert restored.moe_layers.mlp.gate.scale.dtype == jnp.bfloat16
    bf16 = checkpoint.load_target(tmp_path, dtype="bfloat16")
    assert bf16.moe_layers.mlp.gate.scale.dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(bf16.moe_layers.mlp.gate.scale, np.float32), want)


def test_int4_logits_are_those_of_the_dequantized_model(quantized, monkeypatch):
    """Exact numerics: the INT4 model is its dequantized dense model, token for token and bit for bit."""
    from ddtree_jax.pallas.moe import reference

    dense = model.dequantize_experts(quantized)
    kw = dict(max_new_tokens=16, stop_token_ids=())
    assert dj.generate(quantized, PROMPTS, **kw).to_lists() == dj.generate(dense, PROMPTS, **kw).to_lists()
    # The XLA paths match the reference: gather for decode, the dense pass for a few tokens;
    # (forced here) the grouped GEMM, over the whole small stack or over chunks of 3 of the 8
    # experts, the last padded.
    _check_xla_paths(quantized)  # t = 9: the dense pass
    monkeypatch.setattr(reference, "DENSE_MAX_TOKENS", 0)
    for all_bytes, chunk in ((reference.INT4_DEQUANT_ALL_BYTES, 8), (0, 3)):
        monkeypatch.setattr(reference, "INT4_DEQUANT_ALL_BYTES", all_bytes)
        monkeypatch.setattr(reference, "INT4_EXPERT_CHUNK", chunk)
        _check_xla_paths(quantized)


def _check_xla_paths(quantized):
    g, u, d = (jax.tree.map(lambda a: a[0], getattr(quantized.moe_layers.mlp, n)) for n in ("gate", "up", "down"))
    rng = np.random.default_rng(0)
    e, k = quantized.config.n_routed_experts, quantized.config.num_experts_per_tok
    for t in (1, 9):
        x = jnp.asarray(rng.normal(size=(t, quantized.config.hidden_size)), jnp.float32)
        idx = jnp.asarray(np.argsort(rng.uniform(size=(t, e)), axis=1)[:, :k], jnp.int32)
        w = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
        want = moe_experts_reference(x, idx, w, g, u, d)
        np.testing.assert_allclose(moe_experts_xla(x, idx, w, g, u, d), want, rtol=1e-5, atol=1e-5)


def test_hoisted_layers_give_the_same_forward(quantized, monkeypatch):
    """`hoist_layers` (per-layer weights, INT4 experts dequantized, before a decode loop)
    changes no bit of a forward. Under "exact" numerics and past UNROLL_MAX_LAYERS the stacks
    stay stacked, their experts dequantized; stacks over HOIST_MAX_BYTES are left alone."""
    from ddtree_jax.layers import OutMajor, Unstacked

    def int4(stack):
        is_q = lambda a: isinstance(a, quant.QuantizedArray)  # noqa: E731
        return any(is_q(a) for a in jax.tree.leaves(stack, is_leaf=is_q))

    cfg = quantized.config
    hoisted = model.hoist_layers(quantized, "fast")
    for stack in (hoisted.dense_layers, hoisted.moe_layers):
        assert isinstance(stack, Unstacked) and not int4(stack)
    assert len(hoisted.moe_layers) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    tokens = jnp.asarray([[5, 17, 33, 2, 9, 250, 1, 7, 7]], jnp.int32)
    positions = jnp.arange(9, dtype=jnp.int32)[None]
    cache = model.KVCache.init(cfg, 1, 16)
    mask = jnp.tril(jnp.ones((1, 9, 9), bool))

    def forward(numerics):
        return jax.jit(lambda p: model.forward(p, tokens, positions, cache, mask, tap_layers=(0, 1), numerics=numerics))

    exact = model.hoist_layers(quantized, "exact")
    assert not isinstance(exact.moe_layers, Unstacked) and not int4(exact.moe_layers)
    for run, prepared in ((forward("exact"), exact), (forward("fast"), hoisted)):  # fast last: used below
        want = run(quantized)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(run(prepared)), strict=True):
            np.testing.assert_array_equal(a, b)
    # The shared experts' gate and up held [I, H]: the same forward up to float32 rounding.
    monkeypatch.setattr(model, "HOIST_SHARED_OUT_MAJOR", True)
    out_major = model.hoist_layers(quantized, "fast")
    shared = out_major.moe_layers.layers[0].mlp.shared
    assert isinstance(shared.gate, OutMajor) and isinstance(shared.up, OutMajor)
    np.testing.assert_array_equal(shared.gate.t, hoisted.moe_layers.layers[0].mlp.shared.gate.T)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(run(out_major)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # The default (None): held [I, H] on a GPU only.
    monkeypatch.setattr(model, "HOIST_SHARED_OUT_MAJOR", None)
    assert not isinstance(model.hoist_layers(quantized, "fast").moe_layers.layers[0].mlp.shared.gate, OutMajor)
    with monkeypatch.context() as gpu:
        gpu.setattr(jax, "default_backend", lambda: "gpu")
        assert isinstance(model.hoist_layers(quantized, "fast").moe_layers.layers[0].mlp.shared.gate, OutMajor)
    monkeypatch.setattr(model, "HOIST_SHARED_OUT_MAJOR", False)
    monkeypatch.setattr(model, "HOIST_MAX_BYTES", 0)
    assert model.hoist_layers(quantized, "fast").moe_layers is quantized.moe_layers
    monkeypatch.setattr(model, "HOIST_MAX_BYTES", 1 << 30)
    monkeypatch.setattr(model, "UNROLL_MAX_LAYERS", 0)
    scanned = model.hoist_layers(quantized, "fast").moe_layers
    assert not isinstance(scanned, Unstacked) and not int4(scanned)
    # Where the Mosaic kernels would take the INT4 experts (a GPU's shapes), "fast" keeps them
    # INT4 for the kernels; "exact" runs them on XLA, so dequantizes them once all the same.
    monkeypatch.setattr(model, "resolve_moe", lambda *a, **k: "mosaic")
    assert int4(model.hoist_layers(quantized, "fast").moe_layers)
    assert not int4(model.hoist_layers(quantized, "exact").moe_layers)


def test_shared_expert_as_the_last_routed_one(quantized, monkeypatch):
    """HOIST_SHARED_AS_EXPERT: the hoisted "fast" stack holds the shared expert as routed expert
    E, chosen by every token with weight 1; a forward gives the unfolded one's hidden states up to
    float32 rounding on every XLA path (gather, dense pass, grouped GEMM), and the same counts."""
    from ddtree_jax.pallas.moe import reference

    cfg = quantized.config
    monkeypatch.setattr(model, "HOIST_SHARED_AS_EXPERT", True)
    folded = model.hoist_layers(quantized, "fast")
    mlp = folded.moe_layers.layers[0].mlp
    assert isinstance(mlp.shared, model.SharedAsExpert) and mlp.gate.shape[0] == cfg.n_routed_experts + 1
    np.testing.assert_array_equal(mlp.down[-1], quantized.moe_layers.mlp.shared.down[0])
    assert model.hoist_layers(quantized, "exact").moe_layers.mlp.shared is not None  # "exact": kept apart
    monkeypatch.setattr(model, "HOIST_SHARED_AS_EXPERT", False)
    plain = model.hoist_layers(quantized, "fast")
    for t, dense_max in ((1, 128), (9, 128), (9, 0)):
        monkeypatch.setattr(reference, "DENSE_MAX_TOKENS", dense_max)
        tokens = jnp.asarray([[5, 17, 33, 2, 9, 250, 1, 7, 7][:t]], jnp.int32)
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        cache, mask = model.KVCache.init(cfg, 1, 16), jnp.tril(jnp.ones((1, t, t), bool))
        want, got = (
            model.forward(p, tokens, positions, cache, mask, numerics="fast", implementation="xla")
            for p in (plain, folded)
        )
        np.testing.assert_allclose(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(got.expert_counts, want.expert_counts)


def test_forward_looped_over_layers_equals_unrolled(quantized):
    """`unroll_layers=False` (the prefill's loop over each layer stack, one compiled body a kind)
    computes the unrolled "fast" forward: same kv, hidden states and taps."""
    cfg = quantized.config
    tokens = jnp.asarray([[5, 17, 33, 2, 9, 250, 1, 7, 7]], jnp.int32)
    positions = jnp.arange(9, dtype=jnp.int32)[None]
    cache = model.KVCache.init(cfg, 1, 16)
    mask = jnp.tril(jnp.ones((1, 9, 9), bool))

    def run(unroll):
        fn = lambda p: model.forward(  # noqa: E731
            p, tokens, positions, cache, mask, tap_layers=(0, 1), numerics="fast", unroll_layers=unroll
        )
        return jax.jit(fn)(quantized), jax.jit(fn).lower(quantized).as_text().count("stablehlo.while")

    (want, unrolled_loops), (got, loops) = run(True), run(False)
    # A loop over the 2 MoE layers; jax runs the 1-layer dense stack's scan unrolled anyway.
    assert loops == unrolled_loops + 1
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_quantized_greedy_ddtree_equals_quantized_ar(quantized):
    """With a partly wrong drafter (so trees are partly rejected), in both numerics."""
    kw = dict(max_new_tokens=16, stop_token_ids=())  # the exact AR loop is the logits test's
    for numerics in ("exact", "fast"):
        oracle = dj.OracleDrafter(block_size=4, confidence=3.0, noise=2.0)
        tree = dj.generate(quantized, oracle, PROMPTS, method="ddtree", tree_budget=8, numerics=numerics, **kw)
        assert tree.to_lists() == dj.generate(quantized, PROMPTS, numerics=numerics, **kw).to_lists()
        assert 1 < tree.tau < 4  # some drafts accepted, some not
    with pytest.raises(NotImplementedError, match="INT4 experts run with implementation='xla'"):
        dj.generate(quantized, PROMPTS, implementation="pallas", **kw)


def test_our_packing_is_compressed_tensors(quantized, tmp_path):
    """compressed-tensors (HF environment) decompresses our files to our dequantized weights
    (in its bf16 scale dtype), and packs our weights with our scales into our words, bit for bit."""
    py = hf_python()
    if py is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs the HF reference environment: run `make venv-hf`")
        pytest.skip("HF reference environment missing: `make venv-hf` creates .venv-hf")
    checkpoint.save_hf(quantized, tmp_path / "q")
    stored = safetensors.numpy.load_file(tmp_path / "q" / "model.safetensors")
    mlp, first = quantized.moe_layers.mlp, quantized.config.num_dense_layers
    dense = {}
    for name in (k for k in stored if k.endswith(".weight_packed")):
        base = name.removesuffix(".weight_packed")
        parts = base.split(".")  # model.layers.L.mlp.experts.E.gate_proj
        layer, expert, kind = int(parts[2]) - first, int(parts[5]), parts[6].removesuffix("_proj")
        w = jax.tree.map(lambda a, layer=layer, expert=expert: a[layer, expert], getattr(mlp, kind))
        dense[base + ".weight"] = np.asarray(w.dequantize(jnp.float32)).T.copy()
    np.savez(tmp_path / "dense.npz", **dense)
    out = tmp_path / "ct.npz"
    proc = subprocess.run(
        [
            py,
            os.path.join(HERE, "ct_reference.py"),
            str(tmp_path / "q" / "model.safetensors"),
            str(tmp_path / "dense.npz"),
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = np.load(out)
    assert len(dense) == 3 * quantized.config.n_routed_experts * quantized.config.num_moe_layers
    for name, ours in dense.items():
        bf16 = ours.astype(jnp.bfloat16).astype(np.float32)  # compressed-tensors dequantizes into the scale dtype
        np.testing.assert_array_equal(ref[name], bf16, err_msg=name)
        packed = name.removesuffix(".weight") + ".weight_packed"
        np.testing.assert_array_equal(ref[packed], stored[packed], err_msg=packed)


def test_the_quantize_command_writes_what_load_target_reads(tmp_path):
    src = random_target(tiny(), seed=5)
    checkpoint.save_hf(src, tmp_path / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree_jax", "quantize", str(tmp_path / "src"), str(tmp_path / "dst")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "as INT4 (group size 32)" in proc.stdout, proc.stderr[-2000:]
    assert same(checkpoint.load_target(tmp_path / "dst"), model.quantize_experts(src))
    again = subprocess.run(
        [sys.executable, "-m", "ddtree_jax", "quantize", str(tmp_path / "dst"), str(tmp_path / "x")],
        capture_output=True,
        text=True,
    )
    assert (
        again.returncode == 1 and again.stderr.strip() == "error: the routed experts are INT4 already (group size 32)"
    )


def test_kimi_k25_layout_loads_and_skips_vision_weights(quantized, tmp_path):
    """K2.5 wraps the text model: `text_config`, `language_model.` names, vision tensors beside them."""
    checkpoint.save_hf(quantized, tmp_path)
    with open(tmp_path / "config.json") as f:
        text = json.load(f)
    qc = text.pop("quantization_config")
    wrapper = {"model_type": "kimi_k25", "text_config": text, "quantization_config": qc, "vision_config": {}}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(wrapper, f)

    def wrap(t):
        for k in list(t):
            t["language_model." + k] = t.pop(k)
        t["vision_tower.blocks.0.attn.qkv.weight"] = np.zeros((6, 4), np.float32)
        t["mm_projector.proj.0.weight"] = np.zeros((4, 4), np.float32)

    rewrite(tmp_path, wrap)
    with pytest.warns(UserWarning, match="skipped 2 vision tensors"):
        back = checkpoint.load_target(tmp_path)
    assert same(back, quantized)


def test_full_size_int4_kimi_k2_is_about_the_size_moonshot_ships():
    """About 0.6 TB: INT4 routed experts (with bf16 group scales), everything else bf16."""
    import dataclasses

    cfg = dataclasses.replace(dj.KIMI_K2, expert_int4_group_size=32)
    shapes = model.abstract_params(cfg)
    nbytes = quant.nbytes(shapes)
    assert 0.55e12 < nbytes < 0.65e12, nbytes
    assert shapes.moe_layers.mlp.gate.packed.shape == (60, 384, 7168 // 32, 2048, 32)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda qc: qc.update(quant_method="fp8"), r"quantization_config\.quant_method='fp8' is not supported"),
        (lambda qc: qc.update(format="int-quantized"), r"quantization_config\.format='int-quantized'"),
        (
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=12),
            r"config_groups\.group_0\.weights\.group_size=12 is not supported \(a multiple of 8",
        ),
        (
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8),
            r"weights\.num_bits=8 is not supported",
        ),
        (
            lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False),
            r"weights\.symmetric=False",
        ),
        (
            lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
            r"input_activations must be null",
        ),
        (
            lambda qc: qc["config_groups"]["group_0"].update(output_activations={"num_bits": 8}),
            r"output_activations must be null",
        ),
        (lambda qc: qc["config_groups"].update(group_1={}), "exactly one scheme"),
    ],
)
def test_unsupported_quantization_configs_name_the_field(edit, message):
    qc = compressed.quantization_config(32)
    edit(qc)
    with pytest.raises(ConfigError, match=message):
        compressed.expert_group_size({"quantization_config": qc})


def test_other_group_sizes_load_back(tmp_path):
    """Groups other than K2.5's 32 (compressed-tensors' W4A16 preset uses 128) save and load,
    HF and orbax alike (they used to save, then be refused on load); "auto" keeps them on XLA."""
    from ddtree_jax.pallas.moe.api import _mosaic_takes

    assert compressed.expert_group_size({"quantization_config": compressed.quantization_config(128)}) == 128
    q16 = model.quantize_experts(random_target(tiny(), seed=5), group_size=16)
    checkpoint.save_hf(q16, tmp_path / "hf")
    assert same(checkpoint.load_target(tmp_path / "hf"), q16)
    checkpoint.save_checkpoint(q16, tmp_path / "orbax")
    assert same(checkpoint.restore_checkpoint(tmp_path / "orbax"), q16)

    # "auto" on an EP-8 shard of Kimi-K2's experts (shapes only): the kernel in groups of 32 alone.
    def shard(group):
        def q(fan_in, fan_out):
            return quant.Int4(group).stored((48, fan_in, fan_out))

        return q(7168, 2048), q(7168, 2048), q(2048, 7168)

    assert _mosaic_takes(*shard(32)) and not _mosaic_takes(*shard(128))  # 128: the kernel tiles it, untried


def test_bad_quantized_tensors_are_named(quantized, tmp_path):
    checkpoint.save_hf(quantized, tmp_path)
    name = "model.layers.1.mlp.experts.2.down_proj"
    rewrite(tmp_path, lambda t: t.update({name + ".weight_packed": t[name + ".weight_packed"][:, :-1].copy()}))
    with pytest.raises(CheckpointError, match=rf"'{name}\.weight_packed' .* has shape"):
        checkpoint.load_target(tmp_path)
    checkpoint.save_hf(quantized, tmp_path)
    rewrite(tmp_path, lambda t: t.update({name + ".weight_shape": np.asarray([1, 2], np.int64)}))
    with pytest.raises(CheckpointError, match=rf"{name}\.weight_shape is \[1, 2\]"):
        checkpoint.load_target(tmp_path)
    checkpoint.save_hf(quantized, tmp_path)
    attn = "model.layers.0.self_attn.o_proj"
    rewrite(tmp_path, lambda t: t.update({attn + ".weight_packed": np.zeros((4, 4), np.int32)}))
    with pytest.raises(CheckpointError, match=rf"'{attn}\.weight_packed' is pack-quantized, but only routed experts"):
        checkpoint.load_target(tmp_path)
    # One expert kept dense (compressed-tensors' `ignore` can do that): named, not "missing weight ...".
    checkpoint.save_hf(quantized, tmp_path)
    w = quantized.moe_layers.mlp.down.dequantize(jnp.float32)[0, 2].T  # layer 1 is the first MoE layer

    def keep_dense(t):
        for part in ("weight_packed", "weight_scale", "weight_shape"):
            del t[f"{name}.{part}"]
        t[f"{name}.weight"] = np.asarray(w)

    rewrite(tmp_path, keep_dense)
    with pytest.raises(CheckpointError, match=rf"'{name}\.weight' is stored unquantized, .* not supported"):
        checkpoint.load_target(tmp_path)
    dense = random_target(tiny(), seed=1)
    checkpoint.save_hf(dense, tmp_path / "d")
    rewrite(tmp_path / "d", lambda t: t.update({name + ".weight_packed": np.zeros((4, 4), np.int32)}))
    with pytest.raises(CheckpointError, match="is pack-quantized, but only routed experts may be"):
        checkpoint.load_target(tmp_path / "d")


def test_bits_and_nbytes_count_every_dtype_as_stored():
    dtypes = (jnp.int4, jnp.uint4, jnp.int8, jnp.bfloat16, jnp.float32, jnp.bool_)
    assert [quant.bits(d) for d in dtypes] == [4, 4, 8, 16, 32, 8]
    tree = [jnp.zeros((3, 4), jnp.bool_), jnp.zeros((8,), jnp.int4), jax.ShapeDtypeStruct((2,), jnp.float32)]
    assert quant.nbytes(tree) == 12 + 4 + 8
