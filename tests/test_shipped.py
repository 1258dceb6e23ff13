"""The shipped checkpoints (checkpoints/): loading, greedy exactness across methods,
a trained drafter's acceptance, and the `generate` / `eval` CLI end to end.

Greedy comparisons run in float32: in bfloat16 the verify forward (many tokens at once)
and an AR step (one token) round differently, so greedy paths may split at near-ties.
"""

import json
import os
import sysconfig

import jax
import numpy as np
import pytest

from ddtree_jax import compile_cache
from ddtree_jax.__main__ import main
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate
from ddtree_jax.shipped import checkpoints_dir, load_shipped
from tests.conftest import REPO

MAX_CHECKPOINT_BYTES = 48_000_000  # the shipped folder stays small enough for the repo (issue 17)
MAX_FILE_BYTES = 16_000_000
NEW_TOKENS = 48
PROMPTS = (
    "def parse_header(",
    'def running_max(numbers: list[int]) -> list[int]:\n    """Return the running maximum of a list.\n'
    '    >>> running_max([1, 3, 2, 5])\n    [1, 3, 3, 5]\n    """\n',
    "import os\n",
)
# The shipped (v6) drafter gives tau 2.76 (DFlash chain), 3.58 (DDTree 16) and 4.06 (DDTree 64)
# on PROMPTS in float32 (v5: 3.95 / 4.32 / 4.87; v4, whose target looped more: 5.37 / 5.93 /
# 7.00; v3: 4.71 / 6.14 / 6.83); random drafters (init_params, std 0.02 or 0.2, seeds 0-2) gave 1.00-1.05. The bound is
# kept where v2 (chain 2.82, DDTree 64 3.88) also passed.
MIN_TRAINED_TAU = 2.5


@pytest.fixture(scope="module")
def shipped():
    return load_shipped(dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(shipped):
    return [shipped.tokenizer.encode(p, bos=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def greedy(shipped, prompt_ids):
    """Greedy results per method, each one batched call over all PROMPTS."""
    runs = {"ar": ("ar", None), "dflash": ("dflash", None), "ddtree64": ("ddtree", 64)}
    out = {}
    for name, (method, budget) in runs.items():
        out[name] = generate(
            shipped.target,
            None if method == "ar" else shipped.drafter,
            prompt_ids,
            method=method,
            tree_budget=budget,
            max_new_tokens=NEW_TOKENS,
            stop_token_ids=(),
        )
    return out


def test_shipped_checkpoints_load_consistent(shipped):
    tok, target, draft = shipped.tokenizer, shipped.target, shipped.drafter
    assert target.dtype == np.float32 and draft.dtype == np.float32
    assert target.config.vocab_size == tok.vocab_size == draft.config.vocab_size
    assert draft.config.mask_token_id == tok.mask_id
    assert target.config.eos_token_id == tok.eos_id
    assert target.config.bos_token_id == tok.bos_id
    draft.config.check_compatible(target.config)
    assert max(draft.config.target_layer_ids) < target.config.num_hidden_layers


def test_shipped_checkpoints_are_small():
    root = checkpoints_dir()
    sizes = {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files}
    total = sum(sizes.values())
    assert 0 < total <= MAX_CHECKPOINT_BYTES, f"{root} holds {total / 1e6:.1f} MB"
    assert max(sizes.values()) <= MAX_FILE_BYTES, max(sizes, key=sizes.get)


def test_shipped_target_is_kimi_k2_like_with_int4_experts(shipped):
    """Issue 17's shipped target: MLA, >= 16 routed experts, top-k >= 2, a shared expert, the
    sigmoid router with its correction bias, a dense first layer, routed experts INT4."""
    from ddtree_jax.quant import QuantizedArray

    target = shipped.target
    cfg = target.config
    assert cfg.kv_lora_rank > 0 and cfg.q_lora_rank > 0
    assert cfg.n_routed_experts >= 16 and cfg.num_experts_per_tok >= 2 and cfg.n_shared_experts >= 1
    assert cfg.first_k_dense_replace == 1 and cfg.to_hf_config()["scoring_func"] == "sigmoid"
    assert cfg.expert_int4_group_size is not None
    assert isinstance(target.moe_layers.mlp.gate, QuantizedArray)
    assert np.ptp(np.asarray(target.moe_layers.mlp.router_bias)) > 0  # moved by training towards balance


def test_greedy_ddtree_equals_dflash_equals_ar(greedy):
    ref = greedy["ar"].to_lists()
    assert [len(r) for r in ref] == [NEW_TOKENS] * len(PROMPTS)
    for name in ("dflash", "ddtree64"):
        assert greedy[name].to_lists() == ref, name


def test_trained_drafter_accepts_more_than_random(shipped, prompt_ids, greedy):
    tau = greedy["ddtree64"].tau
    assert tau > MIN_TRAINED_TAU, f"DDTree(64) tau {tau:.2f} with the shipped drafter"
    assert greedy["ddtree64"].tau >= 1.2 * greedy["dflash"].tau > 1.2  # the tree beats the chain
    # The bound must separate trained from untrained: a random drafter of the same config stays
    # below it. The DDTree(64) call above with other weights: the same program, no compile.
    # (Exactness with drafters that miss: test_decode, test_int4.)
    random_drafter = dflash.init_params(shipped.drafter.config, jax.random.PRNGKey(0))
    res = generate(
        shipped.target,
        random_drafter,
        prompt_ids,
        method="ddtree",
        tree_budget=64,
        max_new_tokens=NEW_TOKENS,
        stop_token_ids=(),
    )
    assert res.tau < MIN_TRAINED_TAU, f"random drafter tau {res.tau:.2f}"
    assert res.to_lists() == greedy["ar"].to_lists()  # a drafter that misses stays exact


def test_sliding_window_keeps_the_drafter_accepting_on_long_prompts(shipped):
    """400-token prompts, longer than any training context (320): the shipped window (128) keeps
    tau (2.09 measured for v6, 1.96 for v5, 2.82 for v4, 3.12 for v3, 2.75 for v2); the same weights attending
    to all context fall to 1.01 (v5: 1.00, v4: 1.01, v3: 1.05, v2: 1.22)."""
    assert shipped.drafter.config.sliding_window == 128
    stdlib = sysconfig.get_paths()["stdlib"]
    ids = []
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        with open(os.path.join(stdlib, name)) as f:
            ids.append(shipped.tokenizer.encode(f.read(), bos=True)[:400])
    cfg = shipped.drafter.config.with_sliding_window(None)
    taus = {}
    for name, params in (("window", shipped.drafter), ("full", shipped.drafter.replace(config=cfg))):
        res = generate(
            shipped.target, params, ids, method="dflash", max_new_tokens=NEW_TOKENS, stop_token_ids=(), numerics="fast"
        )
        taus[name] = res.tau
    assert taus["window"] > 1.7 and taus["full"] < 1.4, taus


def test_cli_generate(capsys):
    main(["generate", "def f(", "--method", "ddtree", "--budget", "8", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert out.startswith("def f(")
    assert "method=ddtree budget=8 new_tokens=8" in out
    assert "tau=" in out and "tokens/s=" in out
    assert out.rstrip().endswith("tree_temperature=0.8")  # the greedy default


def _eval(data_dir, out_json, capsys):
    main(
        [
            "eval",
            "--prompts",
            "test",
            "--limit",
            "2",
            "--methods",
            "ar",
            "ddtree",
            "--budgets",
            "4",
            "--max-new-tokens",
            "8",
            "--data",
            str(data_dir),
            "--out",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert "test prompts: 2, max_new_tokens 8" in out
    assert "| method | budget | tau | tokens/s | vs AR |" in out
    assert "| ar | - | 1.00 |" in out
    assert "| ddtree | 4 |" in out
    with open(out_json) as f:
        rows = json.load(f)["rows"]
    assert [(r["method"], r["budget"], r["tree_temperature"], r["prompts"], r["tokens"]) for r in rows] == [
        ("ar", None, None, 2, 16),
        ("ddtree", 4, 0.8, 2, 16),
    ]
    assert rows[1]["tau"] >= 1.0
    return rows


def test_cli_eval_on_prepared_test_split(tmp_path, capsys):
    data_dir = os.path.join(REPO, "data")
    if not os.path.exists(os.path.join(data_dir, "test.npy")):
        pytest.skip("data/test.npy missing (experiments/prepare_data.py makes it); the fallback test still runs")
    _eval(data_dir, tmp_path / "rows.json", capsys)


def test_cli_eval_runs_every_prompt_set(tmp_path, capsys, monkeypatch):
    out_json = tmp_path / "rows.json"
    # _eval's length: the test set's AR program (batch 1, one 128-token window) is the one
    # test_cli_eval_without_prepared_data_tokenizes_stdlib compiles (loaded, not compiled, once a session).
    args = ["eval", "--prompts", "humaneval", "test", "--limit", "1", "--methods", "ar", "--max-new-tokens", "8"]
    clear, cleared = compile_cache.clear, []
    monkeypatch.setattr(compile_cache, "clear", lambda: (cleared.append(len(compile_cache._loaded)), clear())[1])
    main([*args, "--data", str(tmp_path), "--out", str(out_json)])
    # Each run starts with the earlier runs' programs dropped: the second found the first's.
    assert len(cleared) == 2 and cleared[1] >= 1, cleared
    capsys.readouterr()
    main([*args, "--data", str(tmp_path), "--out", str(out_json), "--keep-programs"])
    assert len(cleared) == 2, cleared  # kept: not cleared again
    out = capsys.readouterr().out
    assert "humaneval prompts: 1," in out and "test prompts: 1," in out
    with open(out_json) as f:
        rows = json.load(f)["rows"]
    assert [(r["prompt_set"], r["method"], r["tokens"]) for r in rows] == [("humaneval", "ar", 8), ("test", "ar", 8)]


def test_cli_eval_without_prepared_data_tokenizes_stdlib(tmp_path, capsys):
    empty = tmp_path / "no_data"
    empty.mkdir()
    _eval(empty, tmp_path / "rows.json", capsys)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["generate", "def f(", "--method", "beam"], "unknown method 'beam'"),
        (["eval", "--methods", "ar", "beam"], "unknown method 'beam'"),
        (["generate", "def f(", "--checkpoints", "/nonexistent"], "'/nonexistent' does not exist"),
        (["eval", "--checkpoints", "/nonexistent"], "'/nonexistent' does not exist"),
        (["eval", "--checkpoints", __file__], "is a file, not a folder"),
        (["generate", ""], "the prompt is empty"),
        (["generate", "  \n"], "the prompt is empty"),
        (["eval", "--prompts", "nope", "--methods", "ar"], "unknown prompt set 'nope'"),
        (["generate", "def f(", "--budget", "0"], r"tree budget must be an int in \[1, 1024\], got 0"),
        (["eval", "--budgets", "16", "2000"], r"tree budget must be an int in \[1, 1024\], got 2000"),
        (["generate", "def f(", "--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
        (["generate", "def f(", "--top-p", "2"], r"top_p must lie in \(0, 1\], got 2.0"),
        (["generate", "def f(", "--tree-temperature", "0"], "tree temperature must be finite and > 0, got 0.0"),
        (["eval", "--tree-temperature", "nan"], "tree temperature must be finite and > 0, got nan"),
        (["generate", "def f(", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (
            ["generate", "def f(", "--block-size", "1"],
            r"block_size=1 must be an int in \[2, the drafter's block_size=16\]",
        ),
        (["eval", "--limit", "0"], "--limit must be >= 1, got 0"),
        (
            ["generate", "def f(", "--max-new-tokens", "5000"],
            r"prompt 0 \(4 tokens\) \+ max_new_tokens=5000 is 5004 positions, more than the target's "
            "max_position_embeddings=4096",
        ),
        (
            ["generate", "def f(", "--block-size", "17"],
            r"block_size=17 must be an int in \[2, the drafter's block_size=16\]",
        ),
    ],
)
def test_cli_errors(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)


def test_cli_eval_checks_every_prompt_set_fits_before_any_run(tmp_path, capsys):
    """The test windows (128 tokens) fit 3968 new tokens; HumanEval prompt 1 (130 tokens) does not.
    The eval must refuse before it runs the test set, not after."""
    np.save(tmp_path / "test.npy", np.arange(10_000, dtype=np.uint16) % 8000)
    argv = ["eval", "--prompts", "test", "humaneval", "--limit", "2", "--methods", "ar", "--max-new-tokens", "3968"]
    with pytest.raises(
        SystemExit,
        match=r"prompt 1 \(130 tokens\) \+ max_new_tokens=3968 is 4098 positions, more than the target's "
        r"max_position_embeddings=4096",
    ):
        main([*argv, "--data", str(tmp_path)])
    assert "prompts:" not in capsys.readouterr().out  # no set ran


def test_cli_eval_checks_the_block_size_before_any_run(tmp_path, capsys):
    np.save(tmp_path / "test.npy", np.arange(1000, dtype=np.uint16))
    argv = ["eval", "--prompts", "test", "--limit", "1", "--methods", "ar", "dflash", "--block-size", "17"]
    with pytest.raises(SystemExit, match=r"block_size=17 must be an int in \[2, the drafter's block_size=16\]"):
        main([*argv, "--max-new-tokens", "4", "--data", str(tmp_path)])
    assert '"method": "ar"' not in capsys.readouterr().out  # AR, listed first, did not run


@pytest.mark.parametrize("bad", [8192, -1, 10**6])
def test_generate_rejects_ids_outside_vocab(shipped, bad):
    assert shipped.target.config.vocab_size == 8192
    with pytest.raises(ValueError, match=rf"token 2 has id {bad}, outside the vocabulary \[0, 8192\)"):
        generate(shipped.target, shipped.drafter, [[1, 5, bad, 7]], method="ddtree", max_new_tokens=4)
