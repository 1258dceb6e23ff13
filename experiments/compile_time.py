"""Compile + first-run wall time of `generate` (CPU or GPU), the figure that bounds eval turnaround.

    python experiments/compile_time.py

Two cases: AR on the shipped target with a batch of 32 prompts of 256 tokens (prefill
dominated), and ar / dflash / ddtree(64) on a TINY target with a random 2-layer, block-16
drafter (decode-loop dominated). Each line is one fresh compilation in this process.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ddtree_jax import model
from ddtree_jax.config import TINY
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn().tokens.block_until_ready()
    return time.perf_counter() - t0


def main():
    print(f"device: {jax.devices()[0].device_kind}")
    s = load_shipped(dtype="bfloat16", need_drafter=False)
    prompts = np.random.default_rng(0).integers(4, 8000, size=(32, 256)).astype(np.int32)
    t = timed(lambda: generate(s.target, prompts, max_new_tokens=8, stop_token_ids=()))
    print(f"shipped target, ar, batch 32 x 256-token prompts: compile+run {t:.1f} s")
    target = model.init_params(TINY, jax.random.PRNGKey(0))
    d = dflash.init_params(dflash.drafter_config_for(TINY, num_hidden_layers=2, block_size=16), jax.random.PRNGKey(1))
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 64)):
        t = timed(
            lambda m=method, b=budget: generate(target, d, [[1, 2, 3]], method=m, tree_budget=b, max_new_tokens=8)
        )
        print(f"TINY target, {method} {budget or ''}: compile+run {t:.1f} s")


if __name__ == "__main__":
    main()
