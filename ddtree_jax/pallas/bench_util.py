"""Timing and roofline helpers shared by the kernels' bench entries."""

from __future__ import annotations

import statistics
import time

import jax

PEAK_FLOPS = 797e12
"""Dense bf16 matmul rate measured on this project's H200 (shared/reference/gpu-anchors.md)."""
PEAK_BYTES = 3.3e12
"""Copy bandwidth measured on the same machine, bytes/s."""


def median_time(fn, args, reps: int) -> float:
    """Median wall seconds of fn(*args) over `reps` calls, after one untimed (compiling) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percent_of_peak(flops: float, nbytes: float, seconds: float) -> float:
    """The larger of the compute and the bandwidth fraction: whichever bound the shape is closer to."""
    return 100 * max(flops / seconds / PEAK_FLOPS, nbytes / seconds / PEAK_BYTES)
