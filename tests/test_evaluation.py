"""evaluation.py: bucketing, totals, histograms, timing and prompt sets."""

import types

import numpy as np
import pytest

from ddtree_jax import evaluation


def test_bucket_pads_to_multiples_and_groups_by_width():
    prompts = [[1, 2, 3], [4] * 5, [5], [6] * 9]
    groups = evaluation.bucket(prompts, 4)
    assert [g[0].shape for g in groups] == [(2, 4), (1, 8), (1, 12)]
    ids, lengths = groups[0]
    assert lengths.tolist() == [3, 1] and ids.dtype == np.int32
    assert ids.tolist() == [[1, 2, 3, 0], [5, 0, 0, 0]]
    [(one, n)] = evaluation.bucket(prompts, 4, one_call=True)
    assert one.shape == (4, 12) and n.tolist() == [3, 5, 1, 9]
    with pytest.raises(ValueError, match="width must be >= 1"):
        evaluation.bucket(prompts, 0)
    with pytest.raises(ValueError, match="no prompts"):
        evaluation.bucket([], 4)


def _result(accept, rounds, lengths):
    return types.SimpleNamespace(
        accept_lengths=np.asarray(accept), rounds=np.asarray(rounds), lengths=np.asarray(lengths)
    )


def test_totals_count_only_real_rounds():
    # Two rows: row 0 ran 3 rounds (accepting 4, 2, 1), row 1 ran 1 round (3); the rest is padding.
    accept = [[4, 3], [2, 0], [1, 0], [0, 0]]
    t = evaluation.Totals().add(_result(accept, [3, 1], [7, 3]), seconds=2.0, block_size=4)
    assert (t.prompts, t.tokens, t.rounds, t.accepted) == (2, 10, 4, 10)
    assert t.tau == 2.5 and t.tokens_per_s == 5.0
    assert t.histogram.tolist() == [1, 1, 1, 1] and t.outside == 0
    t.add(_result([[5], [0]], [1], [5]), seconds=1.0, block_size=4)
    assert t.outside == 1 and t.rounds == 5 and t.row()["seconds"] == 3.0
    assert np.isnan(evaluation.Totals().tokens_per_s) and evaluation.Totals().tau == 0.0


def test_time_call_warms_up_untimed_then_takes_the_median():
    calls = []

    def fn():
        calls.append(1)
        return np.zeros(2)

    seconds, out = evaluation.time_call(fn, repeats=3)
    assert len(calls) == 4 and seconds >= 0 and out.shape == (2,)
    compiled = evaluation.Compiled()
    compiled.time("a", fn)
    compiled.time("a", fn)
    assert len(calls) == 4 + 2 + 1  # a new signature runs twice, a seen one once
    with pytest.raises(ValueError, match="repeats"):
        evaluation.time_call(fn, repeats=0)


def test_unknown_prompt_set_is_named():
    with pytest.raises(ValueError, match="unknown prompt set 'nope'"):
        evaluation.prompt_set("nope", None, "data")
