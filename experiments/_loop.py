"""The training loop shared by train_target.py and train_drafter.py.

Per step: a batch from a per-step PRNG stream (so a resumed run sees the same
batches), one jitted step; every 25 steps the metrics go to the history and the
progress bar; every `eval_every` steps (and at the end) `evaluate` runs and its row
is printed as JSON; every `save_every` steps (and at the end) the orbax state is
saved. The run ends at `steps` or once `max_minutes` have passed since `t_start`.
A resumed run's metrics file covers the steps before it too (`earlier_metrics`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from ddtree_jax import train


def add_training_args(ap, *, steps: int, batch: int, lr: float, eval_every: int) -> None:
    """The flags both training scripts take, with each script's defaults."""
    ap.add_argument("--data", default="data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--max-minutes", type=float, default=1e9)
    ap.add_argument(
        "--fit-minutes",
        type=float,
        default=None,
        help="time a few probe steps, then set --steps so that training takes about this long",
    )
    ap.add_argument("--seed", type=int, default=0)


def check_training_args(args) -> None:
    """Exits naming the first flag of `add_training_args` that cannot train: --eval-every 0 ended
    in a ZeroDivisionError after the first step, and --lr nan trained to NaN weights and exported
    them with exit status 0."""
    for flag, value in (("--steps", args.steps), ("--batch", args.batch), ("--eval-every", args.eval_every)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise SystemExit(f"error: --warmup must be >= 0, got {args.warmup}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"error: --lr must be a finite number > 0, got {args.lr}")
    if not args.max_minutes > 0:  # NaN too: it never ends the run (inf is no limit)
        raise SystemExit(f"error: --max-minutes must be > 0, got {args.max_minutes}")
    if args.fit_minutes is not None and not (math.isfinite(args.fit_minutes) and args.fit_minutes > 0):
        raise SystemExit(f"error: --fit-minutes must be a finite number > 0, got {args.fit_minutes}")


@contextlib.contextmanager
def refusing(what: str):
    """Turns the library's errors for bad input (a missing or damaged checkpoint, an unsupported
    config: ValueError / OSError, which name the problem) into one `error: WHAT: ...` line."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {what}: {e}") from None


def resume(manager, state: train.TrainState) -> train.TrainState:
    """The newest state `manager` holds (printing its step), else `state`; exits naming a saved
    state that cannot be restored (`train.restore_latest`)."""
    with refusing("cannot resume"):
        restored = train.restore_latest(manager, state)
    if restored is None:
        return state
    print(f"resumed at step {int(restored.step)}")
    return restored


def earlier_metrics(path: str, step: int) -> tuple[list[dict], list[dict]]:
    """(history, evals) that an earlier run of this --out wrote to its metrics file `path`, up to
    `step`, the step this run resumes at; ([], []) when it starts afresh or there is none.

    A resumed run used to write only its own steps' rows, so the file of a run finished over
    several calls lost the earlier evaluations (and a re-run of a finished one wrote none), and
    the best-so-far export restarted from nothing.
    """
    if step == 0 or not os.path.exists(path):
        return [], []
    try:
        with open(path) as f:
            old = json.load(f)
        history = [h for h in old["history"] if h["step"] <= step]
        evals = [e for e in old["evals"] if e["step"] <= step]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"warning: {path} cannot be read ({e!r}); the metrics written now start at step {step}")
        return [], []
    return history, evals


def run(
    state: train.TrainState,
    step_fn: Callable,
    make_batch: Callable[[np.random.Generator], tuple],
    evaluate: Callable[[train.TrainState], dict],
    manager,
    *,
    steps: int,
    seed: int,
    t_start: float,
    max_minutes: float,
    eval_every: int,
    save_every: int,
    postfix: Callable[[dict], dict],
    before_step: Callable[[train.TrainState, int], None] | None = None,
) -> tuple[train.TrainState, list[dict], list[dict], float]:
    """Trains from state.step to `steps`; returns (state, history, evals, train seconds).

    Args:
      step_fn: (state, *batch) -> (state, metrics dict of scalars).
      make_batch: per-step generator -> the batch arguments of step_fn.
      evaluate: state -> a dict of evaluation figures (step and time_s are added).
      manager: an orbax CheckpointManager (`train.checkpoint_manager`).
      postfix: metrics -> progress-bar fields.
      before_step: (state, step) -> None, called before each step's batch is made (e.g. to
        regenerate the model's own text that later batches draw from).
    """
    history, evals = [], []
    start = int(state.step)
    t_train = time.time()
    bar = tqdm(range(start, steps), initial=start, total=steps, mininterval=5)
    for step in bar:
        if before_step is not None:
            before_step(state, step)
        state, metrics = step_fn(state, *make_batch(np.random.default_rng([seed, step])))
        if (step + 1) % 25 == 0:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            history.append({"step": step + 1, **m})
            bar.set_postfix(postfix(m))
        last = step + 1 == steps or (time.time() - t_start) / 60 > max_minutes
        if (step + 1) % eval_every == 0 or last:
            evals.append({"step": step + 1, **evaluate(state), "time_s": time.time() - t_train})
            print(json.dumps(evals[-1]), flush=True)
        if (step + 1) % save_every == 0 or last:
            train.save_state(manager, state)
        if last:
            break
    manager.wait_until_finished()
    return state, history, evals, time.time() - t_train
