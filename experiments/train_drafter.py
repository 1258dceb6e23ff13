"""Train a DFlash drafter against a trained target by self-distillation.

    python experiments/train_drafter.py --data data --target out/target --out out/drafter_run --steps 3000

1. Prompts: random windows of the train split; the target's own greedy
   continuations of them (batched `generate`; --sample-fraction of them sampled at
   T=1 instead) are the training data. Several
   --prompt-len values split the prompts evenly between those lengths; every
   sequence is max(--prompt-len) + --gen-len tokens (shorter prompts get longer
   continuations), and anchors fall in each row's own continuation.
2. DFlash recipe: random anchors in the response, blocks of `block_size`
   ([anchor, MASK ...], bidirectional inside, context strictly before the anchor),
   cross-entropy weighted exp(-(k-1)/gamma).
3. Every --eval-every steps: tau of DFlash and DDTree decoding on validation prompts.
Writes OUT/drafter (HF format, bf16; the final weights), OUT/drafter_best (the weights of
the eval with the highest DFlash-chain tau), OUT/drafter_loss.png, OUT/drafter_metrics.json,
OUT/distill.npy (+ OUT/distill_prompt_lens.npy); resumable orbax states under OUT/ckpt_drafter.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import _loop
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ddtree_jax import checkpoint, compile_cache, train
from ddtree_jax.config import ConfigError
from ddtree_jax.data import Tokenizer, prompt_windows
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate


def distill(
    target, prompts: np.ndarray, gen_len: int, batch: int, temperature: float = 0.0, seed: int = 0
) -> np.ndarray:
    """[N, P + gen_len] prompt + the target's continuation (greedy, or sampled at `temperature`; no stop token)."""
    out = []
    desc = "self-distillation" + (f" (T={temperature:g})" if temperature else "")
    for i in tqdm(range(0, len(prompts), batch), desc=desc, mininterval=5):
        chunk = prompts[i : i + batch]
        key = jax.random.PRNGKey(seed + i)
        res = generate(target, chunk, max_new_tokens=gen_len, stop_token_ids=(), temperature=temperature, key=key)
        out.append(np.concatenate([chunk, np.asarray(res.tokens)], axis=1))
    return np.concatenate(out).astype(np.int32)


def save_atomically(path: str, array: np.ndarray) -> None:
    """np.save through a temporary file: a run killed mid-write leaves no truncated `path` behind."""
    tmp = path + ".tmp.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def reuse_distilled(distill_path: str, starts_path: str, args, counts: np.ndarray, vocab_size: int):
    """(sequences, prompt lengths) of an earlier run's distillation data in --out; exits naming the
    file if it cannot be read, was made with other --prompts / --prompt-len / --gen-len (another
    run's folder: it used to be trained on as it was) or holds ids outside the target's vocabulary."""
    redo = f"remove {distill_path} to distill anew, or train into another --out"
    try:
        seqs = np.load(distill_path)
        starts = np.load(starts_path) if os.path.exists(starts_path) else None
    except (ValueError, OSError, EOFError) as e:
        sys.exit(f"error: {distill_path} cannot be read ({e}); {redo}")
    want = np.repeat(np.asarray(args.prompt_len), counts)
    if starts is None:
        if len(args.prompt_len) > 1:
            sys.exit(f"error: {distill_path} has no {starts_path}: cannot tell its rows' prompt lengths")
        starts = np.full(len(seqs), args.prompt_len[0])  # written before mixed lengths existed
    shape = (len(want), max(args.prompt_len) + args.gen_len)
    if seqs.shape != shape or not np.array_equal(starts, want):
        sys.exit(
            f"error: {distill_path} holds sequences of shape {seqs.shape} with prompt lengths "
            f"{sorted(set(np.asarray(starts).tolist()))}, not the {shape} of --prompts {args.prompts} --prompt-len "
            f"{' '.join(map(str, args.prompt_len))} --gen-len {args.gen_len}; {redo}"
        )
    if seqs.min() < 0 or seqs.max() >= vocab_size:
        sys.exit(f"error: {distill_path} holds token ids outside the target's vocabulary of {vocab_size}; {redo}")
    return seqs, starts


def plot(history, evals, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([h["step"] for h in history], [h["loss"] for h in history], label="weighted block CE")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.grid(alpha=0.3)
    a.legend()
    for key, label in (("tau_dflash", "DFlash chain"), ("tau_ddtree", "DDTree"), ("tau_ddtree_t1", "DDTree, T=1")):
        b.plot([e["step"] for e in evals], [e[key] for e in evals], "o-", label=label)
    b.set_xlabel("step")
    b.set_ylabel("tau (validation prompts; T=0 unless marked)")
    b.grid(alpha=0.3)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    _loop.add_training_args(ap, steps=3000, batch=32, lr=2e-3, eval_every=500)
    ap.add_argument("--target", required=True, help="HF target directory")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[64], help="one or more prompt lengths")
    ap.add_argument("--gen-len", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=4096)
    ap.add_argument(
        "--sample-fraction",
        type=float,
        default=0.0,
        help="fraction of the prompts continued by sampling at T=1 rather than greedily: the contexts the "
        "drafter meets when decoding at T > 0",
    )
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--taps", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: the target's heads / 4)")
    ap.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="every drafter layer sees only the last W context positions (0 = full attention; default: "
        "--init's setting, else full)",
    )
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument(
        "--distill-weight",
        type=float,
        default=0.0,
        help="weight of KL(target || drafter) against the hard-label cross-entropy (0 = DFlash's hard labels)",
    )
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-prompt-len", type=int, default=64, help="validation prompt length for the tau evals")
    ap.add_argument("--eval-budget", type=int, default=32)
    ap.add_argument(
        "--init", default=None, help="start from this HF drafter (its config wins over --layers/--taps/...)"
    )
    args = ap.parse_args()
    _loop.check_training_args(args)

    if not 0.0 <= args.distill_weight <= 1.0:
        sys.exit(f"error: --distill-weight must be in [0, 1], got {args.distill_weight}")
    if not 0.0 <= args.sample_fraction <= 1.0:
        sys.exit(f"error: --sample-fraction must be in [0, 1], got {args.sample_fraction}")
    if not (math.isfinite(args.gamma) and args.gamma > 0):  # 0: NaN block weights, a NaN drafter
        sys.exit(f"error: --gamma must be a finite number > 0, got {args.gamma}")
    for flag in ("--anchors", "--gen-len", "--gen-batch", "--eval-prompts", "--eval-prompt-len", "--eval-budget"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:  # else a failure after the distillation or the first steps
            sys.exit(f"error: {flag} must be >= 1, got {value}")
    if min(args.prompt_len) < 1 or args.prompts < len(args.prompt_len):
        sys.exit(f"error: --prompt-len {args.prompt_len} needs lengths >= 1 and --prompts >= one per length")
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer.load(os.path.join(args.data, "tokenizer.json"))
    with _loop.refusing(f"--target {args.target}"):
        target = checkpoint.load_target(args.target, dtype=jnp.bfloat16)
    if target.config.vocab_size != tok.vocab_size:
        sys.exit(f"error: target vocab {target.config.vocab_size} != tokenizer vocab {tok.vocab_size}")

    def with_window(cfg):
        if args.sliding_window is None:
            return cfg
        try:
            return cfg.with_sliding_window(args.sliding_window)
        except ConfigError as e:
            sys.exit(f"error: --sliding-window {args.sliding_window}: {e}")

    if args.init:  # its config, not --layers / --taps / ...
        with _loop.refusing(f"--init {args.init}"):
            params = dflash.load_drafter(args.init, dtype=jnp.float32)
        dcfg = with_window(params.config)
        params = params.replace(config=dcfg)
        print(f"initialised from {args.init}")
    else:
        dcfg = with_window(
            dflash.drafter_config_for(
                target.config,
                num_hidden_layers=args.layers,
                block_size=args.block_size,
                mask_token_id=tok.mask_id,
                target_layer_ids=tuple(args.taps),
                intermediate_size=args.intermediate,
                num_key_value_heads=args.kv_heads,
            )
        )
        params = dflash.init_params(dcfg, jax.random.PRNGKey(args.seed))
    train_stream = np.load(os.path.join(args.data, "train.npy"), mmap_mode="r")
    val_stream = np.load(os.path.join(args.data, "validation.npy"))

    distill_path = os.path.join(args.out, "distill.npy")
    starts_path = os.path.join(args.out, "distill_prompt_lens.npy")
    t0 = time.time()
    total = max(args.prompt_len) + args.gen_len
    counts = np.diff(np.linspace(0, args.prompts, len(args.prompt_len) + 1).astype(int))
    if os.path.exists(distill_path):
        seqs, starts = reuse_distilled(distill_path, starts_path, args, counts, target.config.vocab_size)
    else:
        parts = []
        for i, (length, count) in enumerate(zip(args.prompt_len, counts, strict=True)):
            prompts = prompt_windows(train_stream, int(count), length, seed=args.seed + 1000 * i)
            n_sampled = round(args.sample_fraction * len(prompts))
            greedy, sampled = prompts[: len(prompts) - n_sampled], prompts[len(prompts) - n_sampled :]
            if len(greedy):
                parts.append(distill(target, greedy, total - length, args.gen_batch))
            if len(sampled):
                parts.append(distill(target, sampled, total - length, args.gen_batch, 1.0, seed=args.seed + i))
        seqs = np.concatenate(parts)
        starts = np.repeat(np.asarray(args.prompt_len), counts)
        save_atomically(starts_path, starts)  # first: a distill.npy on disk always has its prompt lengths
        save_atomically(distill_path, seqs)
    distill_time = time.time() - t0
    print(f"distillation data {seqs.shape} in {distill_time:.0f}s")
    eval_prompts = prompt_windows(val_stream, args.eval_prompts, args.eval_prompt_len, seed=1)

    n, t = seqs.shape
    hi = t - args.block_size

    def make_batch(rng):
        rows = rng.integers(0, n, size=args.batch)
        anchors = train.sample_anchors(rng, args.batch, args.anchors, starts[rows], hi)
        return target, jnp.asarray(seqs[rows]), jnp.asarray(anchors)

    if args.fit_minutes:
        probe_opt = train.make_optimizer(train.OptimConfig(total_steps=10**6), params)
        probe = jax.jit(
            functools.partial(
                train.drafter_train_step, optimizer=probe_opt, gamma=args.gamma, distill_weight=args.distill_weight
            )
        )
        probe_state = train.init_state(params, probe_opt)
        batch = make_batch(np.random.default_rng(0))
        args.steps, per_step = train.steps_that_fit(
            lambda: jax.block_until_ready(probe(probe_state, *batch)), args.fit_minutes * 60
        )
        print(f"probe: {per_step * 1e3:.1f} ms/step -> {args.steps} steps in {args.fit_minutes} min")
    opt = train.make_optimizer(
        train.OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup, total_steps=args.steps), params
    )
    state = train.init_state(params, opt)
    manager = train.checkpoint_manager(os.path.abspath(os.path.join(args.out, "ckpt_drafter")))
    state = _loop.resume(manager, state)
    metrics_path = os.path.join(args.out, "drafter_metrics.json")
    resumed_at = int(state.step)
    prior_history, prior_evals = _loop.earlier_metrics(metrics_path, resumed_at)
    step_fn = jax.jit(
        functools.partial(
            train.drafter_train_step, optimizer=opt, gamma=args.gamma, distill_weight=args.distill_weight
        ),
        donate_argnums=0,
    )

    def export(params, path):
        dflash.save_drafter_hf(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), path)

    best = {"tau_dflash": max([e["tau_dflash"] for e in prior_evals], default=-1.0)}

    def evaluate(state):
        d = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state.params)
        kw = dict(max_new_tokens=96, stop_token_ids=())
        chain = generate(target, d, eval_prompts, method="dflash", **kw)
        tree = generate(target, d, eval_prompts, method="ddtree", tree_budget=args.eval_budget, **kw)
        sampled = generate(
            target,
            d,
            eval_prompts,
            method="ddtree",
            tree_budget=args.eval_budget,
            temperature=1.0,
            key=jax.random.PRNGKey(7),
            **kw,
        )
        if chain.tau > best["tau_dflash"]:
            best["tau_dflash"] = chain.tau
            export(state.params, os.path.join(args.out, "drafter_best"))
        return {"tau_dflash": chain.tau, "tau_ddtree": tree.tau, "tau_ddtree_t1": sampled.tau}

    state, history, evals, train_time = _loop.run(
        state,
        step_fn,
        make_batch,
        evaluate,
        manager,
        steps=args.steps,
        seed=args.seed,
        t_start=t_start,
        max_minutes=args.max_minutes,
        eval_every=args.eval_every,
        save_every=args.eval_every,
        postfix=lambda m: {"loss": f"{m['loss']:.3f}", "acc": f"{m['chain_accept']:.2f}"},
    )
    history, evals = prior_history + history, prior_evals + evals
    export(state.params, os.path.join(args.out, "drafter"))
    plot(history, evals, os.path.join(args.out, "drafter_loss.png"))
    summary = {
        "config": dcfg.to_hf_config(),
        "args": vars(args),
        "params": int(sum(a.size for a in jax.tree.leaves(state.params))),
        "steps_done": int(state.step),
        "distill_shape": list(seqs.shape),
        "distill_time_s": distill_time,
        "resumed_at_step": resumed_at,
        "train_time_s": train_time,  # this call's steps (from resumed_at_step)
        "device": jax.devices()[0].device_kind,
        "evals": evals,
        "best_eval": max(evals, key=lambda e: e["tau_dflash"]) if evals else None,
        "history": history,
    }
    with open(metrics_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"done: {int(state.step)} steps in {train_time:.0f}s; last eval {evals[-1] if evals else None}")


if __name__ == "__main__":
    compile_cache.enable()
    main()
