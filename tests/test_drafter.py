"""The DFlash drafter: a float64 reference, cache semantics, HF checkpoints and configs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from ddtree_jax.config import ConfigError
from ddtree_jax.drafters import dflash
from ddtree_jax.drafters.dflash import DrafterCache, DrafterConfig
from ddtree_jax.hf import CheckpointError
from tests.conftest import rewrite, same, tiny

CFG = DrafterConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=256,
    block_size=6,
    target_layer_ids=(0, 2),
    mask_token_id=255,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    num_target_layers=3,
)
CAPACITY = 24
LENGTHS = np.array([5, 11])  # committed context per row
C = 12  # context width of the extend call (>= max LENGTHS)


def random_params(cfg=CFG, seed=0):
    """Large enough weights for peaked attention; norms random so that each of them matters."""
    params = dflash.init_params(cfg, jax.random.PRNGKey(seed), std=0.15)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 8))

    def norm(a):
        return 1.0 + 0.3 * jax.random.normal(next(keys), a.shape, a.dtype)

    layers = params.layers.replace(
        input_norm=norm(params.layers.input_norm),
        post_norm=norm(params.layers.post_norm),
        q_norm=norm(params.layers.q_norm),
        k_norm=norm(params.layers.k_norm),
    )
    return params.replace(layers=layers, hidden_norm=norm(params.hidden_norm), norm=norm(params.norm))


@pytest.fixture(scope="module")
def params():
    return random_params()


@pytest.fixture(scope="module")
def inputs():
    """Target tables, context features and a block per row, all numpy."""
    rng = np.random.default_rng(0)
    h, v, b = CFG.hidden_size, CFG.vocab_size, len(LENGTHS)
    embed = rng.normal(size=(v, h)).astype(np.float32)
    unembed = (0.15 * rng.normal(size=(h, v))).astype(np.float32)
    features = rng.normal(size=(b, C, CFG.n_taps * h)).astype(np.float32)
    block = np.full((b, CFG.block_size), CFG.mask_token_id, np.int32)
    block[:, 0] = rng.integers(0, v - 1, size=b)
    block_pos = (LENGTHS[:, None] + np.arange(CFG.block_size)[None]).astype(np.int32)
    return dict(embed=embed, unembed=unembed, features=features, block=block, block_pos=block_pos)


extend = jax.jit(dflash.extend_context)
run_draft = jax.jit(dflash.draft)


def context_cache(params, features, lengths=LENGTHS, cache=None):
    """Extends an empty cache with features[b, :lengths[b]] at positions 0 .."""
    b, c = features.shape[:2]
    cache = DrafterCache.init(params.config, b, CAPACITY) if cache is None else cache
    idx = np.arange(c)[None].repeat(b, 0).astype(np.int32)
    return extend(params, cache, jnp.asarray(features), jnp.asarray(idx), jnp.asarray(idx < lengths[:, None]))


def draft_logits(params, cache, inp, block=None):
    block = inp["block"] if block is None else block
    return np.asarray(run_draft(params, cache, inp["embed"], inp["unembed"], block, inp["block_pos"]))


# ----------------------------------------------------------------------------------
# Independent float64 reference, on the HF (torch [out, in]) tensors


def ref_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def ref_rope(x, pos, theta):  # x [T, N, hd], pos [T]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
    return x * np.cos(ang) + rotated * np.sin(ang)


def ref_draft(w, cfg, features, ctx_pos, embed, unembed, tokens, pos):
    """One row: features [L, n_taps*H] at ctx_pos [L]; block tokens/pos [T] -> logits [T-1, V].

    A sliding layer (HF Qwen3 rule) hides context keys with q - k >= sliding_window; a causal
    layer hides the block keys after the query.
    """
    eps, hd, nq, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    w = {k: np.asarray(a, np.float64) for k, a in w.items()}
    ctx = ref_rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[tokens].astype(np.float64)
    t = len(tokens)
    for i in range(cfg.num_hidden_layers):
        p = {k.removeprefix(f"layers.{i}."): a for k, a in w.items() if k.startswith(f"layers.{i}.")}

        def kv(src, src_pos, p=p):
            k = (src @ p["self_attn.k_proj.weight"].T).reshape(len(src), nkv, hd)
            k = ref_rope(ref_rms(k, p["self_attn.k_norm.weight"], eps), src_pos, cfg.rope_theta)
            return k, (src @ p["self_attn.v_proj.weight"].T).reshape(len(src), nkv, hd)

        h = ref_rms(x, p["input_layernorm.weight"], eps)
        q = (h @ p["self_attn.q_proj.weight"].T).reshape(t, nq, hd)
        q = ref_rope(ref_rms(q, p["self_attn.q_norm.weight"], eps), pos, cfg.rope_theta)
        (kc, vc), (kb, vb) = kv(ctx, ctx_pos), kv(h, pos)
        k = np.repeat(np.concatenate([kc, kb]), nq // nkv, axis=1)  # HF repeat_kv
        v = np.repeat(np.concatenate([vc, vb]), nq // nkv, axis=1)
        s = np.einsum("tnd,snd->nts", q, k) * hd**-0.5
        if cfg.types[i] == "sliding_attention":
            far = pos[:, None] - ctx_pos[None, :] >= cfg.sliding_window  # [T, L]
            s[:, :, : len(ctx_pos)] = np.where(far[None], -np.inf, s[:, :, : len(ctx_pos)])
        if cfg.causal_layers[i]:
            later = pos[None, :] > pos[:, None]  # [T, T] block key after the query
            s[:, :, len(ctx_pos) :] = np.where(later[None], -np.inf, s[:, :, len(ctx_pos) :])
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("nts,snd->tnd", a, v).reshape(t, nq * hd)
        x = x + o @ p["self_attn.o_proj.weight"].T
        h = ref_rms(x, p["post_attention_layernorm.weight"], eps)
        g = h @ p["mlp.gate_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
    return ref_rms(x, w["norm.weight"], eps)[1:] @ unembed.astype(np.float64)


# Layer 1 slides with window 8: row 1 (11 context tokens) loses its oldest keys there, and
# (DFlash's rule for sliding layers) its block attention is causal.
SLIDING = dataclasses.replace(CFG, layer_types=("full_attention", "sliding_attention"), sliding_window=8)


@pytest.mark.parametrize(
    "cfg",
    [CFG, SLIDING, dataclasses.replace(SLIDING, is_causal=False), dataclasses.replace(CFG, is_causal=True)],
    ids=["full", "sliding", "sliding-bidirectional", "all-causal"],
)
def test_draft_matches_float64_reference(cfg, inputs, tmp_path):
    params = random_params(cfg)
    dflash.save_drafter_hf(params, tmp_path)
    hf = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    got = draft_logits(params, context_cache(params, inputs["features"]), inputs)
    assert got.shape == (len(LENGTHS), CFG.block_size - 1, CFG.vocab_size)
    assert got.dtype == np.float32
    for b, n in enumerate(LENGTHS):
        want = ref_draft(
            hf,
            cfg,
            inputs["features"][b, :n].astype(np.float64),
            np.arange(n),
            inputs["embed"],
            inputs["unembed"],
            inputs["block"][b],
            inputs["block_pos"][b],
        )
        assert np.abs(want).max() > 1.0  # logits far from flat: the comparison has teeth
        np.testing.assert_allclose(got[b], want, atol=1e-4, rtol=1e-4)


def test_sliding_window_hides_exactly_the_far_context(inputs):
    """Row 1's block sits at 11 .. 16: a window of 8 hides context 0 .. 3 from all its queries."""
    full = random_params(CFG)
    sliding = full.replace(config=dataclasses.replace(SLIDING, layer_types=("sliding_attention",) * 2))
    garbage = inputs["features"].copy()
    garbage[1, :4] = 5 * np.random.default_rng(9).normal(size=garbage[1, :4].shape)
    for params, hidden in ((sliding, True), (full, False)):
        clean = draft_logits(params, context_cache(params, inputs["features"]), inputs)
        noisy = draft_logits(params, context_cache(params, garbage), inputs)
        np.testing.assert_array_equal(clean[0], noisy[0])  # row 0 untouched
        assert np.array_equal(clean[1], noisy[1]) == hidden


def test_bf16_params_run_close_to_float32(params, inputs):
    want = draft_logits(params, context_cache(params, inputs["features"]), inputs)
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    cache = DrafterCache.init(CFG, len(LENGTHS), CAPACITY, jnp.bfloat16)
    got = draft_logits(p16, context_cache(p16, inputs["features"], cache=cache), inputs)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=0.15)


# ----------------------------------------------------------------------------------
# Cache semantics


def test_extend_in_two_pieces_equals_all_at_once(params, inputs):
    whole = context_cache(params, inputs["features"])
    split = np.array([2, 7])  # per row: first piece width
    b = len(LENGTHS)
    idx = np.arange(C)[None].repeat(b, 0)
    cache = DrafterCache.init(CFG, b, CAPACITY)
    cache = extend(params, cache, inputs["features"], idx.astype(np.int32), idx < split[:, None])
    np.testing.assert_array_equal(cache.lengths, split)
    pos2 = split[:, None] + idx
    feats2 = np.take_along_axis(inputs["features"], np.minimum(pos2, C - 1)[..., None], axis=1)
    cache = extend(params, cache, feats2, pos2.astype(np.int32), pos2 < LENGTHS[:, None])
    np.testing.assert_array_equal(cache.lengths, LENGTHS)
    np.testing.assert_allclose(draft_logits(params, cache, inputs), draft_logits(params, whole, inputs), atol=1e-6)
    for row, n in enumerate(LENGTHS):
        np.testing.assert_allclose(cache.k[:, row, :n], whole.k[:, row, :n], atol=1e-6)
        np.testing.assert_allclose(cache.v[:, row, :n], whole.v[:, row, :n], atol=1e-6)


def test_layers_split_for_the_loop_change_no_bit(params, inputs):
    """`DFlashDrafter.for_loop` (per-layer weights, as the decode loop holds them): the same
    context cache and draft logits, bit for bit."""
    from ddtree_jax.drafters import DFlashDrafter
    from ddtree_jax.layers import Unstacked

    split = DFlashDrafter(params=params, block_size=CFG.block_size).for_loop().params
    assert isinstance(split.layers, Unstacked) and len(split.layers) == CFG.num_hidden_layers
    whole, parts = context_cache(params, inputs["features"]), context_cache(split, inputs["features"])
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(parts), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(draft_logits(split, whole, inputs), draft_logits(params, whole, inputs))


def test_invalid_entries_and_stale_slots_are_ignored(params, inputs):
    clean = draft_logits(params, context_cache(params, inputs["features"]), inputs)
    rng = np.random.default_rng(1)
    b = len(LENGTHS)
    idx = np.arange(C)[None].repeat(b, 0)
    valid = idx < LENGTHS[:, None]
    # Invalid entries: huge features at positions that collide with valid slots or exceed capacity.
    feats = np.where(valid[..., None], inputs["features"], 1e3 * rng.normal(size=inputs["features"].shape))
    pos = idx.copy()
    pos[~valid] = np.resize([0, CAPACITY, 3, CAPACITY + 7, 12, 20], (~valid).sum())
    pos = pos.astype(np.int32)
    stale = DrafterCache.init(CFG, b, CAPACITY)
    stale = stale.replace(k=stale.k + 1e4, v=stale.v - 1e4)  # slots >= lengths keep these
    cache = extend(params, stale, feats.astype(np.float32), pos, valid)
    np.testing.assert_array_equal(cache.lengths, LENGTHS)
    np.testing.assert_allclose(draft_logits(params, cache, inputs), clean, atol=1e-5)
    # The poison is live: one more visible slot changes the logits completely.
    exposed = draft_logits(params, cache.replace(lengths=cache.lengths + 1), inputs)
    assert np.abs(exposed - clean).max() > 1.0


def test_block_attention_is_not_causal(params, inputs):
    cache = context_cache(params, inputs["features"])
    base = draft_logits(params, cache, inputs)
    block = inputs["block"].copy()
    block[:, -1] = 7  # the last slot: every other slot sits before it
    changed = draft_logits(params, cache, inputs, block)
    diff = np.abs(changed - base).max(axis=-1)  # [B, T-1]
    assert (diff[:, :-1] > 1e-3).all()


def test_causal_block_attention_hides_later_slots(inputs):
    params = random_params(dataclasses.replace(CFG, is_causal=True))
    cache = context_cache(params, inputs["features"])
    block = inputs["block"].copy()
    block[:, 3] = 7  # slot 3: logits of slots 1 .. 2 are computed before it, 3 .. on see it
    base, changed = draft_logits(params, cache, inputs), draft_logits(params, cache, inputs, block)
    np.testing.assert_array_equal(changed[:, :2], base[:, :2])
    assert (np.abs(changed[:, 2:] - base[:, 2:]).max(axis=-1) > 1e-3).all()


def test_rows_are_independent(params, inputs):
    both = draft_logits(params, context_cache(params, inputs["features"]), inputs)
    for b in range(len(LENGTHS)):
        one = {k: v[b : b + 1] if k in ("features", "block", "block_pos") else v for k, v in inputs.items()}
        cache = context_cache(params, one["features"], LENGTHS[b : b + 1])
        np.testing.assert_allclose(draft_logits(params, cache, one), both[b : b + 1], atol=1e-5)


def test_tap_features_concatenates_layer_major():
    taps = np.random.default_rng(2).normal(size=(3, 2, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(dflash.tap_features(taps), np.concatenate(list(taps), axis=-1))


# ----------------------------------------------------------------------------------
# HF checkpoints


def test_hf_round_trip(params, tmp_path):
    dflash.save_drafter_hf(params, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    loaded = dflash.load_drafter(tmp_path)
    assert loaded.config == CFG
    assert same(loaded, params)
    assert dflash.load_drafter(tmp_path, dtype="bfloat16").fc.dtype == jnp.bfloat16


def test_model_prefix_is_accepted(params, tmp_path):
    dflash.save_drafter_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t)}))
    assert same(dflash.load_drafter(tmp_path), params)


def test_missing_weight_is_named(params, tmp_path):
    dflash.save_drafter_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing weight 'layers\.1\.self_attn\.k_norm\.weight'"):
        dflash.load_drafter(tmp_path)


def test_misshaped_weight_is_named(params, tmp_path):
    dflash.save_drafter_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"fc.weight": np.zeros((64, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"'fc\.weight'.*shape \(64, 64\), expected \(64, 128\)"):
        dflash.load_drafter(tmp_path)


def test_extra_weight_is_named(params, tmp_path):
    dflash.save_drafter_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"embed_tokens.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected weight.*'embed_tokens\.weight'"):
        dflash.load_drafter(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dflash.load_drafter(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        dflash.load_drafter(tmp_path)


# ----------------------------------------------------------------------------------
# Configs

PUBLISHED = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
PUBLISHED_CFG = DrafterConfig(
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    block_size=16,
    target_layer_ids=(1, 9, 17, 25, 33),
    mask_token_id=151669,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    num_target_layers=36,
    max_position_embeddings=40960,
)


def test_published_config():
    assert DrafterConfig.from_hf_config(PUBLISHED) == PUBLISHED_CFG
    assert PUBLISHED_CFG.n_taps == 5


@pytest.mark.parametrize("cfg", [PUBLISHED_CFG, CFG, dataclasses.replace(CFG, num_target_layers=None)])
def test_config_round_trip(cfg):
    assert DrafterConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg


def test_sliding_window_configs():
    """Qwen3Config's rules: the window needs use_sliding_window; absent layer_types slide from max_window_layers."""
    hf = {**PUBLISHED, "layer_types": None, "use_sliding_window": True, "sliding_window": 2048, "max_window_layers": 2}
    cfg = DrafterConfig.from_hf_config(hf)
    assert cfg.types == ("full_attention",) * 2 + ("sliding_attention",) * 3
    assert cfg.windows == (2**31 - 1,) * 2 + (2048,) * 3
    assert DrafterConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg
    # A window without use_sliding_window is ignored by HF, as here.
    assert DrafterConfig.from_hf_config({**PUBLISHED, "sliding_window": 2048}) == PUBLISHED_CFG
    with pytest.raises(ConfigError, match="no layer is sliding_attention"):
        dataclasses.replace(CFG, sliding_window=8)
    # with_sliding_window: every layer slides; None / 0 back to full.
    # The block attention stays bidirectional (DFlash's rule alone would make sliding layers causal).
    slid = dataclasses.replace(SLIDING, layer_types=("sliding_attention",) * 2, is_causal=False)
    assert CFG.with_sliding_window(8) == slid and slid.causal_layers == (False, False)
    unslid = dataclasses.replace(CFG, is_causal=False)
    assert CFG.with_sliding_window(8).with_sliding_window(0) == CFG.with_sliding_window(None) == unslid
    assert SLIDING.with_sliding_window(None).causal_layers == (False, False)  # mixed: the rule stays
    with pytest.raises(ConfigError, match="block_size=6"):
        CFG.with_sliding_window(4)
    # All-full layer types are normalised away, so replace() can change the depth.
    assert dataclasses.replace(CFG, layer_types=("full_attention",) * 2) == CFG
    assert dataclasses.replace(CFG, num_hidden_layers=3).types == ("full_attention",) * 3


def test_a_window_left_out_is_qwen3_configs_default():
    """use_sliding_window with no sliding_window key: Qwen3Config's 4096, so the published model makes
    the layers from max_window_layers on sliding, and so causal among the block. Read as no window,
    they were full and bidirectional: other draft logits, no error (found against the published model)."""
    hf = {k: v for k, v in PUBLISHED.items() if k not in ("sliding_window", "layer_types")}
    cfg = DrafterConfig.from_hf_config({**hf, "use_sliding_window": True, "max_window_layers": 2})
    assert cfg.types == ("full_attention",) * 2 + ("sliding_attention",) * 3
    assert cfg.sliding_window == 4096 and cfg.causal_layers == (False,) * 2 + (True,) * 3
    # An explicit null is no window: every layer full, as Qwen3Config makes them.
    null = {**hf, "use_sliding_window": True, "sliding_window": None, "max_window_layers": 2}
    assert DrafterConfig.from_hf_config(null) == PUBLISHED_CFG


# Shaped after z-lab/Kimi-K2.5-DFlash's public model card (hidden, layers, heads, intermediate,
# vocab, max positions, YaRN factor 64 and theta 50 000). The card does not give head_dim, YaRN's
# original window, the taps or the mask id: those are assumptions (Qwen3's default head_dim,
# 262144 / 64, DFlash's default taps for 61 layers, a late vocabulary id).
KIMI_K25_DFLASH_HF = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 7168,
    "num_hidden_layers": 6,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 18432,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "num_target_layers": 61,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
}


def test_the_kimi_k25_drafter_config_loads_with_yarn():
    cfg = DrafterConfig.from_hf_config(KIMI_K25_DFLASH_HF)
    assert cfg == dflash.KIMI_K25_DFLASH
    assert cfg.rope_scaling.factor == 64.0 and cfg.rope_theta == 50000.0
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 8, 128)
    assert DrafterConfig.from_hf_config(cfg.to_hf_config()) == cfg
    shapes = dflash.abstract_params(cfg)
    n = sum(a.size for a in jax.tree.leaves(shapes))
    assert 3.0e9 < n < 4.0e9, n  # about 3.5B parameters (embedding and lm_head are the target's)
    # YaRN changes the rotation (and scales it by its attention factor).
    plain = dataclasses.replace(cfg, rope_scaling=None)
    pos = jnp.asarray([[0, 5000, 100000]])
    cos_y, _ = dflash._rope(cfg, pos)
    cos_p, _ = dflash._rope(plain, pos)
    assert not np.allclose(cos_y, cos_p)
    assert float(cos_y[0, 0, 0]) == pytest.approx(0.1 * np.log(64.0) + 1.0, rel=1e-6)


def test_transformers5_rope_parameters():
    hf = {k: v for k, v in PUBLISHED.items() if k not in ("rope_theta", "rope_scaling")}
    hf["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    assert DrafterConfig.from_hf_config(hf).rope_theta == 500000.0


@pytest.mark.parametrize(
    ("layers", "targets", "want"),
    [(5, 36, (1, 9, 17, 25, 33)), (1, 36, (18,)), (3, 28, (1, 13, 25)), (2, 61, (1, 58))],
)
def test_default_target_layer_ids(layers, targets, want):
    hf = {**PUBLISHED, "num_hidden_layers": layers, "num_target_layers": targets, "layer_types": None}
    hf["dflash_config"] = {"mask_token_id": 151669}
    assert DrafterConfig.from_hf_config(hf).target_layer_ids == want


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"block_size": 1}, "block_size"),
        ({"num_key_value_heads": 5}, "divisible by num_key_value_heads=5"),
        ({"head_dim": 127}, "head_dim"),
        # 0 is not "absent" (it used to read as the default: num_attention_heads, hidden / heads).
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive int, got 0"),
        ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number, got 'x'"),
        ({"rms_norm_eps": None}, "rms_norm_eps must be a number, got None"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope type 'linear'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope type 'dynamic'"),
        ({"layer_types": ["sliding_attention"] * 5}, "sliding_attention layers but no window"),
        # Before: "argument of type 'int' is not iterable"; a string was searched for a substring.
        ({"layer_types": 5}, "layer_types must be a list of one type per layer, got 5"),
        ({"layer_types": "sliding_attention"}, "layer_types must be a list of one type per layer, got 'sliding"),
        ({"layer_types": ["sliding_attention"] * 5, "use_sliding_window": True, "sliding_window": 8}, "block_size=16"),
        ({"layer_types": ["full_attention"] * 4}, "one type per layer"),
        ({"layer_types": ["chunked_attention"] * 5}, "chunked_attention"),
        ({"dflash_config": {"target_layer_ids": [1, 9]}}, "mask_token_id"),
        ({"dflash_config": {"mask_token_id": 151936, "target_layer_ids": [1]}}, "mask_token_id=151936"),
        ({"dflash_config": {"mask_token_id": 0, "target_layer_ids": []}}, "target_layer_ids"),
        ({"dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 36]}}, "target_layer_ids"),
        ({"dflash_config": {"mask_token_id": 0}, "num_target_layers": None}, "num_target_layers"),
        ({"dflash_config": {"mask_token_id": 0, "final_logit_softcapping": 20.0}}, "final_logit_softcapping"),
        ({"is_causal": "yes"}, "is_causal"),
        ({"dflash_config": {"mask_token_id": 0, "tap_final_norm": 1}}, "tap_final_norm"),
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
        ({"dflash_config": {"mask_token_id": 0, "selector_rank": 64}}, "selector_rank"),
    ],
)
def test_config_validation(change, match):
    with pytest.raises(ConfigError, match=match):
        DrafterConfig.from_hf_config({**PUBLISHED, **change})


def test_keys_left_out_read_as_qwen3_configs_defaults():
    """The published model reads a config.json through transformers' Qwen3Config: a key left out
    takes its default there (rope theta 10 000, head_dim 128, not hidden / heads), a softcap of 0
    or less caps nothing, and a top-level original_max_position_embeddings beats the yarn dict's
    (found against the published model, session 39)."""
    left_out = {k: v for k, v in PUBLISHED.items() if k not in ("rope_theta", "head_dim", "max_position_embeddings")}
    cfg = DrafterConfig.from_hf_config({**left_out, "hidden_size": 1024})
    assert (cfg.rope_theta, cfg.head_dim, cfg.max_position_embeddings) == (10000.0, 128, 32768)
    for cap in (0, -1.0):
        assert DrafterConfig.from_hf_config({**PUBLISHED, "final_logit_softcapping": cap}) == PUBLISHED_CFG
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = DrafterConfig.from_hf_config({**PUBLISHED, "rope_scaling": yarn, "original_max_position_embeddings": 16})
    assert cfg.rope_scaling.original_max_position_embeddings == 16
    assert (
        DrafterConfig.from_hf_config({**PUBLISHED, "rope_scaling": yarn}).rope_scaling.original_max_position_embeddings
        == 64
    )


def test_check_compatible():
    target = tiny()
    cfg = dflash.drafter_config_for(target, num_hidden_layers=2)
    cfg.check_compatible(target)
    assert cfg.hidden_size == 64 and cfg.vocab_size == 256 and cfg.mask_token_id == 255
    assert all(0 <= layer < 3 for layer in cfg.target_layer_ids)
    cases = [
        (dict(hidden_size=32, head_dim=8), "hidden_size=32 != target hidden_size=64"),
        (dict(vocab_size=300), "vocab_size=300 != target vocab_size=256"),
        (dict(target_layer_ids=(0, 3), num_target_layers=None), r"target_layer_ids \[3\]"),
        # A larger vocabulary is named as such, before its mask id or anything else.
        (dict(vocab_size=512, mask_token_id=300), "vocab_size=512 != target vocab_size=256"),
        (dict(vocab_size=512, hidden_size=32, head_dim=8, num_target_layers=4), "vocab_size=512"),
        (dict(hidden_size=32, head_dim=8, num_target_layers=4), "hidden_size=32"),
        (dict(num_target_layers=4), "num_target_layers=4"),
    ]
    for change, match in cases:
        with pytest.raises(ConfigError, match=match):
            dataclasses.replace(cfg, **change).check_compatible(target)


def test_drafter_config_for_defaults():
    target = tiny()
    cfg = dflash.drafter_config_for(target)
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.num_target_layers) == (1, 16, 3)
    assert cfg.target_layer_ids == (1,)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 16)


@pytest.mark.parametrize("cfg", [CFG, SLIDING], ids=["full", "sliding"])
def test_train_logits_equal_inference_drafts_per_anchor(cfg):
    """Each anchored block of the training forward == `draft` with the context before its anchor."""
    params = random_params(cfg)
    rng = np.random.default_rng(3)
    b, t, h, v = 2, 20, CFG.hidden_size, CFG.vocab_size
    tokens = rng.integers(0, v - 1, size=(b, t)).astype(np.int32)
    features = rng.normal(size=(b, t, CFG.n_taps * h)).astype(np.float32)
    embed = rng.normal(size=(v, h)).astype(np.float32)
    unembed = (0.15 * rng.normal(size=(h, v))).astype(np.float32)
    anchors = np.array([[0, 7, 14], [3, 3, 10]], np.int32)  # overlapping blocks and a repeated anchor
    got = np.asarray(jax.jit(dflash.train_logits)(params, embed, unembed, features, tokens, anchors))
    assert got.shape == (b, 3, CFG.block_size - 1, v)
    for row in range(b):
        for j, p in enumerate(anchors[row]):
            cache = DrafterCache.init(CFG, 1, t)
            idx = np.arange(t, dtype=np.int32)[None]
            cache = extend(params, cache, features[row : row + 1], idx, idx < p)
            block = np.full((1, CFG.block_size), CFG.mask_token_id, np.int32)
            block[0, 0] = tokens[row, p]
            pos = (p + np.arange(CFG.block_size, dtype=np.int32))[None]
            want = np.asarray(run_draft(params, cache, embed, unembed, block, pos))[0]
            np.testing.assert_allclose(got[row, j], want, atol=2e-4, rtol=0)


def test_the_loops_joint_context_projection_gives_the_per_layer_keys_and_values(params, inputs):
    """`ContextKV`: every layer's context k / v from one GEMM (the decode loop's form) equals
    the per-layer projections, k_norm and RoPE included, slot for slot."""
    per_layer = context_cache(params, inputs["features"])
    b = len(LENGTHS)
    idx = np.arange(C)[None].repeat(b, 0).astype(np.int32)
    joint = extend(
        params,
        DrafterCache.init(CFG, b, CAPACITY),
        jnp.asarray(inputs["features"]),
        jnp.asarray(idx),
        jnp.asarray(idx < LENGTHS[:, None]),
        dflash.ContextKV.of(params.layers),
    )
    np.testing.assert_allclose(np.asarray(joint.k), np.asarray(per_layer.k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(joint.v), np.asarray(per_layer.v), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(joint.lengths), np.asarray(per_layer.lengths))
    assert float(jnp.abs(per_layer.k).max()) > 0.1  # the caches hold something


def test_for_loop_joins_the_context_projection_only_when_asked(params, monkeypatch):
    drafter = dflash.DFlashDrafter(params=params, block_size=CFG.block_size)
    joint = drafter.for_loop().context_kv
    want = (CFG.hidden_size, CFG.num_hidden_layers, 2, CFG.num_key_value_heads, CFG.head_dim)
    assert joint.weight.shape == want
    monkeypatch.setattr(dflash, "FUSED_CONTEXT_KV", False)
    assert drafter.for_loop().context_kv is None
