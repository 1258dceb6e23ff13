"""Command line: `python -m ddtree_jax demo [...]`.

`demo` generates with a target model: a checkpoint directory (HF format or the
project's orbax format) when given, else a randomly initialised preset (the
trained checkpoints ship with a later release).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _load(args):
    import jax
    import jax.numpy as jnp

    from ddtree_jax import checkpoint, config, model

    if args.checkpoint:
        path = args.checkpoint
        if not os.path.isdir(path):
            sys.exit(f"error: checkpoint directory {path!r} does not exist")
        if os.path.isdir(os.path.join(path, "params")):
            return checkpoint.restore_checkpoint(path, dtype=jnp.dtype(args.dtype)), f"orbax checkpoint {path}"
        return checkpoint.load_target(path, dtype=args.dtype), f"HF checkpoint {path}"
    if args.preset not in config.PRESETS:
        sys.exit(f"error: unknown preset {args.preset!r}; choose one of {sorted(config.PRESETS)}")
    cfg = config.PRESETS[args.preset]
    if cfg.num_params() > 2e9:
        sys.exit(f"error: preset {args.preset!r} has {cfg.num_params() / 1e9:.0f}B parameters; too large to init here")
    params = model.init_params(cfg, jax.random.PRNGKey(args.seed), dtype=jnp.dtype(args.dtype))
    return params, f"random {args.preset} ({cfg.num_params() / 1e6:.1f}M params, seed {args.seed})"


def demo(args) -> None:
    import jax
    import numpy as np

    from ddtree_jax.generate import generate

    params, what = _load(args)
    cfg = params.config
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in rng.integers(4, 33, size=args.batch)]
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        key=jax.random.key(args.seed),
        stop_token_ids=(),
    )
    print(f"target: {what}; device: {jax.devices()[0].device_kind}")
    t0 = time.perf_counter()
    result = generate(params, prompts, **kwargs)
    result.tokens.block_until_ready()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = generate(params, prompts, **kwargs)
    result.tokens.block_until_ready()
    dt = time.perf_counter() - t0
    for i, (prompt, row) in enumerate(zip(prompts, result.to_lists(), strict=True)):
        print(f"[{i}] prompt ({len(prompt)} ids) {prompt[:8]}... -> {len(row)} new ids {row[:16]}...")
    n = int(np.asarray(result.lengths).sum())
    print(
        f"method=ar batch={args.batch} new_tokens={n} compile+run {t_first:.2f}s, "
        f"run {dt * 1e3:.1f} ms = {n / dt:.0f} tokens/s"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree_jax", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="generate with a checkpoint or a random preset")
    d.add_argument("--checkpoint", default=None, help="HF or orbax checkpoint directory")
    d.add_argument("--preset", default="small", help="random-init preset when no checkpoint: tiny, small")
    d.add_argument("--dtype", default="float32")
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--top-k", type=int, default=0)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    demo(args)


if __name__ == "__main__":
    main()
