"""Benchmark absorbed-MLA attention on named real shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.mla_attention.bench                 # GPU: every shape, xla and pallas
    python -m ddtree_jax.pallas.mla_attention.bench --smoke         # CPU: shrunken shapes, interpret mode

Shapes: Kimi-K2 attention (kv_lora 512, rope 64) with 8 query heads (one GPU of a TP-8
split of 64 heads) or all 64, a 32768-token latent cache in bf16, and trees of
16 / 32 / 64 / 128 nodes (17 / 33 / 65 / 129 query tokens with the root) or one AR token.
Peaks are the H200 figures measured on this project's machine (shared/reference/gpu-anchors.md):
797 TFLOP/s dense bf16 and 3.3 TB/s copy bandwidth. "% peak" is the larger of the
compute and the memory fraction: whichever bound the shape is closer to.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ddtree_jax.pallas.bench_util import median_time, percent_of_peak
from ddtree_jax.pallas.mla_attention.kernel import mla_attention_pallas
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference

# name: (batch, query tokens T, heads N, cache length S)
SHAPES = {
    "kimi_k2_tp8_ar": (1, 1, 8, 32768),
    "kimi_k2_tp8_tree16": (1, 17, 8, 32768),
    "kimi_k2_tp8_tree32": (1, 33, 8, 32768),
    "kimi_k2_tp8_tree64": (1, 65, 8, 32768),
    "kimi_k2_tp8_tree128": (1, 129, 8, 32768),
    "kimi_k2_64heads_ar": (1, 1, 64, 32768),
    "kimi_k2_64heads_tree64": (1, 65, 64, 32768),
}
R, P = 512, 64


def inputs(b, t, n, s, r, p, key):
    ks = jax.random.split(key, 6)
    bf = jnp.bfloat16
    causal = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
    return (
        jax.random.normal(ks[0], (b, t, n, r), bf),
        jax.random.normal(ks[1], (b, t, n, p), bf),
        jax.random.normal(ks[2], (b, s, r), bf),
        jax.random.normal(ks[3], (b, s, p), bf),
        jnp.full((b,), s, jnp.int32),
        jax.random.normal(ks[4], (b, t, r), bf),
        jax.random.normal(ks[5], (b, t, p), bf),
        causal,
    )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--impl", nargs="+", default=["xla", "pallas"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-q", type=int, default=64)
    ap.add_argument("--block-k", type=int, default=32)
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument(
        "--smoke", action="store_true", help="CPU check: shapes shrunk 64x in S and 8x in R, interpret mode"
    )
    args = ap.parse_args(argv)
    r, p = (R // 8, P // 8) if args.smoke else (R, P)
    print(
        f"device: {jax.devices()[0].device_kind}; pallas tiles {args.block_q}x{args.block_k}, "
        f"{args.num_warps} warps, {args.num_stages} stages"
    )
    print("| shape | impl | ms | TFLOP/s | GB/s | % peak | max abs err vs xla |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes:
        b, t, n, s = SHAPES[name]
        if args.smoke:
            s //= 64
        x = inputs(b, t, n, s, r, p, jax.random.PRNGKey(0))
        flops = 2 * b * t * n * (s + t) * (2 * r + p)
        nbytes = 2 * b * (s + t) * (r + p) + 2 * b * t * n * (2 * r + p)
        expected = None
        for impl in args.impl:
            if impl == "xla":
                fn = jax.jit(lambda *a: mla_attention_reference(*a, 0.1))
            else:
                tiles = dict(block_q=args.block_q, block_k=args.block_k, num_warps=args.num_warps)
                tiles["num_stages"] = args.num_stages
                fn = jax.jit(lambda *a, kw=tiles: mla_attention_pallas(*a, scale=0.1, interpret=args.smoke, **kw))
            sec = median_time(fn, x, args.reps)
            got = fn(*x)
            if expected is None:
                expected = jax.jit(lambda *a: mla_attention_reference(*a, 0.1))(*x)
            err = float(jnp.max(jnp.abs(got - expected)))
            pct = percent_of_peak(flops, nbytes, sec)
            print(
                f"| {name} | {impl} | {sec * 1e3:.3f} | {flops / sec / 1e12:.1f} | {nbytes / sec / 1e9:.0f} | {pct:.1f} | {err:.2e} |"
            )


if __name__ == "__main__":
    main()
