"""Benchmark the drafter layer's QKV projection on named shapes; prints % of the measured H200 peak.

    python -m ddtree_jax.pallas.drafter_layer.bench            # GPU: every shape, xla and pallas
    python -m ddtree_jax.pallas.drafter_layer.bench --smoke    # CPU: shrunken shapes, interpret mode

Shapes: `pallas/shapes.py` (DRAFTER_LAYER_SHAPES), bf16. Times are device time from a profiler
trace (`bench_util.device_time`; "wall" where the backend gives none). Costs count the weights
read once. A call is the input norm, the QKV projection, the q / k norms and RoPE. Every kernel
output is checked against the XLA path; a mismatch fails the run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from ddtree_jax.pallas.bench_util import device_time, table_header, table_row
from ddtree_jax.pallas.drafter_layer import api
from ddtree_jax.pallas.shapes import DRAFTER_LAYER_SHAPES, DrafterLayerShape

TOLERANCE = 3e-2
"""Largest max-abs error allowed, relative to the XLA output's largest magnitude (bf16 rounding)."""


class Layer:
    """The weights `api.drafter_qkv` reads, as a drafter layer holds them."""

    def __init__(self, shape: DrafterLayerShape, key, dtype=jnp.bfloat16):
        h, hd = shape.hidden, shape.head_dim
        ks = jax.random.split(key, 6)

        def w(k, *dims, scale):
            return (scale * jax.random.normal(k, dims, jnp.float32)).astype(dtype)

        self.input_norm = (1 + 0.1 * jax.random.normal(ks[0], (h,))).astype(dtype)
        self.q = w(ks[1], h, shape.heads, hd, scale=h**-0.5)
        self.k = w(ks[2], h, shape.kv_heads, hd, scale=h**-0.5)
        self.v = w(ks[3], h, shape.kv_heads, hd, scale=h**-0.5)
        self.q_norm = (1 + 0.1 * jax.random.normal(ks[4], (hd,))).astype(dtype)
        self.k_norm = (1 + 0.1 * jax.random.normal(ks[5], (hd,))).astype(dtype)


def inputs(shape: DrafterLayerShape, key, dtype=jnp.bfloat16):
    """(x [B, T, H], cos, sin [B, T, hd / 2]) at positions 1000 .. 1000 + T - 1."""
    b, t, hd = shape.batch, shape.tokens, shape.head_dim
    x = jax.random.normal(key, (b, t, shape.hidden), jnp.float32).astype(dtype)
    pos = 1000.0 + jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32), (b, t))
    freqs = pos[..., None] * (10000.0 ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    return x, jnp.cos(freqs), jnp.sin(freqs)


def weight_bytes(shape: DrafterLayerShape) -> int:
    """bf16 weight bytes of the QKV projection."""
    return 2 * shape.hidden * (shape.heads + 2 * shape.kv_heads) * shape.head_dim


def run(layer: Layer, impl: str):
    """The call of `impl` as a jitted function of (x, cos, sin)."""
    joint = api.JointQKV.of(layer)
    return jax.jit(lambda x, c, s: api.drafter_qkv(x, layer, c, s, 1e-6, joint=joint, implementation=impl))


def main(argv=None):
    ap = argparse.ArgumentParser()
    names = list(DRAFTER_LAYER_SHAPES)
    ap.add_argument("--shapes", nargs="+", default=names, choices=names)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU check: shapes.shrink()ed, interpret mode")
    args = ap.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}")
    print(table_header("xla"))
    bad = []
    for name in args.shapes:
        shape = DRAFTER_LAYER_SHAPES[name].shrink() if args.smoke else DRAFTER_LAYER_SHAPES[name]
        layer = Layer(shape, jax.random.PRNGKey(0))
        x = inputs(shape, jax.random.PRNGKey(1))
        nbytes = weight_bytes(shape)
        flops = shape.batch * shape.tokens * nbytes  # 2 flops a weight (2 bytes) a row
        xla = run(layer, "xla")
        want = [a.astype(jnp.float32) for a in xla(*x)]
        scale = max(float(jnp.max(jnp.abs(w))) for w in want)
        for impl, fn in (("xla", xla), ("pallas", run(layer, "pallas"))):
            got = [a.astype(jnp.float32) for a in fn(*x)]
            err = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want, strict=True))
            if err > TOLERANCE * scale:
                bad.append(f"{name} {impl}: max abs err {err:.3g} against {scale:.3g}")
            sec, timer = device_time(fn, x, args.reps)
            print(table_row(name, impl, sec, timer, flops, nbytes, err, digits=(4, 2)))
    if bad:
        raise SystemExit("kernel output differs from the XLA path:\n" + "\n".join(bad))


if __name__ == "__main__":
    main()
