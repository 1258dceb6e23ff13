"""Experiment scripts end to end at toy sizes, so that a GPU run does not die on a CLI slip."""

import contextlib
import csv
import importlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import train
from ddtree_jax.data import Tokenizer, prompt_windows
from ddtree_jax.drafters import dflash
from tests.conftest import REPO, xla_flags


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A miniature prepared-data folder: the shipped tokenizer, two stdlib files as token streams."""
    out = tmp_path_factory.mktemp("data")
    shutil.copy(os.path.join(REPO, "checkpoints", "tokenizer.json"), out / "tokenizer.json")
    tok = Tokenizer.load(str(out / "tokenizer.json"))
    stdlib = sysconfig.get_paths()["stdlib"]
    for split, name in (("train", "textwrap.py"), ("validation", "shlex.py")):
        with open(os.path.join(stdlib, name)) as f:
            np.save(out / f"{split}.npy", np.asarray(tok.encode(f.read()), np.int32))
    return out


def run_script(name, *args, env=None):
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "experiments", name), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
    )


def refusal(name, *args) -> str:
    """experiments/`name`'s main() run in this process on the command line `args`, which it must
    refuse: what it exits with (its message, or argparse's exit code) plus what it wrote to stderr.

    A refused command line fails before any work, so a subprocess would only add a Python and
    jax start-up per check (1.5 s each alone, twice that beside another worker); each script's
    successful run stays a subprocess, the way it is run."""
    if os.path.join(REPO, "experiments") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "experiments"))
    main = importlib.import_module(name.removesuffix(".py")).main
    stderr = io.StringIO()
    with (
        mock.patch.object(sys, "argv", [name, *map(str, args)]),
        contextlib.redirect_stderr(stderr),
        pytest.raises(SystemExit) as exit_info,
    ):
        main()
    assert exit_info.value.code not in (0, None), stderr.getvalue()[-2000:]
    return f"{exit_info.value.code}\n{stderr.getvalue()}"


def test_train_target_exports_int4_experts_and_starts_from_an_export(data_dir, tmp_path):
    """A few steps of the tiny preset: the bf16 export and the INT4-expert one (compressed-
    tensors, loaded back as INT4); then a second run starts from the first's export."""
    from ddtree_jax import checkpoint
    from ddtree_jax.quant import QuantizedArray

    out = tmp_path / "run"
    common = ("--data", data_dir, "--preset", "tiny", "--batch", 2, "--seq", 32, "--eval-every", 2)
    proc = run_script("train_target.py", *common, "--steps", 2, "--int4-experts", 32, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16 = checkpoint.load_target(out / "target")
    int4 = checkpoint.load_target(out / "target_int4")
    assert int4.config.expert_int4_group_size == 32 and bf16.config.expert_int4_group_size is None
    assert isinstance(int4.moe_layers.mlp.gate, QuantizedArray)
    assert (out / "target_best_int4" / "config.json").exists()
    # From the INT4 export (its experts dequantized; a bf16 export takes the same path minus
    # that), with the unlikelihood of its own greedy text: regenerated before each step here.
    # Two validation windows of the longer prompts: the shapes of that half of the train text,
    # so the validation's generate program is the train text's.
    ul = ("--unlikelihood", 1, "--ul-prompts", 4, "--ul-batch", 2, "--ul-refresh", 1, "--ul-prompt-len", 8, 12)
    ul = (*ul, "--ul-anchor", 1, "--ul-val-windows", 2)
    again = run_script(
        "train_target.py",
        *common,
        "--steps",
        2,
        *ul,
        "--ul-gen-len",
        8,
        "--init",
        out / "target_int4",
        "--out",
        tmp_path / "b",
    )
    assert again.returncode == 0 and f"initialised from {out / 'target_int4'}" in again.stdout, again.stderr[-3000:]
    with open(tmp_path / "b" / "target_metrics.json") as f:
        evals = json.load(f)["evals"]
    assert [e["step"] for e in evals] == [2]
    assert 0 <= evals[0]["val_repeat_4gram"] <= 1
    # The true text's rate: the same two validation windows (12 + 8 tokens, seed 1), its last 8.
    truth = prompt_windows(np.load(data_dir / "validation.npy"), 2, 20, seed=1)
    want = float(np.mean(np.asarray(train.repeated_ngram_mask(jnp.asarray(truth)))[:, 12:]))
    assert evals[0]["val_repeat_4gram_reference"] == pytest.approx(want)
    why = refusal("train_target.py", *common, *ul, "--ul-gen-len", 0, "--init", out / "target", "--out", tmp_path / "e")
    assert "must be >= 1" in why
    why = refusal("train_target.py", *common, *ul, "--ul-prompts", 1, "--init", out / "target", "--out", tmp_path / "g")
    assert "--ul-prompts 1: need at least one per --ul-prompt-len [8, 12]" in why
    why = refusal("train_target.py", *common, *ul, "--out", tmp_path / "f")
    assert "--ul-anchor 1.0 needs --unlikelihood > 0 and --init" in why
    init = ("--init", out / "target", "--out", tmp_path / "c")
    assert "its config differs from --preset small's" in refusal("train_target.py", *common, "--preset", "small", *init)
    why = refusal("train_target.py", *common, "--int4-experts", 24, "--out", tmp_path / "d")
    assert "--int4-experts 24: hidden_size=64 is not a multiple" in why


def test_train_drafter_resumes_a_drafter_with_a_sliding_window(data_dir, tiny_pair, tmp_path):
    out = tmp_path / "run"
    args = (
        *("--data", data_dir, "--target", tiny_pair / "target", "--out", out),
        *("--init", tiny_pair / "drafter", "--sliding-window", 64),
        *("--prompts", 4, "--prompt-len", 48, 64, "--gen-len", 40, "--gen-batch", 4),
        *("--steps", 2, "--batch", 2, "--anchors", 2),
        *("--eval-every", 2, "--eval-prompts", 2, "--eval-prompt-len", 96, "--distill-weight", 0.5),
        *("--sample-fraction", 0.5),
    )
    proc = run_script("train_drafter.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Two prompt lengths, two rows each, every row 64 + 40 long (the short prompts continue further).
    assert np.load(out / "distill_prompt_lens.npy").tolist() == [48, 48, 64, 64]
    # Of each length's two rows the first is the target's greedy continuation, the second a sample.
    from ddtree_jax import checkpoint
    from ddtree_jax.generate import generate

    seqs = np.load(out / "distill.npy")
    target = checkpoint.load_target(tiny_pair / "target", dtype=jnp.bfloat16)
    greedy = [
        generate(target, seqs[r : r + 1, :48], max_new_tokens=56, stop_token_ids=()).to_lists()[0] for r in (0, 1)
    ]
    assert greedy[0] == seqs[0, 48:].tolist() and greedy[1] != seqs[1, 48:].tolist()  # batch 1, as distilled
    trained = dflash.load_drafter(out / "drafter")
    assert trained.config.types == ("sliding_attention",) * trained.config.num_hidden_layers
    assert trained.config.sliding_window == 64
    with open(out / "drafter_metrics.json") as f:
        metrics = json.load(f)
    assert metrics["steps_done"] == 2
    assert metrics["distill_shape"] == [4, 64 + 40]
    assert [e["step"] for e in metrics["evals"]] == [2]
    assert metrics["evals"][0]["tau_dflash"] >= 1.0 and metrics["evals"][0]["tau_ddtree_t1"] >= 1.0
    assert (out / "drafter_best" / "config.json").exists()
    # Run again into the same --out: it resumes at its end, and the metrics keep the first call's
    # evaluations (they were rewritten empty).
    again = run_script("train_drafter.py", *args)
    assert again.returncode == 0 and "resumed at step 2" in again.stdout, again.stderr[-3000:]
    with open(out / "drafter_metrics.json") as f:
        kept = json.load(f)
    assert kept["evals"] == metrics["evals"] and kept["resumed_at_step"] == 2 and kept["steps_done"] == 2


def test_earlier_metrics_keep_a_resumed_runs_rows(tmp_path):
    loop = _experiment("_loop")
    path = tmp_path / "m.json"
    assert loop.earlier_metrics(str(path), 4) == ([], [])  # none written yet
    rows = {"history": [{"step": s, "loss": 1.0 / s} for s in (25, 50)], "evals": [{"step": 25}, {"step": 50}]}
    path.write_text(json.dumps(rows))
    assert loop.earlier_metrics(str(path), 0) == ([], [])  # a fresh start overwrites them
    assert loop.earlier_metrics(str(path), 30) == (rows["history"][:1], rows["evals"][:1])  # past 30: redone
    assert loop.earlier_metrics(str(path), 50) == (rows["history"], rows["evals"])
    path.write_text("{not json")
    assert loop.earlier_metrics(str(path), 50) == ([], [])


def test_train_drafter_rejects_a_window_below_the_block(data_dir, tmp_path):
    why = refusal(
        "train_drafter.py",
        *("--data", data_dir, "--target", os.path.join(REPO, "checkpoints", "target"), "--out", tmp_path),
        *("--sliding-window", 8, "--steps", 1),
    )
    assert "--sliding-window 8" in why and "block_size=16" in why


def test_training_scripts_refuse_bad_numbers_and_foreign_checkpoints(data_dir, tiny_pair, tmp_path):
    """--eval-every 0 was a ZeroDivisionError after the first step and --lr nan trained to NaN
    weights with exit status 0; a drafter as --init, or an --out holding another model's state,
    ended in tracebacks (orbax's naming no folder)."""
    common = ("--data", data_dir, "--preset", "tiny", "--batch", 2, "--seq", 32, "--out", tmp_path / "t")
    for flag, value, message in (
        ("--eval-every", 0, "--eval-every must be >= 1, got 0"),
        ("--lr", "nan", "--lr must be a finite number > 0, got nan"),
        ("--steps", -1, "--steps must be >= 1, got -1"),
        ("--max-minutes", "nan", "--max-minutes must be > 0, got nan"),
        ("--save-every", 0, "--save-every must be >= 1, got 0"),
    ):
        assert message in refusal("train_target.py", *common, flag, value)
    drafter = os.path.join(REPO, "checkpoints", "drafter")
    why = refusal("train_target.py", *common, "--init", drafter)
    assert f"error: --init {drafter}: {drafter}/config.json: model_type 'qwen3' is not supported" in why
    # Another preset's state where this run would resume.
    other = train.TrainState(step=jnp.asarray(1, jnp.int32), params={"w": jnp.ones(3)}, opt_state=())
    train.save_state(manager := train.checkpoint_manager(str(tmp_path / "t" / "ckpt_target")), other)
    manager.wait_until_finished()
    why = refusal("train_target.py", *common, "--steps", 2)
    assert f"error: cannot resume: the training state saved in {tmp_path / 't' / 'ckpt_target' / '1'}" in why

    dcommon = ("--data", data_dir, "--target", tiny_pair / "target", "--out", tmp_path / "d")
    assert "--gamma must be a finite number > 0, got 0.0" in refusal("train_drafter.py", *dcommon, "--gamma", 0)
    assert "--eval-budget must be >= 1, got 0" in refusal("train_drafter.py", *dcommon, "--eval-budget", 0)
    why = refusal("train_drafter.py", *dcommon, "--init", tiny_pair / "target")
    assert f"error: --init {tiny_pair / 'target'}: " in why
    why = refusal("train_drafter.py", "--data", data_dir, "--target", drafter, "--out", tmp_path / "d")
    assert f"error: --target {drafter}: {drafter}/config.json: model_type 'qwen3'" in why


def test_train_drafter_refuses_distillation_data_it_was_not_asked_for(tmp_path):
    """--out's distill.npy was trained on whatever it held: another run's (other --prompts /
    --gen-len, another target's vocabulary), or, cut short by a kill mid-write, a numpy traceback."""
    import argparse

    td = _experiment("train_drafter")
    path, starts = str(tmp_path / "distill.npy"), str(tmp_path / "distill_prompt_lens.npy")
    td.save_atomically(starts, np.asarray([8, 8, 12, 12]))
    td.save_atomically(path, np.arange(4 * 20).reshape(4, 20) % 50)
    assert sorted(os.listdir(tmp_path)) == ["distill.npy", "distill_prompt_lens.npy"]
    args = argparse.Namespace(prompts=4, prompt_len=[8, 12], gen_len=8)
    counts = np.asarray([2, 2])
    seqs, lens = td.reuse_distilled(path, starts, args, counts, 50)
    assert seqs.shape == (4, 20) and lens.tolist() == [8, 8, 12, 12]
    with pytest.raises(SystemExit, match=r"holds sequences of shape \(4, 20\).*not the \(4, 24\) of .*--gen-len 12"):
        td.reuse_distilled(path, starts, argparse.Namespace(prompts=4, prompt_len=[8, 12], gen_len=12), counts, 50)
    with pytest.raises(SystemExit, match="token ids outside the target's vocabulary of 40"):
        td.reuse_distilled(path, starts, args, counts, 40)
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(SystemExit, match=r"distill\.npy cannot be read .*remove .* to distill anew"):
        td.reuse_distilled(path, starts, args, counts, 50)


def test_train_step_cost_script_times_the_step_and_both_expert_paths(tmp_path):
    out = tmp_path / "cost.json"
    proc = run_script("train_step_cost.py", "--preset", "tiny", "--batch", 2, "--seq", 16, "--reps", 1, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows["train_step_ms"] > 0 and rows["moe_routed_ms_per_layer"] > 0 and rows["moe_dense_ms_per_layer"] > 0
    assert rows["moe_dense_ms_all_layers"] == pytest.approx(2 * rows["moe_dense_ms_per_layer"])  # tiny: 2 MoE layers


def test_compile_time_script_splits_warm_time(tiny_pair, tmp_path):
    """AR and a DDTree budget at two temperatures (each program compiles twice: cold, and again
    into jax's own cache; the second temperature reuses it; DFlash would be a third program
    down the same per-program path)."""
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # it makes a fresh cache
    proc = run_script(
        "compile_time.py",
        *("--checkpoints", tiny_pair, "--dtype", "float32", "--methods", "ar", "ddtree", "--budgets", 4),
        *("--prompt-len", 8, "--max-new-tokens", 4, "--temperatures", 0.7, 1.3),
        *("--out", out, "--trace", tmp_path / "trace"),
        *("--no-shipped-autotune", "--save-autotune", tmp_path / "at.tar.gz"),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["shipped_autotune"] is False and result["autotune_entries"] == 0  # the CPU tunes nothing
    assert (tmp_path / "at.tar.gz").exists()
    rows = result["rows"]
    assert [(r["method"], r["budget"], r["temperature"]) for r in rows] == [
        ("ar", None, 0.7),
        ("ar", None, 1.3),
        ("ddtree", 4, 0.7),
        ("ddtree", 4, 1.3),
    ]
    # The first program's cold call alone is profiled: XLA's compile is among its named phases.
    assert any(p["name"] == "backend_compile_and_load" and p["ms"] > 0 for p in rows[0]["phases"]), rows[0]
    assert not any("phases" in r for r in rows[1:])
    for r in rows[::2]:  # jax's compile events: generate's program is traced, lowered and compiled in the cold call
        top = r["compiles"][0]
        assert top["program"] == "_generate" and min(top["trace"], top["lower"], top["backend_compile"]) > 0, r
        assert r["compile_totals"]["backend_compile"] >= top["backend_compile"], r
    for r in rows[1::2]:  # a second temperature: the same program (the temperature is traced), not compiled again
        assert not any(c["program"] == "_generate" for c in r["compiles"]), r
    for r in rows:  # only that each figure was taken: their order is wall-clock, which a busy machine bends
        assert min(r["cold_s"], r["warm_s"], r["warm_jax_s"], r["run_s"], r["lower_s"]) > 0, r
    assert result["executables"] == 2  # one whole executable a program


def test_drafter_tau_script_compares_windows(data_dir, tiny_pair, tmp_path):
    drafter = tiny_pair / "drafter"
    proc = run_script(
        "drafter_tau.py",
        *("--drafters", drafter, f"{drafter}@32", "--target", tiny_pair / "target"),
        *("--data", data_dir, "--prompts", "validation"),
        *("--prompt-lens", 20, "--num-prompts", 2, "--budgets", "--max-new-tokens", 8),  # the chain only
        *("--out", tmp_path / "tau.json"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "tau.json") as f:
        rows = json.load(f)["rows"]
    assert [(r["drafter"].endswith("@32"), r["prompt_len"], r["n"]) for r in rows] == [(False, 20, 2), (True, 20, 2)]
    assert all(1.0 <= r["chain"] <= 8 for r in rows) and not any("ddtree4" in r for r in rows)


def test_chain_misses_replays_generates_rounds_exactly(data_dir, tiny_pair, tmp_path):
    """The offline replay (teacher-forced blocks over the AR text) must give generate's own tau."""
    out = tmp_path / "misses.json"
    proc = run_script(
        "chain_misses.py",
        *("--target", tiny_pair / "target", "--drafter", tiny_pair / "drafter"),
        *("--data", data_dir, "--prompts", "validation", "--num-prompts", 3, "--prompt-len", 40),
        *("--max-new-tokens", 24, "--out", out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["tau_replayed"] == s["tau_measured"]
    assert sum(s["accept_histogram"]) == s["rounds"] >= 3
    assert s["misses"] == s["rounds"] - s["accept_histogram"][-1]
    assert 0.0 <= s["all_positions_share_p1_below_0.5"] <= 1.0
    full = s["accept_histogram"][-1] * 16 / sum(n * (k + 1) for k, n in enumerate(s["accept_histogram"]))
    assert s["share_of_tokens_in_full_block_rounds"] == round(full, 4)
    assert 0.0 <= s["generated_tokens_repeating_a_4gram"] <= 1.0
    # Every round checks its accepted drafts plus the first wrong one (none when all 15 pass).
    hist = s["accept_histogram"]
    counts = s["drafts_checked_accepted"]
    checked, accepted = (sum(c[j] for c in counts.values()) for j in (0, 1))
    assert checked == sum(n * min(k + 1, 15) for k, n in enumerate(hist))
    assert accepted == sum(n * k for k, n in enumerate(hist))
    assert "--max-new-tokens must be >= 2, got 1" in refusal(
        "chain_misses.py", "--data", data_dir, "--max-new-tokens", 1
    )


def test_sweep_tree_writes_csv_json_and_plots(data_dir, tiny_pair, tmp_path):
    """AR, the chain and a DDTree budget, sampled, on two test-split windows (each grid point is
    a compile); then --replot and bad args."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(data_dir / "validation.npy", data / "test.npy")  # the eval reads DATA/test.npy
    out = tmp_path / "sweep"
    grid = ("--budgets", 4, "--block-sizes", 4, "--temperatures", 1, "--tree-temperature", 0.7)
    proc = run_script(
        "sweep_tree.py",
        *("--prompts", "test", "--data", data, "--limit", 2, *grid, "--checkpoints", tiny_pair),
        *("--max-new-tokens", 8, "--dtype", "float32", "--numerics", "fast", "--out", out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "sweep.csv") as f:
        csv_rows = list(csv.DictReader(f))
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    expected = [
        (1.0, m, bs, b) for m, bs, b in [("ar", None, None)] + [(m, 4, b) for m, b in (("dflash", None), ("ddtree", 4))]
    ]
    assert [(r["temperature"], r["method"], r["block_size"], r["budget"]) for r in rows] == expected
    assert len(csv_rows) == len(rows) and csv_rows[0]["method"] == "ar"
    assert [r["tree_temperature"] for r in rows] == [None, None, 0.7]
    assert csv_rows[2]["tree_temperature"] == "0.7"
    for r in rows:
        assert r["prompts"] == 2 and r["tokens"] == 2 * 8, r  # no stop token: every row runs to the end
        hist = r["accept_hist"]
        assert len(hist) == (r["block_size"] or 1) and r["accept_outside"] == 0
        assert sum(hist) == r["rounds"]
        assert r["tau"] == pytest.approx(sum((i + 1) * n for i, n in enumerate(hist)) / r["rounds"])
        assert 1.0 <= r["tau"] <= (r["block_size"] or 1)
    pngs = ("tau_vs_budget.png", "tokens_per_s_vs_budget.png", "accept_hist.png", "ddtree_vs_dflash.png")
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        (out / name).unlink()
    replot = run_script("sweep_tree.py", "--replot", "--out", out)
    assert replot.returncode == 0, replot.stderr[-2000:]
    assert all((out / name).exists() for name in pngs)
    assert "budgets must lie in [1, 1024], got [0]" in refusal(
        "sweep_tree.py", "--budgets", 0, "--out", tmp_path / "bad"
    )
    why = refusal("sweep_tree.py", "--block-sizes", 17, "--out", tmp_path / "bad")
    assert "block sizes must lie in [2, the drafter's block_size=16], got [17]" in why
    why = refusal("sweep_tree.py", "--tree-temperature", 0, "--out", tmp_path / "bad")
    assert "--tree-temperature must be finite and > 0, got 0.0" in why


def test_repeated_ngrams():
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from chain_misses import repeated_ngrams

    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 1, 2, 3, 4, 1, 2, 3, 4, 9]
    # From position 4 on: (1 2 3 4) is new at 4, (2 3 4 1) .. (4 1 2 3) new, (1 2 3 4) again at 8.
    assert repeated_ngrams(seq, 4, 10).tolist() == [False, False, False, False, True, False]
    assert repeated_ngrams(seq, 0, 3).tolist() == [False] * 3  # too short to complete a 4-gram
    assert repeated_ngrams(seq, 8, 10, n=2).tolist() == [True, False]


def test_k2_shard_parity_tells_routing_flips_from_mismatches():
    """k2_shard's check of the verify's logits against the XLA path: a row off while every
    layer's expert counts agree is a mismatch; one off where a layer's routing changed is not;
    many rows off is, whatever the counts."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from k2_shard import parity

    want = np.random.default_rng(0).normal(size=(16, 50))
    counts = np.ones((3, 4))
    flipped = counts.copy()
    flipped[2, 0] = 0
    close = parity(want + 1e-3, want, counts, counts)
    assert close["rows_over_tol"] == [] and not close["mismatch"]
    one_off = want.copy()
    one_off[5] += 1.0
    assert parity(one_off, want, counts, counts)["mismatch"]
    routed = parity(one_off, want, counts, flipped)
    assert routed["rows_over_tol"] == [5] and routed["counts_equal_per_layer"] == [True, True, False]
    assert not routed["mismatch"]
    many_off = want.copy()
    many_off[:3] += 1.0
    assert parity(many_off, want, counts, flipped)["mismatch"]


def test_bench_tree_times_both_builders(tmp_path):
    out = tmp_path / "tree.json"
    res = run_script(
        "bench_tree.py",
        "--batch-sizes",
        "1",
        "--budgets",
        "8",
        "--depth",
        "4",
        "--vocab",
        "64",
        "--reps",
        "2",
        "--out",
        out,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["enumerate", "beam"]
    assert rows[0]["paths"] > 8 and all(r["build_ms"] > 0 for r in rows)


def test_ab_pairs_runs_each_variant_in_its_process_and_resumes(tiny_pair, tmp_path):
    """Two variants (none, and a setting), each in a process of its own: a row each with the
    pairs' ratio at each budget, both against the same AR steps; a bad setting is reported and
    written nowhere; a second run with the same --out skips what it holds."""
    out = tmp_path / "ab.json"
    common = ("--checkpoints", tiny_pair, "--budgets", 4, 6, "--pairs", 2, "--context", 8, "--loop-tokens", 4)
    variants = ("--variants", "", "ddtree_jax.topk.TOP_K_CHUNK=128", "ddtree_jax.tree.NO_SUCH=1")
    proc = run_script("ab_pairs.py", *common, "--dtype", "float32", *variants, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["", "ddtree_jax.topk.TOP_K_CHUNK=128"]
    for r in rows:  # both budgets timed in the same rotation, against the same AR measurements
        b4, b6 = r["budgets"]
        assert (b4["budget"], b6["budget"]) == (4, 6) and b4["pairs"] == b6["pairs"] == 2, r
        assert b4["paired_ar_in_loop_ms"] == b6["paired_ar_in_loop_ms"], r
        assert math.isfinite(b4["paired_round_in_loop_ms"]) and math.isfinite(b6["paired_round_in_loop_ms"]), r
    assert "ddtree_jax.tree has no constant NO_SUCH" in proc.stdout
    again = run_script("ab_pairs.py", *common, "--dtype", "float32", "--variants", "", "--out", out)
    assert again.returncode == 0 and "(none): in" in again.stdout, again.stderr[-3000:]
    assert json.loads(out.read_text())["rows"] == rows


def test_profile_round_times_stages_and_the_real_loop(tiny_pair, tmp_path):
    out = tmp_path / "profile.json"
    res = run_script(
        "profile_round.py",
        *("--checkpoints", tiny_pair),
        *("--batch-sizes", "1", "--budgets", "8", "4", "--context", "16", "--reps", "2"),
        *("--loop-tokens", "8", "--dtype", "float32", "--out", out, "--stage-hlo", tmp_path / "hlo", "--pairs", "3"),
        *("--temperature", "1"),  # the sampled loop (greedy is the same code with no sampling arguments)
    )
    assert res.returncode == 0, res.stderr[-2000:]
    row, row4 = json.loads(out.read_text())["rows"]
    assert row["temperature"] == 1.0 and (row["budget"], row4["budget"]) == (8, 4)
    # Both budgets' pairs in one rotation, against the same AR steps.
    assert row["paired_ar_in_loop_ms"] == row4["paired_ar_in_loop_ms"] and row4["pairs"] == 3
    # A progress line as each measurement ends, in order (a run cut by a timeout shows how far it got).
    done = [m.group(1) for m in re.finditer(r"^\[ *[0-9.]+ s\] ([^:]+):", res.stderr, re.M)]
    assert done == [
        *("batch 1 ar_step", "batch 1 AR in the loop", "batch 1 draft", "batch 1 tree8", "batch 1 verify8"),
        *("batch 1 accept_commit8", "batch 1 DDTree(8) in the loop", "batch 1 tree4", "batch 1 verify4"),
        *(
            "batch 1 accept_commit4",
            "batch 1 DDTree(4) in the loop",
            "batch 1 DDTree(8) pairs",
            "batch 1 DDTree(4) pairs",
        ),
    ], res.stderr[-2000:]
    hlo = sorted(p.name for p in (tmp_path / "hlo").iterdir())
    stage_names = ("ar_step", "draft", *(f"{n}{b}" for n in ("accept_commit", "tree", "verify") for b in (4, 8)))
    assert hlo == sorted(f"b1_{n}.hlo.txt" for n in stage_names)
    assert "HloModule" in (tmp_path / "hlo" / "b1_draft.hlo.txt").read_text()
    stages = ("draft_ms", "tree_ms", "verify_ms", "accept_commit_ms")
    assert all(row[k] > 0 for k in (*stages, "ar_step_ms"))
    # The in-loop figures are differences of two timed calls: on a busy CI CPU they may come out
    # at or below zero, so only their arithmetic is checked here.
    assert all(math.isfinite(row[k]) for k in ("ar_in_loop_ms", "round_in_loop_ms"))
    assert row["sum_ms"] == pytest.approx(sum(row[k] for k in stages))
    assert row["round_over_ar_in_loop"] == pytest.approx(row["round_in_loop_ms"] / row["ar_in_loop_ms"])
    # Interleaved pairs: medians of three, the ratio's quartiles around its median (NaN only if
    # no pair's AR difference came out positive on a busy CPU).
    assert row["pairs"] == 3 and all(math.isfinite(row[k]) for k in ("paired_ar_in_loop_ms", "paired_round_in_loop_ms"))
    q25, q75 = row["paired_round_over_ar_q25_q75"]
    assert math.isnan(row["paired_round_over_ar"]) or q25 <= row["paired_round_over_ar"] <= q75
    assert "--pairs must be >= 0, got -1" in refusal("profile_round.py", "--pairs", "-1")
    assert "--temperature: temperature must be a finite number >= 0, got -1.0" in refusal(
        "profile_round.py", "--temperature", "-1"
    )


def test_call_cost_splits_a_call_from_its_rounds(tiny_pair, tmp_path):
    out = tmp_path / "call_cost.json"
    res = run_script(
        "call_cost.py",
        *("--checkpoints", tiny_pair, "--methods", "ar", "ddtree", "--budget", "4", "--context", "16"),
        *("--tokens", "8", "--repeats", "1", "--dtype", "float32", "--out", out),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["ar", "ddtree"]
    for r in rows:
        timed = ("host_ms", "call_ms", "full_ms", "exe_host_ms", "exe_call_ms", "exe_fresh_call_ms")
        assert all(r[k] > 0 for k in timed), r
        assert 1 <= r["rounds"] <= 7, r  # 8 tokens, the first from the prefill
        # A difference of two timed calls: only its arithmetic is checked (a busy CPU).
        assert r["round_ms"] == pytest.approx((r["full_ms"] - r["call_ms"]) / r["rounds"])


def test_loop_ops_counts_the_decode_loop_body(tmp_path):
    out = tmp_path / "ops.json"
    # "fast": the loop body whose launches the script counts (exact numerics nest loops in it).
    res = run_script(
        "loop_ops.py", "--dtype", "float32", "--numerics", "fast", "--budget", "8", "--context", "16", "--out", out
    )
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["by_kind"]["fusion"] > 100
    assert {"draft", "verify", "build_tree"} <= set(summary["by_scope"])
    # Both models' layers are split before the loop (`model.hoist_layers`, the drafter's
    # `for_loop`): the body slices no stacked weight, only the caches (at most 2 a layer of
    # either model; unsplit, the shipped pair's body sliced 67 arrays in bf16).
    layers = 0
    for part in ("target", "drafter"):
        with open(os.path.join(REPO, "checkpoints", part, "config.json")) as f:
            layers += json.load(f)["num_hidden_layers"]
    assert summary["slices"] <= 2 * layers


def test_k2_memory_plan_compiles_a_full_width_slice_for_8_devices(tmp_path):
    """The whole `generate` loop for two full-width Kimi-K2 layers (INT4 experts) and a drafter
    of K2.5-DFlash's shape at batch 8, compiled for a (1, 8) mesh from abstract params:
    per-device weights are 1/8 of the experts and heads plus the replicated rest, the latent
    cache is split by sequence, and no weight or activation is all-gathered (the routed
    experts run expert-parallel; left to GSPMD they were gathered, 2.8 GB each; a sequence
    split left to GSPMD all-gathered activations at every layer)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
    out = tmp_path / "plan.json"
    args = ("--layers", "2", "--contexts", "8192", "--batches", "8", "--experts", "int4", "--out", str(out))
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "experiments", "k2_memory_plan.py"), *args],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    # 1 dense + 1 MoE layer: the MoE layer's 384 INT4 experts are 2.3 GB, 48 of them per device;
    # the vocabulary-split embedding and lm_head 0.29 GB each per device.
    assert 1.5 < row["weights_gb"] < 2.5, row
    # The drafter's share: 6 layers of width 7168, heads and MLP split 8 ways.
    assert 0.8 < row["drafter_weights_gb"] < 1.2, row
    # Arguments are the weights (the caches live inside the loop: temporaries).
    assert abs(row["arguments_gb"] - row["weights_gb"] - row["drafter_weights_gb"]) < 0.05, row
    # One sequence of 8 per device: 2 layers x 8192 slots x 576 bf16 values.
    assert row["latent_cache_gb"] == 2 * 8192 * 576 * 2 / 1e9, row
    assert row["temp_gb"] > row["latent_cache_gb"], row
    # Attention's queries and outputs change split by all-to-all (the cache by sequence).
    assert {"all-reduce", "all-to-all"} <= set(row["collectives"]), row
    assert max(max(v) for v in row["collective_bytes"].values()) < 1e9, row["collective_bytes"]
    # The largest all-gather is the drafter's vocabulary-split logits (15 x 8 rows x 163840).
    assert max(row["collective_bytes"].get("all-gather", [0])) <= 15 * 8 * 163840 * 4, row["collective_bytes"]
    assert row["collectives"]["all-gather"] <= 8, row["collectives"]


def test_bench_kernels_writes_rows_and_resumes(tmp_path):
    """The kernel bench in interpret mode (routed experts only, shrunk): every implementation's
    row, errors against XLA recorded, and a rerun on the same --out measures nothing again."""
    out = tmp_path / "kernels.json"
    args = ("--smoke", "--reps", "1", "--only", "moe", "--out", out)
    r = run_script("bench_kernels.py", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(row["shape"], row["impl"]) for row in rows} == {
        (s, i) for s in ("moe_ep8_t1", "moe_ep8_t17") for i in ("xla", "pallas", "mosaic", "xla-int4", "mosaic-int4")
    }
    assert all(row["max_abs_err"] < 0.25 and row["ms"] > 0 for row in rows), rows
    assert {row["err_vs"] for row in rows if row["impl"].endswith("-int4")} == {"xla-int4"}
    again = run_script("bench_kernels.py", *args)
    assert again.returncode == 0 and "10 rows" in again.stdout and "| moe_ep8_t1 |" not in again.stdout


def test_bench_kernels_stops_on_a_wrong_or_failing_kernel(monkeypatch, tmp_path, capsys):
    """Only other projects' baselines may fail and be recorded: this project's implementation
    off its reference, or raising, ends the run with an error naming the shape (a GPU run once
    wrote 166 rows that all said "failed" and exited 0)."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    import bench_kernels

    from ddtree_jax.pallas.moe.reference import moe_experts_xla

    def impls(wrong=None, raising=None, baseline_raising=False):
        out = {"xla": moe_experts_xla, "xla-int4": moe_experts_xla}
        if wrong:
            out[wrong] = lambda *a: 1.1 * moe_experts_xla(*a)
        if raising:
            out[raising] = lambda *a: jnp.reshape(a[0], (-1, 7, 5))
        if baseline_raising:
            out["ragged_dot_mgpu"] = lambda *a: jnp.reshape(a[0], (-1, 7, 5))
        return out

    monkeypatch.setattr(bench_kernels, "moe_shapes", lambda quick, smoke: {"moe_ep8_t1": bench_kernels.MoEShape(1)})
    argv = ["--smoke", "--reps", "1", "--only", "moe", "--out", str(tmp_path / "rows.json")]
    monkeypatch.setattr(bench_kernels, "moe_impls", lambda smoke: impls(baseline_raising=True))
    bench_kernels.main(argv)
    assert "| moe_ep8_t1 | ragged_dot_mgpu | failed: " in capsys.readouterr().out
    monkeypatch.setattr(bench_kernels, "moe_impls", lambda smoke: impls(wrong="mosaic"))
    with pytest.raises(SystemExit, match=r"moe_ep8_t1 mosaic: max abs error .* against xla"):
        bench_kernels.main(argv)
    monkeypatch.setattr(bench_kernels, "moe_impls", lambda smoke: impls(raising="mosaic-int4"))
    with pytest.raises(TypeError):
        bench_kernels.main(argv)


def test_bench_kernels_budget_stops_before_a_shapes_inputs(monkeypatch, tmp_path, capsys):
    """Past --budget-s no new shape is set up: its inputs and references compile too, and a GPU
    run that checked the budget only per row ran 130 s past it and was killed."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    import bench_kernels

    def no_setup(*_):
        raise AssertionError("a shape was set up past the budget")

    monkeypatch.setattr(bench_kernels.mla_bench, "inputs", no_setup)
    monkeypatch.setattr(bench_kernels.moe_bench, "inputs", no_setup)
    bench_kernels.main(["--smoke", "--budget-s", "-1", "--out", str(tmp_path / "rows.json")])
    assert "0 rows" in capsys.readouterr().out


def test_sweep_w4a16_rows(tmp_path):
    """The W4A16 tile sweep in interpret mode (shrunk shard): one row per implementation and tile
    config (the last warp specialized, 2 consumers), errors against the XLA path, a rejected
    config reported, not raised."""
    out = tmp_path / "sweep.json"
    tiles = ["n,64,2,2", "16,64,4,1", "n,64,2,3,2"]
    args = ("--smoke", "--tokens", "3", "--tiles", *tiles, "n,64,3,1", "--reps", "1", "--out", out)
    r = run_script("sweep_w4a16.py", *args)  # one process: each start imports jax and compiles anew
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| w4a16 (n,64,3,1) | failed: ValueError" in r.stdout, r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [row["impl"] for row in rows] == ["mosaic-bf16", "xla-int4", *(f"w4a16 ({t})" for t in tiles)]
    assert rows[1]["rel_err"] == 0.0  # the XLA path on INT4 dequantizes exactly as the reference's copy
    assert all(row["rel_err"] < 2e-2 and row["ms"] > 0 for row in rows), rows


def test_moe_layer_stack_rows_and_hlo_counts(tmp_path):
    """The layer-stack probe in interpret mode: every loop computes the same layers as the
    layer-by-layer calls (the W4A16 kernel exactly, XLA within bf16 rounding of it), with
    HLO move counts for the jitted loops."""
    out = tmp_path / "stack.json"
    args = ("--smoke", "--layers", "2", "--tokens", "3", "--weights", "int4", "--reps", "1", "--out", out)
    r = run_script("moe_layer_stack.py", *args, "--impl", "mosaic", "xla", "--loops", "alone", "scan", "indexed")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["impl"], row["loop"]) for row in rows] == [
        (i, lp) for i in ("mosaic", "xla") for lp in ("alone", "scan", "indexed")
    ]
    assert all(row["ms"] > 0 for row in rows)
    assert all(row["rel_err"] == 0 for row in rows if row["impl"] == "mosaic"), rows
    assert all(0 < row["rel_err"] < 3e-2 for row in rows if row["impl"] == "xla"), rows
    assert all(row["hlo"] == {} for row in rows if row["loop"] == "alone")
    assert all(row["hlo"] for row in rows if row["loop"] != "alone")  # XLA:CPU slices the stacks too


def test_profile_round_names_a_bad_set():
    for item, message in (("foo", "expected MODULE.NAME=VALUE"), ("ddtree_jax.tree.NOPE=1", "has no constant NOPE")):
        assert message in refusal("profile_round.py", "--random", "--set", item)


def test_k2_mesh_runs_the_same_tokens_on_two_devices(tmp_path):
    """k2_mesh.py on two virtual CPU devices: a slice of TINY split over a (1, 2) mesh gives one
    device's float32 tokens for DDTree, with the collectives timed and counted."""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"), JAX_PLATFORMS="cpu")
    out = tmp_path / "mesh.json"
    args = ["--base", "tiny", "--of", "2", "--gpus", "2", "--layers", "3", "--dtypes", "float32"]
    # DDTree alone: the 8-device sharding test compares AR and DDTree across meshes already.
    args += ["--methods", "ddtree", "--budgets", "4", "--max-new-tokens", "6", "--prompt-len", "5"]
    # One T for the stages and collectives (each T compiles every stage on one device and on the
    # mesh again: the loop over --tokens is the same for one value as for five).
    args += ["--stages", "--stage-dtype", "float32", "--context", "64"]
    proc = run_script(
        "k2_mesh.py", *args, "--tokens", "5", "--reps", "1", "--collective-reps", "2", "--out", out, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["op"], r["shape"][0], r["dtype"]) for r in result["collectives"]] == [
        ("all-reduce", 5, "bfloat16"),
        ("all-reduce", 5, "float32"),
        ("all-gather", 3, "float32"),  # the drafter's block of 4 -> 3 rows of logits
        ("all-to-all", 2, "float32"),  # [2 sequences, T, heads, latent]
    ]
    assert result["collectives"][-1]["shape"] == [2, 5, 4, 32]
    assert [(r["method"], r["budget"]) for r in result["runs"]] == [("ddtree", 4)]
    stages = {"verify", "attention", "router", "shared_expert", "dense_mlp", "norms", "routed_experts"}
    assert [r["tokens"] for r in result["stages"]] == [5]
    assert all(set(r["one_ms"]) == set(r["mesh_ms"]) == stages for r in result["stages"]), result["stages"]
    for r in result["runs"]:
        assert r["first_divergence"] is None and len(r["one"]["tokens"][0]) == 6, r
        assert r["mesh"]["rounds"] >= 1 and r["mesh"]["ms_per_round"] > 0, r
        assert r["mesh"]["compiled_collectives"]["all-reduce"]["count"] > 0, r
        assert "compiled_collectives" not in r["one"], r


def test_k2_mesh_slices_and_busiest_gpu_sums():
    """The 2-of-8 slice of Kimi-K2 holds what two GPUs of TP-8 / EP-8 hold; a sharded call's
    device time is its busiest GPU's; k2_shard's projection reads measured all-reduces."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from k2_mesh import drafter_slice_config, slice_config

    from ddtree_jax import config
    from ddtree_jax.evaluation import first_difference
    from ddtree_jax.pallas.bench_util import busiest_gpu_per_call

    cfg = slice_config(config.KIMI_K2, 2, 8, 4)
    assert (cfg.num_attention_heads, cfg.n_routed_experts, cfg.num_experts_per_tok) == (16, 96, 2)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.num_hidden_layers) == (40960, 4608, 4)
    d = drafter_slice_config("kimi_k2", cfg, 2, 8)
    assert (d.num_attention_heads, d.num_key_value_heads, d.vocab_size) == (16, 2, 40960)
    assert max(d.target_layer_ids) < 4
    with pytest.raises(SystemExit, match="num_attention_heads=4"):
        slice_config(config.TINY, 1, 8, 2)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None  # what k2_mesh reports as the divergence point
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    with pytest.raises(ValueError):  # equal lengths only: both placements generate max_new_tokens
        first_difference([1, 2], [1, 2, 3])

    # Two calls on two GPUs: GPU 1 is busier in the first call, GPU 0 in the second.
    events = [(0.0, 1.0, "a", "/device:GPU:0"), (0.0, 3.0, "a", "/device:GPU:1"), (5.0, 1.0, "b", "/device:GPU:0")]
    events += [(6.0, 4.0, "a", "/device:GPU:0"), (6.0, 2.0, "a", "/device:GPU:1"), (9.0, 1.0, "b", "/device:GPU:0")]
    assert busiest_gpu_per_call(sorted(events), 2) == [3.0, 5.0]
    assert busiest_gpu_per_call(events[:5], 2) is None  # GPU 0 ran 3 kernels in 2 calls
    assert busiest_gpu_per_call([], 2) is None


def test_k2_shard_random_like_takes_arrays_leaf_by_leaf():
    """random_like on concrete arrays (a cache to refill) through the one-jit-a-leaf path that
    leaves past 1 GiB take: shapes, dtypes and the int4 range kept."""
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from k2_shard import random_like

    tree = {"c": jnp.zeros((3, 4), jnp.bfloat16), "q": jnp.zeros((8,), jnp.int4)}
    for one_jit_below in (0, 2**30):
        out = random_like(tree, np.uint32([0, 0]), std=1.0, one_jit_below=one_jit_below)
        assert out["c"].shape == (3, 4) and out["c"].dtype == jnp.bfloat16 and float(jnp.std(out["c"])) > 0.3
        q = out["q"].astype(jnp.int8)
        assert out["q"].dtype == jnp.int4 and int(q.min()) >= -8 and int(q.max()) <= 7


def test_k2_shard_projection_reads_measured_allreduces(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "experiments"))
    from k2_shard import measured_allreduce

    rows = [
        {"op": "all-reduce", "shape": [t, 7168], "dtype": dt, "ms": ms}
        for t, dt, ms in ((1, "bfloat16", 0.01), (1, "float32", 9.0), (17, "bfloat16", 0.02), (33, "bfloat16", 0.04))
    ]
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps({"collectives": rows}))
    at = measured_allreduce(str(path), 7168)
    assert [at(t) * 1e3 for t in (1, 2, 17, 33, 65)] == pytest.approx([0.01, 0.02, 0.02, 0.04, 0.04])
    with pytest.raises(SystemExit, match="no bf16 all-reduce of width 64"):
        measured_allreduce(str(path), 64)
    # --set, as profile_round's (e.g. the MLA kernel's new-token split on and off)
    why = refusal("k2_shard.py", "--tau-file", path, "--out", tmp_path / "o.json", "--set", "nope")
    assert "--set 'nope': expected MODULE.NAME=VALUE" in why
    why = refusal("k2_shard.py", "--tau-file", path, "--out", tmp_path / "o.json", "--set", "ddtree_jax.model.NOPE=1")
    assert "ddtree_jax.model has no constant NOPE" in why


def _experiment(name):
    if os.path.join(REPO, "experiments") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "experiments"))
    return importlib.import_module(name)


def test_tree_replay_counts_rounds_along_the_text():
    """Drafts that hold the text's next 3 tokens as their likeliest, then wrong ones: every
    round emits 3 drafts + the bonus, under any policy and budget; none right: one token a round."""
    replay = _experiment("tree_replay")
    d, v, new = 15, 50, 20
    seq = np.asarray([7, 8] + [int(t) for t in np.random.default_rng(0).integers(4, v, new)])
    start = 2
    logits = np.full((new, d, v), -5.0, np.float32)
    for r in range(new):
        for depth in range(d):
            at = start + r + depth + 1
            right = depth < 3 and at < len(seq)
            logits[r, depth, seq[at] if right else (seq[at] + 1) % v if at < len(seq) else 0] = 5.0
    for budget, policy in ((4, "1"), (12, "0.8:1")):
        temps = replay.depth_temperatures(policy, d)
        assert replay.replay(jnp.asarray(logits), seq, start, new, budget, temps) == -(-(new - 1) // 4)
    wrong = np.roll(logits, 1, axis=2)  # every likeliest token shifted off the text
    assert replay.replay(jnp.asarray(wrong), seq, start, new, 4, replay.depth_temperatures("1", d)) == new - 1


def test_tree_replay_prompt_lookup():
    """The lookup chain follows the latest earlier occurrence of the longest matching tail; a
    text that repeats itself is accepted along it where the drafts are all wrong."""
    replay = _experiment("tree_replay")
    seq = np.asarray([1, 2, 3, 4, 9, 2, 3, 4, 5, 6, 7, 2, 3, 4])
    np.testing.assert_array_equal(replay.lookup_draft(seq, 13, 3), [5, 6, 7])  # "2 3 4" at 5..7 (latest)
    np.testing.assert_array_equal(replay.lookup_draft(seq, 13, 9), [5, 6, 7, 2, 3, 4])  # stops at the text's end
    np.testing.assert_array_equal(replay.lookup_draft(seq, 4, 3), [])  # "9" never seen before
    np.testing.assert_array_equal(replay.lookup_draft(seq, 6, 2, ngrams=(2,)), [4, 9])  # "2 3" at 1..2
    d, v = 15, 50
    period = [int(t) for t in np.random.default_rng(1).integers(4, v, 6)]
    seq = np.asarray(period * 6)
    start, new = 12, 24
    wrong = np.zeros((new, d, v), np.float32)
    wrong[:, :, 0] = 5.0  # token 0 never occurs: every draft is wrong
    temps = replay.depth_temperatures("1", d)
    assert replay.replay(jnp.asarray(wrong), seq, start, new, 4, temps) == new - 1
    # Lookup of 5: five right tokens + the bonus a round, 23 tokens after the prefill's in 4 rounds.
    assert replay.replay(jnp.asarray(wrong), seq, start, new, 4, temps, lookup=5) == 4


def test_tree_replay_script_and_policies(tiny_pair, tmp_path):
    replay = _experiment("tree_replay")
    np.testing.assert_allclose(replay.depth_temperatures("0.8:0.5", 4), [0.8, 0.7, 0.6, 0.5], rtol=1e-6)
    for bad in ("0", "a", "1:2:3", "-1:1"):
        with pytest.raises(ValueError, match="policy"):
            replay.depth_temperatures(bad, 4)
    assert "--lookup [0]: each chain length must be >= 1" in refusal("tree_replay.py", "--lookup", 0)
    out = tmp_path / "replay.json"
    res = run_script(
        "tree_replay.py",
        *("--checkpoints", tiny_pair, "--prompts", "humaneval", "--limit", "2", "--max-new-tokens", "6"),
        *("--budgets", "4", "--policies", "1", "0.5:1", "--lookup", "3", "--out", out),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["budget"], r["policy"], r["lookup"]) for r in rows] == [
        (4, "1", 0),
        (4, "1", 3),
        (4, "0.5:1", 0),
        (4, "0.5:1", 3),
    ]
    assert all(1.0 <= r["tau"] <= 6.0 and r["rounds"] >= 2 for r in rows), rows


def test_mla_splits_runs_each_split_count_once(tmp_path):
    """mla_splits.py in interpret mode (shrunk cache of 4 blocks): the two built-in choices agree
    (4 splits) and run once under both labels; --splits adds 1 split (4 blocks a split, the
    2-slot ring refilled); every output checked against the XLA path."""
    out = tmp_path / "splits.json"
    shape = ["--smoke", "--heads", "8", "--contexts", "16384", "--batches", "1", "--tokens", "1"]
    _experiment("mla_splits").main([*shape, "--splits", "1", "4", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["choice"], r["splits"]) for r in rows] == [("one wave = wave-aware = 4 splits", 4), ("1 splits", 1)]
    assert all(r["max_abs_err"] < 5e-3 for r in rows), rows
    # Where the choices agree, only --every times the shape (to compare runs under --set).
    for every, want in ((False, []), (True, [("one wave = wave-aware", 4)])):
        out.unlink(missing_ok=True)
        _experiment("mla_splits").main([*shape, "--reps", "1", "--out", str(out), *(["--every"] if every else [])])
        rows = json.loads(out.read_text()) if out.exists() else []
        assert [(r["choice"], r["splits"]) for r in rows] == want, rows


def test_ws_fault_checks_the_tree_tiles_on_a_stack_against_the_reference(monkeypatch, capsys):
    """ws_fault.py's child for "w4a16,0" (interpret mode, shrunk): k2_shard's MoE, top-1 routing
    on a one-layer stack read at layer 0, every call checked against the XLA reference; a kernel
    that returns wrong values is counted bad at every call."""
    from ddtree_jax.pallas.moe import mosaic, w4a16

    refusal = mosaic.refuse_two_consumers
    argv = ["--schedule", "w4a16,0", "--tokens", "5", "--top-k", "1", "--stacked", "--calls", "2", "--smoke"]
    real, rows = w4a16.moe_experts_w4a16, []
    for broken in (False, True):
        if broken:
            monkeypatch.setattr(w4a16, "moe_experts_w4a16", lambda *a, **kw: real(*a, **kw) * 0.5)
        _experiment("ws_fault").main(argv)
        rows.append(json.loads(capsys.readouterr().out.split("ROW ", 1)[1]))
    assert "stages=2, consumers=0" in rows[0]["tiles"], rows
    assert [r["bad_calls"] for r in rows] == [0, 2], rows
    assert rows[0]["worst_abs_err"] < 1e-2 * rows[0]["expected_max_abs"], rows
    # run in-process, the child leaves the other tests' refusal of two compiled consumers alone
    assert mosaic.refuse_two_consumers is refusal


def test_research_scripts_refuse_bad_flags_before_loading(tmp_path):
    """Each command line fails in parse: --methods with a typo used to run no method and write an
    empty table with exit status 0, a bad budget or count died in generate after the load, and a
    bad --out only at the end of the run (sweep_tree: after the load)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = {
        "compare_methods.py": [
            (("--methods", "ar", "ddtre"), "--methods: unknown ['ddtre']"),
            (("--budgets", 0), "--budgets must lie in [1, 1024], got [0]"),
            (("--batch-sizes", 1, 0), "--batch-sizes must be >= 1, got [1, 0]"),
            (("--repeats", 0), "--repeats must be >= 1, got 0"),
            (("--dtype", "int8"), "--dtype='int8' is not supported"),
            (("--out", tmp_path), f"--out {str(tmp_path)!r} is not a file path"),
        ],
        "drafter_tau.py": [
            (("--drafters", "d@x"), "--drafters 'd@x': the window after @ must be an int >= 0"),
            (("--drafters", "d", "--budgets", 0), "--budgets must lie in [1, 1024], got [0]"),
            (("--drafters", "d", "--num-prompts", 0), "--num-prompts must be >= 1, got 0"),
            (("--drafters", "d", "--out", tmp_path / "no" / "t.json"), "is not a file path in an existing folder"),
        ],
        "tree_replay.py": [
            (("--limit", -1), "--limit must be >= 1, got -1"),
            (("--budgets", 2000), "--budgets must lie in [1, 1024], got [2000]"),
        ],
        "chain_misses.py": [(("--prompt-len", 0), "--prompt-len must be >= 1, got 0")],
        "exact_cost.py": [
            (("--numerics", "exakt"), "--numerics: unknown ['exakt']"),
            (("--loop-tokens", 0), "--loop-tokens must be >= 1, got 0"),
        ],
        "sweep_tree.py": [
            (("--temperatures", "nan"), "temperatures must be finite and >= 0, got [nan]"),
            (("--out", a_file), "is a file, not a folder"),
        ],
    }
    for script, checks in cases.items():
        for args, message in checks:
            assert message in refusal(script, *args), (script, args)
    # Run as documented (`python experiments/exact_cost.py`): its `from experiments.profile_round`
    # import needed the repo root on sys.path, so it died of a ModuleNotFoundError.
    proc = run_script("exact_cost.py", "--budget", 0)
    assert proc.returncode == 2 and "--budget must lie in [1, 1024], got [0]" in proc.stderr, proc.stderr[-2000:]


def test_drafter_tau_refuses_a_window_below_the_block_size_before_loading(tmp_path):
    """DIR@W with 0 < W < the drafter's block size (the engine's rule for a sliding window) died
    only at the drafter's load, after the target's: the window is checked against DIR/config.json."""
    shipped = os.path.join(REPO, "checkpoints", "drafter")  # block_size 16; only its config.json is read
    nowhere = ("--target", tmp_path / "no_target")  # a load would fail otherwise, not refuse the flag
    why = refusal("drafter_tau.py", "--drafters", shipped, f"{shipped}@8", *nowhere)
    assert f"--drafters '{shipped}@8': window 8 is below the drafter's block_size=16" in why, why
    assert "--drafters 'd@1': no config.json at d/config.json" in refusal(
        "drafter_tau.py", "--drafters", "d@1", *nowhere
    )


def test_tree_replay_refuses_bad_policies_before_loading(tmp_path):
    """A policy depth_temperatures cannot read was met only after the checkpoints loaded."""
    nowhere = ("--checkpoints", tmp_path / "no_checkpoints")
    for policy, message in (
        ("abc", "--policies: policy 'abc' is not 't' or 'a:b' with numbers"),
        ("0.8:x", "--policies: policy '0.8:x' is not 't' or 'a:b' with numbers"),
        ("-1", "--policies: policy '-1': one or two temperatures > 0"),
        ("nan", "--policies: policy 'nan': one or two temperatures > 0"),
        ("0", "--policies: policy '0': one or two temperatures > 0"),
        ("1:2:3", "--policies: policy '1:2:3': one or two temperatures > 0"),
    ):
        assert message in refusal("tree_replay.py", "--policies", "1", policy, *nowhere), policy


def test_compare_methods_refuses_a_bad_mesh_or_block_size_before_loading(tmp_path):
    """--mesh and --block-size (the random drafter's block) were unchecked: a bad one died in
    make_mesh / the drafter's config after the target loaded."""
    nowhere = ("--target", tmp_path / "no_target")
    for args, message in (
        (("--block-size", 1), "--block-size must be >= 2, got 1"),
        (("--mesh", 0, 2), "--mesh must be >= 1, got [0, 2]"),
        (("--mesh", 2, -1), "--mesh must be >= 1, got [2, -1]"),
        (("--mesh", 1, 4096), "--mesh 1 4096 needs 4096 devices, but jax sees "),
    ):
        assert message in refusal("compare_methods.py", *args, *nowhere), args
