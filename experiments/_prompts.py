"""The validation prompt windows shared by drafter_tau.py and chain_misses.py, as token-id lists.

HumanEval and test-split prompts come from `ddtree_jax.data` (`eval_humaneval_prompts`,
`eval_test_prompts`), as the CLI eval uses them.
"""

from __future__ import annotations

import os

import numpy as np

from ddtree_jax import data


def validation_windows(data_dir: str, n: int, length: int) -> list[list[int]]:
    """`n` windows of `length` tokens of DATA_DIR/validation.npy (seed 1, as train_drafter's evals)."""
    stream = np.load(os.path.join(data_dir, "validation.npy"))
    return data.prompt_windows(stream, n, length, seed=1).tolist()
