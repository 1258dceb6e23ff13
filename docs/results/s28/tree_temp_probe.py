"""The probe behind tree_temp_h200.json and tree_temp_t1_cpu.log: DDTree's tau over HumanEval
prompts (batch 1, padded to the longest, 128 new tokens, the shipped v6 pair) for each tree
temperature, which shapes the tree only (the tokens are the target's choices either way).

    # H200, bf16, greedy (tree_temp_h200.json; that run, before the setting existed, patched
    # tree.build_ddtree to divide the bf16 logits by t, where the setting divides them in float32):
    PYTHONPATH=. python3 docs/results/s28/tree_temp_probe.py --out tree_temp_h200.json
    # CPU, float32, greedy, the first 40 prompts (the figures in docs/benchmarks.md):
    PYTHONPATH=. python docs/results/s28/tree_temp_probe.py --dtype float32 --limit 40 --budgets 12 \
        --tree-temperatures 1.0 0.8 1.25 0.6 --numerics fast --cache-capacity 640
    # CPU, float32, T = 1, PRNG key i for prompt i (tree_temp_t1_cpu.log, printed as
    # "t tau rounds seconds" by the first form of this script; the same computation):
    PYTHONPATH=. python docs/results/s28/tree_temp_probe.py --dtype float32 --temperature 1 --limit 64 \\
        --budgets 12 --tree-temperatures 1.0 0.8 1.25 --numerics fast --cache-capacity 640
"""

import argparse
import json
import time

import jax
import numpy as np

from ddtree_jax.evaluation import prompt_set
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--limit", type=int, default=None)
ap.add_argument("--budgets", type=int, nargs="+", default=[12, 32])
ap.add_argument("--tree-temperatures", type=float, nargs="+", default=[1.0, 0.8, 0.6])
ap.add_argument("--numerics", default=None)
ap.add_argument("--cache-capacity", type=int, default=None)
ap.add_argument("--out", default=None)
args = ap.parse_args()

shipped = load_shipped("checkpoints", dtype=args.dtype)
prompts = prompt_set("humaneval", shipped.tokenizer, "data", args.limit)
width = max(len(p) for p in prompts)
rows = []
for budget in args.budgets:
    for t in args.tree_temperatures:
        accepted = rounds = 0
        t0 = time.time()
        for i, p in enumerate(prompts):
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(p)] = p
            out = generate(
                shipped.target,
                shipped.drafter,
                ids,
                prompt_lengths=[len(p)],
                method="ddtree",
                tree_budget=budget,
                tree_temperature=t,
                max_new_tokens=128,
                temperature=args.temperature,
                key=jax.random.key(i) if args.temperature > 0 else None,
                numerics=args.numerics,
                cache_capacity=args.cache_capacity,
            )
            accepted += int(np.asarray(out.lengths)[0]) - 1
            rounds += int(np.asarray(out.rounds)[0])
        rows.append(dict(budget=budget, temp=t, tau=accepted / rounds, rounds=rounds, seconds=time.time() - t0))
        print(json.dumps(rows[-1]), flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
