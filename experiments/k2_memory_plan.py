"""Per-device memory and collectives of Kimi-K2 on an 8-device mesh, from abstract params (no weights).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python experiments/k2_memory_plan.py --out k2_plan.json

For each expert storage (bf16, INT4), context and batch, `generate.lower` lowers the whole
jitted `generate` loop (prefill, then DDTree rounds of `--budget` nodes: draft, tree, verify,
accept, commit, in the while loop) for KIMI_K2 and a drafter of Kimi-K2.5-DFlash's shape, placed
on a ("data", "model") = (1, 8) mesh under `sharding.RULES` (heads, experts and vocabulary over
"model"; the latent cache split by sequence when 8 divides the batch, else replicated), and
compiles it.
`compiled.memory_analysis()` gives the per-device bytes of the arguments (weights), the output
and the temporaries (the caches live in the loop state, so they are temporaries). The compiled
HLO's collectives are counted by kind and by the computation they sit in (a layer scan's body
runs once per layer). Nothing is allocated. `--what verify` compiles only the verify forward.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import config, model, quant, sharding, weights
from ddtree_jax.cache import KVCache, cache_spec
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import lower as lower_generate

COLLECTIVE = re.compile(
    r"=\s+(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}


def collectives(hlo: str) -> list[dict]:
    """Every collective of an HLO module: kind, result bytes, and the computation holding it."""
    out, computation = [], None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[0].lstrip("%") if not line.startswith("ENTRY") else "ENTRY " + line.split()[1]
        m = COLLECTIVE.search(line)
        if m:
            nbytes = sum(
                BYTES.get(t, 8) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in SHAPE.findall(m[1])
            )
            out.append({"kind": m[2], "bytes": nbytes, "computation": computation})
    return out


def _sharded(abstract, decl, mesh):
    placement = sharding.shardings(abstract, weights.axes(decl), mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement)


def drafter_for(cfg: config.TargetConfig) -> dflash.DrafterConfig:
    """Kimi-K2.5-DFlash's shape, its taps moved inside a slice of fewer layers."""
    d = dflash.KIMI_K25_DFLASH
    if cfg.num_hidden_layers == d.num_target_layers:
        return d
    taps = tuple(sorted({round(i * (cfg.num_hidden_layers - 1) / 5) for i in range(6)}))
    return dataclasses.replace(d, target_layer_ids=taps, num_target_layers=cfg.num_hidden_layers)


def plan(
    cfg: config.TargetConfig, mesh, batch: int, context: int, what: str, budget: int, new: int, chunk: int = 512
) -> dict:
    """Compile `generate` (or the verify forward) for abstract, sharded params; per-device GB."""
    params = _sharded(weights.abstract(model.declare(cfg), jnp.bfloat16), model.declare(cfg), mesh)
    dcfg = drafter_for(cfg)
    dparams = _sharded(dflash.abstract_params(dcfg, jnp.bfloat16), dflash.declare(dcfg), mesh)
    t0 = time.time()
    tokens = budget + 1
    with jax.set_mesh(mesh):
        if what == "generate":
            prompt = context - new - dcfg.block_size
            ids = np.ones((batch, prompt), np.int32)
            lowered = lower_generate(
                params,
                dparams,
                ids,
                method="ddtree",
                tree_budget=budget,
                max_new_tokens=new,
                cache_capacity=context,
                stop_token_ids=(),
                numerics="fast",
                prefill_chunk=chunk,
            )
        else:
            cache = jax.eval_shape(lambda: KVCache.init(cfg, batch, context, jnp.bfloat16))
            s = jax.ShapeDtypeStruct
            fn = jax.jit(lambda p, c, tok, pos, m: model.forward(p, tok, pos, c, m, numerics="fast").hidden)
            i32 = (batch, tokens)
            lowered = fn.lower(params, cache, s(i32, jnp.int32), s(i32, jnp.int32), s((batch, tokens, tokens), bool))
        compiled = lowered.compile()
    ma = compiled.memory_analysis()
    colls = collectives(compiled.as_text())
    by_place = collections.defaultdict(lambda: collections.Counter())
    for c in colls:
        by_place[c["computation"]][c["kind"]] += 1

    def shard_bytes(tree):
        return sum(math.prod(p.sharding.shard_shape(p.shape)) * quant.bits(p.dtype) // 8 for p in jax.tree.leaves(tree))

    # Per device: split by sequence when the mesh divides the batch (`sharding`: "cache_batch").
    shape = (cfg.num_hidden_layers, batch, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    with jax.set_mesh(mesh):
        cache_sharding = jax.sharding.NamedSharding(mesh, cache_spec(batch))
    latent = math.prod(cache_sharding.shard_shape(shape)) * 2
    return {
        "what": what,
        "batch": batch,
        "context": context,
        "budget": budget,
        "prefill_chunk": chunk,
        "weights_gb": shard_bytes(params) / 1e9,
        "drafter_weights_gb": shard_bytes(dparams) / 1e9,
        "latent_cache_gb": latent / 1e9,
        "arguments_gb": ma.argument_size_in_bytes / 1e9,
        "temp_gb": ma.temp_size_in_bytes / 1e9,
        "output_gb": ma.output_size_in_bytes / 1e9,
        "collectives": {k: len([c for c in colls if c["kind"] == k]) for k in sorted({c["kind"] for c in colls})},
        "collective_bytes": {
            k: sorted({c["bytes"] for c in colls if c["kind"] == k}) for k in sorted({c["kind"] for c in colls})
        },
        "collectives_by_computation": {k: dict(v) for k, v in sorted(by_place.items())},
        "compile_s": time.time() - t0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="a slice of this many layers (default: all 61)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--what", choices=["generate", "verify"], default="generate")
    ap.add_argument("--budget", type=int, default=64, help="DDTree budget (verify: budget + 1 tokens per row)")
    ap.add_argument("--new", type=int, default=128, help="generate: max_new_tokens")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="generate: prefill_chunk")
    ap.add_argument("--experts", nargs="+", default=["int4", "bf16"], choices=["int4", "bf16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if jax.device_count() != 8:
        raise SystemExit(
            f"error: needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), got {jax.device_count()}"
        )
    mesh = sharding.make_mesh(data=1, model=8)
    rows = []
    print("| experts | batch | context | weights GB | arguments GB | temporaries GB | total GB | free of 141 GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for experts in args.experts:
        cfg = config.KIMI_K2
        if args.layers:
            cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers, first_k_dense_replace=min(1, args.layers - 1))
        if experts == "int4":
            cfg = dataclasses.replace(cfg, expert_int4_group_size=32)
        for context in args.contexts:
            for batch in args.batches:
                row = {
                    "experts": experts,
                    **plan(cfg, mesh, batch, context, args.what, args.budget, args.new, args.prefill_chunk),
                }
                row["total_gb"] = total = row["arguments_gb"] + row["temp_gb"] + row["output_gb"]
                rows.append(row)
                print(
                    f"| {experts} | {batch} | {context} | {row['weights_gb']:.1f} | {row['arguments_gb']:.1f} "
                    f"| {row['temp_gb']:.1f} | {total:.1f} | {141 - total:.1f} |",
                    flush=True,
                )
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
