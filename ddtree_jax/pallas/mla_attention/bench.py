"""Benchmark absorbed-MLA attention on named real shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.mla_attention.bench                 # GPU: every shape, xla and mosaic
    python -m ddtree_jax.pallas.mla_attention.bench --smoke         # CPU: shrunken shapes, interpret mode

Shapes: `pallas/shapes.py` (MLA_SHAPES), bf16. Times are device time from a profiler
trace ("timer" says "wall" where the backend gives none, e.g. the CPU). Peaks are
`bench_util.PEAK_FLOPS` / `PEAK_BYTES`, measured on this project's H200. "% peak" is the
larger of the compute and the memory fraction: whichever bound the shape is closer to.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ddtree_jax.pallas.bench_util import device_time, table_header, table_row
from ddtree_jax.pallas.mla_attention.mosaic import MosaicMLATiles, mla_attention_mosaic
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
from ddtree_jax.pallas.shapes import MLA_SHAPES, MLAShape


def inputs(shape: MLAShape, key, ragged: bool = False):
    """Random bf16 operands of one call (a causal mask among the new tokens): the cache full
    (lengths S), or with `ragged` holding S - T entries, as a verify whose new tokens end at the
    cache's last slot (`experiments/k2_shard.py`): the last cache block partly visible."""
    b, t, n, s, r, p = shape.batch, shape.tokens, shape.heads, shape.cache, shape.kv_lora_rank, shape.rope_dim
    ks = jax.random.split(key, 6)
    bf = jnp.bfloat16
    causal = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
    return (
        jax.random.normal(ks[0], (b, t, n, r), bf),
        jax.random.normal(ks[1], (b, t, n, p), bf),
        jax.random.normal(ks[2], (b, s, r), bf),
        jax.random.normal(ks[3], (b, s, p), bf),
        jnp.full((b,), s - t if ragged else s, jnp.int32),
        jax.random.normal(ks[4], (b, t, r), bf),
        jax.random.normal(ks[5], (b, t, p), bf),
        causal,
    )


def cost(shape: MLAShape) -> tuple[int, int]:
    """(FLOPs, bytes) of one call: scores and values over cache + new keys; the cache,
    the new entries and the queries read once."""
    b, t, n, s, r, p = shape.batch, shape.tokens, shape.heads, shape.cache, shape.kv_lora_rank, shape.rope_dim
    return 2 * b * t * n * (s + t) * (2 * r + p), 2 * b * (s + t) * (r + p) + 2 * b * t * n * (2 * r + p)


def _tiles(ap: argparse.ArgumentParser, spec: str) -> MosaicMLATiles:
    """--mosaic-tiles' block_k,stages,num_splits[,new_in_kernel] (num_splits 0: chosen per shape)."""
    try:
        bk, st, ns, *nik = (int(v) for v in spec.split(","))
        if len(nik) > 1:
            raise ValueError("more than 4 fields")
        return MosaicMLATiles(block_k=bk, stages=st, num_splits=ns or None, new_in_kernel=nik[0] if nik else 0)
    except ValueError as e:
        ap.error(f"--mosaic-tiles {spec!r}: want block_k,stages,num_splits[,new_in_kernel] ({e})")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(MLA_SHAPES), choices=list(MLA_SHAPES))
    ap.add_argument("--impl", nargs="+", default=["xla", "mosaic"], choices=["xla", "mosaic"])
    m = MosaicMLATiles()
    ap.add_argument(
        "--mosaic-tiles",
        nargs="+",
        default=[f"{m.block_k},{m.stages},0"],
        help="Mosaic tiles to try, each block_k,stages,num_splits[,new_in_kernel] (num_splits 0: chosen "
        "per shape; new_in_kernel, default 0: the most new tokens the kernel attends itself)",
    )
    ap.add_argument("--ragged", action="store_true", help="cache lengths S - T, not S (see `inputs`)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU check: shapes.shrink()ed, interpret mode")
    args = ap.parse_args(argv)
    tiles = {spec: _tiles(ap, spec) for spec in args.mosaic_tiles}
    print(f"device: {jax.devices()[0].device_kind}")
    print(table_header("xla"))
    xla = jax.jit(lambda *a: mla_attention_reference(*a, 0.1))
    for name in args.shapes:
        shape = MLA_SHAPES[name].shrink() if args.smoke else MLA_SHAPES[name]
        r, p = shape.kv_lora_rank, shape.rope_dim
        x = inputs(shape, jax.random.PRNGKey(0), args.ragged)
        flops, nbytes = cost(shape)
        expected = xla(*x)
        runs = [("xla", xla)] if "xla" in args.impl else []
        if "mosaic" in args.impl and args.smoke:
            print(f"| {name} | mosaic | skipped: the shrunk widths (R={r}, P={p}) are below its tiles |")
        elif "mosaic" in args.impl:
            for spec, mt in tiles.items():
                label = "mosaic" if len(tiles) == 1 else f"mosaic {spec}"
                runs.append((label, jax.jit(lambda *a, mt=mt: mla_attention_mosaic(*a, scale=0.1, tiles=mt))))
        for impl, fn in runs:
            try:
                sec, timer = device_time(fn, x, args.reps)
            except Exception as err:  # a tile config the compiler rejects: report it, go on
                print(f"| {name} | {impl} | failed: {type(err).__name__}: {str(err).splitlines()[0][:160]} |")
                continue
            err = float(jnp.max(jnp.abs(fn(*x) - expected)))
            print(table_row(name, impl, sec, timer, flops, nbytes, err))


if __name__ == "__main__":
    main()
