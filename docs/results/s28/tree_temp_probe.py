"""The probe behind tree_temp_h200.json (run on the H200 from the repository root, bf16).

DDTree's tau over all 164 HumanEval prompts (128 new tokens, greedy, the shipped v6 pair) with
the drafter's logits divided by a temperature before `tree.build_ddtree`, patched in for the
probe: the tree changes, the tokens (the target's own greedy choices) do not.

    PYTHONPATH=. python3 docs/results/s28/tree_temp_probe.py tree_temp_h200.json
"""

import json
import sys
import time

import jax
import numpy as np

from ddtree_jax import tree
from ddtree_jax.evaluation import prompt_set
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped

shipped = load_shipped("checkpoints", dtype="bfloat16")
prompts = prompt_set("humaneval", shipped.tokenizer, "data")
width = max(len(p) for p in prompts)
build = tree.build_ddtree
rows = []
for budget in (12, 32):
    for temp in (1.0, 0.8, 0.6):
        tree.build_ddtree = lambda lg, r, b, method="auto", t=temp: build(lg / t, r, b, method=method)
        jax.clear_caches()
        accepted = rounds = 0
        t0 = time.time()
        for p in prompts:
            ids = np.zeros((1, width), np.int32)
            ids[0, : len(p)] = p
            out = generate(
                shipped.target,
                shipped.drafter,
                ids,
                prompt_lengths=[len(p)],
                method="ddtree",
                tree_budget=budget,
                max_new_tokens=128,
            )
            accepted += int(np.asarray(out.lengths)[0]) - 1
            rounds += int(np.asarray(out.rounds)[0])
        rows.append(dict(budget=budget, temp=temp, tau=accepted / rounds, seconds=time.time() - t0))
        print(json.dumps(rows[-1]), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f, indent=1)
