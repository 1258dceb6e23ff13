"""Compare AR, DFlash and DDTree decoding on the same prompts: tau, tokens/s, rounds/s.

    python experiments/compare_methods.py --batch-sizes 1 8 --budgets 16 64 --out compare.json
    python experiments/compare_methods.py --mesh 1 2 --implementation pallas   # 2 GPUs, TP/EP kernels

Without --target / --drafter it uses random `SMALL` weights and a random DFlash drafter
(acceptance is then near 1: the figures measure round cost, not speedup). Round time
is (whole generate call - prefill-only call) / loop iterations, where the loop runs
until the slowest row is done; the ratio column is DDTree round time / AR step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import _args
import jax
import numpy as np

from ddtree_jax import checkpoint, compile_cache, config, model, sharding
from ddtree_jax.drafters import dflash
from ddtree_jax.evaluation import fresh_programs, time_call
from ddtree_jax.generate import generate


def timed(target, draft, prompts, max_new_tokens, repeats, **kw):
    """Median wall time of `generate` after one compile run, and its last result."""
    return time_call(lambda: generate(target, draft, prompts, max_new_tokens=max_new_tokens, **kw), repeats)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="HF target directory (default: random SMALL)")
    ap.add_argument("--drafter", default=None, help="HF DFlash directory (default: random drafter)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16, help="the random drafter's block (without --drafter)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree"])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--implementation", default="xla", choices=("xla", "pallas"))
    ap.add_argument(
        "--mesh",
        type=int,
        nargs=2,
        default=None,
        metavar=("DATA", "MODEL"),
        help="shard weights on this mesh of the first DATA x MODEL devices",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _args.methods(ap, args.methods)
    if "ddtree" in args.methods:
        _args.budgets(ap, args.budgets)
    _args.at_least(ap, 1, batch_sizes=args.batch_sizes, max_new_tokens=args.max_new_tokens)
    _args.at_least(ap, 1, prompt_len=args.prompt_len, repeats=args.repeats, draft_layers=args.draft_layers)
    _args.at_least(ap, 2, block_size=args.block_size)  # the random drafter's: a root and at least one mask
    if args.mesh:
        _args.at_least(ap, 1, mesh=args.mesh)
        if args.mesh[0] * args.mesh[1] > jax.device_count():
            ap.error(
                f"--mesh {args.mesh[0]} {args.mesh[1]} needs {args.mesh[0] * args.mesh[1]} devices, "
                f"but jax sees {jax.device_count()}"
            )
    _args.out_file(ap, args.out)
    dtype = _args.dtype(ap, args.dtype)
    if not args.target and args.preset not in config.PRESETS:
        ap.error(f"unknown --preset {args.preset!r}; choose one of {sorted(config.PRESETS)}")

    if args.target:
        target = checkpoint.load_target(args.target, dtype=dtype)
    else:
        cfg = dataclasses.replace(config.PRESETS[args.preset], eos_token_id=None)
        target = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0), std=0.02), dtype)
    if args.drafter:
        draft = dflash.load_drafter(args.drafter, dtype=dtype)
    else:
        dcfg = dflash.drafter_config_for(target.config, num_hidden_layers=args.draft_layers, block_size=args.block_size)
        draft = jax.tree.map(lambda a: a.astype(dtype), dflash.init_params(dcfg, jax.random.PRNGKey(1)))
    if args.mesh:
        mesh = sharding.make_mesh(*args.mesh, devices=jax.devices()[: args.mesh[0] * args.mesh[1]])
        target, draft = sharding.shard_target(target, mesh), sharding.shard_drafter(draft, mesh)
    dev = jax.devices()[0].device_kind
    print(
        f"device: {dev} x {jax.device_count()}; mesh {args.mesh or '-'}; implementation {args.implementation}; "
        f"target {target.config.num_params() / 1e6:.2f}M params; dtype {args.dtype}"
    )
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch_sizes:
        prompts = rng.integers(3, target.config.vocab_size, size=(b, args.prompt_len)).tolist()
        runs = [("ar", None)] if "ar" in args.methods else []
        runs += [("dflash", None)] if "dflash" in args.methods else []
        runs += [("ddtree", k) for k in args.budgets] if "ddtree" in args.methods else []
        ar_step = None
        for method, budget in runs:
            kw = dict(method=method, tree_budget=budget, stop_token_ids=(), implementation=args.implementation)
            d = None if method == "ar" else draft
            fresh_programs()  # each run as a process of its own would time it
            t_pre, _ = timed(target, d, prompts, 1, args.repeats, **kw)
            t, res = timed(target, d, prompts, args.max_new_tokens, args.repeats, **kw)
            iters = int(np.asarray(res.rounds).max())
            n_tok = int(np.asarray(res.lengths).sum())
            round_ms = (t - t_pre) / max(iters, 1) * 1e3
            if method == "ar":
                ar_step = round_ms
            row = {
                "batch": b,
                "method": method,
                "budget": budget,
                "tau": res.tau,
                "tokens_per_s": n_tok / t,
                "rounds_per_s": iters / (t - t_pre),
                "round_ms": round_ms,
                "round_over_ar_step": round_ms / ar_step if ar_step else None,
                "wall_s": t,
                "prefill_s": t_pre,
            }
            rows.append(row)
            print(json.dumps(row))
    print("\n| batch | method | budget | tau | tokens/s | rounds/s | round ms | round / AR step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = f"{r['round_over_ar_step']:.2f}" if r["round_over_ar_step"] else "-"
        print(
            f"| {r['batch']} | {r['method']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['rounds_per_s']:.0f} | {r['round_ms']:.3f} | {ratio} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            meta = {"device": dev, "devices": jax.device_count(), "dtype": args.dtype, "args": vars(args)}
            json.dump({**meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    compile_cache.enable()
    main()
