"""Train a target preset (SMALL by default) on the token streams of experiments/prepare_data.py.

    python experiments/train_target.py --data data --out out/target_run --steps 2000 --max-minutes 8
    python experiments/train_target.py --preset medium --int4-experts 32 ...   # issue 17's target
    python experiments/train_target.py --init checkpoints/target --unlikelihood 1.0 --ul-anchor 1.0 ...

With --unlikelihood W every step adds W x the sequence-level unlikelihood loss
(`train.unlikelihood_loss`) of the model's own greedy continuations of train windows,
regenerated from the current weights every --ul-refresh steps: it lowers the probability of
tokens that repeat a 4-gram of their text, where greedy decoding of small models loops.
--ul-anchor A keeps the freed probability on the --init weights' other choices.

Writes OUT/target (HF format, bf16, sharded < 16 MB per file; the final weights),
OUT/target_best (the same, for the evaluation with the lowest validation loss: the
small corpus overfits; not with --unlikelihood, whose later weights loop less and whose
evaluations also give the share of repeated 4-grams in greedy continuations of validation
windows), with --int4-experts also OUT/target_int4 and OUT/target_best_int4
(routed experts INT4, compressed-tensors), OUT/target_loss.png, OUT/target_metrics.json;
resumable orbax states under OUT/ckpt_target. A run continued on a machine without those
states starts from an exported OUT/target with --init (weights only: a fresh optimizer).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import _loop
import jax
import jax.numpy as jnp
import numpy as np
from train_drafter import distill

from ddtree_jax import checkpoint, compile_cache, config, model, train
from ddtree_jax.data import Tokenizer, prompt_windows
from ddtree_jax.pallas.moe import reference


def windows(stream: np.ndarray, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, size=n)
    return np.stack([stream[s : s + length] for s in starts]).astype(np.int32)


def plot(history: list[dict], evals: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss")
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token NLL (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class OwnText:
    """The model's own greedy continuations of train windows, for the unlikelihood term."""

    def __init__(self, args, train_stream: np.ndarray, val_stream: np.ndarray):
        self.args, self.train_stream = args, train_stream
        self.width = max(args.ul_prompt_len) + args.ul_gen_len
        self.seqs = self.continuation = None
        # Validation: greedy continuations of validation windows, and the true text's own rate.
        self.val_len = max(args.ul_prompt_len)
        self.val_windows = prompt_windows(val_stream, args.ul_val_windows, self.val_len + args.ul_gen_len, seed=1)
        truth = train.repeated_ngram_mask(jnp.asarray(self.val_windows))[:, self.val_len :]
        self.reference_repeats = float(jnp.mean(truth))

    def refresh(self, state: train.TrainState, step: int) -> None:
        if self.seqs is not None and step % self.args.ul_refresh:
            return
        a = self.args
        target = model.cast_params(state.params, jnp.bfloat16)
        counts = np.diff(np.linspace(0, a.ul_prompts, len(a.ul_prompt_len) + 1).astype(int))
        parts, starts = [], []
        for i, (length, count) in enumerate(zip(a.ul_prompt_len, counts, strict=True)):
            prompts = prompt_windows(self.train_stream, int(count), length, seed=a.seed + 7919 * (step + 1) + i)
            parts.append(distill(target, prompts, self.width - length, a.ul_prompts))
            starts += [length] * int(count)
        self.seqs = np.concatenate(parts)
        self.continuation = np.arange(self.width)[None, :] >= np.asarray(starts)[:, None]

    def batch(self, rng: np.random.Generator) -> tuple[jax.Array, jax.Array]:
        rows = rng.integers(0, len(self.seqs), size=self.args.ul_batch)
        return jnp.asarray(self.seqs[rows]), jnp.asarray(self.continuation[rows])

    def validation_repeats(self, params) -> float:
        """Share of the greedy continuation tokens of the validation windows that repeat a 4-gram
        (--ul-gen-len tokens after max(--ul-prompt-len); `reference_repeats`: the true text's)."""
        target = model.cast_params(params, jnp.bfloat16)
        p = self.val_len
        seqs = distill(target, self.val_windows[:, :p], self.args.ul_gen_len, len(self.val_windows))
        return float(jnp.mean(train.repeated_ngram_mask(jnp.asarray(seqs))[:, p:]))


def main():
    ap = argparse.ArgumentParser()
    _loop.add_training_args(ap, steps=2000, batch=64, lr=3e-3, eval_every=250)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--preset", default="small", choices=sorted(config.PRESETS))
    ap.add_argument(
        "--int4-experts",
        type=int,
        default=None,
        metavar="GROUP",
        help="also export OUT/target_int4 (and target_best_int4): routed experts INT4, one scale per GROUP inputs",
    )
    ap.add_argument(
        "--init",
        default=None,
        help="start from this HF target directory's weights (an earlier run's OUT/target, or an INT4 export "
        "such as checkpoints/target, its experts dequantized) with a fresh optimizer",
    )
    ap.add_argument(
        "--dense-experts",
        action="store_true",
        help="run every routed expert on every token (E/K x the FLOPs, no sort or ragged_dot): the MEDIUM "
        "preset's experts fwd + bwd took 9.3 ms a layer dense vs 22.0 routed on an H200 (train_step_cost.py)",
    )
    ap.add_argument(
        "--unlikelihood",
        type=float,
        default=0.0,
        metavar="W",
        help="add W x the unlikelihood of 4-gram repeats in the model's own greedy text to each step's loss",
    )
    ap.add_argument(
        "--ul-anchor",
        type=float,
        default=0.0,
        metavar="A",
        help="with --unlikelihood and --init: add A x KL(the --init weights' distribution, the repeated token "
        "removed || the model's) over the generated text, so that loops give way to the starting model's "
        "next choices rather than to junk tokens",
    )
    ap.add_argument("--ul-batch", type=int, default=64, help="generated sequences per step")
    ap.add_argument("--ul-prompts", type=int, default=4096, help="train windows continued at each refresh")
    ap.add_argument("--ul-prompt-len", type=int, nargs="+", default=[64, 128], help="their lengths (split evenly)")
    ap.add_argument("--ul-gen-len", type=int, default=128, help="tokens generated after the longest prompt")
    ap.add_argument("--ul-refresh", type=int, default=150, help="regenerate the text every this many steps")
    ap.add_argument(
        "--ul-val-windows", type=int, default=64, help="validation windows whose greedy continuations are evaluated"
    )
    args = ap.parse_args()
    _loop.check_training_args(args)
    for flag, value in (("--seq", args.seq), ("--save-every", args.save_every)):
        if value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    if args.unlikelihood < 0 or args.ul_anchor < 0:
        raise SystemExit(f"--unlikelihood and --ul-anchor must be >= 0, got {args.unlikelihood}, {args.ul_anchor}")
    if args.ul_anchor and not (args.unlikelihood and args.init):
        raise SystemExit(f"--ul-anchor {args.ul_anchor} needs --unlikelihood > 0 and --init (the reference weights)")
    if (
        args.unlikelihood
        and min(
            args.ul_batch, args.ul_prompts, args.ul_gen_len, args.ul_refresh, args.ul_val_windows, *args.ul_prompt_len
        )
        < 1
    ):
        raise SystemExit(
            "--ul-batch, --ul-prompts, --ul-prompt-len, --ul-gen-len, --ul-refresh and --ul-val-windows must be >= 1"
        )
    if args.unlikelihood and args.ul_prompts < len(args.ul_prompt_len):
        raise SystemExit(f"--ul-prompts {args.ul_prompts}: need at least one per --ul-prompt-len {args.ul_prompt_len}")
    if args.dense_experts:
        reference.DENSE_MAX_TOKENS = sys.maxsize  # same outputs and gradients: unchosen experts weigh 0

    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer.load(os.path.join(args.data, "tokenizer.json"))
    cfg = dataclasses.replace(
        config.PRESETS[args.preset], vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id
    )
    if args.int4_experts:  # fail now, not at the first export: the experts' dims must take the groups
        try:
            dataclasses.replace(cfg, expert_int4_group_size=args.int4_experts)
        except config.ConfigError as err:
            raise SystemExit(f"--int4-experts {args.int4_experts}: {err}") from err
    train_stream = np.load(os.path.join(args.data, "train.npy"), mmap_mode="r")
    val_stream = np.load(os.path.join(args.data, "validation.npy"))
    val_batches = windows(val_stream, np.random.default_rng(123), 64, args.seq + 1).reshape(4, 16, -1)

    if args.init:  # no random init first: op by op, it took seconds even for the tiny preset
        with _loop.refusing(f"--init {args.init}"):
            start = checkpoint.load_target(args.init, dtype=jnp.float32)
        if start.config.expert_int4_group_size is not None:  # an INT4 export: continue from its rounded experts
            start = model.dequantize_experts(start, jnp.float32)
        if start.config != cfg:
            raise SystemExit(f"--init {args.init}: its config differs from --preset {args.preset}'s: {start.config}")
        params = start
        print(f"initialised from {args.init}")
    else:
        params = model.init_params(cfg, jax.random.PRNGKey(args.seed))
    compute = jnp.dtype(args.compute_dtype) if args.compute_dtype != "float32" else None
    frozen = train.router_bias_mask(params)
    if args.fit_minutes:
        probe_opt = train.make_optimizer(train.OptimConfig(total_steps=10**6), params, frozen=frozen)
        probe = jax.jit(functools.partial(train.target_train_step, optimizer=probe_opt, compute_dtype=compute))
        probe_state = train.init_state(params, probe_opt)
        rng0 = np.random.default_rng(0)
        args.steps, per_step = train.steps_that_fit(
            lambda: jax.block_until_ready(
                probe(probe_state, jnp.asarray(windows(train_stream, rng0, args.batch, args.seq + 1)))
            ),
            args.fit_minutes * 60,
        )
        print(f"probe: {per_step * 1e3:.1f} ms/step -> {args.steps} steps in {args.fit_minutes} min")
    opt_cfg = train.OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup, total_steps=args.steps)
    opt = train.make_optimizer(opt_cfg, params, frozen=frozen)
    state = train.init_state(params, opt)
    manager = train.checkpoint_manager(os.path.abspath(os.path.join(args.out, "ckpt_target")))
    state = _loop.resume(manager, state)
    metrics_path = os.path.join(args.out, "target_metrics.json")
    resumed_at = int(state.step)
    prior_history, prior_evals = _loop.earlier_metrics(metrics_path, resumed_at)

    # The --init weights, frozen: a copy (the step donates the state's buffers), passed as an
    # argument (closed over, jit would bake them into the program as constants).
    anchor = jax.tree.map(jnp.array, params) if args.ul_anchor else None

    def step(state, reference, tokens, generated=None, continuation=None):
        return train.target_train_step(
            state,
            tokens,
            opt,
            compute_dtype=compute,
            generated=generated,
            continuation=continuation,
            unlikelihood_weight=args.unlikelihood,
            reference=reference,
            anchor_weight=args.ul_anchor,
        )

    jitted_step = jax.jit(step, donate_argnums=0)

    def step_fn(state, *batch):
        return jitted_step(state, anchor, *batch)

    own = OwnText(args, train_stream, val_stream) if args.unlikelihood else None

    @jax.jit
    def val_loss(params, batch):
        p = model.cast_params(params, compute) if compute is not None else params
        return train.target_loss(p, batch)[0]

    print(
        f"device {jax.devices()[0].device_kind}; {cfg.num_params() / 1e6:.2f}M params; {len(train_stream)} train tokens"
    )

    def export(params, name):
        params = model.cast_params(params, jnp.bfloat16)
        checkpoint.save_hf(params, os.path.join(args.out, name), max_shard_bytes=12 * 2**20)
        if args.int4_experts:
            quantized = model.quantize_experts(params, group_size=args.int4_experts)
            checkpoint.save_hf(quantized, os.path.join(args.out, f"{name}_int4"), max_shard_bytes=12 * 2**20)

    best = {"val_loss": min([e["val_loss"] for e in prior_evals], default=float("inf"))}

    def evaluate(state):
        vl = float(np.mean([float(val_loss(state.params, jnp.asarray(b))) for b in val_batches]))
        row = {"val_loss": vl, "val_ppl": float(np.exp(vl))}
        if own is not None:
            row["val_repeat_4gram"] = own.validation_repeats(state.params)
            row["val_repeat_4gram_reference"] = own.reference_repeats
        if vl < best["val_loss"] and own is None:  # with unlikelihood the last weights loop least
            best["val_loss"] = vl
            export(state.params, "target_best")
        return row

    def make_batch(rng):
        tokens = jnp.asarray(windows(train_stream, rng, args.batch, args.seq + 1))
        return (tokens,) if own is None else (tokens, *own.batch(rng))

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
        save_every=args.save_every,
        postfix=lambda m: {
            "loss": f"{m['loss']:.3f}",
            "load": f"{m.get('max_load', 0):.2f}",
            **({"repeat": f"{m['repeat_rate']:.3f}"} if "repeat_rate" in m else {}),
            **({"kl": f"{m['anchor_kl']:.3f}"} if args.ul_anchor else {}),
        },
        before_step=None if own is None else own.refresh,
    )
    history, evals = prior_history + history, prior_evals + evals
    export(state.params, "target")
    plot(
        history,
        evals,
        os.path.join(args.out, "target_loss.png"),
        f"{args.preset.upper()} target ({cfg.num_params() / 1e6:.1f}M)",
    )
    summary = {
        "config": cfg.to_hf_config(),
        "args": vars(args),
        "steps_done": int(state.step),
        "tokens_seen": int(state.step) * args.batch * args.seq,
        "resumed_at_step": resumed_at,
        "train_time_s": train_time,  # this call's steps (from resumed_at_step)
        "device": jax.devices()[0].device_kind,
        "final_val": evals[-1] if evals else None,
        "best_val": min(evals, key=lambda e: e["val_loss"]) if evals else None,
        "evals": evals,
        "history": history,
    }
    with open(metrics_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"done: {int(state.step)} steps in {train_time:.0f}s; final {evals[-1] if evals else None}")


if __name__ == "__main__":
    compile_cache.enable()
    main()
