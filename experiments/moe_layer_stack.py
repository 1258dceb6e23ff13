"""Routed experts over a stack of layers: what a layer's slice of the stacked weights costs a kernel.

    python3 experiments/moe_layer_stack.py --out moe_layer_stack.json
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python3 experiments/moe_layer_stack.py ...

The model keeps each kind of layer's weights stacked ([L, E, ...]) and runs the layers with
`lax.scan` (or unrolled, for few layers); each layer's routed experts reach `moe_experts` as
a slice of the stack. On the 4-layer Kimi-K2 shard the W4A16 kernel, 10x faster than the XLA
path alone, made the whole verify slower (docs/scaling.md). This isolates that: L layers of
one EP-8 shard's routed experts (48 experts, 7168 -> 2048, top-8 of the 48), each layer's
output fed to the next, for every combination of
  weights: "int4" (the grouped INT4 layout) or "bf16";
  loop: "scan" (lax.scan over the stacks), "unrolled" (a Python loop of static slices) or
    "indexed" (lax.scan over layer indices, the whole stacks handed to `moe_experts` with
    `layer=`: the Mosaic kernels index the stack in place);
  implementation: "xla" or "mosaic" (the W4A16 / bf16 Mosaic GPU kernels);
against the same experts called once per layer with that layer's own arrays ("alone", no
slicing: the floor). Each row: device time per call (median of --reps, inputs rotated past
the L2), the largest difference from the first row's output (relative to its largest
value: every row computes the same layers), and, from the compiled HLO, the copies and dynamic slices XLA placed (count and
output bytes), so a row that is slow by a copy of every layer's experts says so.
"""

from __future__ import annotations

import argparse
import json
import re

import _settings
import jax
import jax.numpy as jnp

from ddtree_jax import compile_cache, quant
from ddtree_jax.pallas import mosaic_interpret
from ddtree_jax.pallas.bench_util import device_time
from ddtree_jax.pallas.moe import moe_experts

SHAPE = dict(experts=48, hidden=7168, inter=2048, top_k=8)
SMOKE = dict(experts=4, hidden=128, inter=128, top_k=2)

# One array-valued HLO instruction: "%name = type[dims]{layout} opcode(".
_INSTR = re.compile(r"%([\w.\-]+)\s*=\s*([a-z]+[0-9]*)\[([0-9,]*)\]\S*\s+(copy|dynamic-slice|slice|fusion)\(")
_BITS = {"s4": 4, "u4": 4, "s8": 8, "u8": 8, "bf16": 16, "f16": 16, "s32": 32, "f32": 32}


def hlo_moves(text: str) -> dict:
    """Count and output bytes of the copies, slices and dynamic slices in compiled HLO text
    (fusions by their name: XLA names a fusion after its root, "copy_fusion", "slice_fusion")."""
    out: dict = {}
    for name, dtype, dims, op in _INSTR.findall(text):
        if op == "fusion":
            op = next((o for o in ("dynamic-slice", "dynamic_slice", "slice", "copy") if o in name), None)
            if op is None:
                continue
            op = op.replace("_", "-")
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        row = out.setdefault(op, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += n * _BITS.get(dtype, 32) // 8
    return out


def stack_weights(key, layers: int, e: int, h: int, i: int, int4: bool):
    """gate, up, down stacks [L, E, ...]: int4 grouped or bf16."""
    ks = jax.random.split(key, 3)
    shapes = ((layers, e, h, i), (layers, e, h, i), (layers, e, i, h))
    out = []
    for k, s in zip(ks, shapes, strict=True):
        w = jax.random.normal(k, s, jnp.float32) * s[2] ** -0.5
        out.append(jax.jit(quant.Int4(32).quantize)(w) if int4 else w.astype(jnp.bfloat16))
    return tuple(out)


def _layer(impl: str):
    def layer(x, idx, w, g, u, d, li=None):
        return x + moe_experts(x, idx, w, g, u, d, layer=li, implementation=impl)

    return layer


def make_fn(loop: str, impl: str, stacks):
    """(fn, operands before x's routing): fn(x, idx [L, T, K], w [L, T, K], *operands) runs the layers.

    "scan" / "unrolled" take the stacks and slice them in the jitted function; "alone" slices
    them here, once, and calls a jitted layer per layer on its own arrays.
    """
    layer = _layer(impl)
    if loop == "alone":
        one = jax.jit(layer)
        per_layer = [jax.tree.map(lambda v, li=li: v[li], stacks) for li in range(jax.tree.leaves(stacks)[0].shape[0])]

        def alone(x, idx, w):
            for li, (g, u, d) in enumerate(per_layer):
                x = one(x, idx[li], w[li], g, u, d)
            return x

        return alone, ()

    def fn(x, idx, w, gate, up, down):
        if loop == "indexed":
            n = idx.shape[0]
            body = lambda x, xs: (layer(x, *xs[:2], gate, up, down, xs[2]), None)  # noqa: E731
            return jax.lax.scan(body, x, (idx, w, jnp.arange(n, dtype=jnp.int32)))[0]
        if loop == "scan":
            return jax.lax.scan(lambda x, xs: (layer(x, *xs), None), x, (idx, w, gate, up, down))[0]
        for li in range(idx.shape[0]):
            take = lambda a, li=li: jax.tree.map(lambda v: v[li], a)  # noqa: E731
            x = layer(x, idx[li], w[li], take(gate), take(up), take(down))
        return x

    return jax.jit(fn), stacks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 33])
    ap.add_argument("--weights", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
    ap.add_argument("--impl", nargs="+", default=["xla", "mosaic"], choices=["xla", "mosaic"])
    ap.add_argument("--loops", nargs="+", default=["alone", "scan", "unrolled", "indexed"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU check: 4 experts of 128 x 128, interpret mode")
    _settings.add_argument(ap)
    args = ap.parse_args(argv)
    _settings.apply(args.set)
    if args.smoke and mosaic_interpret() is None:
        raise SystemExit("--smoke is the CPU check (Mosaic GPU's interpret mode)")
    e, h, i, k = (SMOKE if args.smoke else SHAPE).values()
    key = jax.random.PRNGKey(0)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}")
    print("| weights | tokens | impl | loop | ms | rel err | copies (count, MB) | dynamic slices (count, MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in args.weights:
        stacks = stack_weights(key, args.layers, e, h, i, kind == "int4")
        for t in args.tokens:
            kx, ki, kw = jax.random.split(jax.random.fold_in(key, t), 3)
            x = jax.random.normal(kx, (t, h), jnp.bfloat16)
            scores = jax.random.uniform(ki, (args.layers, t, e))
            idx = jnp.argsort(scores, axis=-1)[..., :k].astype(jnp.int32)
            w = jax.random.uniform(kw, (args.layers, t, k), jnp.float32) / k
            expected = None  # the first row's output: every row computes the same layers
            for impl in args.impl:
                for loop in args.loops:
                    fn, rest = make_fn(loop, impl, stacks)
                    operands = (x, idx, w, *rest)
                    text = "" if loop == "alone" else fn.lower(*operands).compile().as_text()
                    try:
                        sec, timer = device_time(fn, operands, args.reps)
                    except Exception as err:  # report, go on
                        msg = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                        print(f"| {kind} | {t} | {impl} | {loop} | failed: {msg} |")
                        rows.append(dict(weights=kind, tokens=t, impl=impl, loop=loop, error=msg))
                        continue
                    got = fn(*operands).astype(jnp.float32)
                    expected = got if expected is None else expected
                    err = float(jnp.max(jnp.abs(got - expected)) / jnp.max(jnp.abs(expected)))
                    moves = hlo_moves(text)
                    row = dict(
                        weights=kind, tokens=t, impl=impl, loop=loop, ms=sec * 1e3, timer=timer, rel_err=err, hlo=moves
                    )
                    rows.append(row)
                    c, d = moves.get("copy", {}), moves.get("dynamic-slice", {})
                    print(
                        f"| {kind} | {t} | {impl} | {loop} | {row['ms']:.3f} | {err:.1e} | {c.get('count', 0)}, "
                        f"{c.get('bytes', 0) / 1e6:.1f} | {d.get('count', 0)}, {d.get('bytes', 0) / 1e6:.1f} |"
                    )
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(
                                dict(device=jax.devices()[0].device_kind, args=vars(args), rows=rows), f, indent=1
                            )


if __name__ == "__main__":
    compile_cache.enable()
    main()
