"""generate(method="ar"): batching, stopping, sampling, and clear errors on bad input."""

import collections
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import model
from ddtree_jax.generate import generate
from ddtree_jax.sampling import Sampler, SamplingConfig, choose, filtered_logits
from tests.conftest import random_target, tiny


@pytest.fixture(scope="module")
def params():
    return random_target(tiny(), seed=21)


@pytest.fixture
def compiles(tmp_path, monkeypatch):
    """generate's compiles, counted: its executables go to a fresh folder (none in memory), so
    each new program compiles once, whether or not the session's cache is on."""
    from ddtree_jax import compile_cache

    monkeypatch.setattr(compile_cache, "_executables_dir", str(tmp_path / "executables"))
    monkeypatch.setattr(compile_cache, "_loaded", collections.OrderedDict())
    count = []
    compile_ = jax.stages.Lowered.compile

    def counted(self, *args, **kwargs):
        count.append(1)
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    return count


PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [250], [1, 2, 3, 4]]
# One max_new_tokens for the greedy AR checks that do not depend on it: they share compiled
# loops (batch 3 or 1, width 7) with test_max_new_tokens_exact[7].
M = 7


def test_mixed_lengths_batch_equals_each_alone(params):
    batch = generate(params, PROMPTS, max_new_tokens=M).to_lists()
    for prompt, row in zip(PROMPTS, batch, strict=True):
        assert generate(params, [prompt], max_new_tokens=M).to_lists()[0] == row


def test_chunked_prefill_gives_the_same_tokens(params):
    """Prompts of 7, 1 and 4 tokens prefilled 3 tokens at a time (rows end mid-chunk, in the
    first chunk and at a chunk's end) give the one-chunk DDTree tokens and rounds: the target's
    cache and the drafter's context are both built chunk by chunk."""
    from ddtree_jax.drafters import dflash

    d = dflash.init_params(dflash.drafter_config_for(params.config, block_size=4), jax.random.PRNGKey(2), std=0.1)
    kw = dict(method="ddtree", max_new_tokens=8, stop_token_ids=())
    whole = generate(params, d, PROMPTS, **kw)
    part = generate(params, d, PROMPTS, prefill_chunk=3, **kw)
    assert part.to_lists() == whole.to_lists()
    np.testing.assert_array_equal(part.accept_lengths, whole.accept_lengths)


def test_prefill_over_unrolled_layers_gives_the_looped_prefills_tokens(params, monkeypatch):
    """SCAN_PREFILL_LAYERS=False (the decode loop's unrolled, hoisted layers in the prefill)
    gives the DDTree tokens and rounds of the default prefill, which loops over the stacks."""
    from ddtree_jax.drafters import dflash

    d = dflash.init_params(dflash.drafter_config_for(params.config, block_size=4), jax.random.PRNGKey(2), std=0.1)
    kw = dict(method="ddtree", max_new_tokens=8, stop_token_ids=())
    looped = generate(params, d, PROMPTS, **kw)
    # The module, not the function the package exports under the same name.
    monkeypatch.setattr(sys.modules["ddtree_jax.generate"], "SCAN_PREFILL_LAYERS", False)
    got = generate(params, d, PROMPTS, **kw)
    assert got.to_lists() == looped.to_lists()
    np.testing.assert_array_equal(got.accept_lengths, looped.accept_lengths)


def test_padded_array_with_lengths_equals_lists(params):
    padded = np.zeros((3, 7), np.int32)
    for i, p in enumerate(PROMPTS):
        padded[i, : len(p)] = p
    a = generate(params, padded, prompt_lengths=[7, 1, 4], max_new_tokens=M).to_lists()
    assert a == generate(params, PROMPTS, max_new_tokens=M).to_lists()


def test_padded_batches_of_one_width_compile_once(params, compiles):
    """The default cache capacity follows the padded width, not the valid lengths (no recompiles)."""
    padded = np.full((1, 80), 7, np.int32)
    for n in (3, 70, 80, 11):  # needed slots on both sides of the 64-slot capacity step
        generate(params, padded, prompt_lengths=[n], max_new_tokens=4).tokens.block_until_ready()
    assert len(compiles) == 1


def test_greedy_continues_argmax_of_full_forward(params):
    """The AR loop's token t is the argmax of a fresh full forward over prompt + tokens[:t]."""
    prompt = PROMPTS[0]
    out = generate(params, [prompt], max_new_tokens=M).to_lists()[0]
    seq = prompt + out
    from tests.test_model import full_forward

    logits, _ = full_forward(params, seq)
    want = np.argmax(np.asarray(logits[len(prompt) - 1 : -1]), axis=-1).tolist()
    assert out == want


def test_stop_token_ends_row_and_is_included(params):
    free = generate(params, PROMPTS, max_new_tokens=M)
    rows = free.to_lists()
    stop = rows[0][3]  # a token row 0 emits at step 3
    res = generate(params, PROMPTS, max_new_tokens=M, stop_token_ids=[stop])
    for free_row, row, stopped in zip(rows, res.to_lists(), np.asarray(res.stopped), strict=True):
        if stop in free_row:
            cut = free_row.index(stop) + 1
            assert row == free_row[:cut] and stopped
        else:
            assert row == free_row and not stopped
    tokens = np.asarray(res.tokens)
    for i, n in enumerate(np.asarray(res.lengths)):
        assert (tokens[i, n:] == -1).all()


def test_default_stop_is_config_eos(params):
    free = generate(params, PROMPTS[:1], max_new_tokens=M).to_lists()[0]
    eos = free[2]
    p2 = params.replace(config=tiny(eos_token_id=eos))
    assert generate(p2, PROMPTS[:1], max_new_tokens=M).to_lists()[0] == free[: free.index(eos) + 1]
    assert generate(p2, PROMPTS[:1], max_new_tokens=M, stop_token_ids=()).to_lists()[0] == free


@pytest.mark.parametrize("m", [1, 2, M])
def test_max_new_tokens_exact(params, m):
    res = generate(params, PROMPTS, max_new_tokens=m, stop_token_ids=())
    assert np.asarray(res.lengths).tolist() == [m] * 3
    assert np.asarray(res.rounds).tolist() == [m - 1] * 3
    assert res.tau == pytest.approx(1.0) or m == 1


def test_sampling_reproducible_and_key_dependent(params):
    kw = dict(max_new_tokens=M, temperature=1.0, stop_token_ids=())
    a = generate(params, PROMPTS, key=jax.random.key(1), **kw).to_lists()
    b = generate(params, PROMPTS, key=jax.random.key(1), **kw).to_lists()
    c = generate(params, PROMPTS, key=jax.random.key(2), **kw).to_lists()
    assert a == b and a != c


def test_top_k_1_sampling_is_greedy(params):
    greedy = generate(params, PROMPTS, max_new_tokens=M).to_lists()
    sampled = generate(params, PROMPTS, max_new_tokens=M, temperature=0.7, top_k=1, key=jax.random.key(0))
    assert sampled.to_lists() == greedy


def test_first_token_distribution_matches_softmax():
    """Chi-square test of 4000 first tokens against softmax(logits / T) after top-k/top-p.

    Tiny vocab (16) so every cell is well populated. With 15 degrees of freedom the
    threshold 37.7 is the 0.999 quantile: a correct sampler fails 1 run in 1000, and
    the fixed key makes this run deterministic.
    """
    cfg = tiny(vocab_size=16)
    params = random_target(cfg, seed=3, std=0.3)
    prompt = [[1, 2, 3]]
    n, temp = 4000, 1.3
    batch = np.repeat(np.asarray(prompt, np.int32), n, axis=0)
    res = generate(params, batch, max_new_tokens=1, temperature=temp, key=jax.random.key(7), stop_token_ids=())
    counts = np.bincount(np.asarray(res.tokens)[:, 0], minlength=16)
    from tests.test_model import full_forward

    logits, _ = full_forward(params, prompt[0])
    probs = np.asarray(jax.nn.softmax(logits[-1] / temp))
    expected = n * probs
    assert expected.min() > 5
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, (chi2, counts, expected)


def test_top_k_top_p_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top_k = filtered_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert np.isfinite(np.asarray(top_k)).tolist() == [[True, True, False, False, False]]
    # Nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; 0.1 is not.
    top_p = filtered_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert np.isfinite(np.asarray(top_p)).tolist() == [[True, True, True, False, False]]
    shuffled = filtered_logits(logits[:, ::-1], SamplingConfig(temperature=1.0, top_p=0.8))
    assert np.isfinite(np.asarray(shuffled)).tolist() == [[False, False, True, True, True]]


def test_a_sampler_with_traced_values_filters_and_samples_as_its_config():
    """`Sampler` (generate's, values traced) and the `SamplingConfig` it comes from agree: the
    same tokens removed, the same draws."""
    logits = jax.random.normal(jax.random.key(5), (4, 50)) * 3
    keys = jax.random.split(jax.random.key(6), 32)
    for cfg in (SamplingConfig(0.7), SamplingConfig(1.3, top_k=5), SamplingConfig(0.9, top_p=0.6), SamplingConfig()):

        @jax.jit
        def traced(values, sig=cfg.signature):
            s = Sampler.of(sig, values)
            return filtered_logits(logits, s) if not s.greedy else logits, jax.vmap(lambda k: choose(logits, k, s))(
                keys
            )

        want = filtered_logits(logits, cfg) if not cfg.greedy else logits
        got, draws = traced(cfg.values())
        # To the last bit or so: XLA may divide by a constant temperature as a reciprocal product.
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
        assert np.asarray(draws).tolist() == np.asarray(jax.vmap(lambda k, c=cfg: choose(logits, k, c))(keys)).tolist()


def test_small_temperatures_sample_the_argmax():
    """Logits less their row maximum before the division: at 1e-37 logits of 100 used to
    overflow to inf (NaN probabilities, junk tokens); the smallest float32 normal still samples
    only the argmax, a tie shared."""
    logits = jnp.asarray([[100.0, 99.0, -50.0, 100.0 - 1e-5], [3.0, 3.0, 1.0, -jnp.inf]])
    for t in (1e-37, float(np.finfo(np.float32).tiny)):
        x = np.asarray(filtered_logits(logits, SamplingConfig(temperature=t)))
        assert not np.isnan(x).any() and x.max(axis=-1).tolist() == [0, 0] and x[1, 3] == -np.inf, t
        cfg = SamplingConfig(temperature=t)
        draws = jax.vmap(lambda k, cfg=cfg: choose(logits, k, cfg))(jax.random.split(jax.random.key(0), 64))
        assert set(np.asarray(draws[:, 0]).tolist()) == {0} and set(np.asarray(draws[:, 1]).tolist()) == {0, 1}
    # The tree's temperature takes the same path: 1e-37 gives the drafter's argmax as the one-node tree.
    from ddtree_jax import tree

    one = tree.build_ddtree(logits[None, :1], jnp.asarray([7], jnp.int32), 1, temperature=1e-37)
    assert np.asarray(one.tokens).tolist() == [[7, 0]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(prompts=[[1, 2, 256]]), ValueError, "id 256, outside the vocabulary"),
        (dict(prompts=[[1, -1]]), ValueError, "id -1"),
        (dict(prompts=[[1, 2], []]), ValueError, "prompt 1 is empty"),
        (dict(prompts=[]), ValueError, "prompts is empty"),
        (dict(prompts=[[1.5, 2.0]]), TypeError, "must be integers"),
        (dict(prompts=np.ones((2, 3), np.float32)), TypeError, "must be integers"),
        (dict(prompts=np.ones((2, 3), np.int32), prompt_lengths=[3, 4]), ValueError, "exceeds the padded"),
        (dict(prompts=[[1] * 30], cache_capacity=20), ValueError, "cache_capacity=20"),
        (dict(prompts=[[1]], max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(prompts=[[1]], temperature=-1.0), ValueError, "temperature"),
        (dict(prompts=[[1]], temperature=1.0), ValueError, "PRNG key"),
        (dict(prompts=[[1]], top_p=0.0, temperature=1.0, key=jax.random.key(0)), ValueError, "top_p"),
        (dict(prompts=[[1]], stop_token_ids=[999]), ValueError, "stop token id 999"),
        (dict(prompts=[[1]], method="beam"), ValueError, "unknown method 'beam'"),
        # Integers must be ints: no bools, no floats (3.5 would have become 3, True one token).
        (dict(prompts=[[1]], stop_token_ids=[3.5]), TypeError, r"stop_token_ids\[0\] must be an int, got 3.5"),
        (dict(prompts=[[1]], stop_token_ids=[True]), TypeError, r"stop_token_ids\[0\] must be an int, got True"),
        (dict(prompts=[[1]], stop_token_ids=3), TypeError, "stop_token_ids must be a sequence of ints, got 3"),
        (dict(prompts=[[1]], stop_token_ids="2"), TypeError, "stop_token_ids must be a sequence of ints"),
        (dict(prompts=[[1]], max_new_tokens=True), TypeError, "max_new_tokens must be an int, got True"),
        (dict(prompts=[[1]], max_new_tokens=4.0), TypeError, "max_new_tokens must be an int, got 4.0"),
        (dict(prompts=[[1]], max_new_tokens=-2), ValueError, "max_new_tokens must be >= 1, got -2"),
        (dict(prompts=[[1]], top_k=True), TypeError, "top_k must be an int, got True"),
        (dict(prompts=[[1]], top_k=2.5), TypeError, "top_k must be an int, got 2.5"),
        (dict(prompts=[[1]], temperature="1"), TypeError, "temperature must be a number, got '1'"),
        (dict(prompts=[[1]], temperature=True), TypeError, "temperature must be a number, got True"),
        (dict(prompts=[[1]], temperature=float("nan")), ValueError, "temperature must be a finite number"),
        (dict(prompts=[[1]], temperature=1e-300), ValueError, "temperature 1e-300 is below float32's smallest normal"),
        (dict(prompts=[[1]], tree_temperature=1e-39), ValueError, "tree temperature 1e-39 is below float32's"),
        (dict(prompts=[[1]], top_p=True), TypeError, "top_p must be a number, got True"),
        (dict(prompts=[[1]], cache_capacity=100.0), TypeError, "cache_capacity must be an int, got 100.0"),
        (dict(prompts=[[1]], cache_dtype="int8"), ValueError, "cache_dtype='int8' is not supported"),
        (dict(prompts=[[1]], cache_dtype="float7"), ValueError, "cache_dtype='float7' is not supported"),
        (dict(prompts=[[1]], numerics="exactly"), ValueError, "unknown numerics 'exactly'"),
        (dict(prompts=[[1]], implementation="cuda"), ValueError, "unknown implementation 'cuda'"),
        (dict(prompts=[[1]], block_size=True), TypeError, "block_size must be an int, got True"),
        (dict(prompts=[[1]], prefill_chunk=0), ValueError, "prefill_chunk must be >= 1, got 0"),
        (dict(prompts=[[1]], prefill_chunk=2.0), TypeError, "prefill_chunk must be an int, got 2.0"),
        (dict(prompts=[[1]], tree_temperature=0.0), ValueError, "tree temperature must be finite and > 0, got 0.0"),
        (dict(prompts=[[1]], tree_temperature=float("inf")), ValueError, "tree temperature must be finite and > 0"),
        (
            dict(prompts=[[1]], tree_temperature="low"),
            TypeError,
            "tree temperature must be a real number > 0, got 'low'",
        ),
        (
            dict(prompts=[[1] * 3, [1] * 500], max_new_tokens=13),
            ValueError,
            r"prompt 1 \(500 tokens\) \+ max_new_tokens=13 is 513 positions, more than the target's "
            r"max_position_embeddings=512",
        ),
    ],
)
def test_bad_inputs(params, kwargs, error, match):
    with pytest.raises(error, match=match):
        generate(params, **{"max_new_tokens": 4, **kwargs})


def test_prompt_plus_new_tokens_may_fill_every_position(params):
    assert params.config.max_position_embeddings == 512
    res = generate(params, [[1] * 508], max_new_tokens=4)
    assert len(res.to_lists()[0]) == 4


def test_wrong_target_type():
    with pytest.raises(TypeError, match="TargetParams"):
        generate({"embed": 1}, [[1]])


def test_forward_rejects_wrong_token_dtype(params):
    from ddtree_jax.cache import KVCache

    cache = KVCache.init(params.config, 1, 4)
    with pytest.raises(AssertionError):
        model.forward(
            params, jnp.zeros((1, 2), jnp.float32), jnp.zeros((1, 2), jnp.int32), cache, jnp.ones((1, 2, 2), bool)
        )


def test_tree_temperature_changes_the_drafts_not_the_tokens(params):
    """Greedy DDTree with a sharpened (0.5) or flattened (3.0) tree gives AR's tokens; the
    trees differ, so the acceptance does (an oracle drafter that errs, whose logits spread)."""
    from ddtree_jax.drafters import OracleDrafter

    oracle = OracleDrafter(block_size=4, confidence=3.0, noise=1.5)
    want = generate(params, PROMPTS, max_new_tokens=M).to_lists()
    accepted = {}
    for t in (0.5, 3.0):
        res = generate(params, oracle, PROMPTS, method="ddtree", tree_budget=6, tree_temperature=t, max_new_tokens=M)
        assert res.to_lists() == want, t
        accepted[t] = np.asarray(res.accept_lengths).tolist()
    assert accepted[0.5] != accepted[3.0]


def test_one_program_serves_every_temperature_top_p_and_tree_temperature(params, compiles):
    """The values are traced: a sweep compiles once, and each value still reaches the program
    (a tiny temperature samples the argmax: greedy's tokens; two temperatures sample apart)."""
    from ddtree_jax.drafters import OracleDrafter

    oracle = OracleDrafter(block_size=4, confidence=3.0, noise=1.5)
    kw = dict(method="ddtree", tree_budget=6, max_new_tokens=M, stop_token_ids=())
    runs = {
        t: generate(params, oracle, PROMPTS, temperature=t, top_p=p, tree_temperature=tt, key=jax.random.key(3), **kw)
        for t, p, tt in [(0.7, 0.9, 0.5), (1.5, 0.6, 3.0), (1e-6, 0.95, 0.8)]
    }
    assert len(compiles) == 1
    assert runs[0.7].to_lists() != runs[1.5].to_lists()
    greedy = generate(params, oracle, PROMPTS, tree_temperature=0.8, **kw)  # a program of its own
    assert len(compiles) == 2
    assert runs[1e-6].to_lists() == greedy.to_lists()
