"""A few training steps lower the loss; the router bias follows load, not gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import train
from ddtree_jax.drafters import dflash
from tests.conftest import random_target, tiny


def repetitive_batch(rng, b, t, v):
    """Sequences of short repeated motifs: learnable in a handful of steps."""
    motifs = rng.integers(0, v, size=(b, 4))
    return np.tile(motifs, (1, t // 4 + 1))[:, :t].astype(np.int32)


def test_target_steps_lower_loss_and_balance_router():
    cfg = tiny()
    params = random_target(cfg, seed=0, std=0.05)
    opt_cfg = train.OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=40)
    opt = train.make_optimizer(opt_cfg, params, frozen=train.router_bias_mask(params))
    state = train.init_state(params, opt)
    step = jax.jit(functools.partial(train.target_train_step, optimizer=opt, bias_rate=1e-2))
    rng = np.random.default_rng(0)
    data = jnp.asarray(repetitive_batch(rng, 8, 33, cfg.vocab_size))
    first = float(train.target_loss(params, data)[0])
    bias0 = np.asarray(params.moe_layers.mlp.router_bias)
    for _ in range(25):
        state, metrics = step(state, data)
    last = float(train.target_loss(state.params, data)[0])
    assert last < 0.6 * first, (first, last)
    # The bias moved by exactly +-bias_rate per step in the direction of under-loaded experts.
    moved = np.asarray(state.params.moe_layers.mlp.router_bias) - bias0
    assert np.abs(moved).max() > 0
    steps = moved / 1e-2
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)  # whole +-bias_rate steps only
    assert float(metrics["max_load"]) >= 1.0


def test_repeated_ngram_mask_matches_a_set_of_seen_ngrams():
    """The mask that the unlikelihood loss trains on and issue 17's figure counts
    (`chain_misses.repeated_ngrams`): token t completes an n-gram already seen."""

    def seen_before(row, n):  # the obvious loop: a set of the n-grams ending before t
        seen, out = set(), np.zeros(len(row), bool)
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1 : t + 1].tolist())
            out[t] = gram in seen
            seen.add(gram)
        return out

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 3, size=(6, 40)).astype(np.int32)  # 3 symbols: many repeats, many not
    for n in (2, 4):
        mask = np.asarray(train.repeated_ngram_mask(jnp.asarray(tokens), n))
        want = np.stack([seen_before(row, n) for row in tokens])
        np.testing.assert_array_equal(mask, want)
        assert 0 < want.mean() < 1


def test_unlikelihood_steps_make_the_models_loop_less_likely():
    """Steps on the MLE data plus the unlikelihood of a looping continuation lower that
    loop's probability, and the KL anchor sends the mass to the reference's next choice."""
    cfg = tiny()
    params = random_target(cfg, seed=2, std=0.05)
    rng = np.random.default_rng(4)
    data = jnp.asarray(rng.integers(4, cfg.vocab_size, size=(4, 33)).astype(np.int32))
    loop = jnp.asarray(repetitive_batch(rng, 4, 24, cfg.vocab_size))  # the "generated" text: a 4-token loop
    continuation = jnp.broadcast_to(jnp.arange(24) >= 8, loop.shape)
    marked = train.repeated_ngram_mask(loop)[:, 1:] & continuation[:, 1:]
    opt = train.make_optimizer(train.OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=40), params)
    logprobs = jax.jit(train._next_token_logprobs)
    ul_loss = jax.jit(train.unlikelihood_loss)

    # First the model learns the loop (plain MLE on it), then unlikelihood steps unlearn it.
    mle = jax.jit(functools.partial(train.target_train_step, optimizer=opt, bias_rate=0.0))
    state = train.init_state(params, opt)
    for _ in range(20):
        state, _ = mle(state, jnp.concatenate([loop, loop[:, :9]], axis=1))
    looping = state.params
    ref = logprobs(looping, loop)  # [4, 23, V]
    repeated_lp = jnp.take_along_axis(ref, loop[:, 1:, None], -1)[..., 0]
    assert float(jnp.mean(repeated_lp[marked])) > -1.0
    first_ul, rate, kl = ul_loss(looping, loop, continuation, reference=ref)
    assert float(rate) == pytest.approx(1.0)  # every continuation token of a 4-token loop repeats a 4-gram
    # Against itself, q is p without the repeated token: KL(q || p) = -log(1 - p) there, 0 elsewhere.
    np.testing.assert_allclose(float(kl), float(first_ul), rtol=1e-4)

    def unlearn(anchor_weight):
        step = functools.partial(
            train.target_train_step, optimizer=opt, bias_rate=0.0, unlikelihood_weight=1.0, anchor_weight=anchor_weight
        )
        jitted, state = jax.jit(step), train.init_state(looping, opt)
        for _ in range(15):
            state, metrics = jitted(state, data, generated=loop, continuation=continuation, reference=looping)
        return state.params, metrics

    plain, _ = unlearn(0.0)
    anchored, metrics = unlearn(1.0)
    assert set(metrics) >= {"nll", "unlikelihood", "repeat_rate", "anchor_kl"}
    for p in (plain, anchored):
        ul, _, kl = ul_loss(p, loop, continuation, reference=ref)
        assert float(ul) < 0.5 * float(first_ul)
        assert float(jnp.mean(jnp.take_along_axis(logprobs(p, loop), loop[:, 1:, None], -1)[..., 0][marked])) < -2.0
    # The anchor keeps the rest of the distribution near the reference's.
    kl_plain = float(ul_loss(plain, loop, continuation, reference=ref)[2])
    kl_anchored = float(ul_loss(anchored, loop, continuation, reference=ref)[2])
    assert kl_anchored < 0.7 * kl_plain, (kl_anchored, kl_plain)
    with pytest.raises(ValueError, match=r"unlikelihood_weight=0\.5 needs generated text"):
        train.target_train_step(state, data, opt, unlikelihood_weight=0.5)  # no text given
    with pytest.raises(ValueError, match=r"anchor_weight=1\.0 needs unlikelihood_weight > 0 and reference"):
        train.target_train_step(state, data, opt, anchor_weight=1.0)


def test_dense_experts_train_like_routed_ones(monkeypatch):
    """`train_target.py --dense-experts` (every expert on every token): the loss and every
    gradient of the routed path, up to float32 summation order."""
    from ddtree_jax.pallas.moe import reference

    cfg = tiny()
    params = random_target(cfg, seed=5, std=0.05)
    data = jnp.asarray(repetitive_batch(np.random.default_rng(1), 4, 33, cfg.vocab_size))  # 128 tokens a batch

    def loss_and_grads(grouped: bool):  # a new function each time: jit's cache does not see the constant
        fn = jax.value_and_grad(lambda p: train.target_loss(p, data)[0])
        assert ("ragged_dot" in str(jax.make_jaxpr(fn)(params))) == grouped
        return jax.jit(fn)(params)

    monkeypatch.setattr(reference, "DENSE_MAX_TOKENS", 0)
    routed = loss_and_grads(grouped=True)
    monkeypatch.setattr(reference, "DENSE_MAX_TOKENS", 1 << 30)
    dense = loss_and_grads(grouped=False)
    np.testing.assert_allclose(dense[0], routed[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(dense[1]), jax.tree.leaves(routed[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(routed[1].moe_layers.mlp.gate)).max() > 0  # the experts do get gradients


def drafter_case(target_seed, drafter_seed, data_seed, b, t, anchors):
    """A tiny target, a 1-layer block-4 drafter for it, and a repetitive batch with anchors."""
    cfg = tiny()
    target = random_target(cfg, seed=target_seed)
    dcfg = dflash.drafter_config_for(cfg, num_hidden_layers=1, block_size=4)
    dparams = dflash.init_params(dcfg, jax.random.PRNGKey(drafter_seed))
    rng = np.random.default_rng(data_seed)
    tokens = jnp.asarray(repetitive_batch(rng, b, t, cfg.vocab_size - 1))
    return target, dparams, tokens, jnp.asarray(train.sample_anchors(rng, b, anchors, 0, t - 4))


def drafter_stepper(dparams, total_steps, **kw):
    """(initial TrainState, jitted drafter_train_step) with AdamW 3e-3."""
    opt_cfg = train.OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=total_steps)
    opt = train.make_optimizer(opt_cfg, dparams)
    step = jax.jit(functools.partial(train.drafter_train_step, optimizer=opt, gamma=4.0, **kw))
    return train.init_state(dparams, opt), step


def test_drafter_steps_lower_loss():
    target, dparams, tokens, anchors = drafter_case(1, 0, 1, 4, 24, 5)
    state, step = drafter_stepper(dparams, 40)
    feats, _ = train.target_outputs(target, tokens, dparams.config.target_layer_ids)
    first = float(train.drafter_loss(dparams, target, feats, tokens, anchors, 4.0)[0])
    for _ in range(25):
        state, metrics = step(state, target, tokens, anchors)
    last = float(train.drafter_loss(state.params, target, feats, tokens, anchors, 4.0)[0])
    assert last < 0.6 * first, (first, last)
    assert 1.0 <= float(metrics["chain_accept"]) <= dparams.config.block_size


def test_teacher_aligns_with_self_distilled_tokens():
    """On the target's own greedy continuation, the teacher's argmax at slot k is the token at a + k."""
    from ddtree_jax.generate import generate

    cfg = tiny()
    target = random_target(cfg, seed=3)
    prompts = np.random.default_rng(3).integers(4, cfg.vocab_size, size=(2, 6)).astype(np.int32)
    cont = generate(target, prompts, max_new_tokens=14, stop_token_ids=())
    tokens = jnp.asarray(np.concatenate([prompts, np.asarray(cont.tokens)], axis=1))  # [2, 20]
    bs = 5
    anchors = jnp.asarray([[5, 9, 15], [6, 10, 11]], jnp.int32)  # continuation starts at 6
    _, hidden = train.target_outputs(target, tokens, (0,))
    teacher = train.teacher_logprobs(target, hidden, anchors, bs)
    assert teacher.shape == (2, 3, bs - 1, cfg.vocab_size)
    want = jnp.take_along_axis(tokens[:, None, :], anchors[:, :, None] + jnp.arange(1, bs), axis=2)
    assert np.array_equal(np.asarray(jnp.argmax(teacher, axis=-1)), np.asarray(want))
    np.testing.assert_allclose(np.exp(np.asarray(teacher)).sum(-1), 1.0, rtol=1e-5)


def test_soft_label_loss():
    target, dparams, tokens, anchors = drafter_case(4, 2, 4, 2, 16, 3)
    feats, hidden = train.target_outputs(target, tokens, dparams.config.target_layer_ids)
    teacher = train.teacher_logprobs(target, hidden, anchors, 4)
    hard = train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0)[0]
    assert float(train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0, teacher, 0.0)[0]) == float(hard)
    soft, aux = train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0, teacher, 1.0)
    # Against a direct computation of the weighted KL(teacher || drafter).
    lg = dflash.train_logits(dparams, target.embed, target.unembed, feats, tokens, anchors)
    logp = np.asarray(jax.nn.log_softmax(lg, axis=-1), np.float64)
    t = np.asarray(teacher, np.float64)
    kl = (np.exp(t) * (t - logp)).sum(-1)  # [B, A, 3]
    w = np.exp(-np.arange(3) / 3.0)
    np.testing.assert_allclose(float(soft), (kl * w).sum() / (2 * 3 * w.sum()), rtol=1e-4)
    assert float(aux["kl"]) > 0
    with pytest.raises(ValueError, match=r"distill_weight=0\.5"):
        train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0, None, 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 1\.5"):
        train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0, teacher, 1.5)


def test_drafter_steps_with_soft_labels_lower_kl():
    target, dparams, tokens, anchors = drafter_case(5, 3, 5, 4, 24, 5)
    state, step = drafter_stepper(dparams, 30, distill_weight=0.5)
    kls = [float(step(state, target, tokens, anchors)[1]["kl"])]
    for _ in range(20):
        state, metrics = step(state, target, tokens, anchors)
    kls.append(float(metrics["kl"]))
    assert kls[-1] < 0.7 * kls[0], kls


def test_block_weights():
    w = np.asarray(train.block_weights(16, 7.0))
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w[7], np.exp(-1.0), rtol=1e-6)


def test_sample_anchors_per_row_lower_bounds():
    rng = np.random.default_rng(0)
    low = np.asarray([0, 10, 20])
    a = train.sample_anchors(rng, 3, 500, low, 25)
    assert a.shape == (3, 500) and a.dtype == np.int32
    assert [int(r.min()) for r in a] == [0, 10, 20] and int(a.max()) == 25
    assert train.sample_anchors(rng, 2, 4, 7, 7).tolist() == [[7] * 4] * 2
    with pytest.raises(ValueError, match="low=30 > high=25"):
        train.sample_anchors(rng, 2, 4, np.asarray([0, 30]), 25)


def test_restore_latest_names_a_damaged_or_foreign_state(tmp_path):
    """A resumed run met orbax's own errors: another run's state (another preset) was a shape
    ValueError naming no folder, a step folder whose arrays are gone 'Must provide `args` of type
    `Composite`', a truncated array file a bare Exception carrying TensorStore's spec."""
    import shutil

    from ddtree_jax.hf import CheckpointError

    def state(width):
        params = {"w": jnp.ones((2, width)), "b": jnp.zeros(width)}
        return train.TrainState(step=jnp.asarray(3, jnp.int32), params=params, opt_state=())

    manager = train.checkpoint_manager(str(tmp_path / "ck"))
    train.save_state(manager, state(4))
    manager.wait_until_finished()
    restored = train.restore_latest(train.checkpoint_manager(str(tmp_path / "ck")), state(4))
    assert int(restored.step) == 3 and restored.params["w"].shape == (2, 4)
    with pytest.raises(CheckpointError, match=r"saved in .*ck/3 cannot be restored \(.*shape.*another run"):
        train.restore_latest(train.checkpoint_manager(str(tmp_path / "ck")), state(5))
    biggest = max((p for p in (tmp_path / "ck" / "3").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"saved in .*ck/3 cannot be restored.*damaged") as error:
        train.restore_latest(train.checkpoint_manager(str(tmp_path / "ck")), state(4))
    assert "TensorStore" not in str(error.value)  # its spec, cut mid-way, named nothing
    shutil.rmtree(tmp_path / "ck" / "3" / "default")
    with pytest.raises(CheckpointError, match=r"saved in .*ck/3 cannot be restored.*damaged"):
        train.restore_latest(train.checkpoint_manager(str(tmp_path / "ck")), state(4))
