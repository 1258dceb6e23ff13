"""The evaluation prompt sets shared by drafter_tau.py and chain_misses.py, as token-id lists."""

from __future__ import annotations

import os

import numpy as np

from ddtree_jax import data


def humaneval(tok: data.Tokenizer, data_dir: str) -> list[list[int]]:
    """The 164 HumanEval prompts, each as [bos] + ids (`data.load_humaneval_prompts`)."""
    return [tok.encode(t, bos=True) for t in data.load_humaneval_prompts(data_dir)]


def validation_windows(data_dir: str, n: int, length: int) -> list[list[int]]:
    """`n` windows of `length` tokens of DATA_DIR/validation.npy (seed 1, as train_drafter's evals)."""
    stream = np.load(os.path.join(data_dir, "validation.npy"))
    return data.prompt_windows(stream, n, length, seed=1).tolist()
