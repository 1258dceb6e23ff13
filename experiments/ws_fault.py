"""Hunt the warp-specialized MoE kernels' intermittent fault: many calls of one schedule, each
output checked, each schedule in a process of its own (a crash ends only that one).

    python3 experiments/ws_fault.py --out ws_fault.json            # GPU: the default schedules
    python3 experiments/ws_fault.py --smoke                        # CPU: shrunk, interpret mode
    python3 experiments/ws_fault.py --schedules w4a16,0 --tokens 16 33 --top-k 1 --stacked  # k2_shard's MoE

Two consumer warpgroups are refused compiled (`mosaic.refuse_two_consumers`): on an H200 the
bf16 kernel once crashed (CUDA_ERROR_LAUNCH_FAILED) and the W4A16 kernel once returned wrong
entries. This script lifts the refusal in its own child processes, on purpose, to find out
which schedules fail and how often: each child builds one EP-8 shard shape's inputs, computes
the one-warpgroup kernel's output (consumers 0) as the expected value, then calls the schedule
--calls times and compares every output with it. A row records the calls made, the calls
whose largest difference passed --tol times the expected output's largest magnitude, the first
such call and its error, and the child's exit status (a crash shows there, not as a row of
its own). Schedules: kernel (bf16 / w4a16), consumers (w4a16,0: `w4a16.TREE_TILES`, checked
against the XLA reference instead), and for bf16 release_delay (1: a slot
released one step after its wgmmas were issued; 0: once they are done). The W4A16 kernel waits
for every wgmma of a step since the first run of this script (docs/results/s27/ws_fault_h200.json:
with the one-step delay it had then, 972 of 1000 calls wrong at 8192 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

SCHEDULES = ("bf16,2,1", "bf16,2,0", "w4a16,2", "bf16,1,1", "w4a16,1")


def child(args) -> dict:
    import jax
    import jax.numpy as jnp

    from ddtree_jax.pallas import mosaic_interpret
    from ddtree_jax.pallas.moe import mosaic, w4a16
    from ddtree_jax.pallas.moe.bench import inputs
    from ddtree_jax.pallas.moe.reference import moe_experts_reference
    from ddtree_jax.pallas.shapes import MoEShape
    from ddtree_jax.quant import Int4

    kernel, consumers, *delay = args.schedule.split(",")
    consumers, delay = int(consumers), int(delay[0]) if delay else 1
    shape = MoEShape(tokens=args.tokens, top_k=args.top_k or 8)
    interpret = None
    if args.smoke:
        shape, interpret = (
            MoEShape(args.tokens, experts=8, top_k=args.top_k or 2, hidden=256, inter=128),
            mosaic_interpret(),
        )
    if interpret is None and consumers == 2:
        # On purpose, compiled in this child process alone: the schedule under test is the refused one.
        mosaic.refuse_two_consumers = lambda *a: None
    x, idx, w, *weights = inputs(shape, jax.random.PRNGKey(args.seed))
    layer = {}
    if args.stacked:  # as the model hands them over: a one-layer stack [1, E, ...] read at layer 0
        weights = [a[None] for a in weights]
        layer = {"layer": jnp.int32(0)}
    if kernel == "bf16":
        block_n = 64 if args.smoke else 128
        tiles = mosaic.MosaicMoETiles(block_n=block_n, stages=4, consumers=consumers, release_delay=delay)
        base = dataclasses.replace(tiles, consumers=0)
        run = lambda t: jax.jit(lambda *a: mosaic.moe_experts_mosaic(*a, tiles=t, interpret=interpret))  # noqa: E731
    else:
        weights = [Int4(32).quantize(a) for a in weights]
        if consumers == 0:  # the decode / tree default, checked against the XLA reference
            tiles, base = w4a16.TREE_TILES, None
        else:
            tiles = w4a16.W4A16Tiles(stages=4, consumers=consumers)
            base = dataclasses.replace(tiles, consumers=0, stages=2)
        run = lambda t: jax.jit(  # noqa: E731
            lambda x, idx, w, *ws: w4a16.moe_experts_w4a16(x, idx, w, *ws, tiles=t, interpret=interpret, **layer)
        )
    operands = (x, idx, w, *weights)
    if base is None:
        dense = [jax.tree.map(lambda a: a[0], q) for q in weights] if args.stacked else weights
        expected = moe_experts_reference(x.astype(jnp.float32), idx, w, *dense).astype(jnp.float32)
    else:
        expected = run(base)(*operands).astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(expected)))
    fn = run(tiles)
    bad, first, worst, start = 0, None, 0.0, time.monotonic()
    for i in range(args.calls):
        err = float(jnp.max(jnp.abs(fn(*operands).astype(jnp.float32) - expected)))
        worst = max(worst, err)
        if not err <= args.tol * scale:  # NaN counts as bad
            bad += 1
            first = first or {"call": i, "max_abs_err": err}
    return dict(
        schedule=args.schedule, tokens=args.tokens, tiles=str(tiles), calls=args.calls, bad_calls=bad,
        first_bad=first, worst_abs_err=worst, expected_max_abs=scale, seconds=time.monotonic() - start,
    )  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), help="kernel,consumers[,release_delay]")
    ap.add_argument("--tokens", type=int, nargs="+", default=[17, 8192])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--tol", type=float, default=1e-2, help="bad: a difference past this x the largest output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=0, help="experts a token (0: the shape's, 8; 2 with --smoke)")
    ap.add_argument(
        "--stacked", action="store_true", help="weights as a one-layer stack read at layer 0 (the model's way)"
    )
    ap.add_argument("--child-timeout", type=float, default=300.0)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="CPU: shrunk shapes, interpret mode")
    ap.add_argument("--schedule", help=argparse.SUPPRESS)  # set in a child
    args = ap.parse_args(argv)
    if args.schedule:
        args.tokens = args.tokens[0]
        print("ROW " + json.dumps(child(args)), flush=True)
        return
    rows = []
    for schedule in args.schedules:
        for tokens in args.tokens:
            cmd = [
                sys.executable,
                __file__,
                "--schedule",
                schedule,
                "--tokens",
                str(tokens),
                "--calls",
                str(args.calls),
            ]
            cmd += ["--tol", str(args.tol), "--seed", str(args.seed), "--top-k", str(args.top_k)]
            cmd += ["--smoke"] * args.smoke + ["--stacked"] * args.stacked
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, env=os.environ)
                rc, out, err = proc.returncode, proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, out, err = "timeout", e.stdout or "", e.stderr or ""
                out, err = (s.decode() if isinstance(s, bytes) else s for s in (out, err))
            found = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
            row = found[0] if found else {"schedule": schedule, "tokens": tokens}
            row["exit"] = rc
            if rc != 0:
                row["stderr_tail"] = [ln for ln in err.splitlines() if "Warning" not in ln][-6:]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
