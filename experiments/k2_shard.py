"""One GPU's share of Kimi-K2 under TP-8 (heads) x EP-8 (experts), built and timed on one GPU.

    python -m ddtree_jax eval --prompts humaneval --methods dflash ddtree --budgets 16 32 64 128 --out tau.json
    python experiments/k2_shard.py --tau-file tau.json --out k2_shard.json   # all 61 layers (~75 GB)

The shard: `KIMI_K2` with 8 of its 64 heads, 48 of its 384 routed experts (INT4, group 32),
1/8 of the vocabulary and of the dense first layer's MLP; the shared expert whole (TP would split
it 8 ways: its measured time is divided by 8 in the projection). Routing keeps one expert per
token, top-1 of the 48 local ones: EP-8 leaves on average 1 of a token's 8 expert pairs on each
GPU. Random weights are drawn on the device, never as dense experts. Batch 1.

For each context and tree size T (1 = an AR step; budget + 1 nodes for a tree), device time
(`pallas.bench_util.device_time`, the profiler's kernel times) of:
- the whole shard's verify: the forward of all layers over T tokens plus the logits of the T rows;
- each stage of one MoE layer: attention (MLA with its projections, over the cache), the router,
  the routed experts, the shared expert; and the dense layer's MLP;
with the bytes each must read (weights touched + cache), the distinct experts the T tokens touch,
and the fraction of the HBM bandwidth measured by a copy in the same run.

The 8-GPU projection adds, per layer, two all-reduces of [T, 7168] bf16 (attention output, MoE
output) and two for the embedding and the logits: with `--collectives`, the all-reduce times that
`experiments/k2_mesh.py` measured on a GPU mesh (bf16 [T, 7168], the nearest measured T at or
above); else an assumed latency (`--allreduce-us`) plus bytes over an assumed 450 GB/s (`--link-gbs`);
tokens/s at the shipped pair's tau measured by `python -m ddtree_jax eval` (`--tau-file`). The drafter's share (KIMI_K25_DFLASH with
8 of 64 query heads, 1 of 8 KV heads, 1/8 of its MLP) is timed the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import _settings
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import compile_cache, config, model
from ddtree_jax.cache import KVCache
from ddtree_jax.drafters import dflash
from ddtree_jax.layers import rms_norm, rope_tables, swiglu
from ddtree_jax.pallas.bench_util import device_time
from ddtree_jax.pallas.moe import moe_experts
from ddtree_jax.quant import QuantizedArray, nbytes

TP = EP = 8


def shard_config(layers: int) -> config.TargetConfig:
    k2 = config.KIMI_K2
    return dataclasses.replace(
        k2,
        num_hidden_layers=layers,
        num_attention_heads=k2.num_attention_heads // TP,
        intermediate_size=k2.intermediate_size // TP,
        vocab_size=k2.vocab_size // TP,
        n_routed_experts=k2.n_routed_experts // EP,
        num_experts_per_tok=1,
        expert_int4_group_size=32,
        bos_token_id=None,  # K2's ids lie outside the shard's 1/8 of the vocabulary
        eos_token_id=None,
    )


def drafter_shard_config(vocab: int) -> dflash.DrafterConfig:
    d = dflash.KIMI_K25_DFLASH
    return dataclasses.replace(
        d,
        num_attention_heads=d.num_attention_heads // TP,
        num_key_value_heads=d.num_key_value_heads // TP,
        intermediate_size=d.intermediate_size // TP,
        vocab_size=vocab,
        mask_token_id=0,
    )


def random_like(abstract, key, std: float = 0.02, one_jit_below: int = 2**30):
    """Device arrays shaped like `abstract` (arrays or shape structs): uniform int4 values for
    packed INT4, std * N(0, 1) otherwise (norms and INT4 scales included); one leaf per jit, so
    the peak is one leaf (all leaves in one jit below `one_jit_below` bytes, where per-leaf
    compiles would cost more than the draws)."""
    leaves, treedef = jax.tree.flatten(abstract)
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]  # hashable: a static argument
    keys = jax.random.split(key, len(leaves))

    def draw(k, a):
        if a.dtype == jnp.int4:
            return jax.random.randint(k, a.shape, -8, 8, jnp.int8).astype(jnp.int4)
        return (std * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)

    if nbytes(leaves) < one_jit_below:
        out = jax.jit(lambda ks: [draw(k, a) for k, a in zip(ks, leaves, strict=True)])(keys)
        return jax.tree.unflatten(treedef, out)
    out = [jax.block_until_ready(jax.jit(draw, static_argnums=1)(k, a)) for k, a in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, out)


def layer_slice(stack, i: int = 0):
    return jax.tree.map(lambda a: a[i], stack)


def expert_bytes(p) -> float:
    """Bytes of one routed expert of one layer's MoE params `p` (gate, up, down; words + scales)."""
    return sum(nbytes(q) / q.packed.shape[0] for q in (p.gate, p.up, p.down))


def spread_router(params, key):
    """`params` with a unit-scale router and a zero correction bias: random weights at the init's
    scale would route every token to the same few experts."""
    mlp = params.moe_layers.mlp
    router = jax.random.normal(key, mlp.router.shape, jnp.float32)
    mlp = mlp.replace(router=router, router_bias=jnp.zeros_like(mlp.router_bias))
    return params.replace(moe_layers=params.moe_layers.replace(mlp=mlp))


def layer_stages(cfg, moe0, dense0, cache, x, positions, mask, implementation: str) -> dict:
    """The stages of one MoE layer (`moe0`, the first of the stack) and the dense layer's MLP
    (`dense0`), each jitted alone, with its operands: name -> (fn, args). x [1, T, H] bf16; the
    attention reads the cache's first MoE layer (index 1)."""
    t, h = x.shape[1:]
    flat = x.reshape(t, h)
    cos, sin = rope_tables(cfg, positions)
    lengths = cache.lengths
    route = jax.jit(lambda m, f: model.route(cfg, f, m.router, m.router_bias))
    idx, w = route(moe0.mlp, flat)
    return {
        "attention": (
            jax.jit(lambda a, x, ckv, kpe: model.mla(cfg, a, x, cos, sin, ckv, kpe, lengths, mask, implementation)[0]),
            (moe0.attn, x, cache.c_kv[1], cache.k_pe[1]),
        ),
        "router": (route, (moe0.mlp, flat)),
        "shared_expert": (jax.jit(lambda s, f: swiglu(f, s.gate, s.up, s.down)), (moe0.mlp.shared, flat)),
        "dense_mlp": (jax.jit(lambda m, f: swiglu(f, m.gate, m.up, m.down)), (dense0.mlp, flat)),
        "norms": (jax.jit(lambda w, x: rms_norm(rms_norm(x, w, 1e-6), w, 1e-6)), (moe0.attn_norm, x)),
        "routed_experts": (
            jax.jit(lambda m, f, i, w: moe_experts(f, i, w, m.gate, m.up, m.down, implementation=implementation)),
            (moe0.mlp, flat, idx, w),
        ),
    }


PARITY_TOL = 5e-2
"""A row of logits disagrees when it differs from the XLA path's by more than this times the
largest XLA logit (bf16 roundings differ by ~1e-2 of it on this shard)."""


def parity(got: np.ndarray, want: np.ndarray, counts: np.ndarray, want_counts: np.ndarray) -> dict:
    """Logits [T, V] of the verify against the XLA path's, and whether the disagreeing rows are
    explained by routing: the shard routes each token top-1 over random weights, so two bf16
    roundings of a layer can pick different experts for a token, which changes that layer's
    expert counts [Lm, E]. Disagreeing rows with every layer's counts equal, or more than one in
    eight rows (at least 2) disagreeing, are a mismatch."""
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    bad = np.flatnonzero(err > PARITY_TOL)
    counts_equal = [bool(c) for c in (counts == want_counts).all(axis=-1)]
    mismatch = bool(len(bad)) and (all(counts_equal) or len(bad) > max(2, len(err) // 8))
    return {
        "max_rel_err": float(err.max()),
        "rows_over_tol": bad.tolist(),
        "counts_equal_per_layer": counts_equal,
        "mismatch": mismatch,
    }


def measure(
    params, cfg, context: int, t: int, reps: int, key, implementation: str = "auto", check_rows: bool = True
) -> dict:
    """Device times and bytes of the whole verify and of one layer's stages, at T = t tokens;
    with `check_rows`, the verify's logits against the XLA path's (`parity`)."""
    h = cfg.hidden_size
    cache = KVCache.init(cfg, 1, context, jnp.bfloat16)  # random contents: zeros can time faster
    cache = random_like(cache, key, std=1.0).replace(lengths=jnp.asarray([context - t], jnp.int32))
    tokens = jax.random.randint(key, (1, t), 0, cfg.vocab_size, jnp.int32)
    positions = jnp.arange(context - t, context, dtype=jnp.int32)[None]
    mask = model.causal_mask(jnp.asarray([t]), t)

    @jax.jit
    def verify(params, cache, tokens):
        out = model.forward(params, tokens, positions, cache, mask, implementation=implementation, numerics="fast")
        return model.logits(params, out.hidden, numerics="fast"), out.expert_counts

    whole, kind = device_time(verify, (params, cache, tokens), reps)
    got, counts = verify(params, cache, tokens)
    counts = np.asarray(counts)  # [Lm, E]
    touched = (counts > 0).sum(axis=1)
    check = None
    if check_rows and implementation != "xla":

        @jax.jit
        def reference(params, cache, tokens):
            out = model.forward(params, tokens, positions, cache, mask, implementation="xla", numerics="fast")
            return model.logits(params, out.hidden, numerics="fast"), out.expert_counts

        want, want_counts = reference(params, cache, tokens)
        check = parity(np.asarray(got, np.float32)[0], np.asarray(want, np.float32)[0], counts, np.asarray(want_counts))

    x = jax.random.normal(key, (1, t, h), jnp.float32).astype(jnp.bfloat16)
    moe0, dense0 = layer_slice(params.moe_layers), layer_slice(params.dense_layers)
    stages = layer_stages(cfg, moe0, dense0, cache, x, positions, mask, implementation)
    times = {name: device_time(fn, args, reps)[0] for name, (fn, args) in stages.items()}

    per_expert = expert_bytes(moe0.mlp)
    attn_w = nbytes(moe0.attn)
    cache_bytes = context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    lm = cfg.num_hidden_layers - cfg.num_dense_layers
    stage_bytes = {
        "attention": attn_w + cache_bytes,
        "router": nbytes(moe0.mlp.router),
        "shared_expert": nbytes(moe0.mlp.shared),
        "dense_mlp": nbytes(dense0.mlp),
        "routed_experts": float(touched.mean()) * per_expert,
    }
    must_read = (
        cfg.num_hidden_layers * stage_bytes["attention"]
        + lm * (stage_bytes["router"] + stage_bytes["shared_expert"])
        + cfg.num_dense_layers * stage_bytes["dense_mlp"]
        + float(touched.sum()) * per_expert
        + nbytes(params.unembed)
    )
    return {
        "implementation": implementation,
        "context": context,
        "tokens": t,
        "timing": kind,
        "verify_ms": whole * 1e3,
        "stage_ms": {k: v * 1e3 for k, v in times.items()},
        "stage_bytes": stage_bytes,
        "experts_touched_mean": float(touched.mean()),
        "must_read_gb": must_read / 1e9,
        "read_gbs": must_read / whole / 1e9,
        "parity": check,
    }


def copy_bandwidth(reps: int) -> float:
    """GB/s of a 4 GiB bf16 read + write, the HBM ceiling measured in this run."""
    # Non-zero data (zeros can time faster), without the random generator's 4-byte temporaries.
    x = jax.jit(lambda: (jnp.arange(1 << 31, dtype=jnp.int32) % 251).astype(jnp.bfloat16))()
    seconds = device_time(jax.jit(lambda x: x + 1), (x,), reps)[0]
    return 2 * x.nbytes / seconds / 1e9


def drafter_ms(cfg: config.TargetConfig, context: int, reps: int, key, implementation: str = "auto") -> float:
    """Device time of one draft of the drafter's shard (a 16-token block over `context` positions;
    `implementation` is its block attention's)."""
    dcfg = drafter_shard_config(cfg.vocab_size)
    params = random_like(dflash.abstract_params(dcfg, jnp.bfloat16), key)
    cache = random_like(dflash.DrafterCache.init(dcfg, 1, context, jnp.bfloat16), key, std=1.0)
    cache = cache.replace(lengths=jnp.asarray([context - 16], jnp.int32))
    embed, unembed = random_like((jnp.zeros((cfg.vocab_size, cfg.hidden_size), jnp.bfloat16),) * 2, key)
    unembed = unembed.T
    block = jnp.zeros((1, dcfg.block_size), jnp.int32)
    pos = jnp.arange(context - 16, context - 16 + dcfg.block_size, dtype=jnp.int32)[None]
    fn = jax.jit(lambda p, c, e, u, b: dflash.draft(p, c, e, u, b, pos, implementation=implementation))
    return device_time(fn, (params, cache, embed, unembed, block), reps)[0] * 1e3


def measured_allreduce(path: str, hidden: int):
    """t -> seconds of one bf16 all-reduce of [t, hidden], from a k2_mesh.py result: the time
    measured at the smallest T >= t (the largest T past the table's end)."""
    with open(path) as f:
        rows = json.load(f)["collectives"]
    table = sorted(
        (r["shape"][0], r["ms"] * 1e-3)
        for r in rows
        if r["op"] == "all-reduce" and r["dtype"] == "bfloat16" and r["shape"][1] == hidden
    )
    if not table:
        raise SystemExit(f"--collectives {path} has no bf16 all-reduce of width {hidden}")
    return lambda t: next((s for n, s in table if n >= t), table[-1][1])


def project(rows, cfg, draft_ms: dict, args) -> list[dict]:
    """8-GPU round time and tokens/s per method from the shard's measured times."""
    lat = args.allreduce_us * 1e-6

    def allreduce_s(t: int) -> float:  # one all-reduce of [t, hidden] bf16
        if args.measured is None:
            return lat + t * cfg.hidden_size * 2 * 2 * 7 / 8 / (args.link_gbs * 1e9)
        return args.measured(t)

    out = []
    by = {(r["context"], r["tokens"]): r for r in rows}
    for context in args.contexts:
        ar = by.get((context, 1))
        if ar is None:
            continue
        for method, t, tau in [("ar", 1, 1.0), ("dflash chain", 16, args.tau["chain"])] + [
            (f"ddtree {b}", b + 1, args.tau[str(b)]) for b in args.budgets
        ]:
            r = by.get((context, t))
            if r is None:
                continue
            comm = (2 * cfg.num_hidden_layers + 2) * allreduce_s(t)
            shared_saving = (cfg.num_hidden_layers - cfg.num_dense_layers) * r["stage_ms"]["shared_expert"] * 7 / 8
            verify = r["verify_ms"] - shared_saving + comm * 1e3
            # 6 layers x 2 all-reduces of the 16-token block
            draft = 0.0 if method == "ar" else draft_ms[context] + 12 * allreduce_s(16) * 1e3
            round_ms = verify + draft
            # TP-8 would read 1/8 of the shared expert, which the shard holds whole.
            shared_gb = (cfg.num_hidden_layers - cfg.num_dense_layers) * r["stage_bytes"]["shared_expert"] * 7 / 8 / 1e9
            bound = (r["must_read_gb"] - shared_gb) / args.hbm_gbs * 1e3 + comm * 1e3
            out.append(
                {
                    "context": context,
                    "method": method,
                    "tokens": t,
                    "tau": tau,
                    "verify_ms": verify,
                    "draft_ms": draft,
                    "round_ms": round_ms,
                    "tokens_per_s": tau / round_ms * 1e3,
                    "bound_round_ms": bound + (0.0 if method == "ar" else draft),
                    "bound_tokens_per_s": tau / (bound + (0.0 if method == "ar" else draft)) * 1e3,
                }
            )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--allreduce-us", type=float, default=20.0, help="assumed small-message all-reduce latency")
    ap.add_argument("--link-gbs", type=float, default=450.0, help="assumed per-GPU NVLink bandwidth, GB/s")
    ap.add_argument(
        "--collectives",
        help="`experiments/k2_mesh.py --out` JSON: its measured bf16 all-reduce times replace the assumed ones",
    )
    ap.add_argument(
        "--tau-file", required=True, help="`python -m ddtree_jax eval --out` JSON with dflash and ddtree rows"
    )
    ap.add_argument(
        "--implementation",
        default="auto",
        help="kernels (ddtree_jax.pallas.IMPLEMENTATIONS); auto: the Mosaic GPU kernels (W4A16 experts)",
    )
    ap.add_argument(
        "--no-check",
        action="store_true",
        help="skip the verify's logits against the XLA path (`parity`; on by default for other implementations)",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--reproject", help="recompute only the projection of this earlier --out file (no GPU work)")
    _settings.add_argument(ap)
    args = ap.parse_args()
    _settings.apply(args.set)
    with open(args.tau_file) as f:
        evals = json.load(f)["rows"]
    args.tau = {
        ("chain" if r["method"] == "dflash" else str(r["budget"])): r["tau"] for r in evals if r["method"] != "ar"
    }
    missing = [b for b in args.budgets if str(b) not in args.tau] + ([] if "chain" in args.tau else ["dflash"])
    if missing:
        raise SystemExit(f"--tau-file {args.tau_file} has no tau for {missing}")
    cfg = shard_config(args.layers)
    args.measured = None if args.collectives is None else measured_allreduce(args.collectives, cfg.hidden_size)
    if args.reproject:
        with open(args.reproject) as f:
            result = json.load(f)
        args.hbm_gbs, args.contexts = result["hbm_gbs"], sorted({r["context"] for r in result["rows"]})
        draft = {int(c): v for c, v in result["draft_ms"].items()}
        result["projection"] = project(result["rows"], cfg, draft, args)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return
    key = jax.random.PRNGKey(0)
    t0 = time.time()
    # Routing must spread tokens over the 48 local experts.
    params = spread_router(random_like(model.abstract_params(cfg, jnp.bfloat16), key), key)
    assert isinstance(params.moe_layers.mlp.gate, QuantizedArray)
    result = {"args": vars(args), "weights_gb": nbytes(params) / 1e9, "build_s": time.time() - t0}
    print(f"shard weights {result['weights_gb']:.1f} GB, built in {result['build_s']:.0f} s", flush=True)
    result["hbm_gbs"] = args.hbm_gbs = copy_bandwidth(args.reps)
    print(f"copy bandwidth {args.hbm_gbs:.0f} GB/s", flush=True)
    rows = []
    for context in args.contexts:
        for t in [1, 16, *(b + 1 for b in args.budgets)]:
            r = measure(
                params, cfg, context, t, args.reps, jax.random.PRNGKey(t), args.implementation, not args.no_check
            )
            r["read_pct_hbm"] = 100 * r["read_gbs"] / args.hbm_gbs
            rows.append(r)
            print(json.dumps(r), flush=True)
            with open(args.out, "w") as f:
                json.dump({**result, "rows": rows}, f, indent=1)
    draft = {c: drafter_ms(cfg, c, args.reps, key, args.implementation) for c in args.contexts}
    result.update(rows=rows, draft_ms=draft, projection=project(rows, cfg, draft, args))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for p in result["projection"]:
        print(json.dumps(p))
    bad = [(r["context"], r["tokens"]) for r in rows if r["parity"] and r["parity"]["mismatch"]]
    if bad:
        raise SystemExit(f"MISMATCH: the verify's logits disagree with the XLA path's at (context, tokens) {bad}")


if __name__ == "__main__":
    compile_cache.enable()
    main()
