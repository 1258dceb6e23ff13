"""Per-stage time of one DDTree round: draft / build tree / verify / accept+commit, vs an AR step.

    python experiments/profile_round.py --batch-sizes 1 8 --budgets 16 64 --out profile.json

Each stage is jitted on its own and run `--reps` times inside one `lax.fori_loop`, so
the figure is device time per call without Python dispatch. The real loop is timed too:
`generate` of --loop-tokens tokens minus `generate` of one token (prefill and dispatch),
divided by the rounds taken ("AR in loop", "round in loop"), each loop's programs the only ones
held (`evaluation.fresh_programs`: held with others, a loop ran slower). Uses the shipped
checkpoints (or random SMALL with --random) and a prompt of --context tokens already in
the cache (random ids, so the in-loop tau is low; the round's cost depends on the budget,
not on tau).

`--kernels N` also traces both loops (GPU): kernels launched and their device time per
round, and the N largest; `--stage-kernels N` the same for each stage alone, and
`--stage-hlo DIR` writes each stage's compiled HLO (its fusions are the kernels' names).
`--pairs N` also times AR and DDTree in the loop in N interleaved pairs and reports the
median round / AR ratio with its quartiles, which a drift of the machine between the
separate in-loop measurements cannot move.
`--temperature T` times the sampled loop (the stages and both loops sample at T, key 0; the
round's cost does not depend on which tokens come).
`--set MODULE.NAME=VALUE` overrides a module constant first, so one call can profile a
change on and off, e.g.
`--set ddtree_jax.generate.HOIST_LOOP_INVARIANTS=False ddtree_jax.topk.TOP_K_CHUNK=0`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _settings
import jax
import jax.numpy as jnp
import numpy as np
from call_cost import host_ms

from ddtree_jax import compile_cache, config, decode, model
from ddtree_jax.cache import KVCache
from ddtree_jax.drafters import DFlashDrafter, dflash
from ddtree_jax.evaluation import fresh_programs, time_call
from ddtree_jax.generate import for_loop, generate
from ddtree_jax.numerics import resolve as resolve_numerics
from ddtree_jax.pallas.bench_util import kernel_table
from ddtree_jax.sampling import SamplingConfig


def per_call(fn, args, reps: int, repeats: int = 3, kernels: int = 0, hlo: str | None = None):
    """(median seconds per call of fn(*args) over `reps` calls chained in a fori_loop, kernel table).

    With `kernels` > 0 the chained calls are also traced (`bench_util.kernel_table`, per call
    of fn; GPU), else the table is None. `hlo`: a file for the compiled program's HLO text,
    whose fusion names are the kernel names of the table.
    """

    @jax.jit
    def looped(args):
        def body(_, carry):
            out = fn(*carry)
            # Feed a float zero made from the output back into the inputs, so the call can
            # be neither removed nor hoisted (x * 0.0 is not folded: x may be NaN).
            zero = jnp.sum(jax.tree.leaves(out)[0].astype(jnp.float32)) * 0.0
            return jax.tree.map(lambda a: a + zero.astype(a.dtype), carry)

        return jax.lax.fori_loop(0, reps, body, args)

    compiled = looped.lower(args).compile()  # one compile serves the HLO text, the timing and the trace
    if hlo:
        with open(hlo, "w") as f:
            f.write(compiled.as_text())
    seconds = time_call(lambda: compiled(args), repeats)[0] / reps
    return seconds, kernel_table(lambda: compiled(args), 1, kernels, per=reps) if kernels else None


def loop_call(target, dparams, prompts, method: str, budget, tokens: int, **gen_kwargs):
    """A no-argument call of `generate` for `tokens` new tokens by `method` (the drafter only
    where the method drafts), as the in-loop timings run it."""
    draft = None if method == "ar" else dparams
    return lambda: generate(
        target,
        draft,
        prompts,
        method=method,
        tree_budget=budget,
        max_new_tokens=tokens,
        stop_token_ids=(),
        **gen_kwargs,
    )


def in_loop(
    target, dparams, prompts, method: str, budget, tokens: int, repeats: int = 3, kernels: int = 0, **gen_kwargs
):
    """(seconds per round of `generate`'s while loop: (t(tokens) - t(1)) / rounds, kernel table,
    t(1): the fixed cost of a call, its dispatch, prefill and first token).

    With `kernels` > 0 the `tokens` run is also traced: kernels launched per round (the
    one-token run's prefill and first step subtracted), their summed time, and the
    `kernels` largest by time (`bench_util.kernel_table`); else the table is None. `gen_kwargs`
    go to `generate` (e.g. numerics).
    """

    def call(m):
        return loop_call(target, dparams, prompts, method, budget, m, **gen_kwargs)

    fresh_programs()  # the loop timed as a process running it alone would (the stages' programs dropped)

    def run(m):
        seconds, res = time_call(call(m), repeats)
        return seconds, float(np.asarray(res.rounds).max())

    t_one, _ = run(1)
    t_all, rounds = run(tokens)
    table = None
    if kernels:
        one, full = kernel_table(call(1), 1, kernels), kernel_table(call(tokens), 1, kernels, per=rounds)
        table = {
            "kernels_per_round": full["kernels"] - one["kernels"] / rounds,
            "kernel_ms_per_round": full["kernel_ms"] - one["kernel_ms"] / rounds,
            "top": full["top"],
            # The one-token call (prefill and first token): its kernels, their span, the host share.
            "call_kernels": one["kernels"],
            "call_kernel_ms": one["kernel_ms"],
            "call_span_ms": one["span_ms"],
            "call_top": one["top"],
            "call_host_ms": host_ms(call(1), repeats=5),
        }
    return (t_all - t_one) / rounds, table, t_one


def paired_in_loop(target, dparams, prompts, budgets, tokens: int, pairs: int, **gen_kwargs) -> list[dict]:
    """Round / AR step in the loop from `pairs` interleaved measurements: each pair times the
    one-token and the `tokens` call of AR and of DDTree at each of `budgets` back to back (the
    order rotated pair by pair), so a drift of the machine between separate measurements (the AR
    step moved 9-18% between lines of one call in session 32) falls on every side of each ratio.
    Every budget's ratio is taken against the same AR measurements: in session 53 an AR step timed
    in pairs beside DDTree(32) alone ran 16% slower than beside DDTree(12) in the same process,
    which gave budget 32 a ratio of 1.62 where the eval's seconds implied 1.94.

    Returns a row a budget: the medians of the per-pair AR step (the same in every row) and round
    (ms) and of their ratio, with the ratio's quartiles; a pair whose AR difference is not
    positive (a busy CPU) gives no ratio.
    """
    fresh_programs()
    methods = [("ar", None), *(("ddtree", b) for b in budgets)]
    calls = {
        (method, budget, m): loop_call(target, dparams, prompts, method, budget, m, **gen_kwargs)
        for method, budget in methods
        for m in (1, tokens)
    }
    rounds = {}
    for (method, budget, m), call in calls.items():  # compiles each; a `tokens` call's rounds (the same every call)
        res = jax.block_until_ready(call())
        if m == tokens:
            rounds[method, budget] = float(np.asarray(res.rounds).max())
    steps = {mb: [] for mb in methods}
    for i in range(pairs):
        for method, budget in methods[i % len(methods) :] + methods[: i % len(methods)]:
            t = {m: time_call(calls[method, budget, m], repeats=1, warmup=0)[0] for m in (1, tokens)}
            steps[method, budget].append((t[tokens] - t[1]) / rounds[method, budget] * 1e3)
    ar = np.asarray(steps["ar", None])
    rows = []
    for budget in budgets:
        dd = np.asarray(steps["ddtree", budget])
        ratios = dd[ar > 0] / ar[ar > 0]
        quartiles = np.percentile(ratios, [25, 50, 75]).tolist() if ratios.size else [float("nan")] * 3
        rows.append(
            {
                "budget": budget,
                "pairs": pairs,
                "paired_ar_in_loop_ms": float(np.median(ar)),
                "paired_round_in_loop_ms": float(np.median(dd)),
                "paired_round_over_ar": quartiles[1],
                "paired_round_over_ar_q25_q75": [quartiles[0], quartiles[2]],
            }
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--random", action="store_true", help="random SMALL target + drafter instead of the shipped ones")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--loop-tokens", type=int, default=128, help="generated tokens for the in-loop timing")
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="also time round / AR in the loop from N interleaved pairs (median, quartiles): AR and every "
        "budget in one rotation, each budget's ratio against the same AR steps",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument(
        "--unroll-max-layers",
        type=int,
        default=model.UNROLL_MAX_LAYERS,
        help="unroll the target's layer stacks up to this depth (0 = always a scan)",
    )
    ap.add_argument(
        "--kernels", type=int, default=0, help="also trace the loops: kernels per round and the N largest (GPU)"
    )
    _settings.add_argument(ap)
    ap.add_argument(
        "--stage-kernels", type=int, default=0, help="also trace each stage alone: its kernels and the N largest (GPU)"
    )
    ap.add_argument("--stage-hlo", default=None, help="write each stage's compiled HLO text to this folder")
    ap.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before the backend starts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.xla_flags:  # read when the backend starts: the first device use below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    model.UNROLL_MAX_LAYERS = args.unroll_max_layers
    if args.stage_hlo:
        os.makedirs(args.stage_hlo, exist_ok=True)
    _settings.apply(args.set)
    if args.pairs < 0:
        ap.error(f"--pairs must be >= 0, got {args.pairs}")
    try:
        sampling = SamplingConfig(temperature=args.temperature)
    except (TypeError, ValueError) as e:
        ap.error(f"--temperature: {e}")
    key = jax.random.key(0)
    # generate's own sampling arguments for the loops; greedy passes none (its default program).
    sampled = dict(temperature=args.temperature, key=key) if args.temperature else {}

    dtype = jnp.dtype(args.dtype)
    if args.random:
        target = model.cast_params(model.init_params(config.SMALL, jax.random.PRNGKey(0)), dtype)
        dparams = dflash.init_params(
            dflash.drafter_config_for(config.SMALL, num_hidden_layers=2), jax.random.PRNGKey(1)
        )
        dparams = jax.tree.map(lambda a: a.astype(dtype), dparams)
    else:
        from ddtree_jax.shipped import load_shipped

        shipped = load_shipped(args.checkpoints, dtype=dtype)
        target, dparams = shipped.target, shipped.drafter
    d = DFlashDrafter(params=dparams, block_size=dparams.config.block_size)
    # The stages as the loop runs them (generate passes its resolved numerics and implementation).
    target, d = for_loop(target, d, resolve_numerics(None, target.dtype, "auto"), "auto")
    rows, stage_tables = [], {}
    start = time.monotonic()

    def progress(what):
        """One line on stderr as each measurement ends: a run cut short by a timeout still says how
        far it got and how long each part took."""
        print(f"[{time.monotonic() - start:7.1f} s] {what}", file=sys.stderr, flush=True)

    def stage(b, name, fn, stage_args):
        """per_call with this run's stage options; keeps the stage's kernel table."""
        hlo = os.path.join(args.stage_hlo, f"b{b}_{name}.hlo.txt") if args.stage_hlo else None
        seconds, table = per_call(fn, stage_args, args.reps, kernels=args.stage_kernels, hlo=hlo)
        stage_tables[b, name] = table
        progress(f"batch {b} {name}: {seconds * 1e3:.3f} ms a call")
        return seconds

    for b in args.batch_sizes:
        rng = np.random.default_rng(0)
        cap = args.context + 64
        cache = KVCache.init(target.config, b, cap, dtype)
        prompt = jnp.asarray(rng.integers(4, target.config.vocab_size, size=(b, args.context)), jnp.int32)
        _, cache = jax.jit(model.prefill)(target, cache, prompt, jnp.full((b,), args.context, jnp.int32))
        dstate = d.init_state(target, b, cap)
        feats = jnp.zeros((len(d.tap_layers), b, args.context, target.config.hidden_size), dtype)
        pos = jnp.broadcast_to(jnp.arange(args.context, dtype=jnp.int32), (b, args.context))
        dstate = jax.jit(d.observe)(dstate, feats, pos, jnp.ones((b, args.context), bool))
        roots = jnp.asarray(rng.integers(4, target.config.vocab_size, size=(b,)), jnp.int32)

        def ar_step(cache, roots):
            out = decode.verify(target, cache, decode.build_tree("ar", None, roots, 0))
            return decode.target_choices(target, out.hidden, key, sampling)[0]

        t_ar = stage(b, "ar_step", ar_step, (cache, roots))
        loop_prompts = np.asarray(prompt)
        t_ar_loop, ar_kernels, t_ar_one = in_loop(
            target, dparams, loop_prompts, "ar", None, args.loop_tokens, kernels=args.kernels, **sampled
        )
        progress(f"batch {b} AR in the loop: {t_ar_loop * 1e3:.3f} ms a step")
        draft_fn = lambda st, cache, roots: d.propose(st, target, cache, roots, key)  # noqa: E731
        t_draft = stage(b, "draft", draft_fn, (dstate, cache, roots))
        logits = jax.jit(draft_fn)(dstate, cache, roots)
        batch_rows = {}
        for budget in args.budgets:
            tree = jax.jit(decode.build_tree, static_argnums=(0, 3))("ddtree", logits, roots, budget)
            t_tree = stage(
                b,
                f"tree{budget}",
                lambda lg, r, budget=budget: decode.build_tree("ddtree", lg, r, budget),
                (logits, roots),
            )

            def verify(cache, tree):
                out = decode.verify(target, cache, tree, tap_layers=d.tap_layers)
                return decode.target_choices(target, out.hidden, key, sampling)[0], out

            t_verify = stage(b, f"verify{budget}", lambda c, t: verify(c, t)[0], (cache, tree))
            choices, out = jax.jit(verify)(cache, tree)

            def finish(cache, dstate, tree, choices, out):
                acc = decode.accept(tree, choices)
                j = jnp.arange(acc.path.shape[1])[None, :]
                new_cache = decode.commit(cache, out.kv, acc, jnp.ones(cache.lengths.shape, bool))
                st = d.observe(
                    dstate, decode.path_features(out.taps, acc), cache.lengths[:, None] + j, j < acc.length[:, None]
                )
                return new_cache.lengths, st

            t_finish = stage(b, f"accept_commit{budget}", finish, (cache, dstate, tree, choices, out))
            t_round_loop, round_kernels, t_round_one = in_loop(
                target, dparams, loop_prompts, "ddtree", budget, args.loop_tokens, kernels=args.kernels, **sampled
            )
            progress(f"batch {b} DDTree({budget}) in the loop: {t_round_loop * 1e3:.3f} ms a round")
            row = {
                "batch": b,
                "budget": budget,
                "temperature": args.temperature,
                "ar_step_ms": t_ar * 1e3,
                "draft_ms": t_draft * 1e3,
                "tree_ms": t_tree * 1e3,
                "verify_ms": t_verify * 1e3,
                "accept_commit_ms": t_finish * 1e3,
            }
            row["sum_ms"] = row["draft_ms"] + row["tree_ms"] + row["verify_ms"] + row["accept_commit_ms"]
            row["sum_over_ar"] = row["sum_ms"] / row["ar_step_ms"]
            row["ar_in_loop_ms"] = t_ar_loop * 1e3
            row["round_in_loop_ms"] = t_round_loop * 1e3
            row["round_over_ar_in_loop"] = t_round_loop / t_ar_loop
            # What a generate call costs beyond its rounds (one-token call): paid once per prompt.
            row["ar_call_ms"], row["round_call_ms"] = t_ar_one * 1e3, t_round_one * 1e3
            if args.kernels:
                row["ar_kernels"], row["round_kernels"] = ar_kernels, round_kernels
            if args.stage_kernels:
                names = ("ar_step", "draft", f"tree{budget}", f"verify{budget}", f"accept_commit{budget}")
                row["stage_kernels"] = {n.removesuffix(str(budget)): stage_tables[b, n] for n in names}
            rows.append(row)
            batch_rows[budget] = row
        # Last, as each budget's own timings were taken without their programs held (session 48:
        # calls ran slower with earlier programs held); every budget against the same AR steps.
        if args.pairs:
            paired = paired_in_loop(
                target, dparams, loop_prompts, args.budgets, args.loop_tokens, args.pairs, **sampled
            )
            for r in paired:
                batch_rows[r["budget"]].update({k: v for k, v in r.items() if k != "budget"})
                progress(f"batch {b} DDTree({r['budget']}) pairs: round / AR {r['paired_round_over_ar']:.3f}")
        for row in batch_rows.values():
            print(json.dumps(row), flush=True)
    print(
        f"\ndevice {jax.devices()[0].device_kind}, {args.dtype}, context {args.context}, "
        f"T = {args.temperature:g}, per call (ms)"
    )
    print(
        "| batch | budget | AR step | draft | build tree | verify | accept+commit | sum | sum / AR "
        "| AR in loop | round in loop | round / AR in loop |"
    )
    print("| --- " * 12 + "|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['budget']} | {r['ar_step_ms']:.3f} | {r['draft_ms']:.3f} | {r['tree_ms']:.3f} | "
            f"{r['verify_ms']:.3f} | {r['accept_commit_ms']:.3f} | {r['sum_ms']:.3f} | {r['sum_over_ar']:.2f} | "
            f"{r['ar_in_loop_ms']:.3f} | {r['round_in_loop_ms']:.3f} | {r['round_over_ar_in_loop']:.2f} |"
        )
    for r in rows if args.pairs else ():
        q25, q75 = r["paired_round_over_ar_q25_q75"]
        print(
            f"batch {r['batch']} budget {r['budget']}, {r['pairs']} interleaved pairs: AR in loop "
            f"{r['paired_ar_in_loop_ms']:.3f} ms, round {r['paired_round_in_loop_ms']:.3f} ms, round / AR "
            f"{r['paired_round_over_ar']:.3f} (quartiles {q25:.3f} - {q75:.3f})"
        )
    for r in rows:
        for name, k in r.get("stage_kernels", {}).items():
            print(
                f"\nbatch {r['batch']} budget {r['budget']}, stage {name} alone: {k['kernels']:.0f} kernels, "
                f"{k['kernel_ms']:.3f} ms of kernels a call\n| kernel | ms / call | launches / call |"
            )
            for t in k["top"]:
                print(f"| {t['kernel'][:80]} | {t['ms']:.4f} | {t['launches']:.1f} |")
    for r in rows if args.kernels else ():
        for name in ("ar", "round"):
            k = r[f"{name}_kernels"]
            print(
                f"\nbatch {r['batch']} budget {r['budget']}, {name} in loop: {k['kernels_per_round']:.0f} kernels, "
                f"{k['kernel_ms_per_round']:.3f} ms of kernels per round\n| kernel | ms / round | launches / round |"
            )
            for t in k["top"]:
                print(f"| {t['kernel'][:80]} | {t['ms']:.4f} | {t['launches']:.1f} |")
            print(
                f"\n{name}, one-token call: {r[f'{name}_call_ms']:.3f} ms wall, {k['call_host_ms']:.3f} ms until "
                f"generate returns, {k['call_kernels']:.0f} kernels, {k['call_kernel_ms']:.3f} ms of kernels over "
                f"{k['call_span_ms']:.3f} ms from the first to the last\n| kernel | ms / call | launches / call |"
            )
            for t in k["call_top"]:
                print(f"| {t['kernel'][:80]} | {t['ms']:.4f} | {t['launches']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    compile_cache.enable()
    main()
