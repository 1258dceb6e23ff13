"""The drafter layer's QKV kernel (the input norm, the projection, q / k norms and RoPE):
Triton-lowered, interpret mode on the CPU, against the XLA path in float32; its dispatch, the
drafter and the decode loop running it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.drafters import dflash
from ddtree_jax.layers import Unstacked
from ddtree_jax.pallas.drafter_layer import api
from ddtree_jax.pallas.drafter_layer.kernel import DrafterLayerTiles, qkv_pallas, takes
from ddtree_jax.pallas.drafter_layer.reference import qkv_reference
from ddtree_jax.pallas.shapes import DrafterLayerShape
from tests.conftest import random_target, tiny


def layer_case(seed, b, t, hidden, nq, nkv, hd, scale=1.0):
    """A float32 layer, x [B, T, H] and RoPE tables at positions 7 .. 7 + T - 1 (offset per row)."""
    shape = DrafterLayerShape(b, hidden, nq, nkv, hd, tokens=t)
    from ddtree_jax.pallas.drafter_layer.bench import Layer

    layer = Layer(shape, jax.random.PRNGKey(seed), dtype=jnp.float32)
    x = scale * jax.random.normal(jax.random.PRNGKey(seed + 1), (b, t, hidden), jnp.float32)
    pos = 7.0 + 100.0 * jnp.arange(b, dtype=jnp.float32)[:, None] + jnp.arange(t, dtype=jnp.float32)
    freqs = pos[..., None] * (1e4 ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    return layer, x, jnp.cos(freqs), jnp.sin(freqs)


def _qkv_ref(layer, x, cos, sin, eps=1e-6):
    return qkv_reference(x, layer.input_norm, layer.q, layer.k, layer.v, layer.q_norm, layer.k_norm, cos, sin, eps)


@pytest.mark.parametrize(
    "b, t, hidden, nq, nkv, hd, tiles",
    [
        (1, 16, 384, 6, 1, 64, DrafterLayerTiles()),  # the shipped drafter: H = 3 x 128
        (3, 5, 48, 4, 2, 32, DrafterLayerTiles()),  # 15 rows padded to 16; H = 3 x 16
        (8, 16, 256, 8, 2, 128, DrafterLayerTiles(block_rows=32, block_k=64)),  # a row grid of 4
        (2, 1, 64, 1, 1, 32, DrafterLayerTiles()),  # one token a row, one query head
    ],
)
def test_kernel_matches_reference(b, t, hidden, nq, nkv, hd, tiles):
    layer, x, cos, sin = layer_case(b + hidden, b, t, hidden, nq, nkv, hd)
    joint = api.JointQKV.of(layer)
    m = b * t
    got = qkv_pallas(
        x.reshape(m, hidden),
        layer.input_norm,
        joint.w,
        joint.head_norm,
        cos.reshape(m, -1),
        sin.reshape(m, -1),
        nq=nq,
        eps=1e-6,
        tiles=tiles,
        interpret=True,
    )
    for g, w, n in zip(got, _qkv_ref(layer, x, cos, sin), (nq, nkv, nkv), strict=True):
        assert g.shape == (m, n, hd) and g.dtype == w.dtype
        np.testing.assert_allclose(g.reshape(w.shape), w, atol=2e-5, rtol=2e-5)


def test_dispatch_and_bf16():
    """ "pallas" runs the kernels (bf16 operands, float32 inside: within bf16 rounding of the XLA
    path); "xla", "mosaic" and "auto" on the CPU give the XLA path bit for bit."""
    layer, x, cos, sin = layer_case(0, 2, 16, 128, 4, 1, 64)
    bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (layer.__dict__, x))
    lay = type("L", (), bf[0])
    want = _qkv_ref(lay, bf[1], cos, sin)
    for impl in ("xla", "mosaic", "auto"):
        got = api.drafter_qkv(bf[1], lay, cos, sin, 1e-6, implementation=impl)
        assert all(bool(jnp.all(g == w)) for g, w in zip(got, want, strict=True))
    got = api.drafter_qkv(bf[1], lay, cos, sin, 1e-6, implementation="pallas")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="implementation must be one of"):
        api.drafter_qkv(bf[1], lay, cos, sin, 1e-6, implementation="triton")


def test_overflowing_rows_come_out_nan():
    """A row whose mean square overflows float32 is NaN on the kernel as on `layers.rms_norm`; the
    other rows are untouched."""
    layer, x, cos, sin = layer_case(3, 1, 16, 64, 2, 1, 32)
    x = x.at[0, 3].set(3e38)
    for out in api.drafter_qkv(x, layer, cos, sin, 1e-6, implementation="pallas"):
        assert bool(jnp.all(jnp.isnan(out[0, 3]))) and bool(jnp.all(jnp.isfinite(out[0, 4:])))
    for out in _qkv_ref(layer, x, cos, sin):
        assert bool(jnp.all(jnp.isnan(out[0, 3])))


def test_takes_and_uses_kernel():
    assert takes(384, 64) and takes(7168, 128)
    assert not takes(40, 64)  # H not a multiple of 16
    assert not takes(384, 16)  # half a head of 8: below the Triton dot's 16
    assert not takes(384, 48)  # not a power of two
    assert api.uses_kernel("pallas", 384, 64) and not api.uses_kernel("pallas", 384, 16)
    assert not api.uses_kernel("auto", 384, 64)  # the CPU
    assert not api.uses_kernel("xla", 384, 64) and not api.uses_kernel("mosaic", 384, 64)
    mesh = jax.sharding.AbstractMesh((2,), ("model",))
    with jax.sharding.use_abstract_mesh(mesh):
        assert not api.uses_kernel("pallas", 384, 64)


@pytest.mark.parametrize("field, value", [("block_k", 8), ("block_k", 48), ("block_rows", 0), ("num_warps", 3)])
def test_bad_tiles(field, value):
    with pytest.raises(ValueError, match=field):
        DrafterLayerTiles(**{field: value})


def test_bad_joint_heads():
    layer, x, cos, sin = layer_case(1, 1, 16, 64, 2, 1, 32)
    joint = api.JointQKV.of(layer)
    with pytest.raises(ValueError, match="do not split"):
        qkv_pallas(x[0], layer.input_norm, joint.w, joint.head_norm, cos[0], sin[0], nq=3, eps=1e-6, interpret=True)


def _drafter(target_cfg, seed=0):
    cfg = dflash.drafter_config_for(target_cfg, num_hidden_layers=2, block_size=4, head_dim=32)
    return dflash.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def test_draft_and_the_loop_drafter_on_the_kernels():
    """`dflash.draft` with the kernel gives the XLA path's logits (float32); the decode loop's
    drafter holds each layer's joined weights only where the kernel runs."""
    cfg = tiny()
    target = random_target(cfg, seed=4)
    params = _drafter(cfg)
    cache = dflash.DrafterCache.init(params.config, 2, 24)
    feats = jax.random.normal(jax.random.PRNGKey(5), (2, 20, params.config.n_taps * cfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
    cache = dflash.extend_context(params, cache, feats, positions, positions < jnp.array([[17], [9]]))
    mask = params.config.mask_token_id
    block = jnp.asarray([[7, mask, mask, mask], [11, mask, mask, mask]], jnp.int32)
    block_pos = cache.lengths[:, None] + jnp.arange(4, dtype=jnp.int32)
    args = (params, cache, target.embed, target.unembed, block, block_pos)
    want = dflash.draft(*args, implementation="xla")
    np.testing.assert_allclose(dflash.draft(*args, implementation="pallas"), want, atol=2e-5, rtol=2e-5)
    looped = dflash.DFlashDrafter(params=params, block_size=4, implementation="pallas").for_loop()
    assert isinstance(looped.joint_qkv, Unstacked) and len(looped.joint_qkv) == 2
    got = looped.propose(cache, target, _lengths(cache), block[:, 0], None)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert dflash.DFlashDrafter(params=params, block_size=4, implementation="auto").for_loop().joint_qkv is None


def _lengths(cache):
    """A stand-in target cache: `propose` reads only its lengths."""

    @dataclasses.dataclass
    class Lengths:
        lengths: jax.Array

    return Lengths(cache.lengths)


def test_bench_smoke(capsys):
    from ddtree_jax.pallas.drafter_layer import bench

    bench.main(["--smoke", "--reps", "1", "--shapes", "shipped"])
    out = capsys.readouterr().out
    for impl in ("xla", "pallas"):
        assert f"| shipped | {impl} |" in out
