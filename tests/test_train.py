"""A few training steps lower the loss; the router bias follows load, not gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

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


def test_block_weights():
    w = np.asarray(train.block_weights(16, 7.0))
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w[7], np.exp(-1.0), rtol=1e-6)
