import dataclasses
import json

import pytest

from ddtree_jax import config
from ddtree_jax.config import ConfigError, TargetConfig


@pytest.mark.parametrize("preset", [config.TINY, config.SMALL, config.MEDIUM, config.KIMI_K2, config.DEEPSEEK_V3])
def test_hf_round_trip(preset):
    hf = json.loads(json.dumps(preset.to_hf_config()))
    assert TargetConfig.from_hf_config(hf) == preset


def test_param_counts():
    assert 1.02e12 < config.KIMI_K2.num_params() < 1.04e12
    assert 6.70e11 < config.DEEPSEEK_V3.num_params() < 6.72e11
    assert 5e6 < config.SMALL.num_params() < 1.3e7  # ships in <= 25 MB with the drafter


def test_medium_pair_fits_the_checkpoint_budget():
    """MEDIUM is Kimi-K2-like (issue 17: >= 16 routed experts, top-k >= 2, a shared expert, the
    sigmoid router with its bias, a dense first layer) and, its routed experts INT4, fits
    `checkpoints/` (48 MB in all) with its drafter and the tokenizer, in files of <= 16 MB."""
    import dataclasses
    import os

    import jax.numpy as jnp

    from ddtree_jax import model
    from ddtree_jax.drafters import dflash
    from ddtree_jax.quant import nbytes

    m = config.MEDIUM
    assert m.n_routed_experts >= 16 and m.num_experts_per_tok >= 2 and m.n_shared_experts >= 1
    assert m.first_k_dense_replace == 1 and m.expert_int4_group_size is None  # the router is always sigmoid
    shipped = dataclasses.replace(m, expert_int4_group_size=32)
    target = nbytes(model.abstract_params(shipped, jnp.bfloat16))
    drafter = nbytes(dflash.abstract_params(dflash.drafter_config_for(m, **config.MEDIUM_DRAFTER), jnp.bfloat16))
    tokenizer = os.path.getsize(os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tokenizer.json"))
    assert target + drafter + tokenizer <= 48e6 * 0.98, (target, drafter, tokenizer)  # 2% for headers and configs
    assert 3 * config.SMALL.num_params() < m.num_params()


@pytest.mark.parametrize(
    ("preset", "scale"),
    [(config.DEEPSEEK_V3, 0.135234), (config.KIMI_K2, 0.130861)],
)
def test_yarn_softmax_scale(preset, scale):
    assert preset.softmax_scale == pytest.approx(scale, abs=2e-6)


def test_softmax_scale_without_yarn():
    assert config.SMALL.softmax_scale == pytest.approx(48**-0.5)


def test_real_deepseek_style_config_json():
    hf = {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    }
    assert TargetConfig.from_hf_config(hf) == config.DEEPSEEK_V3


def test_transformers5_rope_parameters():
    hf = config.TINY.to_hf_config()
    hf.pop("rope_theta")
    hf["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 5000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    cfg = TargetConfig.from_hf_config(hf)
    assert cfg.rope_theta == 5000.0
    assert cfg.rope_scaling.factor == 4.0
    assert cfg.rope_scaling.original_max_position_embeddings == 128


def test_kimi_k25_text_config_unwrapped():
    wrapped = {"model_type": "kimi_k25", "text_config": config.KIMI_K2.to_hf_config()}
    assert TargetConfig.from_hf_config(wrapped) == config.KIMI_K2
    # Tying: transformers' wrapper reads the top-level flag, text-model engines text_config's. One
    # given is taken; two that disagree are refused (the text copy's True used to win silently,
    # dropping a stored lm_head that transformers used).
    text = {k: v for k, v in config.KIMI_K2.to_hf_config().items() if k != "tie_word_embeddings"}
    tied = TargetConfig.from_hf_config({"text_config": text, "tie_word_embeddings": True})
    assert tied.tie_word_embeddings and not TargetConfig.from_hf_config({"text_config": text}).tie_word_embeddings
    both = {"tie_word_embeddings": False, "text_config": {**text, "tie_word_embeddings": True}}
    with pytest.raises(ConfigError, match="tie_word_embeddings is False at the top level but True in text_config"):
        TargetConfig.from_hf_config(both)


def test_a_binary_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\x9a\xff\x00{")
    with pytest.raises(ConfigError, match=r"config\.json is not UTF-8 text"):
        TargetConfig.from_json_file(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"n_group": 3}, "divisible by n_group=3"),
        ({"topk_group": 3}, "topk_group=3"),
        ({"first_k_dense_replace": 4}, "first_k_dense_replace=4"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"eos_token_id": 256}, "eos_token_id=256"),
        ({"n_group": 8, "topk_group": 1}, "needs >= 2 experts"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be True or False, got 'yes'"),
        ({"rope_interleave": "no"}, "rope_interleave must be True or False"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings must be True or False, got 1"),
    ],
)
def test_validation(change, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(config.TINY, **change)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "llama"}, "model_type 'llama'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"topk_method": "greedy"}, "topk_method 'greedy'"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
    ],
)
def test_unsupported_hf_configs(change, match):
    hf = {**config.TINY.to_hf_config(), **change}
    with pytest.raises(ConfigError, match=match):
        TargetConfig.from_hf_config(hf)


def test_absent_keys_read_as_hf_deepseek_v3_defaults():
    """A key config.json leaves out is what HF's DeepseekV3Config gives it (HF loads that model),
    not this dataclass's preset defaults; a null q_lora_rank is a plain q_proj, an absent one 1536."""
    hf = {**config.TINY.to_hf_config(), "num_hidden_layers": 4, "n_routed_experts": 16}
    for key in ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "q_lora_rank"):
        hf.pop(key)
    cfg = TargetConfig.from_hf_config(hf)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == (8, 4, 2.5)
    assert (cfg.first_k_dense_replace, cfg.q_lora_rank) == (3, 1536)
    assert TargetConfig.from_hf_config({**hf, "q_lora_rank": None}).q_lora_rank is None
    # An all-dense model needs no MoE keys.
    dense = {
        k: v for k, v in hf.items() if k not in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    }
    dense["first_k_dense_replace"] = 4
    assert TargetConfig.from_hf_config(dense).num_moe_layers == 0


def test_eos_list_stops_at_each_id():
    hf = {**config.TINY.to_hf_config(), "eos_token_id": [5, 6]}
    cfg = TargetConfig.from_hf_config(hf)
    assert cfg.eos_token_id == (5, 6) and cfg.stop_token_ids == (5, 6)
    assert TargetConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg
    assert TargetConfig.from_hf_config({**hf, "eos_token_id": [7]}).stop_token_ids == (7,)
    assert dataclasses.replace(config.TINY, eos_token_id=None).stop_token_ids == ()
    with pytest.raises(ConfigError, match=r"eos_token_id=\(5, 256\)"):
        TargetConfig.from_hf_config({**hf, "eos_token_id": [5, 256]})


def test_rope_scaling_type_wins_over_rope_parameters_default():
    hf = config.TINY.to_hf_config()
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    hf["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert TargetConfig.from_hf_config(hf).rope_scaling.factor == 4.0


def test_missing_keys():
    hf = config.TINY.to_hf_config()
    del hf["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        TargetConfig.from_hf_config(hf)
    hf = {k: v for k, v in config.TINY.to_hf_config().items() if k != "num_attention_heads"}
    with pytest.raises(ConfigError, match=r"lacks required keys: \['num_attention_heads'\]"):
        TargetConfig.from_hf_config(hf)
