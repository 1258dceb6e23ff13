"""What numerics="exact" costs and what it guarantees on this device, for the shipped pair.

    python experiments/exact_cost.py --out exact_cost.json [--dtypes bfloat16 float32]
        [--numerics fast exact] [--context 256] [--loop-tokens 128] [--budget 32]
        [--check-tokens 256] [--skip-timing] [--skip-check] [--skip-logits]

Timing: an AR step and a DDTree(--budget) round in `generate`'s while loop, as
profile_round.py measures them ((t(N tokens) - t(1 token)) / rounds, random prompt of
--context tokens), for every dtype x numerics. `--numerics default` passes none (so the
script also times a package from before the option existed).

Logits: the logits of one token (position 300 of textwrap.py's source) computed as an AR
step at capacities 384, 399 and 591, as a node of a verified tree beside a sibling, as the
last node of a chain, and as row 1 of a padded batch; the number of its 8192 logits that
differ from the AR step at capacity 384 (0: bitwise equal).

Check: greedy tokens of the same prompt (300 tokens) under layouts that must not matter,
against AR alone at the default capacity: AR in a padded batch at that capacity + 15,
DFlash, and DDTree(64) in a padded batch. Reports the first new token where each departs
(None: the same tokens).
"""

from __future__ import annotations

import argparse
import json
import textwrap

import _args
import jax
import jax.numpy as jnp
import numpy as np
from profile_round import in_loop  # a sibling script: `experiments.` needed the repo root on sys.path

from ddtree_jax import compile_cache, decode, model, tree
from ddtree_jax.cache import KVCache
from ddtree_jax.evaluation import first_difference
from ddtree_jax.generate import CACHE_ALIGN, generate
from ddtree_jax.numerics import NUMERICS
from ddtree_jax.shipped import load_shipped


def stdlib_ids(tokenizer) -> list[int]:
    with open(textwrap.__file__) as f:
        return tokenizer.encode(f.read(), bos=True)


def logits_check(target, ids: list[int], numerics: str) -> dict:
    """How many of token 300's logits differ from the AR step at capacity 384, per layout."""
    kw = dict(numerics=numerics)
    cfg = target.config

    @jax.jit
    def after_prefill(cache, tokens, n):
        return model.prefill(target, cache, tokens, n, **kw)[1]

    @jax.jit
    def ar_step(cache, tok):
        out, _ = model.append(target, cache, tok, jnp.ones((tok.shape[0],), jnp.int32), **kw)
        return model.logits(target, out.hidden[:, 0], **kw)

    @jax.jit
    def verify(cache, t):
        return model.logits(target, decode.verify(target, cache, t, **kw).hidden, **kw)

    def ar(capacity):
        cache = after_prefill(
            KVCache.init(cfg, 1, capacity, target.dtype), jnp.asarray([ids[:299]]), jnp.asarray([299])
        )
        return np.asarray(ar_step(cache, jnp.asarray([[ids[299]]])))[0]

    def tree_of(tokens, parents):
        n = len(tokens)
        depth = [0] * n
        vis = np.eye(n, dtype=bool)
        for i, p in enumerate(parents):
            j = p
            while j >= 0:
                vis[i, j] = True
                j = parents[j]
            depth[i] = int(vis[i].sum()) - 1
        return tree.DraftTree(
            tokens=jnp.asarray([tokens], jnp.int32),
            parents=jnp.asarray([parents], jnp.int32),
            depths=jnp.asarray([depth], jnp.int32),
            valid=jnp.ones((1, n), bool),
            visibility=jnp.asarray(vis[None]),
            max_depth=max(depth),
        )

    def verified(node_tokens, parents, node):
        """Logits of slot `node` of a tree whose root is token 299 - max depth, verified after it."""
        t = tree_of(node_tokens, parents)
        start = 299 - t.max_depth
        cache = after_prefill(KVCache.init(cfg, 1, 384, target.dtype), jnp.asarray([ids[:start]]), jnp.asarray([start]))
        return np.asarray(verify(cache, t))[0, node]

    want = ar(384)
    other = ids[1000:1041]
    batch = np.zeros((2, 299), np.int32)
    batch[0, :41], batch[1] = other, ids[:299]
    cache = after_prefill(KVCache.init(cfg, 2, 640, target.dtype), jnp.asarray(batch), jnp.asarray([41, 299]))
    batched = np.asarray(ar_step(cache, jnp.asarray([[ids[41]], [ids[299]]])))[1]
    got = {
        "ar capacity 399": ar(399),
        "ar capacity 591": ar(591),
        # root = token 298, its children: a sibling (token 7) and token 299 (slot 2)
        "tree node beside a sibling": verified([ids[298], 7, ids[299]], [-1, 0, 0], 2),
        # chain 297 -> 298 -> 299 (slot 2)
        "chain node at depth 2": verified([ids[297], ids[298], ids[299]], [-1, 0, 1], 2),
        "row 1 of a padded batch": batched,
    }
    return {name: int((g != want).sum()) for name, g in got.items()}


def check(shipped, numerics: str, new_tokens: int) -> dict:
    """First departure from AR alone of each layout (None = the same tokens)."""
    ids = stdlib_ids(shipped.tokenizer)
    prompt, other = ids[:300], ids[1000:1041]
    kw = dict(max_new_tokens=new_tokens, stop_token_ids=(), numerics=numerics)
    t, d = shipped.target, shipped.drafter
    want = generate(t, [prompt], **kw).to_lists()[0]
    default = -(-(300 + new_tokens) // CACHE_ALIGN) * CACHE_ALIGN
    runs = {
        f"ar batched, capacity {default + 15}": generate(t, [other, prompt], cache_capacity=default + 15, **kw),
        "dflash": generate(t, d, [prompt], method="dflash", **kw),
        "ddtree(64) batched": generate(t, d, [other, prompt], method="ddtree", tree_budget=64, **kw),
    }
    rows = {"ar batched": 1, "ddtree(64) batched": 1}
    out = {}
    for name, res in runs.items():
        row = next((r for key, r in rows.items() if name.startswith(key)), 0)
        out[name] = first_difference(want, res.to_lists()[row])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--numerics", nargs="+", default=["fast", "exact"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--loop-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--check-tokens", type=int, default=256)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-logits", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _args.at_least(ap, 1, context=args.context, loop_tokens=args.loop_tokens, check_tokens=args.check_tokens)
    _args.budgets(ap, [args.budget], "--budget")
    _args.out_file(ap, args.out)
    for dtype in args.dtypes:
        _args.dtype(ap, dtype, "--dtypes")
    bad = [n for n in args.numerics if n not in (*NUMERICS, "default")]
    if bad:
        ap.error(f"--numerics: unknown {bad}; choose from {[*NUMERICS, 'default']}")
    rows = []
    for dtype in args.dtypes:
        shipped = load_shipped(args.checkpoints, dtype=dtype)
        prompt = np.random.default_rng(0).integers(4, shipped.target.config.vocab_size, size=(1, args.context))
        for numerics in args.numerics:
            row = {"dtype": dtype, "numerics": numerics}
            if not args.skip_timing:
                kwargs = {} if numerics == "default" else {"numerics": numerics}
                for method, budget in (("ar", None), ("ddtree", args.budget)):
                    sec, _, _ = in_loop(
                        shipped.target, shipped.drafter, prompt, method, budget, args.loop_tokens, **kwargs
                    )
                    row[f"{method}_round_ms"] = sec * 1e3
            if not args.skip_logits:
                row["logits_differing"] = logits_check(shipped.target, stdlib_ids(shipped.tokenizer), numerics)
            if not args.skip_check:
                row["first_difference"] = check(shipped, numerics, args.check_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "rows": rows}, f, indent=1)
    print(f"\ndevice {jax.devices()[0].device_kind}; budget {args.budget}, context {args.context}")
    print(
        "| dtype | numerics | AR step in loop (ms) | DDTree round in loop (ms) | logits differing | first departure |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ar, dd = r.get("ar_round_ms"), r.get("ddtree_round_ms")
        print(
            f"| {r['dtype']} | {r['numerics']} | {'-' if ar is None else f'{ar:.3f}'} | "
            f"{'-' if dd is None else f'{dd:.3f}'} | {r.get('logits_differing', '-')} | "
            f"{r.get('first_difference', '-')} |"
        )


if __name__ == "__main__":
    compile_cache.enable()
    main()
