"""Cold and warm compile time of the shipped pair's `generate` programs (CPU or GPU).

    python experiments/compile_time.py --out compile_time.json

For each program (ar, dflash, ddtree at each `--budgets`; one batch-1 prompt of
`--prompt-len` tokens, `--max-new-tokens`) in a fresh persistent compilation cache:
- cold: trace, lower, compile (nothing cached) and run once;
- warm: after `compile_cache.clear()` (as in a new process), the same call again: the
  whole executable loaded from `ddtree_jax.compile_cache`'s folder and run once;
- warm_jax: the same with `generate`'s executable cache off: trace, lower, load the
  executable from jax's persistent cache and run once (what `warm` was before session 18);
- run: one more call, the compiled program alone;
- lower: after `compile_cache.clear()`, `ddtree_jax.generate.lower` alone: the Python
  trace and the lowering to StableHLO that `warm_jax` pays before the cache lookup.
cold - run and warm - run are the compile costs a sweep pays per configuration
without and with the cache. Each row's `compiles` splits the cold call by jax's own
compile events (`jax.monitoring`, no profiler): per jitted program, the seconds spent
tracing, lowering to StableHLO and in XLA's backend compile, the slowest first, and
`compile_totals` sums them by stage. With `--trace DIR` the cold call is profiled (jax.profiler, host
events only, no Python tracer) and each row gets `phases`: the named host events (XLA's
compiler passes, autotuning, jax's lowering) with the most summed time; cold then includes
the profiler's overhead.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import tempfile
import time

import _settings
import jax
import numpy as np

from ddtree_jax import compile_cache
from ddtree_jax.generate import generate, lower
from ddtree_jax.shipped import load_shipped


def timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn().tokens)
    return time.perf_counter() - t0


def traced(folder: str | None):
    """A profile of the block into `folder` (host events, no Python tracer), or nothing."""
    if folder is None:
        return contextlib.nullcontext()
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    return jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=opts)


# jax's compile stages as `jax.monitoring` names them (jax/_src/dispatch.py).
STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend_compile",
}


@contextlib.contextmanager
def compile_events():
    """Yields {(program, stage): seconds}, filled by jax's compile events in the block."""
    seconds = collections.defaultdict(float)

    def listen(event, duration, **kw):
        if event in STAGES:
            name = str(kw.get("fun_name", "?"))  # the trace event names f, the others jit(f)
            name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
            seconds[(name, STAGES[event])] += duration

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


STAGE_KEYS = ("trace", "lower", "backend_compile")


def by_program(seconds: dict, top: int = 12) -> tuple[list[dict], dict]:
    """([{program, trace, lower, backend_compile}] the slowest `top`, {stage: total})."""
    programs = collections.defaultdict(dict)
    for (name, stage), s in seconds.items():
        programs[name][stage] = round(s, 4)
    rows = sorted(
        ({"program": n, **v} for n, v in programs.items()), key=lambda r: -sum(r[k] for k in STAGE_KEYS if k in r)
    )
    totals = {k: round(sum(r.get(k, 0.0) for r in rows), 4) for k in STAGE_KEYS}
    return rows[:top], {**totals, "programs": len(rows)}


def phases(folder: str, top: int = 40) -> list[dict]:
    """The `top` event names of the perfetto trace under `folder` by summed duration (ms)."""
    (path,) = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
        trace = json.load(f)
    total, count = collections.Counter(), collections.Counter()
    for e in trace["traceEvents"] if isinstance(trace, dict) else trace:
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            total[e["name"]] += e.get("dur", 0) / 1e3
            count[e["name"]] += 1
    return [dict(name=n, ms=round(ms, 2), count=count[n]) for n, ms in total.most_common(top)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree"], choices=["ar", "dflash", "ddtree"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64], help="ddtree's")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="each program at each sampling temperature, in this order (0: greedy; the values are traced, so a "
        "second temperature > 0 reuses the first's program: its cold call shows no backend compile)",
    )
    ap.add_argument(
        "--xla-flags",
        default="",
        help="appended to XLA_FLAGS before the backend starts, e.g. --xla_gpu_autotune_level=0 (what a flag costs "
        "or saves in compile and run time)",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="profile the first program's cold call into DIR (see above); on the H200 the profiled dflash and "
        "ddtree programs died (CUDA_ERROR_LAUNCH_FAILED), alone in their process too, and so did ddtree on an H100 "
        "(2026-12-06); ar ran. Each row's `compiles` splits the cold call without the profiler",
    )
    ap.add_argument(
        "--no-jax-cache",
        action="store_true",
        help="skip warm_jax and lower (their second full compile per program): cold, warm and run only",
    )
    ap.add_argument(
        "--no-shipped-autotune",
        action="store_true",
        help="start from an empty autotuning folder: without the results shipped in ddtree_jax/autotune "
        "(compile_cache.SHIPPED_AUTOTUNE), every GEMM fusion is tuned (the cold compile before they were shipped)",
    )
    ap.add_argument(
        "--save-autotune",
        default=None,
        metavar="FILE.tar.gz",
        help="write the autotuning results of the run (XLA's per-fusion files) into this archive after each "
        "program: with --no-shipped-autotune, what ddtree_jax/autotune ships, one archive a GPU model",
    )
    _settings.add_argument(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _settings.apply(args.set)
    if args.no_shipped_autotune:
        compile_cache.SHIPPED_AUTOTUNE = None
    if args.xla_flags:  # read when the backend starts: the first device use below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    with tempfile.TemporaryDirectory() as folder:
        compile_cache.enable(folder)
        if jax.config.jax_compilation_cache_dir != folder:
            raise SystemExit("error: a compilation cache folder is already configured; unset JAX_COMPILATION_CACHE_DIR")
        s = load_shipped(args.checkpoints, dtype=args.dtype)
        ids = np.random.default_rng(0).integers(4, s.target.config.vocab_size, (1, args.prompt_len)).astype(np.int32)
        kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=())
        programs = [
            (m, b, t)
            for m in args.methods
            for b in (args.budgets if m == "ddtree" else [None])
            for t in args.temperatures
        ]
        rows = []
        print(f"device: {jax.devices()[0].device_kind}, dtype {args.dtype}")
        for method, budget, temperature in programs:
            drafter = None if method == "ar" else s.drafter
            kw_t = dict(kw, temperature=temperature, key=jax.random.key(0) if temperature else None)

            def call(d=drafter, m=method, b=budget, kw_t=kw_t):
                return generate(s.target, d, ids, method=m, tree_budget=b, **kw_t)

            name = method + (str(budget) if budget else "") + (f"_t{temperature:g}" if temperature else "")
            trace_dir = None if args.trace is None or rows else os.path.join(args.trace, name)
            with traced(trace_dir), compile_events() as seconds:
                cold = timed(call)
            compiles, compile_totals = by_program(seconds)
            compile_cache.clear()
            warm = timed(call)
            run = timed(call)
            warm_jax = lowering = None
            if not args.no_jax_cache:
                warm_jax, lowering = jax_cache_row(folder, call, s, drafter, ids, method, budget, kw_t)
            rows.append(
                dict(
                    method=method,
                    budget=budget,
                    temperature=temperature,
                    cold_s=cold,
                    warm_s=warm,
                    warm_jax_s=warm_jax,
                    run_s=run,
                    lower_s=lowering,
                    compiles=compiles,
                    compile_totals=compile_totals,
                    **({} if trace_dir is None else {"phases": phases(trace_dir)}),
                )
            )
            print(
                f"{name}: cold {cold:.2f} s ({compile_totals}), warm {warm:.2f} s, run {run:.3f} s"
                + ("" if warm_jax is None else f", jax's cache alone {warm_jax:.2f} s, trace + lower {lowering:.2f} s"),
                flush=True,
            )
            save(args, folder, rows)  # after each program: a later one may take the process down
            if args.save_autotune:
                saved = compile_cache.save_autotune(
                    os.path.join(folder, compile_cache.AUTOTUNE_DIR), args.save_autotune
                )
                print(f"{saved} autotuning results in {args.save_autotune}", flush=True)


def jax_cache_row(folder, call, s, drafter, ids, method, budget, kw) -> tuple[float, float]:
    """(warm_jax, lower): a load from jax's own cache, and the trace + lowering alone."""
    # jax's own cache holds no generate program yet (the executable cache compiles those
    # with it off), so fill it first, then time a load from it.
    compile_cache.enable(folder, executables=False)
    compile_cache.clear()
    timed(call)
    compile_cache.clear()
    warm_jax = timed(call)
    compile_cache.enable(folder)
    compile_cache.clear()
    t0 = time.perf_counter()
    lower(s.target, drafter, ids, method=method, tree_budget=budget, **kw)
    return warm_jax, time.perf_counter() - t0


def save(args, folder: str, rows: list[dict]) -> None:
    if not args.out:
        return
    out = {
        "device": jax.devices()[0].device_kind,
        "args": vars(args),
        "cache_entries": len([f for f in os.listdir(folder) if f.endswith("-cache")]),
        "executables": len(os.listdir(os.path.join(folder, "executables"))),
        "autotune_entries": len(_listdir(os.path.join(folder, compile_cache.AUTOTUNE_DIR))),
        "shipped_autotune": compile_cache.SHIPPED_AUTOTUNE is not None,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def _listdir(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


if __name__ == "__main__":
    main()
