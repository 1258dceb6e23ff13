"""Kimi-K2's layers, sliced as N of a TP-8 / EP-8 deployment's 8 GPUs hold them, on 1 GPU and on N.

    python experiments/k2_mesh.py --gpus 2 --layers 4 --dtypes float32 --out k2_mesh_f32.json
    python experiments/k2_mesh.py --gpus 2 --layers 4 --dtypes bfloat16 --stages --out k2_mesh_bf16.json

The slice: `--layers` full-width layers of `--base` (default `kimi_k2`) with gpus / of (2 / 8) of
its attention heads, routed experts (INT4, group 32), vocabulary and dense-MLP units, the shared
expert whole, and top-(k * gpus / of) routing (top-2 of 96: each token keeps its expected share of
its 8 experts); a random-weight drafter of the K2.5 DFlash shape sliced the same way (query and KV
heads, MLP). On a ("data", "model") = (1, N) mesh each GPU then holds what one GPU of the full
deployment holds: 8 heads and 48 experts of each layer.

For each dtype, in one process:
- `generate` (every `--methods` entry; ddtree at each of `--budgets`) of the same random prompts
  on one GPU and on the N-GPU mesh: tokens (equal, or the first index where they part), rounds,
  tau, ms per round, tokens/s, compile seconds; on the GPU, the collectives' kernels of a round
  (NCCL kernels on GPU 0, device time per round) and the compiled loop's collectives (static
  count and bytes, ops in a layer scan counted once);
- with `--stages` (first), device time (busiest GPU) at a `--context`-token cache of the T-token verify
  (all layers + logits) and of one MoE layer's stages (attention, router, routed experts,
  shared expert, norms; the dense layer's MLP: `k2_shard.layer_stages`), on 1 GPU and on N, for each T in `--tokens`;
- the collectives alone on the mesh (`shard_map`): the all-reduce of [T, hidden] in bf16 and
  float32 (what attention's output projection and the expert-parallel MoE add over the mesh)
  the all-gather of the drafter's [block - 1, vocab] float32 logits over the vocabulary split, and
  the all-to-all of attention's [N, T, heads, latent] float32 queries from the head split to the
  sequence split (what a batch of N sequences, one a GPU, does each way at every layer).

Random weights route near ties, so bf16 tokens may part between the two placements (different
reduction orders); the float32 run is the exactness check.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from k2_memory_plan import collectives  # experiments/ is on sys.path when a script in it runs
from k2_shard import layer_slice, layer_stages, random_like, spread_router

from ddtree_jax import compile_cache, config, model, sharding
from ddtree_jax.cache import KVCache
from ddtree_jax.drafters import dflash
from ddtree_jax.evaluation import first_difference, time_call
from ddtree_jax.generate import generate, lower
from ddtree_jax.pallas.bench_util import device_time, kernel_table
from ddtree_jax.quant import nbytes

DRAFTERS = {"kimi_k2": dflash.KIMI_K25_DFLASH}


def slice_config(base: config.TargetConfig, gpus: int, of: int, layers: int) -> config.TargetConfig:
    """`layers` layers of `base` with gpus / of of its heads, routed experts, vocabulary and dense MLP."""

    def part(n: int, name: str) -> int:
        if (n * gpus) % of:
            raise SystemExit(f"{name}={n} of the base config does not split into {of} parts")
        return n * gpus // of

    return dataclasses.replace(
        base,
        num_hidden_layers=layers,
        num_attention_heads=part(base.num_attention_heads, "num_attention_heads"),
        intermediate_size=part(base.intermediate_size, "intermediate_size"),
        vocab_size=part(base.vocab_size, "vocab_size"),
        n_routed_experts=part(base.n_routed_experts, "n_routed_experts"),
        num_experts_per_tok=max(1, base.num_experts_per_tok * gpus // of),
        n_group=1,
        topk_group=1,
        expert_int4_group_size=32,
        bos_token_id=None,  # the base's ids may lie outside the slice's vocabulary
        eos_token_id=None,
    )


def drafter_slice_config(base: str, cfg: config.TargetConfig, gpus: int, of: int) -> dflash.DrafterConfig:
    """The base's DFlash drafter shape (or `drafter_config_for` a small base) sliced like the target."""
    if base not in DRAFTERS:
        return dflash.drafter_config_for(cfg, num_hidden_layers=1, block_size=4)
    d = DRAFTERS[base]
    return dataclasses.replace(
        d,
        num_attention_heads=d.num_attention_heads * gpus // of,
        num_key_value_heads=max(1, d.num_key_value_heads * gpus // of),
        intermediate_size=d.intermediate_size * gpus // of,
        vocab_size=cfg.vocab_size,
        mask_token_id=0,
        num_target_layers=cfg.num_hidden_layers,
        target_layer_ids=dflash.default_target_layer_ids(cfg.num_hidden_layers, d.num_hidden_layers),
    )


def build(cfg, dcfg, dtype, key):
    """Random target and drafter weights on the default device; the router unit-scale with a
    zero bias, so tokens spread over the experts."""
    target = spread_router(random_like(model.abstract_params(cfg, dtype), key), key)
    drafter = random_like(dflash.abstract_params(dcfg, dtype), jax.random.fold_in(key, 1))
    return target, drafter


COLLECTIVE_NAMES = (
    "nccl",
    "allreduce",
    "all_reduce",
    "all-reduce",
    "allgather",
    "all_gather",
    "alltoall",
    "all_to_all",
)
"""Kernel names of collectives: NCCL's, and XLA's own collective kernels."""


def is_collective(name: str) -> bool:
    return any(k in name.lower() for k in COLLECTIVE_NAMES)


def run_method(target, drafter, prompts, method, budget, args, mesh) -> dict:
    """One `generate` configuration: compile + first call, then `--reps` timed calls."""
    kw = dict(
        method=method,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=(),
        implementation=args.implementation,
        **({"tree_budget": budget} if method == "ddtree" else {}),
    )
    drafter = None if method == "ar" else drafter
    call = lambda: generate(target, drafter, prompts, **kw)  # noqa: E731
    t0 = time.perf_counter()
    first = jax.block_until_ready(call())
    compile_s = time.perf_counter() - t0
    seconds, res = time_call(call, args.reps, warmup=0)
    rounds = int(np.asarray(res.rounds).max())
    tokens = res.to_lists()
    row = {
        "tokens": tokens,
        "same_as_first_call": tokens == first.to_lists(),
        "rounds": rounds,
        "tau": res.tau,
        "seconds": seconds,
        "ms_per_round": 1e3 * seconds / rounds,
        "tokens_per_s": sum(map(len, tokens)) / seconds,
        "first_call_s": compile_s,
    }
    if mesh is not None:
        hlo = lower(target, drafter, prompts, **kw).compile().as_text()
        found = collectives(hlo)
        row["compiled_collectives"] = {
            kind: {
                "count": sum(c["kind"] == kind for c in found),
                "mb": sum(c["bytes"] for c in found if c["kind"] == kind) / 1e6,
            }
            for kind in sorted({c["kind"] for c in found})
        }
    if jax.default_backend() == "gpu":
        table = kernel_table(call, 1, 400, per=rounds, gpu="/device:GPU:0")
        comm = [k for k in table["top"] if is_collective(k["kernel"])]
        row["gpu0_per_round"] = {
            "kernels": table["kernels"],
            "kernel_ms": table["kernel_ms"],
            "collective_ms": sum(k["ms"] for k in comm),
            "collective_launches": sum(k["launches"] for k in comm),
            "collectives": comm,
            "top": table["top"][:30],
        }
    return row


def stage_times(params, cfg, args, t: int, mesh) -> dict:
    """Device times (busiest GPU) of the T-token verify and of one MoE layer's stages."""
    key = jax.random.PRNGKey(t)
    place = (lambda x: x) if mesh is None else (lambda x: jax.device_put(x, NamedSharding(mesh, P())))
    cache = KVCache.init(cfg, 1, args.context, jnp.bfloat16)
    cache = random_like(cache, key, std=1.0).replace(lengths=jnp.asarray([args.context - t], jnp.int32))
    cache = place(cache)
    tokens = place(jax.random.randint(key, (1, t), 0, cfg.vocab_size, jnp.int32))
    positions = jnp.arange(args.context - t, args.context, dtype=jnp.int32)[None]
    mask = model.causal_mask(jnp.asarray([t]), t)
    impl = args.implementation

    @jax.jit
    def verify(params, cache, tokens):
        out = model.forward(params, tokens, positions, cache, mask, implementation=impl, numerics="fast")
        return model.logits(params, out.hidden, numerics="fast")

    x = place(jax.random.normal(key, (1, t, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16))
    moe0, dense0 = layer_slice(params.moe_layers), layer_slice(params.dense_layers)
    stages = {
        "verify": (verify, (params, cache, tokens)),
        **layer_stages(cfg, moe0, dense0, cache, x, positions, mask, impl),
    }
    return {name: 1e3 * device_time(fn, a, args.reps)[0] for name, (fn, a) in stages.items()}


def collective_times(mesh, cfg, dcfg, tokens, reps) -> list[dict]:
    """Device time (busiest GPU) of the mesh's collectives alone, in `shard_map`."""
    axis = "model"
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis), mesh=mesh, in_specs=P(), out_specs=P()))
    rows = []
    for t in tokens:
        for dtype in (jnp.bfloat16, jnp.float32):
            x = jax.device_put(jnp.ones((t, cfg.hidden_size), dtype), NamedSharding(mesh, P()))
            ms = 1e3 * device_time(psum, (x,), reps)[0]
            rows.append({"op": "all-reduce", "shape": [t, cfg.hidden_size], "dtype": jnp.dtype(dtype).name, "ms": ms})
    gather = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True),
            mesh=mesh,
            in_specs=P(None, axis),
            out_specs=P(),
            check_vma=False,
        )
    )
    shape = (dcfg.block_size - 1, cfg.vocab_size)
    x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P(None, axis)))
    rows.append(
        {"op": "all-gather", "shape": list(shape), "dtype": "float32", "ms": 1e3 * device_time(gather, (x,), reps)[0]}
    )
    # At a batch the mesh divides, attention moves each sequence's latent queries from the head
    # split to the sequence split and its outputs back: one all-to-all each way per layer.
    n = mesh.shape[axis]
    to_rows = jax.jit(
        jax.shard_map(
            lambda q: jax.lax.all_to_all(q, axis, 0, 2, tiled=True),
            mesh=mesh,
            in_specs=P(None, None, axis, None),
            out_specs=P(axis, None, None, None),
            check_vma=False,
        )
    )
    for t in tokens:
        shape = (n, t, cfg.num_attention_heads, cfg.kv_lora_rank)
        q = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P(None, None, axis, None)))
        ms = 1e3 * device_time(to_rows, (q,), reps)[0]
        rows.append({"op": "all-to-all", "shape": list(shape), "dtype": "float32", "ms": ms})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="kimi_k2", choices=sorted(config.PRESETS))
    ap.add_argument("--gpus", type=int, default=2, help="devices of the mesh (1, gpus); the slice is gpus / of")
    ap.add_argument("--of", type=int, default=8, help="GPUs of the whole deployment the base would be split over")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="*", default=["ar", "dflash", "ddtree"], choices=["ar", "dflash", "ddtree"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--collective-reps", type=int, default=20, help="calls timed per collective (median)")
    ap.add_argument("--implementation", default="auto")
    ap.add_argument("--stages", action="store_true", help="also time the verify and one layer's stages")
    ap.add_argument("--stage-dtype", default="bfloat16", help="the dtype whose weights --stages times")
    ap.add_argument("--context", type=int, default=32768, help="cache positions for --stages")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 17, 33, 65, 129], help="T for --stages and collectives"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if jax.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus} but only {jax.device_count()} devices: {jax.devices()}")
    cfg = slice_config(config.PRESETS[args.base], args.gpus, args.of, args.layers)
    dcfg = drafter_slice_config(args.base, cfg, args.gpus, args.of)
    mesh = sharding.make_mesh(1, args.gpus, jax.devices()[: args.gpus])
    result = {"args": vars(args), "device": str(jax.devices()[0].device_kind), "runs": [], "stages": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["collectives"] = collective_times(mesh, cfg, dcfg, args.tokens, args.collective_reps)
    for r in result["collectives"]:
        print(json.dumps(r), flush=True)
    save()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (1, args.prompt_len)).tolist()
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        t0 = time.perf_counter()
        target, drafter = build(cfg, dcfg, dtype, jax.random.PRNGKey(0))
        target_s, drafter_s = sharding.shard_target(target, mesh), sharding.shard_drafter(drafter, mesh)
        print(
            f"{dtype_name}: target {nbytes(target) / 1e9:.2f} GB, drafter {nbytes(drafter) / 1e9:.2f} GB, "
            f"built and placed in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        if args.stages and dtype_name == args.stage_dtype:
            for t in args.tokens:
                row = {"dtype": dtype_name, "context": args.context, "tokens": t}
                row["one_ms"] = stage_times(target, cfg, args, t, None)
                with sharding.use_mesh(mesh, sharding.placed_rules(target_s)):
                    row["mesh_ms"] = stage_times(target_s, cfg, args, t, mesh)
                result["stages"].append(row)
                print(json.dumps(row), flush=True)
                save()
        configs = [(m, None) for m in args.methods if m != "ddtree"]
        configs += [("ddtree", b) for b in args.budgets if "ddtree" in args.methods]
        for method, budget in configs:
            row = {"dtype": dtype_name, "method": method, "budget": budget}
            for name, (t, d, m) in {"one": (target, drafter, None), "mesh": (target_s, drafter_s, mesh)}.items():
                try:
                    row[name] = run_method(t, d, prompts, method, budget, args, m)
                except Exception as e:  # one failing placement must not lose the others' figures
                    traceback.print_exc()
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            if "tokens" in row["one"] and "tokens" in row["mesh"]:
                row["first_divergence"] = first_difference(row["one"]["tokens"][0], row["mesh"]["tokens"][0])
            result["runs"].append(row)
            brief = {k: v for k, v in row.items() if k not in ("one", "mesh")}
            for name in ("one", "mesh"):
                brief[name] = {k: row[name].get(k) for k in ("ms_per_round", "tau", "first_call_s", "error")}
                if "gpu0_per_round" in row[name]:
                    brief[name]["collective_ms"] = row[name]["gpu0_per_round"]["collective_ms"]
            print(json.dumps(brief), flush=True)
            save()
        del target, drafter, target_s, drafter_s
        gc.collect()
    bad = [
        (r["method"], r["budget"])
        for r in result["runs"]
        if r["dtype"] == "float32" and r.get("first_divergence", 0) is not None
    ]
    if bad:
        raise SystemExit(f"MISMATCH: float32 tokens on {args.gpus} devices differ from one device's for {bad}")


if __name__ == "__main__":
    compile_cache.enable()
    main()
