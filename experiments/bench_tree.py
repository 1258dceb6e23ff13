"""Device time of one DDTree tree build, enumerated vs beam, at drafter shapes.

    python experiments/bench_tree.py --batch-sizes 1 8 --budgets 16 32 64 128 --out tree.json

Logits are random [B, D, V] (D = block size - 1 = 15, V = the shipped vocab 8192), peaked
on a few tokens per depth so the trees go deep, as a trained drafter's do. Each build is
timed as in `profile_round.py` (calls chained in one `fori_loop`); compile time is the
first lower + compile. The beam runs at every budget; enumeration where the eligible
paths fit (`tree.MAX_ENUMERATED_PATHS`).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
from profile_round import per_call  # experiments/ is on sys.path when a script in it runs

from ddtree_jax import compile_cache, tree


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rows = []
    print(f"device: {jax.devices()[0].device_kind}; D={args.depth} V={args.vocab}")
    print("| batch | budget | method | paths | compile (s) | build (ms) |\n| --- | --- | --- | --- | --- | --- |")
    for b in args.batch_sizes:
        key = jax.random.PRNGKey(b)
        logits = jax.random.normal(key, (b, args.depth, args.vocab))
        logits = logits.at[:, :, :4].add(6.0)  # a few dominant tokens per depth: deep trees
        roots = jnp.zeros((b,), jnp.int32)
        for budget in args.budgets:
            paths = tree.enumerated_paths(budget, args.depth, args.vocab)
            for method in ("enumerate", "beam"):
                if method == "enumerate" and paths is None:
                    continue
                fn = functools.partial(tree.build_ddtree, budget=budget, method=method)
                t0 = time.perf_counter()
                jax.jit(fn).lower(logits, roots).compile()
                compile_s = time.perf_counter() - t0
                ms = per_call(fn, (logits, roots), args.reps)[0] * 1e3
                row = {
                    "batch": b,
                    "budget": budget,
                    "method": method,
                    "paths": None if method == "beam" else paths,
                    "compile_s": round(compile_s, 3),
                    "build_ms": round(ms, 4),
                }
                rows.append(row)
                print(f"| {b} | {budget} | {method} | {row['paths'] or '-'} | {compile_s:.2f} | {ms:.3f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    compile_cache.enable()
    main()
