"""Benchmark the routed experts on named real shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.moe.bench                 # GPU: every shape, xla, pallas, mosaic
    python -m ddtree_jax.pallas.moe.bench --smoke         # CPU: shrunken shapes, interpret mode
    python -m ddtree_jax.pallas.moe.bench --impl mosaic --mosaic-tiles 128,64,4 128,64,4,2
                                                          # GPU: the Mosaic schedules side by side
    python -m ddtree_jax.pallas.moe.bench --dense --dense-tiles 64,128,4,2 32,128,4,2
                                                          # GPU: the few-token dense pass (dense.py)

With --dense the shapes are MOE_DENSE_SHAPES (the shipped target's verify) and every expert
runs on every token, as `reference._moe_dense_flat` (the XLA path there) does: FLOPs count that
dense work, bytes every expert's weights. A kernel output off the XLA path's by more than
`DENSE_TOLERANCE` of its largest magnitude fails the run.

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
from ddtree_jax.pallas.bench_util import device_time, table_row
from ddtree_jax.pallas.moe.dense import DenseMoETiles, moe_dense_pallas
from ddtree_jax.pallas.moe.kernel import MoETiles, moe_experts_pallas
from ddtree_jax.pallas.moe.mosaic import MosaicMoETiles, moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_xla
from ddtree_jax.pallas.shapes import MOE_DENSE_SHAPES, MOE_SHAPES, MoEShape
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


DENSE_TOLERANCE = 3e-2
"""--dense: largest max-abs error allowed, relative to the XLA output's largest magnitude (bf16 rounding)."""


def dense_main(args) -> None:
    """The few-token dense pass: XLA (`moe_experts_xla`, its dense branch) against dense.py's kernel."""
    xla = jax.jit(moe_experts_xla)
    print(f"device: {jax.devices()[0].device_kind}")
    print("| shape | impl | ms | timer | TFLOP/s | GB/s | % peak | max abs err vs xla |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    bad = []
    for name in args.shapes or list(MOE_DENSE_SHAPES):
        shape = MOE_DENSE_SHAPES[name]
        t, h, i, e = shape.tokens, shape.hidden, shape.inter, shape.experts
        x = inputs(shape, jax.random.PRNGKey(0))
        flops, nbytes = 2 * t * e * 3 * h * i, 2 * (e * 3 * h * i + 2 * t * h)
        want = xla(*x).astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(want)))
        runs = [("xla", xla)]
        for spec in args.dense_tiles:
            dt = DenseMoETiles(*(int(v) for v in spec.split(",")))
            label = "dense" if len(args.dense_tiles) == 1 else f"dense {spec}"
            runs.append((label, jax.jit(lambda *a, dt=dt: moe_dense_pallas(*a, tiles=dt, interpret=args.smoke))))
        for impl, fn in runs:
            try:
                err = float(jnp.max(jnp.abs(fn(*x).astype(jnp.float32) - want)))
                sec, timer = device_time(fn, x, args.reps)
            except Exception as fault:  # a tile config the compiler rejects: report it, go on, fail at the end
                why = f"{type(fault).__name__}: {str(fault).splitlines()[0][:120]}"
                print(f"| {name} | {impl} | failed: {why} |")
                bad.append(f"{name} {impl}: {why}")
                continue
            if err > DENSE_TOLERANCE * scale:
                bad.append(f"{name} {impl}: max abs err {err:.3g} against {scale:.3g}")
            print(table_row(name, impl, sec, timer, flops, nbytes, err, digits=(4, 2)))
    if bad:
        raise SystemExit("kernel failed or differs from the XLA path:\n" + "\n".join(bad))


def main(argv=None):
    d = MoETiles()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=None, choices=[*MOE_SHAPES, *MOE_DENSE_SHAPES])
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
    ap.add_argument("--dense", action="store_true", help="the few-token dense pass (MOE_DENSE_SHAPES), see above")
    dd = DenseMoETiles()
    ap.add_argument(
        "--dense-tiles",
        nargs="+",
        default=[f"{dd.block_i},{dd.block_k},{dd.num_warps},{dd.num_stages}"],
        help="with --dense: tiles to try, each block_i,block_k,num_warps,num_stages",
    )
    args = ap.parse_args(argv)
    if args.dense:
        return dense_main(args)
    int4 = Int4(32)
    tiles = MoETiles(args.block_m, args.block_i, args.block_h, args.block_k, args.num_warps, args.num_stages)
    print(f"device: {jax.devices()[0].device_kind}; pallas {tiles}")
    print("| shape | impl | ms | timer | TFLOP/s | GB/s | % peak | max abs err vs xla |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    xla = jax.jit(moe_experts_xla)
    pallas = jax.jit(lambda *a: moe_experts_pallas(*a, tiles=tiles, interpret=args.smoke))
    interpret = mosaic_interpret() if args.smoke else None
    for name in args.shapes or list(MOE_SHAPES):
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
