"""AR greedy decoding speed: ddtree_jax `generate(method="ar")` vs HF transformers `generate`.

Both run the same random `SMALL` weights (written once with `save_hf`, read by
both), the same prompts, greedy, no stop token, on the same GPU in one process
run. Prints a table and writes JSON.

    python experiments/bench_ar.py --batch-sizes 1 8 --max-new-tokens 256 --out bench_ar.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import checkpoint, compile_cache, config, model
from ddtree_jax.evaluation import time_call
from ddtree_jax.generate import generate


def time_jax(params, prompts, max_new, repeats):
    seconds, result = time_call(lambda: generate(params, prompts, max_new_tokens=max_new, stop_token_ids=()), repeats)
    return seconds, np.asarray(result.tokens)


def time_hf(hf_model, prompts, max_new, repeats):
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device="cuda")
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        min_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        hf_model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf_model.generate(ids, **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out[:, ids.shape[1] :].cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    cfg = dataclasses.replace(config.SMALL, eos_token_id=None)
    params = model.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.dtype(args.dtype), std=0.02)
    rng = np.random.default_rng(0)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; SMALL params: {cfg.num_params() / 1e6:.2f}M; dtype {args.dtype}")
    with tempfile.TemporaryDirectory() as d:
        checkpoint.save_hf(params, d)
        params = checkpoint.load_target(d)
        hf_model = None
        if not args.no_hf:
            import torch
            from transformers import DeepseekV3ForCausalLM

            hf_model = DeepseekV3ForCausalLM.from_pretrained(d, dtype=getattr(torch, args.dtype)).cuda().eval()
        for b in args.batch_sizes:
            prompts = rng.integers(3, cfg.vocab_size, size=(b, args.prompt_len)).tolist()
            t_jax, tok_jax = time_jax(params, prompts, args.max_new_tokens, args.repeats)
            row = {
                "batch": b,
                "max_new_tokens": args.max_new_tokens,
                "prompt_len": args.prompt_len,
                "jax_s": t_jax,
                "jax_tok_s": b * args.max_new_tokens / t_jax,
            }
            if hf_model is not None:
                t_hf, tok_hf = time_hf(hf_model, prompts, args.max_new_tokens, args.repeats)
                same = tok_jax == tok_hf
                first_diff = [int(np.argmin(r)) if not r.all() else len(r) for r in same]
                row.update(hf_s=t_hf, hf_tok_s=b * args.max_new_tokens / t_hf, first_divergence=first_diff)
            rows.append(row)
            print(json.dumps(row))
    print("\n| batch | new tokens | ddtree_jax tok/s | HF transformers tok/s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        hf = r.get("hf_tok_s")
        ratio = f"{r['jax_tok_s'] / hf:.1f}x" if hf else "-"
        hf_txt = f"{hf:.1f}" if hf else "-"
        print(f"| {r['batch']} | {r['max_new_tokens']} | {r['jax_tok_s']:.1f} | {hf_txt} | {ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "dtype": args.dtype, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    compile_cache.enable()
    main()
