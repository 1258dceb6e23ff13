"""The Pallas grouped MoE kernels (Triton-style and Mosaic GPU, interpret mode on the CPU) against the dense reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.moe import moe_experts
from ddtree_jax.pallas.moe.kernel import MoETiles, group_by_expert, moe_experts_pallas, num_row_blocks
from ddtree_jax.pallas.moe.mosaic import MosaicMoETiles, moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_reference
from ddtree_jax.pallas.moe.w4a16 import W4A16Tiles, moe_experts_w4a16

SMALL_TILES = MoETiles(block_m=16, block_i=16, block_h=16, block_k=16)


def case(seed, t, e, h, i, idx=None, k=2, dtype=jnp.float32):
    """Random x, routing and weights; idx defaults to k distinct experts per token."""
    rng = np.random.default_rng(seed)

    def f(*shape, scale=1.0):
        return jnp.asarray(scale * rng.normal(size=shape), dtype)

    if idx is None:
        idx = np.argsort(rng.uniform(size=(t, e)), axis=1)[:, :k]
    idx = jnp.asarray(idx, jnp.int32)
    w = jnp.asarray(rng.uniform(size=idx.shape), jnp.float32)
    return f(t, h), idx, w, f(e, h, i, scale=h**-0.5), f(e, h, i, scale=h**-0.5), f(e, i, h, scale=i**-0.5)


@pytest.mark.parametrize(
    ("t", "k", "e", "h", "i", "tiles"),
    [
        (1, 2, 8, 24, 20, SMALL_TILES),  # AR: T * K < block_m; H, I not multiples of 16; 6 experts idle
        (9, 3, 8, 40, 36, MoETiles(block_m=4, block_i=16, block_h=32, block_k=8)),  # several blocks per expert
        (33, 8, 16, 64, 32, MoETiles()),  # default tiles, shrunk to the small H and I
    ],
)
def test_kernel_matches_reference(t, k, e, h, i, tiles):
    args = case(t, t, e, h, i, k=k)
    got = moe_experts_pallas(*args, tiles=tiles, interpret=True)
    np.testing.assert_allclose(got, moe_experts_reference(*args), atol=1e-5, rtol=1e-5)


def test_skewed_routing_with_idle_experts_and_several_tile_sizes():
    """Experts 0, 2, 4, 5 get nothing; expert 1 spans blocks; the last experts are idle, so unused blocks trail."""
    idx = [[1, 3], [3, 1], [1, 3], [1, 3], [3, 1], [1, 3], [1, 3]]
    args = case(5, 7, 6, 48, 40, idx=idx)
    want = moe_experts_reference(*args)
    for bm, bi, bh, bk in [(4, 16, 16, 8), (2, 32, 64, 16), (8, 64, 32, 32)]:
        got = moe_experts_pallas(*args, tiles=MoETiles(bm, bi, bh, bk), interpret=True)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"tiles {(bm, bi, bh, bk)}")


def test_bf16():
    args = case(3, 12, 8, 64, 48, k=3, dtype=jnp.bfloat16)
    got = moe_experts_pallas(*args, tiles=SMALL_TILES, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = moe_experts_reference(*args)
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2, rtol=3e-2)


def test_layout_groups_pairs_by_expert_in_padded_blocks():
    idx = jnp.asarray([[3, 1], [1, 0], [3, 1], [1, 4]], jnp.int32)  # sizes: e0 1, e1 4, e2 0, e3 2, e4 1
    pos, block_expert = group_by_expert(idx, 6, 2)
    # e0: rows 0-1, e1: rows 2-5, e3: rows 6-7, e4: rows 8-9; pairs keep their order within an expert.
    np.testing.assert_array_equal(pos, [6, 2, 3, 0, 7, 4, 5, 8])
    assert block_expert.shape == (num_row_blocks(8, 6, 2),)  # (8 + 6) // 2 = 7
    np.testing.assert_array_equal(block_expert, [0, 1, 1, 3, 4, -1, -1])


def test_dropped_pairs_cost_nothing_and_count_zero():
    """idx < 0 drops a pair (expert parallelism: another shard's expert): same as weight 0."""
    x, idx, w, gate, up, down = case(5, 6, 4, 16, 8, k=3)
    drop = jnp.asarray(np.random.default_rng(5).random(idx.shape) < 0.4)
    got = moe_experts_pallas(x, jnp.where(drop, -1, idx), w, gate, up, down, tiles=MoETiles(block_m=4), interpret=True)
    want = moe_experts_reference(x, idx, jnp.where(drop, 0.0, w), gate, up, down)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    _, block_expert = group_by_expert(jnp.asarray([[-1, 2], [-1, -1]], jnp.int32), 4, 2)
    np.testing.assert_array_equal(block_expert, [2, -1, -1, -1])  # dropped pairs: blocks 1-2, skipped


def test_ids_past_the_experts_are_dropped_like_negative_ones():
    """An id >= E drops its pair on the kernel path as on the XLA path and in the reference (it
    fell outside the layout's bincount: NaN rows)."""
    x, idx, w, gate, up, down = case(6, 4, 4, 16, 8, k=2)
    bad = idx.at[0, 0].set(4).at[2, 1].set(99)
    want = moe_experts_reference(x, jnp.where(bad >= 4, 0, bad), jnp.where(bad >= 4, 0.0, w), gate, up, down)
    for impl in ("xla", "pallas"):
        got = moe_experts(x, bad, w, gate, up, down, implementation=impl)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=impl)
    _, block_expert = group_by_expert(jnp.asarray([[4, 2], [7, -1]], jnp.int32), 4, 2)
    np.testing.assert_array_equal(block_expert, [2, -1, -1, -1])


def test_dispatch_checks_ranks_and_widths_and_takes_no_pairs():
    """Wrong ranks and a gate of another H are named (the kernel ran such a gate silently);
    no tokens or no experts a token give zeros on every path (the interpreter failed on them)."""
    x, idx, w, gate, up, down = case(7, 4, 4, 16, 8)
    with pytest.raises(ValueError, match=r"x must have 2 dimensions, got shape \(16,\)"):
        moe_experts(x[0], idx, w, gate, up, down)
    with pytest.raises(ValueError, match=r"idx must have 2 dimensions, got shape \(1, 4, 2\)"):
        moe_experts(x, idx[None], w, gate, up, down)
    for impl in ("xla", "pallas"):
        with pytest.raises(ValueError, match=r"gate of shape \(4, 12, 8\) does not take x of shape \(4, 16\)"):
            moe_experts(x, idx, w, gate[:, :12], up, down, implementation=impl)
    for impl in ("xla", "pallas", "mosaic", "auto"):
        for t, k in ((0, 2), (4, 0)):
            got = moe_experts(x[:t], idx[:t, :k], w[:t, :k], gate, up, down, implementation=impl)
            assert got.shape == (t, 16) and not got.any(), impl


def test_row_block_bound_is_reached():
    """One token on 8 distinct experts with 16-row blocks needs all 8 = (8 + 8 * 15) // 16 blocks."""
    _, block_expert = group_by_expert(jnp.arange(8, dtype=jnp.int32)[None] * 5, 48, 16)
    np.testing.assert_array_equal(block_expert, np.arange(8) * 5)


def test_tiles_must_be_powers_of_two():
    with pytest.raises(ValueError, match="block_h"):
        MoETiles(block_h=24)


def test_dispatch_with_pallas():
    # generate(implementation="pallas"), the routed experts on this kernel, giving the XLA path's
    # tokens: test_mla_kernel.py::test_pallas_means_the_xla_path_for_attention (the same two AR
    # loops on TINY, and DDTree).
    args = case(1, 5, 8, 32, 24, k=2)
    np.testing.assert_allclose(
        moe_experts(*args, implementation="pallas"), moe_experts(*args, implementation="xla"), atol=1e-5, rtol=1e-5
    )


def test_bench_smoke(capsys):
    from ddtree_jax.pallas.moe import bench

    # Mosaic's interpreter on 48 experts takes minutes: its smoke run is bench_kernels' (8 experts).
    bench.main(["--smoke", "--reps", "1", "--shapes", "kimi_k2_ep8_tree16", "--impl", "xla", "pallas"])
    out = capsys.readouterr().out
    assert "| kimi_k2_ep8_tree16 | xla |" in out and "| kimi_k2_ep8_tree16 | pallas |" in out


def _bf16_reference(args):
    """The float32 reference on the kernel's own bf16 operands."""
    return moe_experts_reference(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args])


def _mosaic(args, tiles, race_states, **kw):
    """`moe_experts_mosaic` in interpret mode under the race detector (compiled on a GPU), float32;
    fails on a race between its TMA copies and warpgroups."""
    interpret = mosaic_interpret()
    if interpret is not None:
        interpret = dataclasses.replace(interpret, detect_races=True)
    got = moe_experts_mosaic(*args, tiles=tiles, interpret=interpret, **kw)
    assert not [s for s in race_states if s.races_found], "the interpreter found a race"
    return got.astype(jnp.float32)


# 0: one warpgroup a program; 1, 2: warp specialized, a producer and that many consumers (64 rows each).
MOSAIC_SCHEDULES = pytest.mark.parametrize("consumers", [0, 1, 2], ids=["one-wg", "ws1", "ws2"])


@MOSAIC_SCHEDULES
@pytest.mark.parametrize(
    ("idx", "tiles"),
    [
        # Dropped pairs (-1, experts of other shards) and idle experts; two output tiles, four K
        # steps through two slots (the ring wraps).
        ([[0, -1], [3, 1], [1, 3], [-1, -1], [2, 0], [3, 2]], MosaicMoETiles(block_n=32, block_k=16, stages=2)),
        # Expert 1 takes 70 pairs: its rows span two 64-row blocks (one of 128 rows for two
        # consumers); one pipeline slot.
        ([[1]] * 70 + [[2], [0]], MosaicMoETiles(block_n=64, block_k=16, stages=1)),
        # Top-8 of 8: every token on every expert (Kimi-K2's top-k); 70 pairs an expert fill rows
        # of both consumers' halves of a 128-row block.
        (
            [list(range(8))[r % 8 :] + list(range(8))[: r % 8] for r in range(70)],
            MosaicMoETiles(block_n=32, block_k=32),
        ),
    ],
)
def test_mosaic_kernel_matches_reference(idx, tiles, consumers, race_states):
    """Mosaic GPU kernels (TMA pipeline, wgmma) in Mosaic GPU's interpret mode, bf16, in each
    schedule of a program."""
    args = case(11, len(idx), max(4, 1 + max(max(row) for row in idx)), 64, 64, idx=idx, dtype=jnp.bfloat16)
    got = _mosaic(args, dataclasses.replace(tiles, consumers=consumers), race_states)
    want = _bf16_reference(args)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    # bf16 operands and a bf16 SwiGLU activation between the two products: a few bf16 ulps.
    np.testing.assert_allclose(got, want, atol=2e-2 * float(jnp.max(jnp.abs(want))), rtol=0)
    assert not np.asarray(jnp.isnan(got)).any()


@MOSAIC_SCHEDULES
def test_mosaic_reads_layer_stacks_in_place(consumers, race_states):
    """`layer=` over [L, E, ...] bf16 stacks: the kernels read the layer's experts in the stack,
    exactly as from that layer's own arrays."""
    idx = np.asarray([[1, 3]] * 66 + [[0, 2], [3, 1], [-1, 3]])  # expert 1's rows reach the second consumer's
    layers = [case(s, len(idx), 4, 64, 64, idx=idx, dtype=jnp.bfloat16) for s in range(3)]
    x, idx, w = layers[0][:3]
    stacks = [jnp.stack([lay[3 + n] for lay in layers]) for n in range(3)]
    tiles = MosaicMoETiles(block_n=32, block_k=32, consumers=consumers)
    got = _mosaic((x, idx, w, *stacks), tiles, race_states, layer=jnp.int32(1))
    np.testing.assert_array_equal(got, _mosaic((x, idx, w, *layers[1][3:]), tiles, race_states))
    want = _bf16_reference((x, idx, w, *layers[1][3:]))
    np.testing.assert_allclose(got, want, atol=2e-2 * float(jnp.max(jnp.abs(want))), rtol=0)


def test_mosaic_tiles_and_shapes_are_checked():
    with pytest.raises(ValueError, match="block_n must be a positive multiple of 16, got 24"):
        MosaicMoETiles(block_n=24)
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        MosaicMoETiles(stages=0)
    with pytest.raises(ValueError, match="consumers must be 0, 1 or 2, got 3"):
        MosaicMoETiles(consumers=3)
    with pytest.raises(ValueError, match="release_delay must be 0 or 1, got 2"):
        MosaicMoETiles(release_delay=2)
    args = case(0, 2, 4, 48, 64, dtype=jnp.bfloat16)
    # Two consumers crashed once compiled on an H200 (CUDA_ERROR_LAUNCH_FAILED), cause unknown:
    # refused unless interpreted (the interpreter tests above still run them).
    with pytest.raises(ValueError, match=r"mosaic: consumers=2 .* refused compiled: it crashed once on an H200"):
        moe_experts_mosaic(*case(0, 2, 4, 64, 64, dtype=jnp.bfloat16), tiles=MosaicMoETiles(32, 32, consumers=2))
    with pytest.raises(ValueError, match="H=48 to be a multiple of block_n=32"):
        moe_experts_mosaic(*args, tiles=MosaicMoETiles(block_n=32, block_k=16), interpret=mosaic_interpret())


def test_auto_takes_a_mosaic_kernel_only_for_large_experts_it_tiles():
    from ddtree_jax.pallas.moe.api import _mosaic_takes
    from ddtree_jax.quant import Int4

    def w(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    def experts(h, i, dtype=jnp.bfloat16):
        return w(48, h, i, dtype=dtype), w(48, h, i, dtype=dtype), w(48, i, h, dtype=dtype)

    assert _mosaic_takes(*experts(7168, 2048))  # an EP-8 shard of Kimi-K2
    assert not _mosaic_takes(w(8, 256, 128), w(8, 256, 128), w(8, 128, 256))  # the shipped pair: launch-bound
    assert not _mosaic_takes(*experts(7168, 2048, jnp.float32))
    assert not _mosaic_takes(*experts(7168, 2000))  # I not a multiple of the tiles

    # INT4 experts: the W4A16 kernel, under bf16 activations, for outputs it tiles, when large enough.
    def int4(e, h, i, group=32):
        return [Int4(group).stored((e, h, i))] * 2 + [Int4(group).stored((e, i, h))]

    assert _mosaic_takes(*int4(48, 7168, 2048))
    assert not _mosaic_takes(*int4(48, 7168, 2048), activations=jnp.float32)
    assert not _mosaic_takes(*int4(48, 7168, 2016))  # I not a multiple of block_o
    assert not _mosaic_takes(*int4(48, 7168, 2048, group=16))
    assert not _mosaic_takes(*int4(8, 256, 128))  # the shipped pair's size


def test_auto_judges_layer_stacks_by_one_layer(monkeypatch):
    """With `layer=`, "auto" weighs one layer's experts against AUTO_MIN_BYTES, not the stack's."""
    from ddtree_jax.pallas.moe import api

    monkeypatch.setattr(api, "on_hopper", lambda: True)
    one = [jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16)] * 3  # 50 MB a layer
    four = [jax.ShapeDtypeStruct((4, 8, 1024, 1024), jnp.bfloat16)] * 3
    assert api.resolve("auto", *one) == api.resolve("auto", *four, stacked=True) == "xla"
    assert api.resolve("auto", *four) == "mosaic"  # the stack alone would pass the bar
    big = [jax.ShapeDtypeStruct((4, 16, 1024, 1024), jnp.bfloat16)] * 3  # 100 MB a layer
    assert api.resolve("auto", *big, stacked=True) == "mosaic"
    assert api.resolve("xla", *four, stacked=True) == "xla"


def int4_case(seed, idx, e, h, i, group=32):
    """bf16 x, routing, and INT4 experts (grouped layout)."""
    from ddtree_jax.quant import Int4

    rng = np.random.default_rng(seed)
    idx = jnp.asarray(idx, jnp.int32)
    t = idx.shape[0]
    q = Int4(group)

    def expert(fan_in, fan_out):
        return q.quantize(jnp.asarray(rng.normal(size=(e, fan_in, fan_out)) * fan_in**-0.5, jnp.float32))

    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=idx.shape), jnp.float32)
    return x, idx, w, expert(h, i), expert(h, i), expert(i, h)


def _int4_reference(x, idx, w, gate, up, down):
    """The float32 reference on the kernel's operands: bf16 x, the dequantized INT4 experts."""
    return moe_experts_reference(x.astype(jnp.float32), idx, w, gate, up, down)


def _assert_bf16_close(got, want):
    # bf16 activations, bf16-rounded dequantized weights and a bf16 SwiGLU activation between the
    # two products: a few bf16 ulps of the largest output.
    assert got.shape == want.shape and not np.asarray(jnp.isnan(got)).any()
    np.testing.assert_allclose(got, want, atol=2e-2 * float(jnp.max(jnp.abs(want))), rtol=0)


@pytest.fixture
def race_states(monkeypatch):
    """The interpreter's race-detector states, one a kernel call (each call starts a new one)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    states, detector = [], gpu_callbacks.GPURaceDetectionState

    def recorded(**kw):
        states.append(detector(**kw))
        return states[-1]

    monkeypatch.setattr(gpu_callbacks, "GPURaceDetectionState", recorded)
    return states


def _w4a16(args, tiles, race_states, **kw):
    """`moe_experts_w4a16` in interpret mode under the race detector (compiled on a GPU), float32;
    fails on a race between its TMA copies and warpgroups (their barriers order the ring)."""
    interpret = mosaic_interpret()
    if interpret is not None:
        interpret = dataclasses.replace(interpret, detect_races=True)
    got = moe_experts_w4a16(*args, tiles=tiles, interpret=interpret, **kw)
    assert not [s for s in race_states if s.races_found], "the interpreter found a race"
    return got.astype(jnp.float32)


# 0: one warpgroup a program; 1, 2: warp specialized, a producer and that many consumers.
W4A16_SCHEDULES = pytest.mark.parametrize("consumers", [0, 1, 2], ids=["one-wg", "ws1", "ws2"])


@W4A16_SCHEDULES
@pytest.mark.parametrize(
    ("idx", "e", "h", "i", "tiles"),
    [
        # Dropped pairs (-1) and idle experts; one group per step, 128 outputs, 4 K steps.
        ([[0, -1], [3, 1], [1, 3], [-1, -1], [2, 0], [3, 2]], 4, 128, 128, W4A16Tiles(groups_per_step=1)),
        # All 40 tokens on expert 1 (three 16-pair blocks), top-1; 128 output rows a warpgroup, one
        # slot (the warp-specialized ring then releases it at once).
        ([[1]] * 40, 3, 256, 256, W4A16Tiles(block_t=16, block_o=128, groups_per_step=2, stages=1)),
        # Top-8 of 8 (Kimi-K2's top-k), 32-pair blocks, H = 384: 12 groups, 6 K steps of 2 through 3 slots.
        ([list(range(8))[r:] + list(range(8))[:r] for r in range(5)], 8, 384, 128, W4A16Tiles(32, 64, 2, 3)),
    ],
)
def test_w4a16_kernel_matches_reference(idx, e, h, i, tiles, consumers, race_states):
    """The W4A16 Mosaic GPU kernels (int4 weights as wgmma's A operand) in Mosaic GPU's interpret
    mode, in each schedule of a program (outputs are multiples of 2 x 128 rows for all three)."""
    args = int4_case(12, idx, e, h, i)
    got = _w4a16(args, dataclasses.replace(tiles, consumers=consumers), race_states)
    _assert_bf16_close(got, _int4_reference(*args))


@W4A16_SCHEDULES
def test_w4a16_reads_layer_stacks_in_place(consumers, race_states):
    """`layer=` over [L, E, ...] INT4 stacks: the kernels read the layer's experts in the stack,
    exactly as from that layer's own arrays."""
    idx = [[0, 2], [3, 1], [-1, 3]]
    layers = [int4_case(s, idx, 4, 128, 128) for s in range(3)]
    x, idx, w = layers[0][:3]
    stacks = [jax.tree.map(lambda *a: jnp.stack(a), *[lay[3 + n] for lay in layers]) for n in range(3)]
    tiles = W4A16Tiles(groups_per_step=2, consumers=consumers)
    got = _w4a16((x, idx, w, *stacks), tiles, race_states, layer=jnp.int32(1))
    np.testing.assert_array_equal(got, _w4a16((x, idx, w, *layers[1][3:]), tiles, race_states))
    _assert_bf16_close(got, _int4_reference(x, idx, w, *layers[1][3:]))


def test_w4a16_default_tiles_by_pairs():
    """Two consumers where row blocks hold 128 pairs and the shapes take them (faster there on an
    H200: docs/results/s27/w4a16_ws2.json); one warpgroup for trees, or where they do not fit."""
    from ddtree_jax.pallas.moe.w4a16 import PREFILL_TILES, TREE_TILES, default_tiles

    _, _, _, gate, _, down = int4_case(0, [[0]], 4, 256, 256)
    assert default_tiles(4 * 65, gate, down) == PREFILL_TILES  # 65 a expert -> blocks of 128
    assert default_tiles(4 * 64, gate, down) == TREE_TILES  # 64 a expert -> blocks of 64
    assert default_tiles(1, gate, down) == TREE_TILES
    _, _, _, gate, _, down = int4_case(0, [[0]], 4, 192, 256)  # down's 192 outputs: no 2 x 64 split
    assert default_tiles(4 * 1000, gate, down) == TREE_TILES


def test_w4a16_tiles_and_shapes_are_checked():
    with pytest.raises(ValueError, match="block_t must be a multiple of 16 in"):
        W4A16Tiles(block_t=8)
    with pytest.raises(ValueError, match="block_o must be 64 or 128, got 32"):
        W4A16Tiles(block_o=32)
    with pytest.raises(ValueError, match="groups_per_step must be >= 1"):
        W4A16Tiles(groups_per_step=0)
    with pytest.raises(ValueError, match="consumers must be 0, 1 or 2, got 3"):
        W4A16Tiles(consumers=3)
    # Gate / up accumulators of 2 x 128 x 128 float32 over 128 threads: 256 registers a thread, more
    # than a consumer's 232 (C = 2) or 256 (C = 1); NaN on an H200 at C = 2.
    for c, budget in ((2, 232), (1, 256)):
        with pytest.raises(
            ValueError, match=rf"block_t=128: .* take 256 registers a thread, .* has {budget}; measured"
        ):
            W4A16Tiles(block_t=128, block_o=128, consumers=c)
    W4A16Tiles(block_t=128, block_o=128)  # one warpgroup: correct on the H200 (spilled, slower)
    W4A16Tiles(block_t=112, block_o=128, consumers=2)  # 224 of 232: not measured, not refused
    W4A16Tiles(block_t=128, block_o=64, consumers=2)  # 128: correct on the H200
    # block_t=None resolves to 128 where it runs: 128 tokens, each on both of 2 experts.
    idx = [[0, 1]] * 128
    with pytest.raises(ValueError, match=r"block_o=128, consumers=2\) at block_t=128"):
        moe_experts_w4a16(*int4_case(0, idx, 2, 256, 256), tiles=W4A16Tiles(block_o=128, consumers=2))
    with pytest.raises(ValueError, match="outputs a multiple of block_o=64"):
        moe_experts_w4a16(*int4_case(0, [[0]], 2, 128, 96), interpret=mosaic_interpret())
    with pytest.raises(ValueError, match=r"down needs outputs a multiple of block_o=64 x consumers=2 .* got 192"):
        moe_experts_w4a16(*int4_case(0, [[0]], 2, 192, 128), tiles=W4A16Tiles(groups_per_step=2, consumers=2))
    with pytest.raises(ValueError, match="groups of a multiple of 32 inputs, got 128 outputs and groups of 16"):
        moe_experts_w4a16(*int4_case(0, [[0]], 2, 128, 128, group=16), interpret=mosaic_interpret())
    with pytest.raises(ValueError, match="6 groups, not a multiple of groups_per_step=4"):
        moe_experts_w4a16(*int4_case(0, [[0]], 2, 192, 128), tiles=W4A16Tiles(groups_per_step=4))
    with pytest.raises(NotImplementedError, match="not 'pallas'"):
        moe_experts(*int4_case(0, [[0]], 2, 128, 128), implementation="pallas")


def test_w4a16_block_rows_follow_the_pairs_per_expert():
    t = W4A16Tiles()
    assert [t.rows_per_block(p, 48) for p in (8, 520, 4160, 65536)] == [16, 16, 128, 128]
    assert t.rows_per_block(1040, 48) == 32 and W4A16Tiles(block_t=64).rows_per_block(8, 48) == 64


@pytest.mark.parametrize("weights", ["int4", "bf16"])
def test_layer_stacks_are_indexed_in_place(weights):
    """`layer=` over [L, E, ...] stacks: each kernel reads the layer's experts in the stack and
    agrees exactly with its call on that layer's own arrays; the XLA path slices the stack."""
    idx = [[0, 2], [3, 1], [-1, 3]]
    if weights == "int4":
        layers = [int4_case(s, idx, 4, 128, 128) for s in range(3)]
    else:
        layers = [case(s, 3, 4, 128, 128, idx=np.asarray(idx), dtype=jnp.bfloat16) for s in range(3)]
    x, idx, w = layers[0][:3]
    stacks = [jax.tree.map(lambda *a: jnp.stack(a), *[lay[3 + n] for lay in layers]) for n in range(3)]
    run = jax.jit(
        lambda li, *s, impl: moe_experts(x, idx, w, *s, layer=li, implementation=impl), static_argnames="impl"
    )
    # Both sides jitted: eagerly, each bf16 op rounds its result, where XLA may keep a fused
    # value in float32 (the dense pass's expert outputs before the weighted sum).
    alone = jax.jit(lambda *s: moe_experts(x, idx, w, *s))
    for li in (2, 1):
        own = moe_experts(x, idx, w, *layers[li][3:], implementation="mosaic")
        np.testing.assert_array_equal(run(jnp.int32(li), *stacks, impl="mosaic"), own)
        np.testing.assert_allclose(run(jnp.int32(li), *stacks, impl="xla"), alone(*layers[li][3:]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\[L, E, H, I\] with one"):
        moe_experts(x, idx, w, *layers[0][3:], layer=jnp.int32(0))
    with pytest.raises(ValueError, match=r"\[E, H, I\] without a layer"):
        moe_experts(x, idx, w, *stacks)
