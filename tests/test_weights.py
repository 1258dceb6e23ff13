"""Weight declarations (weights.py) and INT4 storage (quant.py): everything derives from one spec."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ddtree_jax as dj
from ddtree_jax import model, quant, sharding, weights
from ddtree_jax.drafters import dflash
from tests.conftest import tiny


def _count(tree) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("cfg", [tiny(), tiny(q_lora_rank=None, tie_word_embeddings=True, n_shared_experts=0)])
def test_init_matches_the_abstract_shapes(cfg):
    params = model.init_params(cfg, jax.random.PRNGKey(0), dtype="bfloat16")
    shapes = model.abstract_params(cfg, "bfloat16")
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shapes), strict=True):
        assert (a.shape, a.dtype) == (s.shape, s.dtype)
    assert params.moe_layers.mlp.router.dtype == jnp.float32  # declared fixed dtype


def test_full_size_models_are_abstract_and_the_size_they_should_be():
    """Kimi-K2 is about 1.03 T parameters (the MTP layer aside); nothing is allocated."""
    k2 = model.abstract_params(dj.KIMI_K2)
    assert 1.0e12 < _count(k2) < 1.05e12, _count(k2)
    assert isinstance(k2.moe_layers.mlp.gate, jax.ShapeDtypeStruct)
    assert k2.moe_layers.mlp.gate.shape == (60, 384, 7168, 2048)
    v3 = model.abstract_params(dj.DEEPSEEK_V3)
    assert 6.6e11 < _count(v3) < 6.8e11, _count(v3)
    d = dflash.abstract_params(dflash.drafter_config_for(dj.KIMI_K2, num_hidden_layers=6, num_key_value_heads=8))
    assert d.layers.q.shape == (6, 7168, 64, 112)


def test_drafter_init_matches_its_declaration():
    dcfg = dflash.drafter_config_for(tiny(), num_hidden_layers=2, block_size=4)
    params = dflash.init_params(dcfg, jax.random.PRNGKey(0))
    decl = dflash.declare(dcfg)
    for a, w in zip(jax.tree.leaves(params), weights.leaves(decl), strict=True):
        assert a.shape == w.shape and len(w.axes) == a.ndim


def test_every_declared_hf_name_is_written_once(tmp_path):
    """save_hf writes exactly the declared names: kv_b_proj joins W_UK and W_UV into one."""
    import safetensors.numpy

    cfg = tiny()
    params = model.init_params(cfg, jax.random.PRNGKey(1))
    dj.save_hf(params, tmp_path)
    stored = set(safetensors.numpy.load_file(tmp_path / "model.safetensors"))
    declared = set()
    for w in weights.leaves(model.declare(cfg)):
        h = w.hf[0]
        for layer in w.layers or (None,):
            experts = range(w.shape[1] if w.layers else w.shape[0]) if "{expert}" in h.name else [0]
            declared |= {h.name.format(layer=layer, expert=e) for e in experts}
    assert stored == declared
    assert f"model.layers.{cfg.num_dense_layers}.self_attn.kv_b_proj.weight" in stored


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="do not fit shape"):
        weights.Weight((3, 4), ("embed",))
    with pytest.raises(ValueError, match="init"):
        weights.Weight((3,), ("embed",), init="zeros")
    with pytest.raises(ValueError, match="leading 'layers' axis"):
        weights.Weight((2, 3), (None, "embed"), layers=(0, 1))
    with pytest.raises(ValueError, match="multiple of group_size 32"):
        weights.Weight((48, 16), ("embed", None), quant=quant.Int4(32))
    with pytest.raises(ValueError, match="multiple of 8"):
        quant.Int4(group_size=12)


def test_int4_nibble_order_is_compressed_tensors():
    """Checkpoint words: element 8k + j of a row sits in bits 4j .. 4j+3 of word k, as q + 8."""
    q = np.arange(-8, 8, dtype=np.int8).reshape(16, 1)  # one output, 16 inputs: two words
    grouped = np.moveaxis(q.reshape(2, 8, 1), -1, -2).astype(ml_dtypes.int4)  # [In/G, Out, G], G = 8
    words = quant.to_words(grouped)
    assert words.shape == (1, 2) and words.dtype == np.int32
    assert int(words.view(np.uint32)[0, 0]) == 0x76543210
    assert int(words.view(np.uint32)[0, 1]) == 0xFEDCBA98
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(3, 4, 5, 32)).astype(ml_dtypes.int4)
    np.testing.assert_array_equal(quant.from_words(quant.to_words(q), 32), q)


def test_a_quantized_expert_weight_is_one_declaration():
    """INT4 routed experts: abstract shapes, logical axes, shardings and random init follow from `quant`."""
    w = weights.Weight((8, 64, 16), ("experts", "embed", None), quant=quant.Int4(32))
    stored = w.abstract(jnp.bfloat16)
    assert stored.packed.shape == (8, 2, 16, 32) and stored.packed.dtype == jnp.int4
    assert stored.scale.shape == (8, 2, 16) and stored.scale.dtype == jnp.bfloat16
    axes = w.logical_axes()
    assert axes.packed == ("experts", "embed", None, None) and axes.scale == ("experts", "embed", None)
    fake = type("FakeMesh", (), {"shape": {"data": 1, "model": 8}})()
    assert sharding.spec_for(axes.packed, stored.packed.shape, fake)[0] == "model"
    q = w.random(jax.random.PRNGKey(0), jnp.float32, std=0.5)
    assert isinstance(q, quant.QuantizedArray) and q.shape == (8, 64, 16) and q.group_size == 32
    dense = (0.5 * jax.random.normal(jax.random.PRNGKey(0), (8, 64, 16), jnp.float32)).astype(jnp.float32)
    err = jnp.abs(q.dequantize() - dense)
    step = jnp.repeat(q.scale.astype(jnp.float32), 32, axis=1)
    assert bool(jnp.all(err <= 0.5 * step * 1.01 + 1e-6))  # round to nearest within half a step


def test_placed_rules_are_read_back_from_the_weights():
    params = model.init_params(tiny(), jax.random.PRNGKey(0))
    assert sharding.placed_rules(params) == sharding.RULES  # unplaced: the defaults
    mesh = sharding.make_mesh(data=1, model=1)
    rules = dict(sharding.RULES, experts=None, vocab="data")
    placed = sharding.shard_target(params, mesh, rules)
    got = sharding.placed_rules(placed)
    assert got["experts"] is None and got["vocab"] == "data" and got["heads"] == "model"
    with sharding.use_mesh(mesh, got):
        assert sharding.context_rules() == got
        assert sharding.kernel_spec(("experts", None), (8, 3)) is None  # one device: kernels run whole
    assert sharding.context_rules() == sharding.RULES
    with pytest.raises(TypeError, match="no weight declarations"):
        sharding.logical_axes({"w": jnp.zeros(3)})


def test_the_full_kimi_k2_verify_forward_lowers_from_abstract_params():
    """Compile-only work at full size: nothing allocated, the 61-layer forward traces and lowers."""
    from ddtree_jax.cache import KVCache

    cfg = dj.KIMI_K2
    cache = jax.eval_shape(lambda: KVCache.init(cfg, 1, 4096, jnp.bfloat16))
    s = jax.ShapeDtypeStruct
    lowered = jax.jit(lambda p, c, tok, pos, m: model.forward(p, tok, pos, c, m).hidden).lower(
        model.abstract_params(cfg), cache, s((1, 33), jnp.int32), s((1, 33), jnp.int32), s((1, 33, 33), jnp.bool_)
    )
    assert lowered.out_info.shape == (1, 33, cfg.hidden_size) and lowered.out_info.dtype == jnp.bfloat16
