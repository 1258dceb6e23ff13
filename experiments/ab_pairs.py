"""Round / AR step in the decode loop under several settings: one process a setting, pairs only.

    python3 experiments/ab_pairs.py --checkpoints checkpoints --budgets 12 32 --pairs 7 \
        --variants "" "ddtree_jax.pallas.draft_topk.api.AUTO_MAX_K=32" \
        "ddtree_jax.topk.TOP_K_CHUNK=128 ddtree_jax.model.ROUTER_RANK_MAX_EXPERTS=16" \
        --out ab.json

Each variant is a space-separated list of `MODULE.NAME=VALUE` settings ("" : none), applied in a
process of its own before anything is traced (module constants are read when a program is
traced). The process times `profile_round.paired_in_loop` at all budgets at once: AR and
DDTree at each budget in the loop, in rotation, each budget's median round / AR ratio and its
quartiles against the same AR measurements (as `profile_round.py --pairs` now does too: timed
beside one budget at a time, session 53's AR step ran 16% slower beside DDTree(32) than beside
DDTree(12)). Only the pairs, without
`profile_round.py`'s stage timings: a setting costs its loops' compiles (AR and one a budget)
and the pairs. Each variant's result is written to --out as it ends; a run given the same --out skips
the variants already there (a GPU call cut short goes on in the next). Ratios compare across
variants; a process's absolute times drift between processes of one machine (session 52: the
same AR step 0.396-0.467 ms in the pairs of three processes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args) -> None:
    """One variant in this process: a JSON line a budget on stdout."""
    import _settings
    import jax
    import jax.numpy as jnp
    import numpy as np
    from profile_round import paired_in_loop

    from ddtree_jax import compile_cache
    from ddtree_jax.shipped import load_shipped

    compile_cache.enable()
    _settings.apply(args.child.split())
    shipped = load_shipped(args.checkpoints, dtype=jnp.dtype(args.dtype))
    vocab = shipped.target.config.vocab_size
    prompts = np.random.default_rng(0).integers(4, vocab, size=(1, args.context))
    sampled = dict(temperature=args.temperature, key=jax.random.key(0)) if args.temperature else {}
    for row in paired_in_loop(
        shipped.target, shipped.drafter, prompts, args.budgets, args.loop_tokens, args.pairs, **sampled
    ):
        print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--variants", nargs="+", default=[""], help='each a space-separated list of settings ("": none)')
    ap.add_argument("--budgets", type=int, nargs="+", default=[12, 32])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--loop-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds a variant may take (default: no limit)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # set in a variant's process
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error(f"--pairs must be >= 1, got {args.pairs}")
    if args.child is not None:
        return child(args)
    done = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {r["variant"]: r for r in json.load(f)["rows"]}
    rows = list(done.values())
    for variant in dict.fromkeys(" ".join(v.split()) for v in args.variants):
        if variant in done:
            print(f"{variant or '(none)'}: in {args.out} already", flush=True)
            continue
        cmd = [sys.executable, os.path.join(HERE, "ab_pairs.py"), *_common(args), "--child", variant]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            print(f"{variant or '(none)'}: over --child-timeout {args.child_timeout:g} s", flush=True)
            continue
        if proc.returncode != 0:
            print(f"{variant or '(none)'}: exit {proc.returncode}\n{proc.stderr[-2000:]}", flush=True)
            continue
        budgets = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        rows.append({"variant": variant, "budgets": budgets})
        for b in budgets:
            q25, q75 = b["paired_round_over_ar_q25_q75"]
            print(
                f"{variant or '(none)'}: DDTree({b['budget']}) round / AR {b['paired_round_over_ar']:.3f} "
                f"(quartiles {q25:.3f} - {q75:.3f}; AR {b['paired_ar_in_loop_ms']:.3f} ms, round "
                f"{b['paired_round_in_loop_ms']:.3f} ms)",
                flush=True,
            )
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"}, "rows": rows}, f, indent=1)


def _common(args) -> list[str]:
    """The options a variant's process takes from this one."""
    out = ["--budgets", *map(str, args.budgets), "--pairs", str(args.pairs), "--context", str(args.context)]
    out += ["--loop-tokens", str(args.loop_tokens), "--dtype", args.dtype, "--temperature", str(args.temperature)]
    out += ["--out", args.out] + (["--checkpoints", args.checkpoints] if args.checkpoints else [])
    return out


if __name__ == "__main__":
    main()
