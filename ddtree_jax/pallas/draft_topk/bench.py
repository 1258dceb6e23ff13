"""Benchmark the drafter's log-softmax top-K on named shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.draft_topk.bench            # GPU: every shape, xla and pallas
    python -m ddtree_jax.pallas.draft_topk.bench --smoke    # CPU: shrunken shapes, interpret mode

Shapes: `pallas/shapes.py` (DRAFT_TOPK_SHAPES), float32 logits scaled by a temperature of 0.8 (the
CLI's default tree temperature at T = 0). "xla" is the dispatch's XLA path (a softmax kernel and
`topk.chunked_top_k`'s sorts), "reference" one `lax.top_k` of the row, "pallas" the kernel with
`DraftTopKTiles(one_pass=False)`, "pallas_one_pass" with the default tiles (`one_pass=True`). Times
are device time from a profiler trace (`bench_util.device_time`; "wall" where the backend gives
none). Bytes: the logits read once. Every output is checked against the reference: the ids must
match and the values agree to 1e-5; a mismatch fails the run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.pallas.bench_util import device_time, table_header, table_row
from ddtree_jax.pallas.draft_topk import api
from ddtree_jax.pallas.draft_topk.kernel import DraftTopKTiles
from ddtree_jax.pallas.draft_topk.reference import log_softmax_top_k_reference
from ddtree_jax.pallas.shapes import DRAFT_TOPK_SHAPES, DraftTopKShape

TOLERANCE = 1e-5
"""Largest difference of a kept log-probability from the reference's (float32 sums)."""


def logits(shape: DraftTopKShape, key) -> jax.Array:
    """Drafter-like float32 logits [B, D, V], rounded to 1/64 so that rows hold exact ties."""
    x = 4.0 * jax.random.normal(key, (shape.batch, shape.depths, shape.vocab), jnp.float32)
    return jnp.round(x * 64) / 64


def runs(k: int) -> dict:
    """Each implementation as a jitted function of (logits, temperature)."""
    return {
        "reference": jax.jit(lambda x, t: log_softmax_top_k_reference(x, k, t)),
        "xla": jax.jit(lambda x, t: api.log_softmax_top_k(x, k, t, implementation="xla")),
        "pallas": jax.jit(
            lambda x, t: api.log_softmax_top_k(x, k, t, implementation="pallas", tiles=DraftTopKTiles(one_pass=False))
        ),
        "pallas_one_pass": jax.jit(
            lambda x, t: api.log_softmax_top_k(x, k, t, implementation="pallas", tiles=DraftTopKTiles(one_pass=True))
        ),
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    names = list(DRAFT_TOPK_SHAPES)
    ap.add_argument("--shapes", nargs="+", default=names, choices=names)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU check: shapes.shrink()ed, interpret mode")
    args = ap.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}")
    print(table_header("reference"))
    bad = []
    t = jnp.float32(0.8)
    for name in args.shapes:
        shape = DRAFT_TOPK_SHAPES[name].shrink() if args.smoke else DRAFT_TOPK_SHAPES[name]
        x = logits(shape, jax.random.PRNGKey(0))
        want = None
        nbytes = 4 * x.size
        for impl, fn in runs(shape.k).items():
            values, ids = fn(x, t)
            if want is None:
                want = np.asarray(values), np.asarray(ids)
            err = float(np.max(np.abs(np.asarray(values) - want[0])))
            if err > TOLERANCE or not np.array_equal(np.asarray(ids), want[1]):
                bad.append(
                    f"{name} {impl}: max abs err {err:.3g}, ids equal: {np.array_equal(np.asarray(ids), want[1])}"
                )
            sec, timer = device_time(fn, (x, t), args.reps)
            print(table_row(name, impl, sec, timer, 5 * x.size, nbytes, err, digits=(4, 2)))
    if bad:
        raise SystemExit("outputs differ from the reference:\n" + "\n".join(bad))


if __name__ == "__main__":
    main()
