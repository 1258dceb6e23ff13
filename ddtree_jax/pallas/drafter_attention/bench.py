"""Benchmark the drafter's block attention on named shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.drafter_attention.bench            # GPU: every shape, xla and pallas
    python -m ddtree_jax.pallas.drafter_attention.bench --smoke    # CPU: shrunken shapes, interpret mode
    python -m ddtree_jax.pallas.drafter_attention.bench --head-group 1 8   # also 8 query heads a program

Shapes: `pallas/shapes.py` (DRAFTER_ATTENTION_SHAPES), bf16. Times are device time from a
profiler trace (`bench_util.device_time`; "wall" where the backend gives none). Costs count
the context slots a query can see (the window, or the filled cache) plus the block: the
kernel reads those; the XLA path reads the whole cache.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ddtree_jax.pallas.bench_util import device_time, table_header, table_row
from ddtree_jax.pallas.drafter_attention.kernel import DrafterAttentionTiles, drafter_attention_pallas, num_splits
from ddtree_jax.pallas.drafter_attention.reference import drafter_attention_reference
from ddtree_jax.pallas.shapes import DRAFTER_ATTENTION_SHAPES, DrafterAttentionShape

FULL = 2**31 - 1


def inputs(shape: DrafterAttentionShape, key):
    """Random bf16 operands: the block at positions length .. length + T - 1."""
    b, t, nq, nkv, hd, s = shape.batch, shape.tokens, shape.heads, shape.kv_heads, shape.head_dim, shape.cache
    ks = jax.random.split(key, 5)
    bf = jnp.bfloat16
    lengths = jnp.full((b,), shape.length, jnp.int32)
    return (
        jax.random.normal(ks[0], (b, t, nq, hd), bf),
        jax.random.normal(ks[1], (b, s, nkv, hd), bf),
        jax.random.normal(ks[2], (b, s, nkv, hd), bf),
        lengths,
        lengths[:, None] + jnp.arange(t, dtype=jnp.int32),
        jax.random.normal(ks[3], (b, t, nkv, hd), bf),
        jax.random.normal(ks[4], (b, t, nkv, hd), bf),
    )


def cost(shape: DrafterAttentionShape) -> tuple[int, int]:
    """(FLOPs, bytes) of one call over the keys a query can see: scores and values, keys and values read once."""
    b, t, nq, nkv, hd = shape.batch, shape.tokens, shape.heads, shape.kv_heads, shape.head_dim
    seen = min(shape.length, shape.window or shape.length) + t
    return 4 * b * t * nq * seen * hd, 2 * (2 * b * seen * nkv * hd + 2 * b * t * nq * hd)


def main(argv=None):
    ap = argparse.ArgumentParser()
    names = list(DRAFTER_ATTENTION_SHAPES)
    ap.add_argument("--shapes", nargs="+", default=names, choices=names)
    ap.add_argument("--impl", nargs="+", default=["xla", "pallas"], choices=["xla", "pallas"])
    ap.add_argument(
        "--splits", type=int, nargs="+", default=[0], help="kernel splits to try (0: `kernel.num_splits`' choice)"
    )
    ap.add_argument(
        "--head-group", type=int, nargs="+", default=[1], help="query heads per program to try (`head_group`)"
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU check: shapes.shrink()ed, interpret mode")
    args = ap.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}")
    print(table_header("xla", impl="impl (pallas: `num_splits`' choice)"))
    for name in args.shapes:
        shape = DRAFTER_ATTENTION_SHAPES[name].shrink() if args.smoke else DRAFTER_ATTENTION_SHAPES[name]
        window = shape.window or FULL  # the shipped drafter is not causal within its block
        reach = min(shape.window or shape.cache, shape.cache)
        x = inputs(shape, jax.random.PRNGKey(0))
        runs = {"xla": jax.jit(lambda *a, w=window: drafter_attention_reference(*a, w, False))}
        for hg in args.head_group:
            if (shape.heads // shape.kv_heads) % hg:
                continue  # a program's heads must share a key / value head
            chosen = num_splits(reach, shape.batch, shape.heads // hg)
            tiles = DrafterAttentionTiles(head_group=hg)
            for n in dict.fromkeys(n or chosen for n in args.splits):
                label = "pallas" if n == chosen else f"pallas, {n} splits"
                label += f", {hg} heads a program" if hg > 1 else ""
                runs[label] = jax.jit(
                    lambda *a, w=window, n=n, t=tiles: drafter_attention_pallas(
                        *a, w, False, tiles=t, splits=n, interpret=args.smoke
                    )
                )
        xla = runs["xla"]
        expected = xla(*x)
        flops, nbytes = cost(shape)
        for impl, fn in runs.items():
            if impl.split(",")[0] not in args.impl:
                continue
            sec, timer = device_time(fn, x, args.reps)
            err = float(jnp.max(jnp.abs(fn(*x).astype(jnp.float32) - expected.astype(jnp.float32))))
            print(table_row(name, impl, sec, timer, flops, nbytes, err, digits=(4, 2)))


if __name__ == "__main__":
    main()
