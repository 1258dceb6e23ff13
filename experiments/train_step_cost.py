"""Where a target training step's time goes: the whole step vs its routed experts.

    python experiments/train_step_cost.py --preset medium --batch 128 --seq 512 --out cost.json

Device time (`pallas.bench_util.device_time`: the profiler's kernel time per call) of
1. the whole `train.target_train_step` as `experiments/train_target.py` runs it (bf16
   compute on float32 master weights, AdamW, the router-bias update);
2. one MoE layer's routed experts, forward + backward, on the step's B x T tokens with
   random routing: the routed XLA path (`moe_experts_xla`: sort + `ragged_dot`) against
   every expert on every token (`moe_experts_reference`: E / K times the FLOPs, plain
   batched matmuls), times the number of MoE layers;
3. the largest kernels of the step by name, from the same trace, so a step that is not
   the experts' says what it is.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import compile_cache, config, model, train
from ddtree_jax.pallas.bench_util import device_time, kernel_table
from ddtree_jax.pallas.moe.reference import moe_experts_reference, moe_experts_xla


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium", choices=sorted(config.PRESETS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    cfg = config.PRESETS[args.preset]
    bf16 = jnp.bfloat16
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    opt = train.make_optimizer(train.OptimConfig(total_steps=1000), params, frozen=train.router_bias_mask(params))
    state = train.init_state(params, opt)
    tokens = jnp.asarray(np.random.default_rng(0).integers(4, cfg.vocab_size, (args.batch, args.seq + 1)), jnp.int32)
    step = jax.jit(functools.partial(train.target_train_step, optimizer=opt, compute_dtype=bf16))
    step_s, how = device_time(step, (state, tokens), args.reps)
    rows = {"train_step_ms": 1e3 * step_s, "timing": how}

    t, h, i = args.batch * args.seq, cfg.hidden_size, cfg.moe_intermediate_size
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(t, h)), bf16)
    idx = jnp.asarray(np.argsort(rng.uniform(size=(t, e)), axis=1)[:, :k], jnp.int32)
    w = jnp.asarray(rng.uniform(size=(t, k)), jnp.float32)
    weights = [jnp.asarray(rng.normal(size=s) * 0.05, bf16) for s in ((e, h, i), (e, h, i), (e, i, h))]
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    for name, fn in (("routed (sort + ragged_dot)", moe_experts_xla), ("dense (all experts)", moe_experts_reference)):

        def fwd_bwd(x, *ws, fn=fn):
            loss = lambda x, *ws: jnp.sum(fn(x, idx, w, *ws).astype(jnp.float32) ** 2)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2, 3))(x, *ws)

        s, _ = device_time(jax.jit(fwd_bwd), (x, *weights), args.reps)
        rows[f"moe_{name.split()[0]}_ms_per_layer"] = 1e3 * s
        rows[f"moe_{name.split()[0]}_ms_all_layers"] = 1e3 * s * moe_layers
    rows["kernels"] = kernel_table(lambda: step(state, tokens), args.reps, args.top)["top"]

    tokens_per_s = args.batch * args.seq / step_s
    print(
        f"device {jax.devices()[0].device_kind}; {args.preset}: B {args.batch} x T {args.seq}, {moe_layers} MoE layers"
    )
    print(f"train step {rows['train_step_ms']:.1f} ms ({how}) = {tokens_per_s / 1e3:.0f}k tokens/s")
    for name in ("routed", "dense"):
        print(
            f"experts fwd+bwd, {name}: {rows[f'moe_{name}_ms_per_layer']:.2f} ms a layer, "
            f"{rows[f'moe_{name}_ms_all_layers']:.1f} ms for all {moe_layers}"
        )
    print("| kernel | ms / step | launches / step |\n| --- | --- | --- |")
    for r in rows["kernels"]:
        print(f"| {r['kernel'][:70]} | {r['ms']:.2f} | {r['launches']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), **rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    compile_cache.enable()
    main()
