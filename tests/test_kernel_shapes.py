"""The kernels on the named real shapes (pallas/shapes.py): one test base, two modes.

In CI (CPU) a sample of the shapes runs shrunk (`shape.shrink()`), in interpret
mode; on the GPU machine `pytest -m gpu tests/test_kernel_shapes.py` runs every
shape full size, compiled. Both compare against the float32 reference on the same
bf16 operands.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.pallas.drafter_attention import bench as drafter_bench
from ddtree_jax.pallas.drafter_attention.kernel import DrafterAttentionTiles, drafter_attention_pallas, num_splits
from ddtree_jax.pallas.drafter_attention.reference import drafter_attention_reference
from ddtree_jax.pallas.mla_attention import bench as mla_bench
from ddtree_jax.pallas.mla_attention.mosaic import MosaicMLATiles, mla_attention_mosaic
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
from ddtree_jax.pallas.moe import bench as moe_bench
from ddtree_jax.pallas.moe.kernel import moe_experts_pallas
from ddtree_jax.pallas.moe.mosaic import MosaicMoETiles, moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_reference
from ddtree_jax.pallas.moe.w4a16 import W4A16Tiles, moe_experts_w4a16
from ddtree_jax.pallas.shapes import (
    DRAFT_TOPK_SHAPES,
    DRAFTER_ATTENTION_SHAPES,
    DRAFTER_LAYER_SHAPES,
    MLA_SHAPES,
    MOE_SHAPES,
)
from ddtree_jax.quant import Int4

ON_GPU = jax.default_backend() == "gpu"
# Interpret mode runs the kernel body in Python: the CPU takes a sample.
CPU_SAMPLE = {"kimi_k2_tp8_tree16", "kimi_k2_ep8_tree16", "shipped_ctx512_batch8", "shipped_batch8"}


def _shape(table, name):
    if not ON_GPU and name not in CPU_SAMPLE:
        pytest.skip("full size and compiled on the GPU machine: pytest -m gpu")
    return table[name] if ON_GPU else table[name].shrink()


def _f32(args):
    return [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]


@pytest.mark.gpu
@pytest.mark.parametrize(("new_in_kernel", "ragged"), [(0, False), (256, False), (0, True)])
@pytest.mark.parametrize("name", list(MLA_SHAPES))
def test_mla_kernel_on_named_shapes(name, new_in_kernel, ragged):
    if not ON_GPU:
        pytest.skip("Mosaic GPU on the CPU: tests/test_mla_kernel.py (interpret mode, widths it tiles)")
    shape = _shape(MLA_SHAPES, name)
    args = mla_bench.inputs(shape, jax.random.PRNGKey(1), ragged)
    scale = (shape.kv_lora_rank + shape.rope_dim) ** -0.5
    tiles = MosaicMLATiles(new_in_kernel=new_in_kernel)
    got = jax.jit(lambda *a: mla_attention_mosaic(*a, scale=scale, tiles=tiles))(*args)
    want = mla_attention_reference(*_f32(args), scale)
    assert got.shape == want.shape == (shape.batch, shape.tokens, shape.heads, shape.kv_lora_rank)
    err = float(jnp.max(jnp.abs(got - want)))
    assert err < 3e-2 * float(jnp.max(jnp.abs(want))), err


def _moe_kernel(impl: str):
    return {
        "pallas": functools.partial(moe_experts_pallas, interpret=not ON_GPU),
        "mosaic": moe_experts_mosaic,
        # warp specialized: a producer warpgroup and 1 consumer (consumers=2 is refused compiled:
        # it failed intermittently on an H200, see mosaic.refuse_two_consumers)
        "mosaic-ws1": functools.partial(moe_experts_mosaic, tiles=MosaicMoETiles(consumers=1)),
        "w4a16": moe_experts_w4a16,
        "w4a16-ws1": functools.partial(moe_experts_w4a16, tiles=W4A16Tiles(stages=4, consumers=1)),
        "w4a16-ws2": functools.partial(moe_experts_w4a16, tiles=W4A16Tiles(stages=4, consumers=2)),
    }[impl]


def _moe_operands(shape, impl: str):
    """The bench's operands; for W4A16 the same weights quantized (group 32), which the
    reference dequantizes."""
    args = moe_bench.inputs(shape, jax.random.PRNGKey(2))
    return (*args[:3], *(Int4(32).quantize(a) for a in args[3:])) if impl.startswith("w4a16") else args


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "mosaic", "mosaic-ws1", "w4a16", "w4a16-ws1", "w4a16-ws2"])
@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_moe_kernel_on_named_shapes(name, impl):
    if impl != "pallas" and not ON_GPU:
        pytest.skip("Mosaic GPU on the CPU: tests/test_moe_kernel.py (interpret mode, small shapes)")
    shape = _shape(MOE_SHAPES, name)
    args = _moe_operands(shape, impl)
    got = jax.jit(_moe_kernel(impl))(*args).astype(jnp.float32)
    int4 = impl.startswith("w4a16")
    want = moe_experts_reference(*_f32(args[:3]), *args[3:]) if int4 else moe_experts_reference(*_f32(args))
    assert got.shape == (shape.tokens, shape.hidden)
    np.testing.assert_allclose(got, want, atol=3e-2 * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 8])
@pytest.mark.parametrize("name", list(DRAFTER_ATTENTION_SHAPES))
def test_drafter_attention_kernel_on_named_shapes(name, splits):
    """The drafter's attention kernel, as `num_splits` chooses (0) and split 8 ways, against the
    float32 reference on the same bf16 operands."""
    shape = _shape(DRAFTER_ATTENTION_SHAPES, name)
    args = drafter_bench.inputs(shape, jax.random.PRNGKey(1))
    window = shape.window or 2**31 - 1
    n = splits or num_splits(min(shape.window or shape.cache, shape.cache), shape.batch, shape.heads)
    fn = jax.jit(lambda *a: drafter_attention_pallas(*a, window, False, splits=n, interpret=not ON_GPU))
    got = fn(*args).astype(jnp.float32)
    want = drafter_attention_reference(*_f32(args), window, False)
    assert got.shape == want.shape == (shape.batch, shape.tokens, shape.heads, shape.head_dim)
    err = float(jnp.max(jnp.abs(got - want)))
    assert err < 2e-2 * float(jnp.max(jnp.abs(want))), err


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DRAFTER_LAYER_SHAPES))
def test_drafter_layer_kernel_on_named_shapes(name):
    """The drafter layer's QKV kernel on the bench's bf16 operands against the XLA path in float32."""
    from ddtree_jax.pallas.drafter_layer import api
    from ddtree_jax.pallas.drafter_layer import bench as layer_bench

    shape = _shape(DRAFTER_LAYER_SHAPES, name)
    layer = layer_bench.Layer(shape, jax.random.PRNGKey(0))
    x, cos, sin = layer_bench.inputs(shape, jax.random.PRNGKey(1))
    got = jax.jit(lambda *a: api.drafter_qkv(a[0], layer, *a[1:], 1e-6, implementation="pallas"))(x, cos, sin)
    f32 = types.SimpleNamespace(**{k: v.astype(jnp.float32) for k, v in vars(layer).items()})
    want = api.drafter_qkv(x.astype(jnp.float32), f32, cos, sin, 1e-6, implementation="xla")
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
        assert err < 3e-2 * float(jnp.max(jnp.abs(w))), err


# Lowered for CUDA on the CPU (no GPU needed): Mosaic GPU's layout inference, relayouts and
# register / shared-memory checks of the compiled kernels at the real shapes, which interpret
# mode skips (it takes wgmma's A operand through shared memory). Abstract operands: nothing of
# the full-size weights is allocated.
LOWERED_MOE = ["kimi_k2_ep8_ar", "kimi_k2_ep8_top1_tree32", "kimi_k2_ep8_tree64_batch8", "kimi_k2_ep8_prefill8192"]


def _lowered_for_cuda(fn, *abstract_args) -> str:
    return jax.jit(fn).trace(*abstract_args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(("new_in_kernel", "ragged"), [(0, False), (256, True)])
@pytest.mark.parametrize("name", list(MLA_SHAPES))
def test_mla_kernel_lowers_for_the_gpu(name, new_in_kernel, ragged):
    shape = MLA_SHAPES[name]
    args = jax.eval_shape(lambda: mla_bench.inputs(shape, jax.random.PRNGKey(1), ragged))
    scale = (shape.kv_lora_rank + shape.rope_dim) ** -0.5
    tiles = MosaicMLATiles(new_in_kernel=new_in_kernel)
    # An abstract H100: the partials' merge (`merge.MERGE_KERNEL`) may be Triton-lowered.
    text = _triton_lowered_for_cuda(lambda *a: mla_attention_mosaic(*a, scale=scale, tiles=tiles), *args)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("impl", ["mosaic", "mosaic-ws1", "w4a16", "w4a16-ws1", "w4a16-ws2"])
@pytest.mark.parametrize("name", LOWERED_MOE)
def test_moe_kernels_lower_for_the_gpu(name, impl):
    operands = jax.eval_shape(lambda: _moe_operands(MOE_SHAPES[name], impl))
    assert "mosaic_gpu" in _lowered_for_cuda(_moe_kernel(impl), *operands)


# The Triton lowering reads the GPU's compute capability when it lowers: an abstract H100 gives it
# one on the CPU. Lowering stops at the Triton IR; Triton compiles it on the GPU.
_H100 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"),
)


def _triton_lowered_for_cuda(fn, *abstract_args) -> str:
    with jax.sharding.use_abstract_mesh(_H100):
        return _lowered_for_cuda(fn, *abstract_args)


@pytest.mark.parametrize("name", list(DRAFTER_ATTENTION_SHAPES))
def test_drafter_attention_kernel_lowers_for_the_gpu(name):
    """The drafter's attention kernel at full size, split as `num_splits` chooses, to Triton IR."""
    shape = DRAFTER_ATTENTION_SHAPES[name]
    args = jax.eval_shape(lambda: drafter_bench.inputs(shape, jax.random.PRNGKey(1)))
    splits = num_splits(min(shape.window or shape.cache, shape.cache), shape.batch, shape.heads)
    window = shape.window or 2**31 - 1
    text = _triton_lowered_for_cuda(lambda *a: drafter_attention_pallas(*a, window, False, splits=splits), *args)
    assert "xla.gpu.triton" in text and f"grid_z = {splits} : i32" in text


@pytest.mark.parametrize("name", ["kimi_k25_dflash_tp8_32k", "kimi_k25_dflash_32k"])
def test_drafter_attention_head_groups_lower_for_the_gpu(name):
    """Eight query heads a program (`head_group`, one KV head's): the reshapes to [8 Tp, hd] rows
    lower to Triton IR at full size, split as `num_splits` chooses for the fewer programs."""
    shape = DRAFTER_ATTENTION_SHAPES[name]
    args = jax.eval_shape(lambda: drafter_bench.inputs(shape, jax.random.PRNGKey(1)))
    splits = num_splits(shape.cache, shape.batch, shape.heads // 8)
    tiles = DrafterAttentionTiles(head_group=8)
    fn = functools.partial(drafter_attention_pallas, window=2**31 - 1, causal=False, tiles=tiles, splits=splits)
    text = _triton_lowered_for_cuda(fn, *args)
    assert "xla.gpu.triton" in text and f"grid_y = {shape.heads // 8} : i32" in text


@pytest.mark.parametrize("name", ["kimi_k2_ep8_tree16", "kimi_k2_ep8_tree64_batch8"])
def test_moe_triton_kernel_lowers_for_the_gpu(name):
    operands = jax.eval_shape(lambda: _moe_operands(MOE_SHAPES[name], "pallas"))
    assert _triton_lowered_for_cuda(moe_experts_pallas, *operands).count("xla.gpu.triton") == 2  # gate/up, down


@pytest.mark.parametrize(("splits", "tokens"), [(128, 1), (43, 16)])
def test_mla_merge_kernel_lowers_for_the_gpu(monkeypatch, splits, tokens):
    """The partials' merge to Triton IR with `MERGE_EXTENDED`: a batch-1 AR step of 64 heads over
    32K (128 splits, the new key scored in the merge), and a 16-token tree at 8 heads (43 splits:
    a block of 64 partials, the rest masked; the new tokens' partial from XLA)."""
    from ddtree_jax.pallas.mla_attention import merge
    from ddtree_jax.pallas.mla_attention.merge import merge_partials

    monkeypatch.setattr(merge, "MERGE_EXTENDED", True)

    f32, bf16 = jnp.float32, jnp.bfloat16
    q = 64 if tokens == 1 else tokens * 8
    o = jax.ShapeDtypeStruct((1, splits, q, 512), bf16)
    lse = jax.ShapeDtypeStruct((1, splits, q), f32)
    if tokens == 1:
        key = [jax.ShapeDtypeStruct(s, bf16) for s in ((1, 64, 512), (1, 64, 64), (1, 1, 512), (1, 1, 64))]
        key.append(jax.ShapeDtypeStruct((1,), jnp.bool_))
        fn = lambda o, lse, *key: merge_partials(o, lse, None, tuple(key), rows=q, scale=0.04)  # noqa: E731
        text = _triton_lowered_for_cuda(fn, o, lse, *key)
    else:
        new = jax.ShapeDtypeStruct((1, q, 512), f32), jax.ShapeDtypeStruct((1, q), f32)
        fn = lambda o, lse, no, nl: merge_partials(o, lse, (no, nl), rows=q)  # noqa: E731
        text = _triton_lowered_for_cuda(fn, o, lse, *new)
    assert "xla.gpu.triton" in text and f"grid_y = {q} : i32" in text


@pytest.mark.parametrize("name", list(DRAFTER_LAYER_SHAPES))
def test_drafter_layer_kernel_lowers_for_the_gpu(name):
    """The drafter layer's QKV kernel at full size to Triton IR, a program a head."""
    from ddtree_jax.pallas.drafter_layer.kernel import qkv_pallas

    s = DRAFTER_LAYER_SHAPES[name]
    bf16, f32 = jnp.bfloat16, jnp.float32
    m, nh, half = s.batch * s.tokens, s.heads + 2 * s.kv_heads, s.head_dim // 2
    rows = jax.ShapeDtypeStruct((m, s.hidden), bf16)
    norm = jax.ShapeDtypeStruct((s.hidden,), bf16)
    w = jax.ShapeDtypeStruct((s.hidden, nh, s.head_dim), bf16)
    head_norm = jax.ShapeDtypeStruct((nh, s.head_dim), bf16)
    table = jax.ShapeDtypeStruct((m, half), f32)
    fn = functools.partial(qkv_pallas, nq=s.heads, eps=1e-6)
    text = _triton_lowered_for_cuda(fn, rows, norm, w, head_norm, table, table)
    assert "xla.gpu.triton" in text and f"grid_x = {nh} : i32" in text


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DRAFT_TOPK_SHAPES))
def test_draft_topk_kernel_on_named_shapes(name):
    """The drafter's log-softmax top-K kernel on the bench's logits (exact ties) against the
    float32 reference: the same ids, the values within float32 rounding."""
    from ddtree_jax.pallas.draft_topk import api
    from ddtree_jax.pallas.draft_topk import bench as topk_bench
    from ddtree_jax.pallas.draft_topk.reference import log_softmax_top_k_reference

    shape = DRAFT_TOPK_SHAPES[name] if ON_GPU else DRAFT_TOPK_SHAPES[name].shrink()
    x, t = topk_bench.logits(shape, jax.random.PRNGKey(0)), jnp.float32(0.8)
    got = jax.jit(lambda x, t: api.log_softmax_top_k(x, shape.k, t, implementation="pallas"))(x, t)
    want = log_softmax_top_k_reference(x, shape.k, t)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", [*DRAFT_TOPK_SHAPES, "tiny_vocab", "longest_row"])
def test_draft_topk_kernel_lowers_for_the_gpu(name):
    """The drafter's top-K kernel at full size to Triton IR, a program a row; also a toy
    vocabulary (37 logits padded to 64, K = 1) and the longest row it takes (bf16)."""
    from ddtree_jax.pallas.draft_topk.kernel import MAX_VOCAB, DraftTopKTiles, log_softmax_top_k_pallas
    from ddtree_jax.pallas.shapes import DraftTopKShape

    extra = {"tiny_vocab": DraftTopKShape(1, 37, 1), "longest_row": DraftTopKShape(2, MAX_VOCAB, 16)}
    s = extra[name] if name in extra else DRAFT_TOPK_SHAPES[name]
    rows = jax.ShapeDtypeStruct((s.batch * s.depths, s.vocab), jnp.bfloat16 if name in extra else jnp.float32)
    for one_pass in (False, True):
        fn = functools.partial(log_softmax_top_k_pallas, k=s.k, tiles=DraftTopKTiles(one_pass=one_pass))
        text = _triton_lowered_for_cuda(lambda x, t, fn=fn: fn(x, t), rows, jax.ShapeDtypeStruct((), jnp.float32))
        assert "xla.gpu.triton" in text and f"grid_x = {s.batch * s.depths} : i32" in text
