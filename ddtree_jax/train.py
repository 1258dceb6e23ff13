"""Training steps for the target (next-token LM) and the DFlash drafter (self-distillation).

Notation: B batch, T sequence length, A anchors per sequence, bs block size,
V vocab, E experts, Lm MoE layers.

The target's router bias (e_score_correction_bias) gets no gradient: it is moved
after every step towards balanced expert load, DeepSeek-V3's auxiliary-loss-free
rule b_e -= u * sign(load_e - mean load).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization, struct

from ddtree_jax.cache import KVCache
from ddtree_jax.drafters import dflash
from ddtree_jax.hf import CheckpointError, orbax_error
from ddtree_jax.model import ForwardOutput, TargetParams, cast_params, causal_mask, forward, logits


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay to `final_fraction` of the peak."""

    learning_rate: float = 3e-3
    warmup_steps: int = 100
    total_steps: int = 2000
    final_fraction: float = 0.1
    weight_decay: float = 0.1
    b2: float = 0.95
    clip_norm: float = 1.0


@struct.dataclass
class TrainState:
    """Everything a training run carries from step to step (orbax-saveable)."""

    step: jax.Array
    params: object
    opt_state: object


def _is_matrix(params):
    return jax.tree.map(lambda a: a.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, params, frozen=None) -> optax.GradientTransformation:
    """AdamW (decay on matrices only); leaves marked True in `frozen` are never updated."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.learning_rate,
        cfg.warmup_steps,
        max(cfg.total_steps, cfg.warmup_steps + 1),
        cfg.learning_rate * cfg.final_fraction,
    )
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=_is_matrix(params)),
    )
    if frozen is None:
        return adamw
    labels = jax.tree.map(lambda f: "frozen" if f else "train", frozen)
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, labels)


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


# ----------------------------------------------------------------------------------
# Target


def router_bias_mask(params: TargetParams):
    """True at the router-bias leaf (not trained by gradient), False elsewhere."""
    mask = jax.tree.map(lambda _: False, params)
    if params.moe_layers is None:
        return mask
    mlp = mask.moe_layers.mlp.replace(router_bias=True)
    return mask.replace(moe_layers=mask.moe_layers.replace(mlp=mlp))


def _sequence_forward(
    params: TargetParams, tokens: jax.Array, tap_layers: tuple[int, ...] = (), tap_final_norm: bool = True
) -> ForwardOutput:
    """Causal forward of whole sequences [B, T] from position 0 with nothing committed."""
    b, t = tokens.shape
    cache = KVCache.init(params.config, b, 1, params.dtype)  # one slot, never visible (lengths 0)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = causal_mask(jnp.full((b,), t, jnp.int32), t)
    # "fast": training needs gradients and speed, not decode-time bitwise invariance.
    return forward(
        params, tokens, positions, cache, mask, tap_layers=tap_layers, tap_final_norm=tap_final_norm, numerics="fast"
    )


def target_loss(params: TargetParams, tokens: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Mean next-token NLL of tokens [B, T + 1] (positions 0..T-1 predict 1..T), and expert counts [Lm, E]."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    out = _sequence_forward(params, inputs)
    logp = jax.nn.log_softmax(logits(params, out.hidden, numerics="fast"), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return jnp.mean(nll), out.expert_counts


def repeated_ngram_mask(tokens: jax.Array, n: int = 4) -> jax.Array:
    """[B, T] bool: token t completes an n-gram (t-n+1 .. t) that also ends at some s < t.

    Issue 17's repetition figure (`experiments/chain_misses.py`); positions t < n - 1
    complete no n-gram.
    """
    b, t = tokens.shape
    same = jnp.ones((b, t, t), bool)  # [B, t, s]: the n-grams ending at t and at s are equal
    for k in range(n):
        shifted = jnp.pad(tokens, ((0, 0), (k, 0)), constant_values=-1)[:, :t]  # token at position - k
        same &= shifted[:, :, None] == shifted[:, None, :]
    pos = jnp.arange(t)
    earlier = (pos[None, :] < pos[:, None]) & (pos[None, :] >= n - 1)  # [t, s]
    return jnp.any(same & earlier[None], axis=-1) & (pos >= n - 1)[None]


def _next_token_logprobs(params: TargetParams, tokens: jax.Array) -> jax.Array:
    """[B, T - 1, V] float32 log-probs of each next token of tokens [B, T]."""
    out = _sequence_forward(params, tokens[:, :-1])
    return jax.nn.log_softmax(logits(params, out.hidden, numerics="fast").astype(jnp.float32), axis=-1)


def unlikelihood_loss(
    params: TargetParams,
    tokens: jax.Array,
    continuation: jax.Array,
    n: int = 4,
    reference: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sequence-level unlikelihood (Welleck et al., 2019) of the model's own text [B, T].

    At every position of `continuation` ([B, T] bool, the generated part) whose token
    completes an n-gram already in the text, the loss is -log(1 - p(token | prefix)):
    it lowers the probability of entering and staying in a loop.

    Pushed down alone, a repeated token's probability can go to any other token, and a
    small model learns a few junk tokens that break every loop. `reference` ([B, T - 1, V]
    log-probs of a frozen model on the same text, e.g. the weights before this training)
    says where it should go: the KL term is KL(q || p) at every continuation position, q
    being the reference's distribution with the repeated token (where there is one)
    removed and the rest renormalized, so the model keeps the reference's other choices.

    Returns:
      The unlikelihood summed over repeated positions, the share of continuation tokens
      that repeat an n-gram, and the KL term (0 without `reference`), each divided by the
      number of continuation positions.
    """
    lp_all = _next_token_logprobs(params, tokens)
    labels = tokens[:, 1:]
    lp = jnp.take_along_axis(lp_all, labels[..., None], axis=-1)[..., 0]  # [B, T-1] log p of each next token
    counted = continuation[:, 1:]
    repeated = repeated_ngram_mask(tokens, n)[:, 1:] & counted
    # log(1 - p) = log(-expm1(log p)); p within float32 rounding of 1 is held at 1 - 1e-6.
    penalty = -jnp.log(jnp.maximum(-jnp.expm1(lp), 1e-6))
    total = jnp.maximum(jnp.sum(counted), 1)
    kl = jnp.zeros((), jnp.float32)
    if reference is not None:
        ref = jax.lax.stop_gradient(reference)
        drop = repeated[..., None] & (jnp.arange(ref.shape[-1]) == labels[..., None])  # [B, T-1, V]
        q = jax.nn.log_softmax(jnp.where(drop, -1e30, ref), axis=-1)  # finite: no NaN in the masked terms
        per_position = jnp.sum(jnp.where(drop, 0.0, jnp.exp(q) * (q - lp_all)), axis=-1)
        kl = jnp.sum(jnp.where(counted, per_position, 0.0)) / total
    return jnp.sum(jnp.where(repeated, penalty, 0.0)) / total, jnp.sum(repeated) / total, kl


def target_train_step(
    state: TrainState,
    tokens: jax.Array,
    optimizer: optax.GradientTransformation,
    bias_rate: float = 1e-3,
    compute_dtype=None,
    generated: jax.Array | None = None,
    continuation: jax.Array | None = None,
    unlikelihood_weight: float = 0.0,
    reference: TargetParams | None = None,
    anchor_weight: float = 0.0,
) -> tuple[TrainState, dict]:
    """One optimizer step on tokens [B, T + 1], then the router-bias balance update.

    With `compute_dtype` (e.g. bfloat16) the forward runs on a cast copy of the
    float32 master weights (router kept float32); gradients flow back to the master.
    With `unlikelihood_weight` > 0 the loss adds that times `unlikelihood_loss` of
    `generated` [B2, T2] (the model's own continuations; `continuation` [B2, T2] marks
    the generated positions); with `anchor_weight` > 0 also that times its KL term against
    the frozen `reference` weights (run in `compute_dtype` like the model). The router bias
    follows the data batch's load only.
    """
    if unlikelihood_weight and (generated is None or continuation is None):
        raise ValueError(f"unlikelihood_weight={unlikelihood_weight} needs generated text and its continuation mask")
    if anchor_weight and (not unlikelihood_weight or reference is None):
        raise ValueError(f"anchor_weight={anchor_weight} needs unlikelihood_weight > 0 and reference weights")
    ref_logp = None
    if anchor_weight:
        ref = cast_params(reference, compute_dtype) if compute_dtype is not None else reference
        ref_logp = _next_token_logprobs(ref, generated)

    def loss_fn(params, tokens):
        if compute_dtype is not None:
            params = cast_params(params, compute_dtype)
        nll, counts = target_loss(params, tokens)
        aux = {"counts": counts}
        if not unlikelihood_weight:
            return nll, aux
        ul, rate, kl = unlikelihood_loss(params, generated, continuation, reference=ref_logp)
        loss = nll + unlikelihood_weight * ul + anchor_weight * kl
        return loss, {**aux, "nll": nll, "unlikelihood": ul, "repeat_rate": rate, "anchor_kl": kl}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, tokens)
    counts = aux.pop("counts")
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), **aux}
    if counts is not None:
        load = counts / jnp.sum(counts, axis=-1, keepdims=True)  # [Lm, E] fraction of routed pairs
        mlp = params.moe_layers.mlp
        bias = mlp.router_bias - bias_rate * jnp.sign(load - jnp.mean(load, axis=-1, keepdims=True))
        params = params.replace(moe_layers=params.moe_layers.replace(mlp=mlp.replace(router_bias=bias)))
        metrics["max_load"] = jnp.max(load) * load.shape[-1]  # 1.0 = perfectly balanced
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


# ----------------------------------------------------------------------------------
# Drafter


def block_weights(block_size: int, gamma: float) -> jax.Array:
    """DFlash's loss weights exp(-(k - 1) / gamma) for block slots k = 1 .. bs - 1."""
    k = jnp.arange(1, block_size, dtype=jnp.float32)
    return jnp.exp(-(k - 1) / gamma)


def target_outputs(
    target: TargetParams, tokens: jax.Array, tap_layers: tuple[int, ...], tap_final_norm: bool = True
) -> tuple[jax.Array, jax.Array]:
    """One frozen target pass over whole sequences [B, T]: the drafter's conditioning
    features [B, T, n_taps * H] and the final hidden states [B, T, H] (for
    `teacher_logprobs`), both without gradient."""
    out = _sequence_forward(target, tokens, tap_layers, tap_final_norm)
    return jax.lax.stop_gradient((dflash.tap_features(out.taps), out.hidden))


def teacher_logprobs(target: TargetParams, hidden: jax.Array, anchors: jax.Array, block_size: int) -> jax.Array:
    """The target's own next-token log-probs [B, A, bs-1, V] for every drafted slot.

    Slot k (1..bs-1) of the block anchored at a predicts position a + k, so its
    teacher is the target's distribution after position a + k - 1. hidden: [B, T, H]
    final hidden states of the target over the sequences (`target_outputs`).
    """
    pos = anchors[:, :, None] + jnp.arange(block_size - 1)[None, None, :]  # [B, A, bs-1]
    h = jnp.take_along_axis(hidden[:, None, :, :], pos[..., None], axis=2)  # [B, A, bs-1, H]
    return jax.lax.stop_gradient(jax.nn.log_softmax(logits(target, h, numerics="fast").astype(jnp.float32), axis=-1))


def drafter_loss(
    params: dflash.DrafterParams,
    target: TargetParams,
    features: jax.Array,  # [B, T, F]
    tokens: jax.Array,  # [B, T]
    anchors: jax.Array,  # [B, A]
    gamma: float,
    teacher: jax.Array | None = None,  # [B, A, bs-1, V] log-probs
    distill_weight: float = 0.0,
) -> tuple[jax.Array, dict]:
    """Weighted loss of every anchored block against the continuation.

    Per slot: (1 - distill_weight) * cross-entropy with the continuation's token +
    distill_weight * KL(teacher || drafter), where `teacher` is `teacher_logprobs`
    (required when distill_weight > 0). Slots are weighted exp(-(k - 1) / gamma).
    """
    bs = params.config.block_size
    lg = dflash.train_logits(params, target.embed, target.unembed, features, tokens, anchors)  # [B, A, bs-1, V]
    idx = anchors[:, :, None] + jnp.arange(1, bs)[None, None, :]
    labels = jnp.take_along_axis(tokens[:, None, :], idx, axis=2)  # [B, A, bs-1]
    logp = jax.nn.log_softmax(lg, axis=-1)
    per_slot = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    aux = {}
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    if distill_weight:
        if teacher is None:
            raise ValueError(f"distill_weight={distill_weight} needs the teacher's log-probs")
        kl = jnp.sum(jnp.exp(teacher) * (teacher - logp), axis=-1)
        per_slot = (1.0 - distill_weight) * per_slot + distill_weight * kl
        aux["kl"] = jnp.mean(kl)
    w = block_weights(bs, gamma)
    loss = jnp.sum(per_slot * w) / (per_slot.shape[0] * per_slot.shape[1] * jnp.sum(w))
    hit = (jnp.argmax(lg, axis=-1) == labels).astype(jnp.float32)
    # Expected accepted drafts of a DFlash chain: the run of leading correct slots.
    run = jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1)
    return loss, {"top1": jnp.mean(hit[..., 0]), "chain_accept": jnp.mean(run) + 1.0, **aux}


def drafter_train_step(
    state: TrainState,
    target: TargetParams,
    tokens: jax.Array,
    anchors: jax.Array,
    optimizer: optax.GradientTransformation,
    gamma: float,
    distill_weight: float = 0.0,
) -> tuple[TrainState, dict]:
    """One drafter step: the frozen target's features (and, with distill_weight, its
    next-token distributions as soft labels), the weighted block loss, AdamW."""
    cfg = state.params.config
    features, hidden = target_outputs(target, tokens, cfg.target_layer_ids, cfg.tap_final_norm)
    teacher = None
    if distill_weight:
        teacher = teacher_logprobs(target, hidden, anchors, state.params.config.block_size)
    (loss, aux), grads = jax.value_and_grad(drafter_loss, has_aux=True)(
        state.params, target, features, tokens, anchors, gamma, teacher, distill_weight
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), {"loss": loss, **aux}


def steps_that_fit(run_step, budget_s: float, probe: int = 12) -> tuple[int, float]:
    """How many calls of `run_step()` fit in `budget_s` seconds, from timing `probe` calls.

    The first call (compilation) is not counted. Returns (steps, seconds per step).
    """
    run_step()
    times = []
    for _ in range(probe):
        t0 = time.perf_counter()
        run_step()
        times.append(time.perf_counter() - t0)
    per_step = float(np.median(times))
    return max(1, int(budget_s / per_step)), per_step


def sample_anchors(rng: np.random.Generator, batch: int, anchors: int, low, high: int) -> np.ndarray:
    """[batch, anchors] int32 anchor positions drawn uniformly from [low, high].

    low: an int, or one per row ([batch]; rows whose prompts differ in length).
    """
    low = np.asarray(low)
    if np.any(high < low):
        raise ValueError(f"no room for anchors: low={low.max()} > high={high}")
    if low.ndim:
        low = low[:, None]
    return rng.integers(low, high + 1, size=(batch, anchors)).astype(np.int32)


# ----------------------------------------------------------------------------------
# Resumable checkpoints


def checkpoint_manager(path: str, max_to_keep: int = 2):
    """An orbax CheckpointManager for TrainStates under `path`."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save_state(manager, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    manager.save(int(state.step), args=ocp.args.StandardSave(serialization.to_state_dict(state)))


def restore_latest(manager, template: TrainState) -> TrainState | None:
    """The newest saved state (shaped like `template`), or None if there is none.

    Raises:
      CheckpointError: the newest step's folder (named) cannot be restored into `template`:
        damaged files, or the state of another run (another preset, model or optimizer).
    """
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), serialization.to_state_dict(template))
    try:
        restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except Exception as e:  # orbax raises ValueErrors, FileNotFoundErrors and (TensorStore) bare Exceptions
        raise CheckpointError(
            f"the training state saved in {manager.directory / str(step)} cannot be restored ({orbax_error(e)}): "
            "its files are damaged or it is another run's (another preset, model or optimizer); remove that "
            "folder to resume from an earlier step or start over, or train into another folder"
        ) from None
    return serialization.from_state_dict(template, restored)
