"""The training loop shared by train_target.py and train_drafter.py.

Per step: a batch from a per-step PRNG stream (so a resumed run sees the same
batches), one jitted step; every 25 steps the metrics go to the history and the
progress bar; every `eval_every` steps (and at the end) `evaluate` runs and its row
is printed as JSON; every `save_every` steps (and at the end) the orbax state is
saved. The run ends at `steps` or once `max_minutes` have passed since `t_start`.
"""

from __future__ import annotations

import json
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
