"""Bad input at the public boundaries: a clear error naming the value, never a deep crash or a
silent wrong answer (configs, checkpoints, `generate`, the CLI)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from ddtree_jax import checkpoint, config, evaluation, model
from ddtree_jax.__main__ import main
from ddtree_jax.config import ConfigError, TargetConfig
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate, lower
from ddtree_jax.hf import CheckpointError
from ddtree_jax.shipped import load_shipped
from tests.conftest import random_target, rewrite, tiny

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "checkpoints")


@pytest.fixture(scope="module")
def params():
    return random_target(tiny(), seed=3)


# -- config.json fields ------------------------------------------------------------------


def _yarn(**fields):
    return {"rope_scaling": {"type": "yarn", **fields}}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # Before: a bare TypeError from a comparison, or accepted and failing later in a shape.
        ({"n_routed_experts": "8"}, "n_routed_experts must be an int, got '8'"),
        ({"num_experts_per_tok": 2.0}, "num_experts_per_tok must be an int, got 2.0"),
        ({"first_k_dense_replace": "1"}, "first_k_dense_replace must be an int, got '1'"),
        ({"q_lora_rank": 32.0}, r"q_lora_rank must be None or an int >= 1, got 32.0"),
        ({"hidden_size": True}, "hidden_size must be a positive int, got True"),
        ({"eos_token_id": "2"}, r"eos_token_id='2' is not a token id in the vocabulary \[0, 256\)"),
        # Before: float("abc")'s ValueError, naming no field; NaN accepted.
        ({"rope_theta": "abc"}, "rope_theta must be a number, got 'abc'"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number, got 'x'"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor must be finite and > 0, got nan"),
        # Before: bool("false") is True.
        ({"norm_topk_prob": "false"}, "norm_topk_prob must be true or false, got 'false'"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        # Before: dict.update's ValueError, a bare KeyError, ZeroDivisionError, int(None)'s TypeError.
        ({"rope_scaling": "yarn"}, "rope_scaling must be a JSON object, got 'yarn'"),
        ({"max_position_embeddings": None, **_yarn(original_max_position_embeddings=64)}, "without a factor needs"),
        (_yarn(original_max_position_embeddings=0), "without a factor needs max_position_embeddings and"),
        (_yarn(factor=2.0, original_max_position_embeddings=None), "original_max_position_embeddings must be an int"),
        (_yarn(factor=2.0, original_max_position_embeddings=64, beta_fast="x"), "yarn beta_fast must be a number"),
        (
            _yarn(factor=2.0, original_max_position_embeddings=64, mscale_all_dim="x"),
            "yarn mscale_all_dim must be None or a number, got 'x'",
        ),
    ],
)
def test_hf_config_fields_of_the_wrong_type(change, match):
    hf = {k: v for k, v in {**config.TINY.to_hf_config(), **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        TargetConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("hf", "match"),
    [
        ([], "an HF config must be a JSON object, got list"),
        (None, "an HF config must be a JSON object, got NoneType"),
        ({"text_config": "x"}, "text_config must be a JSON object, got str"),
    ],
)
def test_hf_config_that_is_not_an_object(hf, match):
    with pytest.raises(ConfigError, match=match):  # before: AttributeError: ... has no attribute 'get'
        TargetConfig.from_hf_config(hf)


@pytest.mark.parametrize("load", [checkpoint.load_target, dflash.load_drafter])
def test_config_json_that_is_not_an_object(tmp_path, load):
    (tmp_path / "config.json").write_text(json.dumps([config.TINY.to_hf_config()]))
    with pytest.raises(ConfigError, match=r"config\.json must hold a JSON object, got list"):
        load(tmp_path)


# -- checkpoint tensors ------------------------------------------------------------------


def test_float_weight_stored_as_integers_is_refused(params, tmp_path):
    """Before: cast to float and loaded, silently."""
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int8)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' in .* is stored as int8, expected a float dtype"):
        checkpoint.load_target(tmp_path)


@pytest.mark.parametrize("stored", [np.float32, np.int64, np.uint32])
def test_int4_words_of_another_dtype_are_refused(params, tmp_path, stored):
    """Before: cast to int32 (float words truncated, wide or unsigned ones wrapped), silently."""
    checkpoint.save_hf(model.quantize_experts(params), tmp_path)
    name = "model.layers.1.mlp.experts.0.up_proj.weight_packed"
    rewrite(tmp_path, lambda t: t.update({name: t[name].astype(stored)}))
    with pytest.raises(CheckpointError, match=rf"'{name}' in .* is stored as {np.dtype(stored).name}, expected int32"):
        checkpoint.load_target(tmp_path)


def test_weight_stored_twice_is_refused(params, tmp_path):
    """Before: the file read last won, silently."""
    checkpoint.save_hf(params, tmp_path)
    safetensors.numpy.save_file({"model.norm.weight": np.zeros(64, np.float32)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is stored twice: in .*extra\.safetensors and"):
        checkpoint.load_target(tmp_path)


def test_shipped_folder_with_a_drafter_for_another_target(tmp_path):
    """Before: loaded; the mismatch surfaced only at the first drafted generate call."""
    target_cfg = tiny(vocab_size=8192)
    checkpoint.save_hf(random_target(target_cfg), tmp_path / "target")
    other = dflash.drafter_config_for(tiny(vocab_size=8192, num_hidden_layers=4), num_hidden_layers=1, block_size=4)
    dflash.save_drafter_hf(dflash.init_params(other, jax.random.key(0)), tmp_path / "drafter")
    shutil.copy(os.path.join(SHIPPED, "tokenizer.json"), tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="drafter num_target_layers=4 != target num_hidden_layers=3"):
        load_shipped(str(tmp_path))


# -- generate ----------------------------------------------------------------------------

PADDED = np.ones((2, 4), np.int32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # Before: 2.7 truncated to 2, "3" read as 3, a [2, 1] array flattened.
        (dict(prompts=PADDED, prompt_lengths=[2.7, 4]), TypeError, r"prompt_lengths must be integers, got \[2.7, 4\]"),
        (dict(prompts=PADDED, prompt_lengths=["3", "4"]), TypeError, "prompt_lengths must be integers"),
        (dict(prompts=PADDED, prompt_lengths=[[3], [4]]), ValueError, r"prompt_lengths has shape \(2, 1\), expected"),
        # Before: numpy's "attempt to get argmax of an empty sequence" / "inhomogeneous shape".
        (dict(prompts=np.ones((0, 3), np.int32)), ValueError, "prompts is empty"),
        (
            dict(prompts=[[1, 2], [3, [4]]]),
            ValueError,
            r"prompt 1 must be a 1-D sequence of token ids, got \[3, \[4\]\]",
        ),
        (dict(prompts=[1, [2, 3]]), ValueError, "prompts must be a list of token-id lists or a"),
        # Before: JAX's "invalid PRNG key data" / "split accepts a single key", from inside the jit.
        (dict(temperature=1.0, key=0), TypeError, r"key must be one PRNG key \(e\.g\. jax\.random\.key\(0\)\), got 0"),
        (
            dict(temperature=1.0, key=jax.random.split(jax.random.key(0))),
            TypeError,
            r"key must be one PRNG key .*got an array of shape \(2,\)",
        ),
        (dict(temperature=1.0, key=np.zeros(2, np.float32)), TypeError, "dtype float32"),
        # Before: ignored by the methods that build no tree.
        (dict(tree_budget=0), ValueError, r"tree budget must be an int in \[1, 1024\], got 0"),
        (dict(tree_budget=2.5), TypeError, "tree budget must be an int in .*got 2.5"),
    ],
)
def test_generate_bad_inputs(params, kwargs, error, match):
    kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(error, match=match):
        generate(params, kwargs.pop("prompts"), **kwargs)


def test_negative_tree_budget_for_dflash(params):
    drafter = dflash.init_params(
        dflash.drafter_config_for(params.config, num_hidden_layers=1, block_size=4), jax.random.key(0)
    )
    with pytest.raises(ValueError, match=r"tree budget must be an int in \[1, 1024\], got -3"):
        generate(params, drafter, [[1, 2]], method="dflash", tree_budget=-3, max_new_tokens=2)


@pytest.mark.parametrize("key", [jax.random.key(1), jax.random.PRNGKey(1)])
def test_typed_and_raw_keys_are_accepted(params, key):
    assert lower(params, [[1, 2]], temperature=1.0, key=key, max_new_tokens=2) is not None


# -- CLI and prompt sets -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--preset", "tiny", "--seed", str(2**70)],  # before: an OverflowError traceback
        ["demo", "--preset", "tiny", "--seed", str(2**32)],  # before: sampled as seed 0
        ["generate", "def f(", "--seed", "-1"],
    ],
)
def test_cli_seed_out_of_range(argv):
    with pytest.raises(SystemExit, match=r"--seed must be in \[0, 2\*\*32\), got"):
        main(argv)


@pytest.mark.parametrize("command", [["eval"], ["humaneval"]])
def test_cli_out_is_checked_before_the_run(tmp_path, command):
    """Before: the eval ran (for hours at full size), then failed writing its results."""
    for out in (tmp_path / "missing" / "rows.json", tmp_path):
        with pytest.raises(SystemExit, match=rf"--out '{out}' is not a file path in an existing folder"):
            main([*command, "--out", str(out)])


def test_damaged_test_split_is_named(tmp_path):
    """Before: np.load's message alone, naming no file."""
    (tmp_path / "test.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match=rf"test prompt set: {tmp_path}/test\.npy: not a token array"):
        evaluation.prompt_set("test", None, str(tmp_path))


@pytest.mark.parametrize("bad", ["layers", [1, 3]])
def test_a_dflash_config_that_is_no_object_is_named(bad):
    hf = dflash.drafter_config_for(tiny(), num_hidden_layers=1, block_size=4).to_hf_config()
    hf["dflash_config"] = bad
    with pytest.raises(ConfigError, match="dflash_config must be a JSON object"):
        dflash.DrafterConfig.from_hf_config(hf)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(hidden_size=32), r"params\.embed has shape \(256, 64\), but params\.config gives \(256, 32\)"),
        (dict(num_hidden_layers=4), r"params\.moe_layers holds 2 layers, but params\.config has 3"),
        (dict(kv_lora_rank=16), r"params\.dense_layers\.attn\.kv_a has shape \(1, 64, 40\), but .* \(1, 64, 24\)"),
    ],
)
def test_a_config_put_on_other_weights_is_named(params, change, match):
    """Before: "Incompatible shapes for broadcasting" from inside the jitted loop."""
    import dataclasses

    wrong = params.replace(config=dataclasses.replace(params.config, **change))
    with pytest.raises(ValueError, match=match):
        generate(wrong, [[1, 2, 3]], max_new_tokens=2)


def test_layers_split_before_the_loop_pass_the_check(params):
    hoisted = model.hoist_layers(params, "fast")
    assert type(hoisted.moe_layers).__name__ == "Unstacked"
    model.check_params(hoisted)
    want = generate(params, [[1, 2, 3]], max_new_tokens=3, numerics="fast").to_lists()
    assert generate(hoisted, [[1, 2, 3]], max_new_tokens=3, numerics="fast").to_lists() == want
