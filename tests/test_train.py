"""A few training steps lower the loss; the router bias follows load, not gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import drafter, train
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


def test_drafter_steps_lower_loss():
    cfg = tiny()
    target = random_target(cfg, seed=1)
    dcfg = drafter.drafter_config_for(cfg, num_hidden_layers=1, block_size=4)
    dparams = drafter.init_params(dcfg, jax.random.PRNGKey(0))
    opt = train.make_optimizer(train.OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=40), dparams)
    state = train.init_state(dparams, opt)
    step = jax.jit(functools.partial(train.drafter_train_step, optimizer=opt, gamma=4.0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(repetitive_batch(rng, 4, 24, cfg.vocab_size - 1))
    anchors = jnp.asarray(train.sample_anchors(rng, 4, 5, 0, 24 - 4))
    feats = train.target_features(target, tokens, dcfg.target_layer_ids)
    first = float(train.drafter_loss(dparams, target, feats, tokens, anchors, 4.0)[0])
    for _ in range(25):
        state, metrics = step(state, target, tokens, anchors)
    last = float(train.drafter_loss(state.params, target, feats, tokens, anchors, 4.0)[0])
    assert last < 0.6 * first, (first, last)
    assert 1.0 <= float(metrics["chain_accept"]) <= dcfg.block_size


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
    hidden = train._sequence_forward(target, tokens).hidden
    teacher = train.teacher_logprobs(target, hidden, anchors, bs)
    assert teacher.shape == (2, 3, bs - 1, cfg.vocab_size)
    want = jnp.take_along_axis(tokens[:, None, :], anchors[:, :, None] + jnp.arange(1, bs), axis=2)
    assert np.array_equal(np.asarray(jnp.argmax(teacher, axis=-1)), np.asarray(want))
    np.testing.assert_allclose(np.exp(np.asarray(teacher)).sum(-1), 1.0, rtol=1e-5)


def test_soft_label_loss():
    cfg = tiny()
    target = random_target(cfg, seed=4)
    dcfg = drafter.drafter_config_for(cfg, num_hidden_layers=1, block_size=4)
    dparams = drafter.init_params(dcfg, jax.random.PRNGKey(2))
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(repetitive_batch(rng, 2, 16, cfg.vocab_size - 1))
    anchors = jnp.asarray(train.sample_anchors(rng, 2, 3, 0, 16 - 4))
    out = train._sequence_forward(target, tokens, dcfg.target_layer_ids)
    feats = drafter.tap_features(out.taps)
    teacher = train.teacher_logprobs(target, out.hidden, anchors, 4)
    hard = train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0)[0]
    assert float(train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0, teacher, 0.0)[0]) == float(hard)
    soft, aux = train.drafter_loss(dparams, target, feats, tokens, anchors, 3.0, teacher, 1.0)
    # Against a direct computation of the weighted KL(teacher || drafter).
    lg = drafter.train_logits(dparams, target.embed, target.unembed, feats, tokens, anchors)
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
    cfg = tiny()
    target = random_target(cfg, seed=5)
    dcfg = drafter.drafter_config_for(cfg, num_hidden_layers=1, block_size=4)
    dparams = drafter.init_params(dcfg, jax.random.PRNGKey(3))
    opt = train.make_optimizer(train.OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=30), dparams)
    state = train.init_state(dparams, opt)
    step = jax.jit(functools.partial(train.drafter_train_step, optimizer=opt, gamma=4.0, distill_weight=0.5))
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(repetitive_batch(rng, 4, 24, cfg.vocab_size - 1))
    anchors = jnp.asarray(train.sample_anchors(rng, 4, 5, 0, 24 - 4))
    kls = [float(step(state, target, tokens, anchors)[1]["kl"])]
    for _ in range(20):
        state, metrics = step(state, target, tokens, anchors)
    kls.append(float(metrics["kl"]))
    assert kls[-1] < 0.7 * kls[0], kls


def test_block_weights():
    w = np.asarray(train.block_weights(16, 7.0))
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w[7], np.exp(-1.0), rtol=1e-6)
