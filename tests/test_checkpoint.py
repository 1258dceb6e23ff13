"""HF directory and orbax checkpoints: round trips and clear errors."""

import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from ddtree_jax import checkpoint, model
from ddtree_jax.config import ConfigError
from ddtree_jax.hf import CheckpointError
from tests.conftest import random_target, rewrite, same, tiny


@pytest.fixture(scope="module")
def params():
    return random_target(tiny(), seed=11)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("shard", [None, 50_000])
def test_hf_round_trip(params, tmp_path, fused, shard):
    checkpoint.save_hf(params, tmp_path, fused_experts=fused, max_shard_bytes=shard)
    assert os.path.exists(tmp_path / checkpoint.INDEX_FILE) == (shard is not None)
    assert same(checkpoint.load_target(tmp_path), params)


def test_a_save_over_another_checkpoint_leaves_none_of_its_files(params, tmp_path):
    """A one-file save over a sharded checkpoint left its index, which the loader follows: the
    old shards' weights came back under the new config, with no error (same shapes)."""
    checkpoint.save_hf(random_target(tiny(), seed=12), tmp_path, max_shard_bytes=50_000)
    checkpoint.save_hf(params, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert same(checkpoint.load_target(tmp_path), params)
    checkpoint.save_hf(params, tmp_path, max_shard_bytes=50_000)  # and back: no model.safetensors left
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert same(checkpoint.load_target(tmp_path), params)


def test_orbax_round_trip(params, tmp_path):
    checkpoint.save_checkpoint(params, tmp_path / "ck")
    assert same(checkpoint.restore_checkpoint(tmp_path / "ck"), params)


def test_an_orbax_save_cut_short_leaves_no_config_beside_old_params(params, tmp_path, monkeypatch):
    """config.json was written before the params: a save over another checkpoint that died in
    between left the new config beside the old params, restored without a word where the shapes
    agree (here only rope_theta differs)."""
    import dataclasses

    import orbax.checkpoint as ocp

    checkpoint.save_checkpoint(params, tmp_path / "ck")
    other = params.replace(config=dataclasses.replace(params.config, rope_theta=params.config.rope_theta * 2))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(other, tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        checkpoint.restore_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    checkpoint.save_checkpoint(other, tmp_path / "ck")
    assert checkpoint.restore_checkpoint(tmp_path / "ck").config == other.config
    assert sorted(os.listdir(tmp_path / "ck")) == ["config.json", "params"]


def test_bf16_load_and_cast(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    loaded = checkpoint.load_target(tmp_path, dtype="bfloat16")
    assert loaded.embed.dtype == np.dtype("bfloat16")
    assert loaded.moe_layers.mlp.router.dtype == np.float32


def test_bf16_checkpoints_are_plain_safetensors(params, tmp_path):
    """What save_hf writes in bf16 is what the safetensors package reads, dtype included."""
    bf = model.cast_params(params, "bfloat16")
    checkpoint.save_hf(bf, tmp_path)
    stored = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(stored["model.embed_tokens.weight"], np.asarray(bf.embed))
    assert stored["model.layers.1.mlp.gate.weight"].dtype == np.float32  # the router stays float32
    assert same(checkpoint.load_target(tmp_path), bf)


def test_missing_weight_is_named(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing weight 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        checkpoint.load_target(tmp_path)


def test_extra_weight_is_named(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="bogus"):
        checkpoint.load_target(tmp_path)


def test_empty_tensors_are_let_be(params, tmp_path):
    """transformers saves a config's zero-width layers (shared experts of n_shared_experts = 0)
    as [H, 0] tensors: they hold nothing, so they are not refused as unexpected."""
    checkpoint.save_hf(params, tmp_path)
    empty = "model.layers.1.mlp.shared_experts_extra.down_proj.weight"
    rewrite(tmp_path, lambda t: t.update({empty: np.zeros((params.config.hidden_size, 0), np.float32)}))
    assert same(checkpoint.load_target(tmp_path), params)
    rewrite(tmp_path, lambda t: t.update({empty: np.zeros((params.config.hidden_size, 1), np.float32)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected weight.*shared_experts_extra"):
        checkpoint.load_target(tmp_path)


def test_fp8_tensors_are_named(params, tmp_path):
    """A tensor numpy has no dtype for (F8_E4M3, as DeepSeek-V3 ships its weights) is refused by
    name before it is read; it used to end in numpy's AttributeError."""
    checkpoint.save_hf(params, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    path = tmp_path / "model.safetensors"
    tensors = safetensors.numpy.load_file(path)
    shape = tensors.pop(name).shape
    safetensors.numpy.save_file(tensors, path)
    # Appended by hand: the header names the dtype; one byte an element.
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    data = path.read_bytes()[8 + header_len :]
    header[name] = {
        "dtype": "F8_E4M3",
        "shape": list(shape),
        "data_offsets": [len(data), len(data) + int(np.prod(shape))],
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data + bytes(int(np.prod(shape))))
    with pytest.raises(CheckpointError, match=rf"'{name}' in .* is stored as F8_E4M3, which this engine does not read"):
        checkpoint.load_target(tmp_path)


def test_orbax_arrays_unreadable_or_unplaced_are_named(params, tmp_path):
    """A truncated array file was a bare Exception from TensorStore (a traceback from the CLI);
    a config.json changed to tie the head after saving restored and dropped the stored lm_head."""
    checkpoint.save_checkpoint(params, tmp_path / "ck")
    biggest = max((p for p in (tmp_path / "ck").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="its stored arrays cannot be read"):
        checkpoint.restore_checkpoint(tmp_path / "ck")
    # The array store's manifest gone: said "stored params do not match its config.json".
    checkpoint.save_checkpoint(params, tmp_path / "ck")
    os.remove(tmp_path / "ck" / "params" / "manifest.ocdbt")
    with pytest.raises(CheckpointError, match=r"its stored arrays cannot be read \(a file is missing"):
        checkpoint.restore_checkpoint(tmp_path / "ck")
    checkpoint.save_checkpoint(params, tmp_path / "tie")
    cfg = json.loads((tmp_path / "tie" / "config.json").read_text())
    (tmp_path / "tie" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match=r"stored arrays \['lm_head'\] have no place"):
        checkpoint.restore_checkpoint(tmp_path / "tie")


def test_a_tied_config_says_a_stored_head_is_not_read(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.warns(UserWarning, match="the stored lm_head.weight is not read"):
        assert checkpoint.load_target(tmp_path).lm_head is None


def test_mtp_layer_is_ignored(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    n = params.config.num_hidden_layers
    rewrite(tmp_path, lambda t: t.update({f"model.layers.{n}.eh_proj.weight": np.zeros((2, 2), np.float32)}))
    assert same(checkpoint.load_target(tmp_path), params)


def test_misshaped_weight_is_named(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight'.*shape \(7,\), expected \(64,\)"):
        checkpoint.load_target(tmp_path)


def test_corrupt_file(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        checkpoint.load_target(tmp_path)
    f.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        checkpoint.load_target(tmp_path)


def test_missing_files(params, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load_target(tmp_path / "nope")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a directory"):
        checkpoint.load_target(tmp_path / "a_file")
    os.remove(tmp_path / "a_file")
    checkpoint.save_hf(params, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        checkpoint.load_target(tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        checkpoint.load_target(tmp_path)
    with pytest.raises(FileNotFoundError, match="no orbax checkpoint"):
        checkpoint.restore_checkpoint(tmp_path)


def test_index_naming_a_missing_shard(params, tmp_path):
    checkpoint.save_hf(params, tmp_path, max_shard_bytes=50_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    os.remove(shards[1])
    with pytest.raises(CheckpointError, match="missing from"):
        checkpoint.load_target(tmp_path)


def test_unsupported_config(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="gelu"):
        checkpoint.load_target(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        checkpoint.load_target(tmp_path)


def test_packed_experts_without_a_quantization_config_are_refused(params, tmp_path):
    """INT4 tensors need config.json's quantization_config (tests/test_int4.py loads real ones)."""
    checkpoint.save_hf(params, tmp_path)

    def to_packed(t):
        for j in range(params.config.n_routed_experts):
            for name in ("gate", "up", "down"):
                t.pop(f"model.layers.1.mlp.experts.{j}.{name}_proj.weight")
                t[f"model.layers.1.mlp.experts.{j}.{name}_proj.weight_packed"] = np.zeros((4, 4), np.int32)

    rewrite(tmp_path, to_packed)
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight_packed' is pack-quantized, but only"):
        checkpoint.load_target(tmp_path)


@pytest.mark.parametrize("dtype", ["int32", "int8", "float7", "bf16", "float64", "bool"])
def test_unsupported_dtypes_are_refused(params, tmp_path, dtype):
    """int32 used to truncate every weight to zero; float7 and bf16 ended in numpy tracebacks."""
    checkpoint.save_hf(params, tmp_path)
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not supported; choose one of"):
        checkpoint.load_target(tmp_path, dtype=dtype)
    from ddtree_jax import model
    from ddtree_jax.drafters import dflash

    with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not supported"):
        model.init_params(params.config, jax.random.PRNGKey(0), dtype=dtype)
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not supported"):
        model.cast_params(params, dtype)
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not supported"):
        dflash.load_drafter(tmp_path, dtype=dtype)
    with pytest.raises(ValueError, match=rf"dtype='{dtype}' is not supported"):
        checkpoint.restore_checkpoint(tmp_path, dtype=dtype)


def test_float64_weights_load_as_float32(params, tmp_path):
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t.update({k: v.astype(np.float64) for k, v in t.items()}))
    loaded = checkpoint.load_target(tmp_path)
    assert loaded.embed.dtype == np.float32 and same(loaded, params)
