"""NaN and Inf never decode silently: refused at load naming the tensor, flagged by generate,
an error line from the CLI."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from ddtree_jax import checkpoint
from ddtree_jax.__main__ import main
from ddtree_jax.drafters import OracleDrafter, dflash
from ddtree_jax.generate import generate
from ddtree_jax.hf import CheckpointError
from tests.conftest import random_target, rewrite, tiny

PROMPT = [[5, 17, 33, 2]]
BAD = [np.nan, np.inf, -np.inf]


@pytest.fixture(scope="module")
def params():
    return random_target(tiny(), seed=5)


def _plant(leaf, value):
    """`value` where every token's computation meets it: the first element of each matrix
    (every expert's, every layer's), the embedding rows of the prompt."""
    a = np.array(leaf)
    if a.ndim == 2 and a.shape[0] == tiny().vocab_size:  # the embedding
        a[5, 0] = value
    elif a.ndim >= 3:  # a stack of layers (and of experts): each gets one
        a[(slice(None),) * (a.ndim - 2) + (0, 0)] = value
    else:
        a[(slice(None),) * (a.ndim - 1) + (0,)] = value
    return jnp.asarray(a, leaf.dtype)


def _paths(params):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


@pytest.mark.parametrize("value", BAD)
def test_nonfinite_weight_in_memory_is_reported_not_decoded(params, value):
    kw = dict(max_new_tokens=6, stop_token_ids=())
    assert generate(params, PROMPT, **kw).nonfinite_errors() == []
    paths = _paths(params)
    assert len(paths) >= 20  # every kind of weight: norms, MLA, dense MLP, router, experts, shared, lm_head
    for i, path in enumerate(paths):
        leaves, treedef = jax.tree.flatten(params)
        leaves[i] = _plant(leaves[i], value)
        res = generate(jax.tree.unflatten(treedef, leaves), PROMPT, **kw)
        assert int(res.nonfinite_at[0]) == 0 and res.to_lists() == [[]], path
        assert res.nonfinite_errors() == ["row 0: the target's logits for new token 0 were not finite"], path


def test_overflowing_activations_are_reported(params):
    """Finite weights, an embedding scaled past what a squared activation can hold in float32."""
    huge = params.replace(embed=params.embed * 1e25)
    assert bool(jnp.isfinite(huge.embed).all())
    res = generate(huge, PROMPT, max_new_tokens=6, stop_token_ids=())  # the loop the test above compiled
    assert int(res.nonfinite_at[0]) == 0 and res.to_lists() == [[]]


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_row_ends_at_the_first_token_with_nonfinite_logits(params, method):
    """A NaN embedding row of the third generated token: two rows of a batch, one meets it."""
    kw = dict(max_new_tokens=8, stop_token_ids=())
    clean = generate(params, [*PROMPT, [9, 9]], **kw).to_lists()
    row = clean[0]
    j = next(j for j in range(2, 8) if row[j] not in row[:j] + PROMPT[0] + clean[1] + [9])
    bad = params.replace(embed=params.embed.at[row[j], 3].set(jnp.nan))
    oracle = OracleDrafter(block_size=4)
    args = (bad, [*PROMPT, [9, 9]]) if method == "ar" else (bad, oracle, [*PROMPT, [9, 9]])
    res = generate(*args, method=method, tree_budget=6, **kw)
    # The token itself is emitted (its logits were finite); the next one never is.
    assert res.to_lists()[0] == row[: j + 1]
    assert np.asarray(res.nonfinite_at).tolist() == [j + 1, -1]
    assert res.to_lists()[1] == clean[1]
    assert res.nonfinite_errors() == [f"row 0: the target's logits for new token {j + 1} were not finite"]


def test_nonfinite_drafter_is_flagged_and_the_output_stays_the_targets(params):
    dcfg = dflash.drafter_config_for(params.config, num_hidden_layers=1, block_size=4)
    dparams = dflash.init_params(dcfg, jax.random.PRNGKey(1))
    bad = dparams.replace(fc=dparams.fc.at[0, 0].set(jnp.nan))
    kw = dict(max_new_tokens=6, stop_token_ids=())
    res = generate(params, bad, PROMPT, method="ddtree", tree_budget=8, **kw)
    assert res.to_lists() == generate(params, PROMPT, **kw).to_lists()
    assert bool(res.draft_nonfinite[0]) and int(res.nonfinite_at[0]) == -1
    assert res.nonfinite_errors() == ["row 0: the drafter's logits were not finite"]


@pytest.mark.parametrize("value", BAD)
def test_nonfinite_tensor_on_disk_is_refused_naming_it(params, tmp_path, value):
    checkpoint.save_hf(params, tmp_path)
    names = list(safetensors.numpy.load_file(tmp_path / "model.safetensors"))
    assert len(names) >= 30
    for name in names:
        rewrite(tmp_path, lambda t, name=name: t[name].reshape(-1).__setitem__(3, value))
        with pytest.raises(CheckpointError, match=rf"weight '{name}' in .* holds 1 non-finite value"):
            checkpoint.load_target(tmp_path)
        checkpoint.load_target(tmp_path, check_finite=False)  # the opt-out loads it
        rewrite(tmp_path, lambda t, name=name: t[name].reshape(-1).__setitem__(3, 0.5))


def test_values_that_overflow_the_requested_dtype_are_refused(params, tmp_path):
    checkpoint.save_hf(params.replace(lm_head=params.lm_head.at[2, 1].set(1e6)), tmp_path)
    with pytest.raises(CheckpointError, match=r"weight 'lm_head\.weight' .* cast to float16 holds 1 non-finite"):
        checkpoint.load_target(tmp_path, dtype="float16")
    assert checkpoint.load_target(tmp_path, dtype="bfloat16").lm_head.dtype == jnp.bfloat16


def test_nonfinite_drafter_and_orbax_checkpoints_are_refused(params, tmp_path):
    dcfg = dflash.drafter_config_for(params.config, num_hidden_layers=1)
    dparams = dflash.init_params(dcfg, jax.random.PRNGKey(2))
    dflash.save_drafter_hf(dparams.replace(norm=dparams.norm.at[1].set(jnp.inf)), tmp_path / "d")
    with pytest.raises(CheckpointError, match=r"weight 'norm\.weight' .* holds 1 non-finite value\(s\) \(Inf"):
        dflash.load_drafter(tmp_path / "d")
    dflash.load_drafter(tmp_path / "d", check_finite=False)
    moe = params.moe_layers
    bad = params.replace(
        moe_layers=moe.replace(mlp=moe.mlp.replace(router_bias=moe.mlp.router_bias.at[0, 2].set(jnp.nan)))
    )
    checkpoint.save_checkpoint(bad, tmp_path / "o")
    with pytest.raises(CheckpointError, match=r"array .*router_bias.* holds 1 non-finite value\(s\) \(NaN"):
        checkpoint.restore_checkpoint(tmp_path / "o")


def test_cli_refuses_a_nonfinite_checkpoint_and_reports_nonfinite_logits(params, tmp_path, capsys):
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t["model.norm.weight"].__setitem__(0, np.nan))
    argv = ["demo", "--checkpoint", str(tmp_path), "--batch", "2", "--max-new-tokens", "3"]
    with pytest.raises(SystemExit, match=r"error: weight 'model\.norm\.weight' .* holds 1 non-finite"):
        main(argv)
    with pytest.raises(SystemExit, match=r"error: non-finite logits: row 0: .* new token 0 .*; row 1: .* token 0"):
        main([*argv, "--no-check-finite"])


def test_cli_errors_are_one_line_without_a_traceback(params, tmp_path):
    """Run as a user would (a subprocess; no time limit, so a busy machine cannot fail it)."""
    checkpoint.save_hf(params, tmp_path)
    rewrite(tmp_path, lambda t: t["lm_head.weight"].__setitem__((0, 0), np.inf))
    for argv, match in (
        (["demo", "--preset", "tiny", "--dtype", "float7"], "dtype='float7' is not supported"),
        (["demo", "--preset", "tiny", "--dtype", "int8"], "dtype='int8' is not supported"),
        (["demo", "--checkpoint", str(tmp_path)], "weight 'lm_head.weight'"),
        (["generate", "def f(", "--dtype", "float7"], "--dtype='float7' is not supported"),
    ):
        proc = subprocess.run([sys.executable, "-m", "ddtree_jax", *argv], capture_output=True, text=True)
        assert proc.returncode != 0, argv
        lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
        assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr
