"""Timing and roofline helpers shared by the kernels' benches.

`device_time` reads how long the device ran each call from a profiler trace (the
kernels on the GPU plane's stream lines, summed per call: the device's busy time),
so host dispatch, Python and launch gaps do not count. A call spread over several
GPUs (a sharded program) counts the busiest GPU's sum: the GPUs run their shares at
once. Off the GPU (the CPU backend), or where the trace has no GPU kernels, it times
wall-clock instead and says so.
"""

from __future__ import annotations

import collections
import glob
import statistics
import tempfile

import jax
import jax.numpy as jnp

from ddtree_jax import quant
from ddtree_jax.evaluation import time_call

PEAK_FLOPS = 797e12
"""Dense bf16 matmul rate measured on this project's H200 (jnp.dot of large bf16 matrices)."""
PEAK_BYTES = 3.3e12
"""Elementwise-copy bandwidth measured on the same machine (bytes read + written per s).
A kernel that only streams weights in can exceed it (the HBM3e spec is 4.8 TB/s), so
"% peak" above 100 means a read-only stream faster than that copy, not an error."""


def kernel_events(trace_dir: str) -> tuple[list[tuple[float, float, str, str]], list[str]]:
    """(start, duration) seconds, name and GPU plane ("/device:GPU:0", ...) of every kernel on
    a GPU stream in the trace in `trace_dir`, by start, and the (plane: line) names seen (to
    say why, when there are none)."""
    from jax.profiler import ProfileData

    out, seen = [], []
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            seen += [f"{plane.name}: {line.name}" for line in plane.lines]
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    out += [(e.start_ns * 1e-9, e.duration_ns * 1e-9, e.name, plane.name) for e in line.events]
    return sorted(out), seen


PROFILER = True
"""Whether `device_time` reads the profiler's trace on the GPU; False times wall-clock there too
(`--set ddtree_jax.pallas.bench_util.PROFILER=False`: to tell a fault of the profiler's from one
of the program's)."""

L2_BYTES = 50 * 2**20
"""An H200's L2 cache (50 MiB): inputs are rotated past it, so each call reads from HBM."""


def _rotations(args) -> int:
    """Copies of `args` whose total exceeds twice the L2 cache (at most 8; 1 off the GPU)."""
    if jax.default_backend() != "gpu":
        return 1
    nbytes = quant.nbytes([x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)])  # int4 at half a byte
    return max(1, min(8, -(-2 * L2_BYTES // max(nbytes, 1))))


def device_time(fn, args, reps: int) -> tuple[float, str]:
    """(median device seconds per call of fn(*args), "device" or "wall").

    On the GPU (with `PROFILER`): one untimed call compiles; `reps` calls run under the
    profiler, cycling through enough copies of `args` that no call finds its inputs in the L2
    cache left by the one before (`_rotations`). Each call's kernels (the same number every
    call) are summed; the median over the calls is returned. Otherwise, or where the trace
    cannot tell the calls apart, the median wall-clock time of `reps` calls.
    """
    # Off the GPU there is no device plane to read, and the profiler's stop costs seconds per
    # call in Mosaic GPU's interpreter (a trace event for each of its thousands of callbacks).
    if jax.default_backend() == "gpu" and PROFILER:
        sums = _kernel_sums(fn, args, reps)
        if sums is not None:
            return statistics.median(sums), "device"
    return time_call(lambda: fn(*args), reps)[0], "wall"


def _kernel_sums(fn, args, reps: int) -> list[float] | None:
    """Each of `reps` profiled calls' kernel seconds (`busiest_gpu_per_call`), or None, said."""
    fresh = lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x  # noqa: E731
    copies = [args] + [jax.tree.map(fresh, args) for _ in range(_rotations(args) - 1)]
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            for i in range(reps):
                jax.block_until_ready(fn(*copies[i % len(copies)]))
        finally:
            jax.profiler.stop_trace()
        events, seen = kernel_events(trace_dir)
    sums = busiest_gpu_per_call(events, reps)
    if sums is None:
        print(f"device_time: {len(events)} kernels for {reps} calls; trace lines: {sorted(set(seen))[:20]}")
    return sums


def busiest_gpu_per_call(events: list[tuple[float, float, str, str]], reps: int) -> list[float] | None:
    """Per call of `reps` calls in a row, the largest over the GPUs of that GPU's summed kernel
    seconds (`kernel_events`' events, by start); None when there are no events or a GPU's
    count is not a multiple of `reps` (the calls cannot be told apart)."""
    by_gpu = collections.defaultdict(list)
    for event in events:
        by_gpu[event[3]].append(event[1])
    if not events or any(len(d) % reps for d in by_gpu.values()):
        return None
    return [
        max(sum(d[i * (len(d) // reps) : (i + 1) * (len(d) // reps)]) for d in by_gpu.values()) for i in range(reps)
    ]


def kernel_table(fn, calls: int, top: int, per: float = 1.0, gpu: str | None = None) -> dict:
    """The kernels of `calls` calls of fn(), by name, from a profiler trace (GPU traces only).

    One untimed call compiles. Figures are per `per` units of work (a call: per = 1; a
    generate call of R rounds: per = R): "kernels" launched and "kernel_ms" summed over
    every kernel, and the `top` names by time. `gpu` ("/device:GPU:1") keeps one GPU's
    kernels; None sums every GPU's. "span_ms": from the first kernel's start to the last
    one's end, per call (with calls=1: the kernels plus the device's idle gaps between them).
    """
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            for _ in range(calls):
                jax.block_until_ready(fn())
        finally:
            jax.profiler.stop_trace()
        events, _ = kernel_events(trace_dir)
    events = [e for e in events if gpu is None or e[3] == gpu]
    n = calls * per
    totals, counts = collections.Counter(), collections.Counter()
    for _, duration, name, _ in events:
        totals[name] += duration
        counts[name] += 1
    span = max(s + d for s, d, _, _ in events) - min(s for s, _, _, _ in events) if events else 0.0
    return {
        "kernels": len(events) / n,
        "kernel_ms": 1e3 * sum(totals.values()) / n,
        "span_ms": 1e3 * span / calls,
        "top": [{"kernel": k, "ms": 1e3 * v / n, "launches": counts[k] / n} for k, v in totals.most_common(top)],
    }


def percent_of_peak(flops: float, nbytes: float, seconds: float) -> float:
    """The larger of the compute and the bandwidth fraction: whichever bound the shape is closer to."""
    return 100 * max(flops / seconds / PEAK_FLOPS, nbytes / seconds / PEAK_BYTES)


def table_header(against: str, impl: str = "impl") -> str:
    """The header and separator of `table_row`'s table: errors against `against`; `impl` names
    the implementation column."""
    columns = ["shape", impl, "ms", "timer", "TFLOP/s", "GB/s", "% peak", f"max abs err vs {against}"]
    return "| " + " | ".join(columns) + " |\n" + "| --- " * len(columns) + "|"


def table_row(
    name: str, impl: str, seconds: float, timer: str, flops: float, nbytes: float, err: float, *, digits=(3, 1)
) -> str:
    """A kernel bench's markdown row: ms, timer, TFLOP/s, GB/s, % of peak, max abs error.

    digits: decimals of the ms and the TFLOP/s columns."""
    ms, tf = digits
    return (
        f"| {name} | {impl} | {seconds * 1e3:.{ms}f} | {timer} | {flops / seconds / 1e12:.{tf}f} "
        f"| {nbytes / seconds / 1e9:.0f} | {percent_of_peak(flops, nbytes, seconds):.1f} | {err:.2e} |"
    )
