"""The W4A16 routed-expert kernel's tiles, swept on an EP-8 shard of Kimi-K2, beside its baselines.

    python3 experiments/sweep_w4a16.py --tokens 1 17 65 129 520 8192 \\
        --tiles n,64,4,4 n,128,4,4 n,64,4,2 n,64,2,3 n,64,4,4,2 --out w4a16_sweep.json

One EP-8 shard: 48 experts, 7168 -> 2048, top-8 of the 48 (every pair local). The weights
are drawn once, quantized to INT4 (group 32, the grouped layout of `quant`), and their
dequantized bf16 copy feeds the baselines, so every row computes the same function: `xla`
on the bf16 copy is the reference each row's relative L2 error is measured against;
`mosaic-bf16` is the bf16 Mosaic kernel on that copy; `xla-int4` the XLA path on the INT4
weights (up to 520 tokens: it dequantizes 8 experts at a time); `w4a16 (BT, BO, groups, stages)`
the W4A16 kernel with those `W4A16Tiles` ("n": None, the default rule), and with a fifth field,
`(BT, BO, groups, stages, consumers)`, its warp-specialized schedule with that many consumer
warpgroups (1 or 2; 0 or no field: one warpgroup a program), so one call times both side by side.

Each row: device time (median of --reps, inputs rotated past the L2 cache), the INT4
weight bytes of the experts used over that time, TFLOP/s of the routed work, the first
call's wall time (compile + run). A tile config the compiler rejects gets its error.
"""

from __future__ import annotations

import argparse
import json
import time

import _settings
import jax
import jax.numpy as jnp

from ddtree_jax import compile_cache
from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.bench_util import device_time
from ddtree_jax.pallas.moe.mosaic import moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_xla
from ddtree_jax.pallas.moe.w4a16 import W4A16Tiles, moe_experts_w4a16
from ddtree_jax.quant import Int4

SHAPE = dict(experts=48, hidden=7168, inter=2048, top_k=8)
SMOKE = dict(experts=4, hidden=128, inter=128, top_k=2)


def tiles_from(spec: str) -> W4A16Tiles:
    """ "BT,BO,groups,stages[,consumers]" ("n" for None) -> W4A16Tiles."""
    fields = [None if v == "n" else int(v) for v in spec.split(",")]
    if not 4 <= len(fields) <= 5:
        raise ValueError(f"--tiles {spec!r}: expected BT,BO,groups,stages[,consumers]")
    names = ("block_t", "block_o", "groups_per_step", "stages", "consumers")[: len(fields)]
    return W4A16Tiles(**dict(zip(names, fields, strict=True)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 65, 129, 520, 8192])
    ap.add_argument("--tiles", nargs="+", default=["n,64,4,2"], help="W4A16Tiles, each BT,BO,groups,stages[,consumers]")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU check: 4 experts of 128 x 128, interpret mode")
    _settings.add_argument(ap)
    args = ap.parse_args(argv)
    _settings.apply(args.set)
    e, h, i, k = (SMOKE if args.smoke else SHAPE).values()
    interpret = mosaic_interpret() if args.smoke else None
    tiles = {spec: tiles_from(spec) for spec in args.tiles}  # a malformed one fails before any run
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    quantize = jax.jit(Int4(32).quantize)
    gate = quantize(jax.random.normal(ks[3], (e, h, i), jnp.float32) * h**-0.5)
    up = quantize(jax.random.normal(ks[4], (e, h, i), jnp.float32) * h**-0.5)
    down = quantize(jax.random.normal(ks[5], (e, i, h), jnp.float32) * i**-0.5)
    dense = [q.dequantize(jnp.bfloat16) for q in (gate, up, down)]
    xla = jax.jit(moe_experts_xla)
    mosaic = jax.jit(lambda *a: moe_experts_mosaic(*a, interpret=interpret))
    rows = []
    print(f"device: {jax.devices()[0].device_kind}")
    print("| tokens | impl | ms | rel err | INT4 weight TB/s | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in args.tokens:
        x = jax.random.normal(ks[0], (t, h), jnp.bfloat16)
        idx = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
        w = jax.random.uniform(ks[2], (t, k), jnp.float32) / k
        weight_bytes = int(jnp.unique(idx).size) * 3 * h * i * 9 / 16  # int4 + a bf16 scale per 32
        ref = xla(x, idx, w, *dense).astype(jnp.float32)
        runs = [("mosaic-bf16", mosaic, (x, idx, w, *dense))]
        if t <= 520:
            runs.append(("xla-int4", xla, (x, idx, w, gate, up, down)))
        for spec, tl in tiles.items():
            fn = jax.jit(lambda *a, tl=tl: moe_experts_w4a16(*a, tiles=tl, interpret=interpret))
            runs.append((f"w4a16 ({spec})", fn, (x, idx, w, gate, up, down)))
        for name, fn, operands in runs:
            try:
                t0 = time.time()
                out = jax.block_until_ready(fn(*operands))
                first_s = time.time() - t0
                sec, timer = device_time(fn, operands, args.reps)
            except Exception as err:  # a tile config the compiler rejects: report it, go on
                row = dict(tokens=t, impl=name, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
                print(f"| {t} | {name} | failed: {row['error']} |")
                rows.append(row)
                continue
            err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            row = dict(
                tokens=t,
                impl=name,
                ms=sec * 1e3,
                timer=timer,
                rel_err=err,
                first_call_s=first_s,
                weight_tbps=weight_bytes / sec / 1e12,
                tflops=2 * t * k * 3 * h * i / sec / 1e12,
            )
            rows.append(row)
            print(f"| {t} | {name} | {row['ms']:.3f} | {err:.2e} | {row['weight_tbps']:.2f} | {row['tflops']:.0f} |")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(device=jax.devices()[0].device_kind, args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    compile_cache.enable()
    main()
