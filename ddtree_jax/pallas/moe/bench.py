"""Benchmark the routed experts on named real shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.moe.bench                 # GPU: every shape, xla, pallas, mosaic
    python -m ddtree_jax.pallas.moe.bench --smoke         # CPU: shrunken shapes, interpret mode
    python -m ddtree_jax.pallas.moe.bench --impl mosaic --mosaic-tiles 128,64,4 128,64,4,2
                                                          # GPU: the Mosaic schedules side by side

Shapes: `pallas/shapes.py` (MOE_SHAPES), bf16: the 48 local experts of one GPU of an
8-way expert-parallel split of Kimi-K2's 384 (4.2 GB of weights), and each token's 8 experts are
drawn at random, distinct, among those 48: every (token, expert) pair lands on this
GPU, the worst case of such a split rather than its average (1/8 of the pairs).
FLOPs count the routed work (2 * T * K * 3 * H * I); bytes count the weights of the
experts actually used plus x and the output. Peaks are `bench_util.PEAK_FLOPS` /
`PEAK_BYTES`, measured on this project's H200. "% peak" is the larger of the compute and
the memory fraction: whichever bound the shape is closer to. The error is against the
xla path ("xla-int4": the XLA path on INT4 weights, its error including the quantization's).
Times are device time from a profiler trace ("timer": "wall" where there is none, the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.bench_util import device_time, table_header, table_row
from ddtree_jax.pallas.moe.kernel import MoETiles, moe_experts_pallas
from ddtree_jax.pallas.moe.mosaic import MosaicMoETiles, moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_xla
from ddtree_jax.pallas.shapes import MOE_SHAPES, MoEShape
from ddtree_jax.quant import Int4


def inputs(shape: MoEShape, key):
    """Random bf16 activations and weights (scaled so outputs stay O(1)); distinct experts per token."""
    t, h, i, e, k = shape.tokens, shape.hidden, shape.inter, shape.experts, shape.top_k
    ks = jax.random.split(key, 6)
    bf = jnp.bfloat16
    idx = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(ks[2], (t, k), jnp.float32) / k
    return (
        jax.random.normal(ks[0], (t, h), bf),
        idx,
        w,
        (jax.random.normal(ks[3], (e, h, i), jnp.float32) * h**-0.5).astype(bf),
        (jax.random.normal(ks[4], (e, h, i), jnp.float32) * h**-0.5).astype(bf),
        (jax.random.normal(ks[5], (e, i, h), jnp.float32) * i**-0.5).astype(bf),
    )


def cost(shape: MoEShape, used: int) -> tuple[int, int]:
    """(FLOPs, bytes) of one call: the routed work; the `used` experts' bf16 weights, x and the output."""
    t, h, i, k = shape.tokens, shape.hidden, shape.inter, shape.top_k
    return 2 * t * k * 3 * h * i, 2 * (used * 3 * h * i + 2 * t * h)


def int4_bytes(shape: MoEShape, used: int) -> int:
    """`cost`'s bytes with the weights in INT4 (packed + a bf16 scale per 32): 4.5 bits each."""
    weights = used * 3 * shape.hidden * shape.inter
    return cost(shape, used)[1] - 2 * weights + weights * 9 // 16


def main(argv=None):
    d = MoETiles()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(MOE_SHAPES), choices=list(MOE_SHAPES))
    ap.add_argument(
        "--impl", nargs="+", default=["xla", "pallas", "mosaic"], choices=["xla", "pallas", "mosaic", "xla-int4"]
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-m", type=int, default=d.block_m)
    ap.add_argument("--block-i", type=int, default=d.block_i)
    ap.add_argument("--block-h", type=int, default=d.block_h)
    ap.add_argument("--block-k", type=int, default=d.block_k)
    ap.add_argument("--num-warps", type=int, default=d.num_warps)
    ap.add_argument("--num-stages", type=int, default=d.num_stages)
    m = MosaicMoETiles()
    ap.add_argument(
        "--mosaic-tiles",
        nargs="+",
        default=[f"{m.block_n},{m.block_k},{m.stages},{m.consumers}"],
        help="Mosaic tiles to try, each block_n,block_k,stages[,consumers] (consumers 0: one warpgroup a "
        "program; 1 or 2: warp specialized)",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU check: shapes.shrink()ed, interpret mode")
    args = ap.parse_args(argv)
    int4 = Int4(32)
    tiles = MoETiles(args.block_m, args.block_i, args.block_h, args.block_k, args.num_warps, args.num_stages)
    print(f"device: {jax.devices()[0].device_kind}; pallas {tiles}")
    print(table_header("xla"))
    xla = jax.jit(moe_experts_xla)
    pallas = jax.jit(lambda *a: moe_experts_pallas(*a, tiles=tiles, interpret=args.smoke))
    interpret = mosaic_interpret() if args.smoke else None
    for name in args.shapes:
        shape = MOE_SHAPES[name].shrink() if args.smoke else MOE_SHAPES[name]
        h, i = shape.hidden, shape.inter
        x = inputs(shape, jax.random.PRNGKey(0))
        used = int(jnp.unique(x[1]).size)  # experts whose weights are read
        flops, nbytes = cost(shape, used)
        expected = xla(*x).astype(jnp.float32)
        runs = []
        for impl in args.impl:
            if impl != "mosaic":
                runs.append((impl, {"xla": xla, "pallas": pallas}.get(impl, xla)))
                continue
            for spec in args.mosaic_tiles:
                mt = MosaicMoETiles(*(int(v) for v in spec.split(",")))
                if args.smoke:  # the largest power of two that divides the shrunk widths
                    bn = next(b for b in (mt.block_n, 64, 32, 16) if h % b == 0 and i % b == 0)
                    mt = dataclasses.replace(mt, block_n=bn, block_k=min(mt.block_k, bn))
                label = "mosaic"
                if len(args.mosaic_tiles) > 1:
                    label += f" {mt.block_n},{mt.block_k},{mt.stages},{mt.consumers}"
                runs.append((label, jax.jit(lambda *a, mt=mt: moe_experts_mosaic(*a, tiles=mt, interpret=interpret))))
        for impl, fn in runs:
            operands, weight_bytes = x, nbytes
            if impl == "xla-int4":  # INT4 weights (packed + bf16 scales per 32): 4.5 bits per weight
                fn, operands = xla, (*x[:3], *(int4.quantize(a) for a in x[3:]))
                weight_bytes = int4_bytes(shape, used)
            try:
                sec, timer = device_time(fn, operands, args.reps)
            except Exception as err:  # a tile config the compiler rejects: report it, go on
                print(f"| {name} | {impl} | failed: {type(err).__name__}: {str(err).splitlines()[0][:120]} |")
                continue
            err = float(jnp.max(jnp.abs(fn(*operands).astype(jnp.float32) - expected)))
            print(table_row(name, impl, sec, timer, flops, weight_bytes, err))


if __name__ == "__main__":
    main()
