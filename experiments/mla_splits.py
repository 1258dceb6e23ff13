"""The MLA kernel's cache splits: the wave-aware choice (`mosaic.num_splits`) against filling
one wave (the choice before it), in device time, same process.

    python3 experiments/mla_splits.py --out mla_splits.json
    python3 experiments/mla_splits.py --smoke        # CPU: shrunk shapes, interpret mode

For each shape (heads x context x batch x new tokens) where the two choices differ (or
`--splits` adds others, or `--every`), each split count runs the Mosaic kernel once (`bench_util.device_time`,
inputs rotated past the L2 cache), and each output is compared with the XLA reference where its float32 scores stay under 2 GB.
Rows go to --out as they finish; --budget-s stops starting new ones.
"""

from __future__ import annotations

import argparse
import json
import time

import _settings
import jax
import jax.numpy as jnp

from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.bench_util import device_time, kernel_table, percent_of_peak
from ddtree_jax.pallas.mla_attention.bench import cost, inputs
from ddtree_jax.pallas.mla_attention.mosaic import (
    BLOCK_Q,
    H200_SMS,
    MosaicMLATiles,
    mla_attention_mosaic,
    num_splits,
)
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
from ddtree_jax.pallas.shapes import MLAShape

XLA_SCORE_BYTES = 2e9


def one_wave(programs: int, cache_blocks: int, sms: int) -> int:
    """The choice before `num_splits`: enough splits that the grid fills the SMs once."""
    return max(1, min(cache_blocks, -(-sms // programs)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 33, 65, 129])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="CPU: shrunk shapes, interpret mode")
    ap.add_argument("--splits", type=int, nargs="+", default=None, help="also run these split counts on every shape")
    ap.add_argument("--kernels", type=int, default=0, help="also list each call's N largest kernels (GPU)")
    ap.add_argument(
        "--every", action="store_true", help="also time shapes where the choices agree (to compare --set runs)"
    )
    _settings.add_argument(ap)
    args = ap.parse_args(argv)
    _settings.apply(args.set)
    interpret = mosaic_interpret() if args.smoke else None
    sms = getattr(jax.devices()[0], "core_count", None) or H200_SMS
    start, rows = time.monotonic(), []
    print(f"device: {jax.devices()[0].device_kind}, {sms} SMs")
    print("| heads | context | batch | T | splits | programs | ms | TFLOP/s | GB/s | % peak | max abs err vs xla |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for heads in args.heads:
        for context in args.contexts:
            for batch in args.batches:
                for t in args.tokens:
                    if time.monotonic() - start > args.budget_s:
                        break
                    shape = MLAShape(batch=batch, tokens=t, heads=heads, cache=context)
                    if args.smoke:
                        shape = MLAShape(batch=batch, tokens=t, heads=heads, cache=context // 64, kv_lora_rank=128)
                    tiles_q = -(-t * heads // BLOCK_Q)
                    blocks = shape.cache // MosaicMLATiles().block_k
                    choices = {"one wave": one_wave(batch * tiles_q, blocks, sms)}
                    choices["wave-aware"] = num_splits(batch, tiles_q, blocks, sms)
                    for ns in args.splits or ():
                        choices[f"{ns} splits"] = min(ns, blocks)
                    if len(set(choices.values())) == 1 and not args.every:
                        continue
                    labels = {}  # each split count runs once, under every label that chose it
                    for label, ns in choices.items():
                        labels[ns] = f"{labels[ns]} = {label}" if ns in labels else label
                    x = inputs(shape, jax.random.PRNGKey(0))
                    flops, nbytes = cost(shape)
                    small = batch * t * heads * shape.cache * 4 <= XLA_SCORE_BYTES
                    expected = mla_attention_reference(*x, 0.1) if small else None
                    for ns, label in labels.items():
                        tiles = MosaicMLATiles(num_splits=ns)
                        fn = jax.jit(
                            lambda *a, tiles=tiles: mla_attention_mosaic(
                                *a, scale=0.1, tiles=tiles, interpret=interpret
                            )
                        )
                        sec, timer = device_time(fn, x, args.reps)
                        err = float(jnp.max(jnp.abs(fn(*x) - expected))) if small else None
                        row = dict(
                            heads=heads,
                            context=shape.cache,
                            batch=batch,
                            tokens=t,
                            choice=label,
                            splits=ns,
                            programs=batch * tiles_q * ns,
                            ms=sec * 1e3,
                            timer=timer,
                            tflops=flops / sec / 1e12,
                            gbps=nbytes / sec / 1e9,
                            pct_peak=percent_of_peak(flops, nbytes, sec),
                            max_abs_err=err,
                        )
                        if args.kernels:
                            row["kernels"] = kernel_table(lambda fn=fn, x=x: fn(*x), args.reps, args.kernels)
                        rows.append(row)
                        print(
                            f"| {heads} | {shape.cache} | {batch} | {t} | {ns} ({label}) | {row['programs']} | "
                            f"{row['ms']:.4f} | {row['tflops']:.0f} | {row['gbps']:.0f} | {row['pct_peak']:.1f} | "
                            f"{'-' if err is None else f'{err:.2e}'} |",
                            flush=True,
                        )
                        for k in row.get("kernels", {}).get("top", ()):
                            print(f"|   | {k['kernel'][:60]} | {k['launches']:.0f} | {1e3 * k['ms']:.1f} us |")
                        if args.out:
                            with open(args.out, "w") as f:
                                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
