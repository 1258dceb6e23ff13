"""Per-device memory of Kimi-K2 on an 8-device mesh, from abstract params (no weights).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python experiments/k2_memory_plan.py --out k2_plan.json

For each expert storage (bf16, INT4), context and batch, the target's verify forward of a
`--tokens`-token tree is lowered and compiled for a ("data", "model") = (1, 8) mesh under
`sharding.RULES` (heads, experts and vocabulary over "model"; the single-stream latent cache
replicated over "model"), and `compiled.memory_analysis()` gives the per-device bytes of the
arguments (weights + cache), the output and the temporaries. Nothing is allocated. This is the
forward a DDTree round runs, not the whole `generate` loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp

from ddtree_jax import config, model, sharding, weights
from ddtree_jax.cache import KVCache


def plan(cfg: config.TargetConfig, mesh, batch: int, context: int, tokens: int) -> dict:
    """Compile the verify forward for abstract, sharded params; per-device GB."""
    decl = model.declare(cfg)
    abstract = weights.abstract(decl, jnp.bfloat16)
    placement = sharding.shardings(abstract, weights.axes(decl), mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement)
    cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, context, jnp.bfloat16))
    s = jax.ShapeDtypeStruct
    fn = jax.jit(lambda p, c, tok, pos, m: model.forward(p, tok, pos, c, m, numerics="fast").hidden)
    t0 = time.time()
    with jax.set_mesh(mesh):
        compiled = fn.lower(
            params,
            cache,
            s((batch, tokens), jnp.int32),
            s((batch, tokens), jnp.int32),
            s((batch, tokens, tokens), bool),
        ).compile()
    ma = compiled.memory_analysis()
    weight_bytes = sum(math.prod(p.sharding.shard_shape(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(params))
    return {
        "batch": batch,
        "context": context,
        "tokens": tokens,
        "weights_gb": weight_bytes / 1e9,
        "arguments_gb": ma.argument_size_in_bytes / 1e9,
        "temp_gb": ma.temp_size_in_bytes / 1e9,
        "output_gb": ma.output_size_in_bytes / 1e9,
        "compile_s": time.time() - t0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="a slice of this many layers (default: all 61)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=65, help="verified tokens per row (a 64-node tree + root)")
    ap.add_argument("--experts", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if jax.device_count() != 8:
        raise SystemExit(
            f"error: needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), got {jax.device_count()}"
        )
    mesh = sharding.make_mesh(data=1, model=8)
    rows = []
    print("| experts | batch | context | weights GB | arguments GB | temporaries GB | total GB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for experts in args.experts:
        cfg = config.KIMI_K2
        if args.layers:
            cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers, first_k_dense_replace=min(1, args.layers - 1))
        if experts == "int4":
            cfg = dataclasses.replace(cfg, expert_int4_group_size=32)
        for context in args.contexts:
            for batch in args.batches:
                row = {"experts": experts, **plan(cfg, mesh, batch, context, args.tokens)}
                rows.append(row)
                total = row["arguments_gb"] + row["temp_gb"] + row["output_gb"]
                print(
                    f"| {experts} | {batch} | {context} | {row['weights_gb']:.1f} | {row['arguments_gb']:.1f} "
                    f"| {row['temp_gb']:.1f} | {total:.1f} |",
                    flush=True,
                )
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
