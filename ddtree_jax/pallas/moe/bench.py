"""Benchmark the routed experts on named real shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.moe.bench                 # GPU: every shape, xla and pallas
    python -m ddtree_jax.pallas.moe.bench --smoke         # CPU: shrunken shapes, interpret mode

Shapes: Kimi-K2 experts (H = 7168, I = 2048, top-8) in bf16 for one AR token or
trees of 16 / 32 / 64 / 128 nodes (17 / 33 / 65 / 129 tokens with the root). To keep
GPU memory modest (4.2 GB of weights) only the 48 local experts of one GPU of an
8-way expert-parallel split of the 384 are built, and each token's 8 experts are
drawn at random, distinct, among those 48: every (token, expert) pair lands on this
GPU, the worst case of such a split rather than its average (1/8 of the pairs).
FLOPs count the routed work (2 * T * K * 3 * H * I); bytes count the weights of the
experts actually used plus x and the output. Peaks are the H200 figures measured on
this project's machine (shared/reference/gpu-anchors.md): 797 TFLOP/s dense bf16 and
3.3 TB/s copy bandwidth. "% peak" is the larger of the compute and the memory
fraction: whichever bound the shape is closer to. The error is against the xla path.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ddtree_jax.pallas.bench_util import median_time, percent_of_peak
from ddtree_jax.pallas.moe.kernel import moe_experts_pallas
from ddtree_jax.pallas.moe.reference import moe_experts_xla

# name: tokens T
SHAPES = {
    "kimi_k2_ep8_ar": 1,
    "kimi_k2_ep8_tree16": 17,
    "kimi_k2_ep8_tree32": 33,
    "kimi_k2_ep8_tree64": 65,
    "kimi_k2_ep8_tree128": 129,
}
HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 48, 8


def inputs(t, h, i, e, k, key):
    """Random bf16 activations and weights (scaled so outputs stay O(1)); distinct experts per token."""
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--impl", nargs="+", default=["xla", "pallas"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-i", type=int, default=128)
    ap.add_argument("--block-h", type=int, default=128)
    ap.add_argument("--block-k", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU check: H and I shrunk 32x, interpret mode")
    args = ap.parse_args(argv)
    h, i = (HIDDEN // 32, INTER // 32) if args.smoke else (HIDDEN, INTER)
    print(
        f"device: {jax.devices()[0].device_kind}; H {h}, I {i}, E {EXPERTS}, top-{TOP_K}; pallas tiles "
        f"m {args.block_m}, i {args.block_i}, h {args.block_h}, k {args.block_k}, "
        f"{args.num_warps} warps, {args.num_stages} stages"
    )
    print("| shape | impl | ms | TFLOP/s | GB/s | % peak | max abs err vs xla |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    xla = jax.jit(moe_experts_xla)
    tiles = dict(block_m=args.block_m, block_i=args.block_i, block_h=args.block_h, block_k=args.block_k)
    tiles.update(num_warps=args.num_warps, num_stages=args.num_stages, interpret=args.smoke)
    pallas = jax.jit(lambda *a: moe_experts_pallas(*a, **tiles))
    for name in args.shapes:
        t = SHAPES[name]
        x = inputs(t, h, i, EXPERTS, TOP_K, jax.random.PRNGKey(0))
        used = int(jnp.unique(x[1]).size)  # experts whose weights are read
        flops = 2 * t * TOP_K * 3 * h * i
        nbytes = 2 * (used * 3 * h * i + 2 * t * h)
        expected = xla(*x).astype(jnp.float32)
        for impl in args.impl:
            fn = xla if impl == "xla" else pallas
            sec = median_time(fn, x, args.reps)
            err = float(jnp.max(jnp.abs(fn(*x).astype(jnp.float32) - expected)))
            pct = percent_of_peak(flops, nbytes, sec)
            print(
                f"| {name} | {impl} | {sec * 1e3:.3f} | {flops / sec / 1e12:.1f} | {nbytes / sec / 1e9:.0f} | {pct:.1f} | {err:.2e} |"
            )


if __name__ == "__main__":
    main()
