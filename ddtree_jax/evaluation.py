"""Evaluation helpers shared by the CLI's `eval` and the experiment scripts.

Prompt sets (`prompt_set`, `validation_windows`), padding prompts into buckets of
one width each (`bucket`), timing a call after its compile (`time_call`,
`Compiled`) in a process cleared of earlier runs' programs (`fresh_programs`),
totals over many generate calls (`Totals`: tau, tokens/s, the acceptance
histogram), and where two token lists part (`first_difference`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np

from ddtree_jax import compile_cache, data

PROMPT_SETS = ("humaneval", "test")


def prompt_set(name: str, tokenizer, data_dir: str, limit: int | None = None) -> list[list[int]]:
    """The token ids of a held-out prompt set: "humaneval" (the wheel's 164 prompts) or
    "test" (windows of DATA_DIR's test split); the first `limit` when given.

    Raises:
      ValueError: an unknown set.
      FileNotFoundError: the set's data is missing.
    """
    if name == "humaneval":
        prompts = data.eval_humaneval_prompts(tokenizer, data_dir)
    elif name == "test":
        prompts = data.eval_test_prompts(tokenizer, data_dir)
    else:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {PROMPT_SETS}")
    return prompts[:limit] if limit else prompts


def validation_windows(data_dir: str, n: int, length: int) -> list[list[int]]:
    """`n` windows of `length` tokens of DATA_DIR/validation.npy (seed 1, as train_drafter's evals)."""
    stream = data.load_tokens(os.path.join(data_dir, "validation.npy"))
    return data.prompt_windows(stream, n, length, seed=1).tolist()


def bucket(prompts: Sequence[Sequence[int]], width: int, one_call: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prompts right-padded to multiples of `width`, grouped by padded width.

    One compiled program per group instead of one per prompt length.

    Args:
      prompts: token-id lists.
      width: the bucket width (tokens).
      one_call: one group, padded to the widest bucket.

    Returns:
      [(ids [n, W] int32, lengths [n] int32)] in increasing W.
    """
    if width < 1:
        raise ValueError(f"bucket width must be >= 1, got {width}")
    if not prompts:
        raise ValueError("no prompts to bucket")
    padded_width = [-(-len(p) // width) * width for p in prompts]
    widest = max(padded_width)
    groups: dict[int, list[Sequence[int]]] = {}
    for p, w in zip(prompts, padded_width, strict=True):
        groups.setdefault(widest if one_call else w, []).append(p)
    out = []
    for w in sorted(groups):
        rows = groups[w]
        ids = np.zeros((len(rows), w), np.int32)
        for i, p in enumerate(rows):
            ids[i, : len(p)] = p
        out.append((ids, np.asarray([len(p) for p in rows], np.int32)))
    return out


def first_difference(want: Sequence[int], got: Sequence[int]) -> int | None:
    """The first index where two equally long token lists differ; None where they are equal.

    Raises:
      ValueError: the lists' lengths differ.
    """
    return next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), None)


def time_call(fn: Callable[[], object], repeats: int = 1, warmup: int = 1) -> tuple[float, object]:
    """(median seconds of `repeats` calls, the last result), after `warmup` untimed calls.

    Every jax array in the result is waited for, so the time covers the device work.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def fresh_programs() -> None:
    """Drops the compiled programs earlier runs left in the process (jax's caches and
    `compile_cache`'s), so that the next timed run measures what a process running it alone
    would. Its programs are loaded again from the persistent cache, or compiled, at their
    first call, which the timers here leave untimed.

    On an H100 (docs/benchmarks.md, session 48), from the third eval run of a process on,
    every call was slower with the earlier runs' programs held: DDTree(12) over the 164
    HumanEval prompts 4597 -> 3807 tokens/s, 4564-4582 after this.
    """
    compile_cache.clear()


class Compiled:
    """Remembers which call signatures ran already: `time` warms a new one up (its compile
    is not timed) and times the call once."""

    def __init__(self):
        self._seen: set[Hashable] = set()

    def time(self, signature: Hashable, fn: Callable[[], object]) -> tuple[float, object]:
        warm = signature in self._seen
        self._seen.add(signature)
        return time_call(fn, repeats=1, warmup=0 if warm else 1)


def accept_histogram(accept_lengths: np.ndarray, rounds: np.ndarray, block_size: int) -> tuple[np.ndarray, int]:
    """Counts of acceptance lengths 1..block_size over the real rounds, and how many fell outside.

    accept_lengths is [M, B] (`GenerateResult.accept_lengths`); only its first
    rounds[b] rows of column b are real rounds.
    """
    active = np.arange(accept_lengths.shape[0])[:, None] < rounds[None, :]
    values = accept_lengths[active]
    counts = np.bincount(values, minlength=block_size + 1)
    inside = counts[1 : block_size + 1]
    return inside, int(values.size - inside.sum())


@dataclasses.dataclass
class Totals:
    """Sums over generate calls; tau = accepted tokens per round, tokens/s over the timed seconds."""

    prompts: int = 0
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    seconds: float = 0.0
    histogram: np.ndarray | None = None  # counts of acceptance lengths 1..block_size
    outside: int = 0  # rounds whose length fell outside 1..block_size

    def add(self, result, seconds: float = 0.0, block_size: int | None = None) -> Totals:
        """Adds one `GenerateResult` (and its time); with `block_size`, its acceptance histogram."""
        acc, rnd, lens = (np.asarray(a) for a in jax.device_get((result.accept_lengths, result.rounds, result.lengths)))
        self.prompts += int(lens.shape[0])
        self.tokens += int(lens.sum())
        self.rounds += int(rnd.sum())
        self.accepted += int(acc.sum())
        self.seconds += seconds
        if block_size is not None:
            hist, outside = accept_histogram(acc, rnd, block_size)
            self.histogram = hist if self.histogram is None else self.histogram + hist
            self.outside += outside
        return self

    @property
    def tau(self) -> float:
        return self.accepted / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def row(self) -> dict:
        """prompts, tau, tokens_per_s, rounds, tokens, seconds as a flat dict."""
        return {
            "prompts": self.prompts,
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "seconds": self.seconds,
        }
