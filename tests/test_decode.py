"""The speculative round: accept / commit units, greedy exactness across methods, lossless sampling."""

import dataclasses
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import decode, tree
from ddtree_jax.cache import KVCache
from ddtree_jax.config import ConfigError
from ddtree_jax.drafters import OracleDrafter, RandomDrafter, dflash
from ddtree_jax.generate import generate
from tests.conftest import REPO, default_emitters_env, random_target, tiny


def small_tree():
    """root(7) -> a(1) -> c(3); root -> b(2) -> d(4), b -> e(5)."""
    tokens = jnp.asarray([[7, 1, 2, 3, 4, 5, 0]])
    parents = jnp.asarray([[-1, 0, 0, 1, 2, 2, 0]])
    depths = jnp.asarray([[0, 1, 1, 2, 2, 2, 0]])
    valid = jnp.asarray([[True] * 6 + [False]])
    vis = jnp.asarray(
        [
            [
                [1, 0, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0, 0],
                [1, 0, 1, 0, 0, 0, 0],
                [1, 1, 0, 1, 0, 0, 0],
                [1, 0, 1, 0, 1, 0, 0],
                [1, 0, 1, 0, 0, 1, 0],
                [0, 0, 0, 0, 0, 0, 1],
            ]
        ],
        bool,
    )
    return tree.DraftTree(tokens=tokens, parents=parents, depths=depths, valid=valid, visibility=vis, max_depth=2)


@pytest.mark.parametrize(
    ("choices", "path", "length", "bonus"),
    [
        ([2, 9, 5, 9, 9, 6, 9], [0, 2, 5], 3, 6),  # root -> b -> e, bonus from e
        ([1, 8, 9, 9, 9, 9, 9], [0, 1, 1], 2, 8),  # root -> a, nothing under a matches 8
        ([9, 9, 9, 9, 9, 9, 9], [0, 0, 0], 1, 9),  # nothing accepted: one token per round
        ([0, 9, 9, 9, 9, 9, 9], [0, 0, 0], 1, 0),  # padding slot 6 holds token 0: never accepted
    ],
)
def test_accept_walk(choices, path, length, bonus):
    t = small_tree()
    acc = decode.accept(t, jnp.asarray([choices]))
    assert np.asarray(acc.path).tolist() == [path]
    assert int(acc.length[0]) == length and int(acc.bonus[0]) == bonus
    emitted = np.asarray(decode.path_tokens(t, acc))[0, :length].tolist()
    assert emitted == [int(t.tokens[0, i]) for i in path[1:length]] + [bonus]


def _walk(tokens, parents, valid, choices, max_depth):
    """The acceptance walk, one depth at a time (numpy, one row): the oracle of `decode.accept`."""
    cur, path = 0, [0]
    for _ in range(max_depth):
        children = [i for i in range(len(tokens)) if valid[i] and parents[i] == cur and tokens[i] == choices[cur]]
        if not children:
            break
        cur = children[0]
        path.append(cur)
    return path + [cur] * (max_depth + 1 - len(path)), len(path), choices[cur]


@pytest.mark.parametrize(("method", "budget"), [("ddtree", 5), ("ddtree", 12), ("dflash", 0)])
def test_accept_equals_the_walk_on_built_trees(method, budget):
    """Real trees (the builder's); the choices lead each row towards a random node, then
    random: deep accepted paths, dead ends and misses at the root all occur."""
    rng = np.random.default_rng(budget)
    b, bs, vocab = 16, 6, 6
    logits = jnp.asarray(rng.normal(size=(b, bs - 1, vocab)) * 2, jnp.float32)
    t = decode.build_tree(method, logits, jnp.asarray(rng.integers(0, vocab, b), jnp.int32), budget)
    choices = rng.integers(0, vocab, (b, t.num_slots))
    parents, tokens = np.asarray(t.parents), np.asarray(t.tokens)
    for r in range(1, b):  # row 0 stays random
        node = int(rng.choice(np.flatnonzero(np.asarray(t.valid[r]))))
        while node > 0:
            choices[r, parents[r, node]] = tokens[r, node]
            node = parents[r, node]
    acc = decode.accept(t, jnp.asarray(choices, jnp.int32))
    lengths = []
    for r in range(b):
        path, length, bonus = _walk(
            *(np.asarray(a[r]) for a in (t.tokens, t.parents, t.valid)), choices[r], t.max_depth
        )
        assert np.asarray(acc.path[r]).tolist() == path and int(acc.length[r]) == length
        assert int(acc.bonus[r]) == bonus
        lengths.append(length)
    assert max(lengths) >= 4 and len(set(lengths)) >= 3, lengths  # the cases the comparison is about


def test_commit_moves_path_entries_to_their_slots():
    cfg = tiny()
    cache = KVCache.init(cfg, 2, 10).replace(lengths=jnp.asarray([3, 5]))
    n = 7
    marks = jnp.arange(n, dtype=jnp.float32) + 1  # entry of slot i carries value i + 1
    kv = decode.LatentKV(
        c_kv=jnp.broadcast_to(marks[None, None, :, None], (cfg.num_hidden_layers, 2, n, cfg.kv_lora_rank)),
        k_pe=jnp.broadcast_to(marks[None, None, :, None], (cfg.num_hidden_layers, 2, n, cfg.qk_rope_head_dim)),
    )
    acc = decode.Acceptance(path=jnp.asarray([[0, 2, 5], [0, 1, 1]]), length=jnp.asarray([3, 2]), bonus=jnp.zeros(2))
    out = decode.commit(cache, kv, acc, active=jnp.asarray([True, True]))
    assert np.asarray(out.lengths).tolist() == [6, 7]
    got = np.asarray(out.c_kv[1, :, :, 0])
    assert got[0].tolist() == [0, 0, 0, 1, 3, 6, 0, 0, 0, 0]
    assert got[1].tolist() == [0, 0, 0, 0, 0, 1, 2, 0, 0, 0]
    frozen = decode.commit(cache, kv, acc, active=jnp.asarray([True, False]))
    assert np.asarray(frozen.lengths).tolist() == [6, 5]
    assert not np.asarray(frozen.c_kv[:, 1]).any()


# ---------------------------------------------------------------------------------
# Greedy exactness: DDTree == DFlash == AR, token for token.
#
# XLA:CPU compiles each static configuration of the generate loop (method, budget, drafter,
# batch, prompt width, max_new_tokens) once, and the compile is what these tests wait for. So:
# every prompt is padded to one width (W), the tests share configurations where they check
# different things (the oracle's full blocks and the stop-token test; a batch of SWEEP and the
# batch-vs-alone test), and their AR references all come from one batched AR run (`greedy`):
# float32 greedy tokens are bitwise independent of batch and cache capacity (test_numerics), so
# a row's AR tokens there are its AR tokens anywhere, and the first m of M_REF are those of a
# run to m.

TARGET_CFG = tiny(num_hidden_layers=3, first_k_dense_replace=1)
W = 11  # the padded prompt width: prompts_for makes 1 .. 11 tokens
M_REF = 30  # the longest run of any test below


@pytest.fixture(scope="module")
def target():
    return random_target(TARGET_CFG, seed=31)


def dflash_drafter(block_size, seed=0):
    cfg = dflash.drafter_config_for(TARGET_CFG, num_hidden_layers=1, block_size=block_size)
    return dflash.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def prompts_for(batch, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TARGET_CFG.vocab_size, int(n)).tolist() for n in rng.integers(1, 12, batch)]


def run(target, drafter, prompts, **kw):
    """`generate` on `prompts` right-padded to width W (drafter None: AR)."""
    ids = np.zeros((len(prompts), W), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return generate(target, drafter, ids, prompt_lengths=[len(p) for p in prompts], **kw)


# (batch, block size, budgets): budgets from 1 to 257 (more nodes than the 256-token vocabulary), block
# sizes 2 / 4 / 16, batches 1-3, in few compiles.
SWEEP = [(1, 2, (1, 64)), (2, 4, (2, 257)), (3, 16, (15, 64))]
PROMPTS = {
    **{f"sweep{bs}": prompts_for(batch, seed=batch * 100 + bs) for batch, bs, _ in SWEEP},
    "noisy4": prompts_for(4, seed=4),
    "noisy16": prompts_for(4, seed=16),
    "step": [[5, 17, 33, 2], [250, 1], [7, 7, 7]],
    "oracle": prompts_for(3, seed=7),
    "rejected": prompts_for(2, seed=8),
    "rows": prompts_for(3, seed=9),
    "stop": prompts_for(3, seed=10),
    "smaller": prompts_for(2, seed=11),
}


@pytest.fixture(scope="module")
def greedy(target):
    """greedy(name, m): the AR tokens of PROMPTS[name] to m new tokens, from one batched run."""
    rows = [p for prompts in PROMPTS.values() for p in prompts]
    out = iter(run(target, None, rows, max_new_tokens=M_REF, stop_token_ids=()).to_lists())
    ref = {name: [next(out) for _ in prompts] for name, prompts in PROMPTS.items()}
    return lambda name, m: [row[:m] for row in ref[name]]


@pytest.mark.parametrize(("batch", "bs", "budgets"), SWEEP)
def test_ddtree_equals_dflash_equals_ar_greedy(target, greedy, batch, bs, budgets):
    prompts = PROMPTS[f"sweep{bs}"]
    assert len(prompts) == batch
    m = 24
    ar = greedy(f"sweep{bs}", m)
    d = dflash_drafter(bs, seed=bs)
    assert run(target, d, prompts, method="dflash", max_new_tokens=m, stop_token_ids=()).to_lists() == ar
    for budget in budgets:
        res = run(target, d, prompts, method="ddtree", tree_budget=budget, max_new_tokens=m, stop_token_ids=())
        assert res.to_lists() == ar, budget


@pytest.mark.parametrize("bs", [4, 16])
def test_partially_right_drafter_advances_rows_unevenly_and_stays_exact(target, greedy, bs):
    prompts = PROMPTS[f"noisy{bs}"]
    noisy = OracleDrafter(block_size=bs, confidence=3.0, noise=2.0)
    ar = greedy(f"noisy{bs}", 30)
    chain = run(target, noisy, prompts, method="dflash", max_new_tokens=30, stop_token_ids=())
    res = run(target, noisy, prompts, method="ddtree", tree_budget=32, max_new_tokens=30, stop_token_ids=())
    assert res.to_lists() == ar and chain.to_lists() == ar
    acc = np.asarray(res.accept_lengths)
    first_round = acc[0]
    if bs > 2:
        assert len(set(first_round.tolist())) > 1 or len(set(acc[1].tolist())) > 1, acc[:3]
        assert res.tau > chain.tau  # the tree recovers what the noisy top-1 chain misses


def test_step_is_the_whole_round_and_leaves_inactive_rows_alone(target, greedy):
    """decode.step with a DFlash drafter: both caches of an active row advance by what it
    accepted; the inactive row's cache, drafter context and length are untouched."""
    from ddtree_jax import model
    from ddtree_jax.cache import KVCache
    from ddtree_jax.sampling import SamplingConfig

    bs = 4
    d = dflash.DFlashDrafter(params=dflash_drafter(bs), block_size=bs)
    prompts = jnp.asarray([[5, 17, 33, 2], [250, 1, 9, 9], [7, 7, 7, 7]], jnp.int32)
    lengths = jnp.asarray([4, 2, 3], jnp.int32)
    active = jnp.asarray([True, False, True])
    key = jax.random.PRNGKey(0)

    @jax.jit  # one compile of the prefill and the round (op by op, each op compiles alone)
    def prefill_and_step(target, d):
        cache = KVCache.init(target.config, 3, 64)
        out, cache = model.append(target, cache, prompts, lengths, tap_layers=d.tap_layers)
        idx = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (3, 4))
        state = d.observe(d.init_state(target, 3, 64), out.taps, idx, idx < lengths[:, None])
        roots = jnp.argmax(model.logits(target, out.hidden[jnp.arange(3), lengths - 1]), -1).astype(jnp.int32)
        kw = dict(method="ddtree", budget=8, sampling=SamplingConfig())
        return cache, state, roots, decode.step(target, d, cache, state, roots, active, key, key, **kw)

    cache, state, roots, (new_cache, new_state, r) = prefill_and_step(target, d)
    assert r.tokens.shape == (3, bs) and r.first_nonfinite.tolist() == [bs] * 3
    assert not bool(jnp.any(r.draft_nonfinite))
    adv = np.asarray(new_cache.lengths - cache.lengths)
    assert adv[1] == 0 and adv[0] == int(r.length[0]) and adv[2] == int(r.length[2])
    np.testing.assert_array_equal(new_state.lengths - state.lengths, adv)
    np.testing.assert_array_equal(new_cache.c_kv[:, 1], cache.c_kv[:, 1])
    np.testing.assert_array_equal(new_state.k[:, 1], state.k[:, 1])
    # Its tokens are the target's greedy continuation, bonus included.
    ar = greedy("step", 1 + bs)
    for row in (0, 2):
        a = int(r.length[row])
        assert [int(roots[row]), *np.asarray(r.tokens[row, :a]).tolist()] == ar[row][: a + 1]


# The oracle test and the stop-token test share the oracle's configuration (block 6, budget 10,
# batch 3) and one max_new_tokens, 20 = 1 + 3 full blocks + 1 token of a fourth.
ORACLE = OracleDrafter(block_size=6)
ORACLE_KW = dict(tree_budget=10, max_new_tokens=20)


def test_oracle_accepts_full_blocks(target, greedy):
    """Every round accepts the whole block, the last one too (it counts its whole acceptance
    although max_new_tokens lets it emit only one of its tokens)."""
    bs = ORACLE.block_size
    for method in ("dflash", "ddtree"):
        res = run(target, ORACLE, PROMPTS["oracle"], method=method, stop_token_ids=(), **ORACLE_KW)
        assert res.to_lists() == greedy("oracle", 20)
        assert np.asarray(res.rounds).tolist() == [4, 4, 4]
        assert (np.asarray(res.accept_lengths)[:4] == bs).all()
        assert res.tau == bs


def test_rejected_trees_still_advance_one_token_per_round(target, greedy):
    res = run(
        target,
        RandomDrafter(block_size=4, scale=0.0),
        PROMPTS["rejected"],
        method="ddtree",
        tree_budget=3,
        max_new_tokens=12,
    )
    assert res.to_lists() == greedy("rejected", 12)
    acc = np.asarray(res.accept_lengths)
    rounds = np.asarray(res.rounds)
    for row in range(2):
        assert (acc[: rounds[row], row] >= 1).all()
    assert np.asarray(res.lengths).tolist() == [12, 12]


def test_batch_rows_equal_each_alone(target):
    """SWEEP's batch-3 DDTree(15) configuration, against each row alone (batch 1)."""
    prompts = PROMPTS["rows"]
    d = dflash_drafter(16, seed=16)
    kw = dict(method="ddtree", tree_budget=15, max_new_tokens=24, stop_token_ids=())
    batch = run(target, d, prompts, **kw)
    for i, p in enumerate(prompts):
        alone = run(target, d, [p], **kw)
        assert alone.to_lists()[0] == batch.to_lists()[i]
        assert np.asarray(alone.accept_lengths)[:, 0].tolist() == np.asarray(batch.accept_lengths)[:, i].tolist()


def test_stop_tokens_and_max_new_tokens_exact(target, greedy):
    """DDTree with a stop token and max_new_tokens 1 (no round), 7 (one full block; row 1's stop
    token is its last token) and 20 (the last round cut short) emits the AR greedy tokens cut
    after the first stop token and at max_new_tokens; so does AR (in the shared batched run's
    configuration: stop ids are data)."""
    prompts = PROMPTS["stop"]
    stop = greedy("stop", 20)[1][6]

    def cut(m):
        rows = greedy("stop", m)
        return [row[: row.index(stop) + 1] if stop in row else row for row in rows], [stop in row for row in rows]

    everyone = [p for ps in PROMPTS.values() for p in ps]
    first = everyone.index(prompts[0])
    ar = run(target, None, everyone, max_new_tokens=M_REF, stop_token_ids=[stop])
    want, stopped = cut(M_REF)
    assert ar.to_lists()[first : first + 3] == want
    assert np.asarray(ar.stopped)[first : first + 3].tolist() == stopped
    for m in (1, 7, 20):
        want, stopped = cut(m)
        kw = {**ORACLE_KW, "max_new_tokens": m}
        tr = run(target, ORACLE, prompts, method="ddtree", stop_token_ids=[stop], **kw)
        assert tr.to_lists() == want
        assert np.asarray(tr.stopped).tolist() == stopped
        assert stopped[1] == (m >= 7)
        assert max(len(r) for r in tr.to_lists()) <= m
        toks = np.asarray(tr.tokens)
        for i, n in enumerate(np.asarray(tr.lengths)):
            assert (toks[i, n:] == -1).all()


def test_smaller_block_than_the_drafters(target, greedy):
    d = dflash_drafter(16)
    res = run(target, d, PROMPTS["smaller"], method="ddtree", block_size=3, max_new_tokens=10, stop_token_ids=())
    assert res.to_lists() == greedy("smaller", 10)


# ---------------------------------------------------------------------------------
# Lossless sampling.


def chi2_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal z."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_joint(params, prompt, n_tokens, temperature):
    """P(t_1..t_n) under softmax(logits / T), from full forwards of every prefix."""
    from tests.test_model import full_forward

    v = params.config.vocab_size
    probs = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for seq, p in probs.items():
            lg, _ = full_forward(params, prompt + list(seq))
            x = np.asarray(lg[-1], np.float64) / temperature
            q = np.exp(x - x.max())
            q /= q.sum()
            for t in range(v):
                nxt[(*seq, t)] = p * float(q[t])
        probs = nxt
    return probs


def chi2_stat(samples: np.ndarray, probs: dict) -> tuple[float, int]:
    """Pearson statistic of sample tuples against probs, cells with expected < 5 pooled."""
    n = len(samples)
    counts = {}
    for row in map(tuple, samples.tolist()):
        counts[row] = counts.get(row, 0) + 1
    stat, pooled_o, pooled_e, cells = 0.0, 0, 0.0, 0
    for seq, p in probs.items():
        e, o = n * p, counts.get(seq, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / max(pooled_e, 1e-9)
        cells += 1
    return stat, cells - 1


LOSSLESS_ROWS = 6000
LOSSLESS_PROMPT = [1, 3, 0, 2]


def lossless_target():
    """A 2-layer target over a 4-token vocabulary: 64 joint outcomes of 3 tokens."""
    return random_target(tiny(vocab_size=4, num_hidden_layers=2), seed=5, std=0.4)


def lossless_samples(out: str) -> None:
    """The first 3 sampled tokens of LOSSLESS_ROWS rows under AR and two DDTree drafters, and
    DDTree's tau with the oracle drafter, saved to `out` (.npz). Run by `test_ddtree_sampling_is_lossless` in a
    subprocess on XLA:CPU's default fusion emitters (`conftest.default_emitters_env`: the legacy
    ones the suite compiles with make a batch this large slow)."""
    params = lossless_target()
    batch = np.repeat(np.asarray([LOSSLESS_PROMPT], np.int32), LOSSLESS_ROWS, axis=0)
    common = dict(max_new_tokens=3, temperature=1.0, stop_token_ids=())
    runs = {
        "ar": generate(params, batch, key=jax.random.key(1), **common),
        "ddtree": generate(
            params,
            OracleDrafter(block_size=4, confidence=2.0, noise=1.0),
            batch,
            method="ddtree",
            tree_budget=6,
            key=jax.random.key(2),
            **common,
        ),
        "ddtree_random": generate(
            params, RandomDrafter(block_size=3), batch, method="ddtree", tree_budget=4, key=jax.random.key(3), **common
        ),
    }
    arrays = {name: np.asarray(res.tokens)[:, :3] for name, res in runs.items()}
    np.savez(out, **arrays, ddtree_tau=np.float64(runs["ddtree"].tau))


def test_ddtree_sampling_is_lossless(tmp_path):
    """The first 3 sampled tokens follow the target's joint distribution, under AR and under DDTree.

    Target with a 4-token vocabulary (64 joint outcomes), 6000 samples per method,
    Pearson chi-square against the exact joint (computed by full forwards), cells
    with expected count < 5 pooled. Threshold: the 0.999 quantile (z = 3.09, Wilson-
    Hilferty), so a correct sampler fails one run in 1000 per check; keys are fixed,
    so the outcome is deterministic. Power check: the same samples against the
    distribution at a different temperature must be rejected.
    """
    out = tmp_path / "samples.npz"
    code = f"from tests.test_decode import lossless_samples; lossless_samples({str(out)!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=default_emitters_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = np.load(out)
    params = lossless_target()
    probs = exact_joint(params, LOSSLESS_PROMPT, 3, 1.0)
    wrong = exact_joint(params, LOSSLESS_PROMPT, 3, 1.6)
    for name in ("ar", "ddtree", "ddtree_random"):
        samples = runs[name]
        assert samples.shape == (LOSSLESS_ROWS, 3), name
        stat, df = chi2_stat(samples, probs)
        assert stat < chi2_quantile(df, 3.09), (name, stat, df)
        bad, df_bad = chi2_stat(samples, wrong)
        assert bad > chi2_quantile(df_bad, 3.09), (name, bad, df_bad)
    assert float(runs["ddtree_tau"]) > 1.2  # the trees did accept drafts


# ---------------------------------------------------------------------------------
# Bad inputs.


def test_bad_inputs(target):
    p = [[1, 2, 3]]
    d = dflash_drafter(4)
    with pytest.raises(ValueError, match="budget"):
        generate(target, d, p, method="ddtree", tree_budget=0)
    with pytest.raises(ValueError, match="budget"):
        generate(target, d, p, method="ddtree", tree_budget=2000)
    with pytest.raises(ValueError, match=r"block_size=8 .*drafter's block_size=4"):
        generate(target, d, p, method="ddtree", block_size=8)
    for bad, error in ((2.0, TypeError), (True, TypeError), (np.float32(3), TypeError), (0, ValueError)):
        with pytest.raises(error, match="budget"):
            generate(target, d, p, method="ddtree", tree_budget=bad)
    for bad in (3.0, True, np.bool_(True)):
        with pytest.raises(TypeError, match=rf"block_size must be an int, got {bad!r}"):
            generate(target, d, p, method="dflash", block_size=bad)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, p, method="ddtree")
    other = dataclasses.replace(TARGET_CFG, vocab_size=300)
    bad_vocab = dflash.init_params(dflash.drafter_config_for(other, block_size=4), jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match="vocab"):
        generate(target, bad_vocab, p, method="dflash")
    other = dataclasses.replace(TARGET_CFG, hidden_size=32)
    bad_hidden = dflash.init_params(dflash.drafter_config_for(other, block_size=4), jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match="hidden"):
        generate(target, bad_hidden, p, method="ddtree")
    with pytest.raises(TypeError, match="drafter"):
        generate(target, object(), p, method="ddtree")
