"""Every kernel over Kimi-K2's shapes, each next to its baselines, in device time.

    python3 experiments/bench_kernels.py --out docs/results/kernels/bench_kernels_h200.json
    python3 experiments/bench_kernels.py --quick --out ...   # one context, batch 1
    python3 experiments/bench_kernels.py --smoke             # CPU: shrunk shapes, interpret mode

Absorbed-MLA attention: 64 heads (one GPU) and 8 (a TP-8 shard), contexts 4K / 32K /
128K, 1 / 17 / 33 / 65 / 129 query tokens (AR, trees of 16..128 nodes), batch 1 / 8.
Implementations: `xla` (the reference path), `mosaic` (the Mosaic GPU kernel; the
Triton-lowered one was removed once this beat it at every shape), and jax's `decode_attention.mqa` (Triton: the cache part
alone, no tree keys, queries and keys zero-padded to 1024 wide, see `_mqa`: a proxy). The XLA path is skipped where its float32 scores would pass 8 GB.

Routed experts of one EP-8 shard (48 experts, 7168 -> 2048, top-8, every pair local):
1 / 17 / 65 / 129 / 520 / 8192 tokens. Implementations: `xla`, `pallas`, `mosaic`,
`xla-int4` and `mosaic-int4` (the same weights quantized to INT4, group 32, on the XLA path
and on the W4A16 Mosaic kernel; checked against `xla-int4`) and `ragged_dot_mgpu` (jax's
Mosaic GPU grouped GEMM: gate, up and down as three ragged dots over the pairs sorted by expert).

Each row: device time (median of --reps calls, inputs rotated past the L2 cache), TFLOP/s,
GB/s and % of the H200 peaks (`bench_util`), and the largest error against the XLA path
(on the first sequence alone where all would not fit). Rows go to --out as they finish; a rerun
with the same --out skips the rows already there (resumable across calls), and
--budget-s stops starting new rows after that many seconds. A baseline of another project
(`BASELINES`) that does not take a shape gets a row saying why; this project's implementations
that raise, or miss their reference by more than `MAX_REL_ERR`, stop the run with an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import _settings
import jax
import jax.numpy as jnp

from ddtree_jax import compile_cache
from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.bench_util import device_time, percent_of_peak
from ddtree_jax.pallas.mla_attention import bench as mla_bench
from ddtree_jax.pallas.mla_attention.mosaic import mla_attention_mosaic
from ddtree_jax.pallas.mla_attention.reference import mla_attention_reference
from ddtree_jax.pallas.moe import bench as moe_bench
from ddtree_jax.pallas.moe.kernel import moe_experts_pallas
from ddtree_jax.pallas.moe.mosaic import moe_experts_mosaic
from ddtree_jax.pallas.moe.reference import moe_experts_xla
from ddtree_jax.pallas.moe.w4a16 import moe_experts_w4a16
from ddtree_jax.pallas.shapes import MLAShape, MoEShape
from ddtree_jax.quant import Int4

SCALE = 0.1
BASELINES = ("decode_attention.mqa", "ragged_dot_mgpu")
"""Other projects' kernels: a shape one of them does not take is a row saying why. Any other
implementation that raises, or strays past MAX_REL_ERR from its reference, stops the run."""
MAX_REL_ERR = 2e-2
"""Largest error against the reference, relative to the reference's largest magnitude (bf16
inputs and outputs against float32)."""
XLA_SCORES_MAX = 8e9
"""Bytes of float32 scores past which the XLA attention path is not run."""


def mla_shapes(quick: bool, smoke: bool = False) -> dict[str, MLAShape]:
    contexts = (32768,) if quick else (4096, 32768, 131072)
    batches = (1,) if quick else (1, 8)
    heads, tokens = ((8,), (1, 17)) if smoke else ((64, 8), (1, 17, 33, 65, 129))
    return {
        f"mla_{n}heads_ctx{s // 1024}k_t{t}_b{b}": MLAShape(b, t, n, s)
        for n in heads
        for s in contexts
        for b in batches
        for t in tokens
    }


def moe_shapes(quick: bool, smoke: bool = False) -> dict[str, MoEShape]:
    tokens = (1, 17) if smoke else (1, 65, 520) if quick else (1, 17, 65, 129, 520, 8192)
    return {f"moe_ep8_t{t}": MoEShape(t) for t in tokens}


def _mqa(q_lat, q_pe, keys, ckv, lens):
    """jax's Triton decode kernel over the cache alone (queries [B, T * N, R + P]).

    It takes values as wide as the keys, and (Triton) head dims that are powers of two:
    queries and keys [c_kv; k_pe] are zero-padded from R + P = 576 to 1024 before the
    timing, and the keys serve as the values. It so reads 1024 / 576 of the bytes it needs:
    a proxy, not a like-for-like baseline.
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    del ckv
    b, t, n, r = q_lat.shape
    q = jnp.concatenate([q_lat, q_pe], -1).reshape(b, t * n, -1)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, keys.shape[-1] - q.shape[-1])))
    # block_k 16: its default 256 keys x 1024 wide, keys and values double-buffered, asks
    # for 1.09 MB of shared memory (the H200 has 227 KB per block).
    return decode_attention.mqa(q, keys, keys, kv_seq_len=lens, sm_scale=SCALE, block_k=16)[..., :r]


def _pow2_keys(ckv, kpe):
    """[c_kv; k_pe] zero-padded to the next power of two (`_mqa`)."""
    keys = jnp.concatenate([ckv, kpe], -1)
    width = 1 << (keys.shape[-1] - 1).bit_length()
    return jnp.pad(keys, ((0, 0), (0, 0), (0, width - keys.shape[-1])))


def mla_impls(shape: MLAShape, smoke: bool):
    interpret = mosaic_interpret() if smoke else None
    impls = {
        "xla": jax.jit(lambda *a: mla_attention_reference(*a, SCALE)),
        "mosaic": jax.jit(lambda *a: mla_attention_mosaic(*a, scale=SCALE, interpret=interpret)),
    }
    if not smoke:
        impls["decode_attention.mqa"] = jax.jit(
            lambda q_lat, q_pe, ckv, kpe, lens, *_: _mqa(q_lat, q_pe, kpe, ckv, lens)
        )
    if 4 * shape.batch * shape.tokens * shape.heads * (shape.cache + shape.tokens) > XLA_SCORES_MAX:
        del impls["xla"]
    return impls


def _moe_ragged(x, idx, w, gate, up, down):
    """MoE on jax's `ragged_dot_mgpu`: pairs sorted by expert, three grouped GEMMs, the weighted sum."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    t, k = idx.shape
    e = gate.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    dot = functools.partial(
        ragged_dot_mgpu.ragged_dot,
        group_sizes=sizes,
        block_m=64,
        block_n=128,
        block_k=64,
        max_concurrent_steps=4,
        grid_block_n=1,
    )
    xs = x[order // k]
    g, u = dot(xs, gate), dot(xs, up)
    act = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
    ys = dot(act, down).astype(jnp.float32)
    out = jnp.zeros((t * k, x.shape[1]), jnp.float32).at[order].set(ys)
    return jnp.einsum("tkh,tk->th", out.reshape(t, k, -1), w).astype(x.dtype)


def moe_impls(smoke: bool):
    interpret = mosaic_interpret() if smoke else None
    impls = {
        "xla": jax.jit(moe_experts_xla),
        "pallas": jax.jit(lambda *a: moe_experts_pallas(*a, interpret=smoke)),
        "mosaic": jax.jit(lambda *a: moe_experts_mosaic(*a, interpret=interpret)),
        "xla-int4": jax.jit(moe_experts_xla),
        "mosaic-int4": jax.jit(lambda *a: moe_experts_w4a16(*a, interpret=interpret)),
    }
    if not smoke:
        impls["ragged_dot_mgpu"] = jax.jit(_moe_ragged)
    return impls


def _shrink_mla(shape: MLAShape) -> MLAShape:
    """The CPU version: widths Mosaic tiles (R 128, P 64), cache / 256 (at least one block)."""
    return dataclasses.replace(shape, cache=max(shape.cache // 256, 64), kv_lora_rank=128, rope_dim=64)


def _shrink_moe(shape: MoEShape) -> MoEShape:
    return dataclasses.replace(shape, tokens=min(shape.tokens, 17), experts=8, top_k=2, hidden=128, inter=128)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON rows (read first: rows already there are skipped)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="32K context and batch 1 only; fewer MoE sizes")
    ap.add_argument("--only", choices=("mla", "moe"), default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="start no new row after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="CPU check: shrunk shapes, interpret mode")
    _settings.add_argument(ap)
    args = ap.parse_args(argv)
    _settings.apply(args.set)
    if args.smoke:
        args.quick = True
    start = time.perf_counter()
    rows = []
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)["rows"]
    done = {(r["shape"], r["impl"]) for r in rows}
    device = jax.devices()[0].device_kind
    print(f"device: {device}")
    print("| shape | impl | ms | TFLOP/s | GB/s | % peak | max abs err | vs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def out_of_time():
        return args.budget_s is not None and time.perf_counter() - start > args.budget_s

    def record(name, impl, fn, operands, flops, nbytes, expected, against):
        if (name, impl) in done or out_of_time():
            return
        try:
            sec, timer = device_time(fn, operands, args.reps)
            got = fn(*operands)
        except Exception as err:
            if impl not in BASELINES:
                raise
            # a baseline that does not take the shape: say so, go on
            msg = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err) else type(err).__name__
            print(f"| {name} | {impl} | failed: {msg} |")
            rows.append(dict(shape=name, impl=impl, error=msg))
            return
        # An expected output of fewer sequences (the XLA path on the first, where all would not
        # fit) is compared with those rows.
        got = None if expected is None else got[: expected.shape[0]].astype(jnp.float32)
        err = None if expected is None else float(jnp.max(jnp.abs(got - expected)))
        largest = None if expected is None else float(jnp.max(jnp.abs(expected)))
        if err is not None and impl not in BASELINES and err > MAX_REL_ERR * largest:
            raise SystemExit(
                f"error: {name} {impl}: max abs error {err:.3e} against {against} (largest |reference| "
                f"{largest:.3e}, tolerance {MAX_REL_ERR:.0%} of it)"
            )
        row = dict(
            shape=name,
            impl=impl,
            ms=sec * 1e3,
            timer=timer,
            tflops=flops / sec / 1e12,
            gbps=nbytes / sec / 1e9,
            pct_peak=percent_of_peak(flops, nbytes, sec),
            max_abs_err=err,
            err_vs=against,
        )
        rows.append(row)
        print(
            f"| {name} | {impl} | {row['ms']:.3f} | {row['tflops']:.1f} | {row['gbps']:.0f} | {row['pct_peak']:.1f} "
            f"| {'-' if err is None else f'{err:.2e}'} | {against} |"
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=device, date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)

    if args.only in (None, "mla"):
        for name, shape in mla_shapes(args.quick, args.smoke).items():
            shape = _shrink_mla(shape) if args.smoke else shape
            impls = mla_impls(shape, args.smoke)
            if all((name, i) in done for i in impls):
                continue
            if out_of_time():  # the references below compile too: stop before them
                break
            x = mla_bench.inputs(shape, jax.random.PRNGKey(0))
            flops, nbytes = mla_bench.cost(shape)
            # The reference: the XLA path, on the first sequence alone where all of their scores
            # would not fit.
            if "xla" in impls:
                against, expected = "xla", impls["xla"](*x).astype(jnp.float32)
            else:
                first = [a[:1] for a in x]
                against = "xla, first sequence"
                expected = jax.jit(lambda *a: mla_attention_reference(*a, SCALE))(*first).astype(jnp.float32)
            for impl, fn in impls.items():
                if impl == "decode_attention.mqa":  # keys concatenated outside the timing
                    operands = (x[0], x[1], x[2], _pow2_keys(x[2], x[3]), x[4])
                    mqa_ref = _mqa_expected(x) if "xla" in impls else None
                    record(name, impl, fn, operands, flops, nbytes, mqa_ref, "float32, cache only")
                else:
                    record(name, impl, fn, x, flops, nbytes, expected, against)
    if args.only in (None, "moe"):
        int4 = Int4(32)
        for name, shape in moe_shapes(args.quick, args.smoke).items():
            if out_of_time():  # inputs and references compile too: stop before them
                break
            shape = _shrink_moe(shape) if args.smoke else shape
            x = moe_bench.inputs(shape, jax.random.PRNGKey(0))
            used = int(jnp.unique(x[1]).size)
            flops, nbytes = moe_bench.cost(shape, used)
            impls = moe_impls(args.smoke)
            if all((name, i) in done for i in impls):
                continue
            expected = impls["xla"](*x).astype(jnp.float32)
            # INT4 rows: the same weights quantized (group 32), checked against the XLA path on them.
            x4 = (*x[:3], *(int4.quantize(a) for a in x[3:]))
            expected4 = impls["xla-int4"](*x4).astype(jnp.float32)
            for impl, fn in impls.items():
                if impl.endswith("-int4"):
                    record(name, impl, fn, x4, flops, moe_bench.int4_bytes(shape, used), expected4, "xla-int4")
                else:
                    record(name, impl, fn, x, flops, nbytes, expected, "xla")
    print(f"{len(rows)} rows; {time.perf_counter() - start:.0f} s")


def _mqa_expected(x):
    """float32 attention over the cache alone (what `decode_attention.mqa` computes)."""
    q_lat, q_pe, ckv, kpe, lens = (a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in x[:5])
    b, t, n, _ = q_lat.shape
    s = (jnp.einsum("btnr,bsr->btns", q_lat, ckv) + jnp.einsum("btnp,bsp->btns", q_pe, kpe)) * SCALE
    s = jnp.where(jnp.arange(ckv.shape[1]) < lens[:, None, None, None], s, -jnp.inf)
    return jnp.einsum("btns,bsr->btnr", jax.nn.softmax(s, -1), ckv).reshape(b, t * n, -1)


if __name__ == "__main__":
    compile_cache.enable()
    main()
