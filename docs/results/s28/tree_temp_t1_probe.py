"""The probe behind tree_temp_t1_cpu.log (this project's CPU machine, float32, from the repository root).

DDTree(12) tau at T = 1 over the first N HumanEval prompts (128 new tokens, PRNG key i for
prompt i, the shipped v6 pair) for each tree temperature given.

    PYTHONPATH=. python docs/results/s28/tree_temp_t1_probe.py 64 1.0 0.8 1.25
"""

import sys
import time

import jax
import numpy as np

from ddtree_jax.evaluation import prompt_set
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped

shipped = load_shipped("checkpoints", dtype="float32")
prompts = prompt_set("humaneval", shipped.tokenizer, "data")[: int(sys.argv[1])]
width = max(len(p) for p in prompts)
for t in [float(x) for x in sys.argv[2:]]:
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
            tree_budget=12,
            tree_temperature=t,
            max_new_tokens=128,
            numerics="fast",
            temperature=1.0,
            key=jax.random.key(i),
            cache_capacity=640,
        )
        accepted += int(np.asarray(out.lengths)[0]) - 1
        rounds += int(np.asarray(out.rounds)[0])
    print(t, round(accepted / rounds, 4), rounds, round(time.time() - t0), flush=True)
