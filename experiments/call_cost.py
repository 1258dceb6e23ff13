"""What a `generate` call costs beyond its rounds: the host's share and the device's.

    python experiments/call_cost.py --methods ar ddtree --context 256 --out call_cost.json

For each method, with the shipped pair (bf16 by default) and a random prompt of --context
tokens, the median over --repeats calls of:
- "host_ms": until `generate` returns, its result not waited for (argument checks,
  transfers, dispatch; and any device work the runtime waits for before returning);
- "call_ms": the one-token call, waited for (prefill, first token: the fixed cost a prompt
  pays once);
- "round_ms": (t(--tokens) - t(1)) / rounds, the loop's cost per round;
- "exe_host_ms" / "exe_call_ms": the same one-token call made on the compiled program
  with `generate`'s prepared arguments already on the device, so that host_ms - exe_host_ms
  is what `generate` adds (its Python, the inputs' transfers); "exe_fresh_call_ms": the
  direct call handed new host copies of the prompt, lengths and stop ids each time.
`--xla-flags` is appended to XLA_FLAGS before the backend starts, so one process per flag
set compares, e.g., command-buffer settings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import numpy as np


def host_ms(fn, repeats: int) -> float:
    """Median ms until fn() returns, its result not waited for, over `repeats` calls after
    one untimed call: the host's share of a call (checks, transfers, dispatch)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return 1e3 * statistics.median(times)


def call_ms(fn, repeats: int) -> float:
    """Median ms of fn() waited for (`evaluation.time_call`)."""
    from ddtree_jax.evaluation import time_call

    return 1e3 * time_call(fn, repeats)[0]


def with_fresh_inputs(exe, target, drafter, ids, lengths, stop, key, knobs):
    """exe called with new host copies of generate's host inputs (prompt, lengths, stop ids, and
    the traced temperatures)."""
    return exe(target, drafter, *[np.array(a) for a in (ids, lengths, stop)], key, np.array(knobs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--methods", nargs="+", choices=["ar", "dflash", "ddtree"], default=["ar", "ddtree"])
    ap.add_argument("--budget", type=int, default=12)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before the backend starts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()

    import jax
    import jax.numpy as jnp

    from ddtree_jax import compile_cache
    from ddtree_jax.generate import generate
    from ddtree_jax.shipped import load_shipped

    compile_cache.enable()
    seen = {}  # the compiled program and its arguments, as generate last called it
    lookup = compile_cache.executable

    def spy(jitted, args, static):
        seen["exe"], seen["args"] = lookup(jitted, args, static), args
        return seen["exe"]

    compile_cache.executable = spy
    shipped = load_shipped(args.checkpoints, dtype=jnp.dtype(args.dtype))
    prompt = np.random.default_rng(0).integers(4, shipped.target.config.vocab_size, size=(1, args.context))
    rows = []
    for method in args.methods:

        def call(m, method=method):
            return lambda: generate(
                shipped.target,
                None if method == "ar" else shipped.drafter,
                prompt.astype(np.int32),
                method=method,
                tree_budget=args.budget if method == "ddtree" else None,
                max_new_tokens=m,
                stop_token_ids=(),
            )

        rounds = float(np.asarray(call(args.tokens)().rounds).max())
        row = {
            "method": method,
            "host_ms": host_ms(call(1), args.repeats),
            "call_ms": call_ms(call(1), args.repeats),
            "full_ms": call_ms(call(args.tokens), max(3, args.repeats // 4)),
            "rounds": rounds,
        }
        call(1)()
        exe, (target, drafter, ids, lengths, stop, key, knobs) = seen["exe"], seen["args"]
        on_device = [jax.device_put(a) for a in (ids, lengths, stop, key, knobs)]
        direct = functools.partial(exe, target, drafter, *on_device)
        row["exe_host_ms"] = host_ms(direct, args.repeats)
        row["exe_call_ms"] = call_ms(direct, args.repeats)
        # The same, handed new host copies of the prompt, lengths, stop ids and knobs each call
        # (as generate does): new input buffers every call.
        fresh = functools.partial(with_fresh_inputs, exe, *seen["args"])
        row["exe_fresh_call_ms"] = call_ms(fresh, args.repeats)
        row["round_ms"] = (row["full_ms"] - row["call_ms"]) / rounds
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
