"""Greedy DDTree replayed offline: tau of any tree policy from one pass of the models per prompt.

    python experiments/tree_replay.py --limit 40 --budgets 12 32 \
        --policies 1 0.8 0.8:1 1:0.6 --out replay.json

At T = 0 the tokens are the target's greedy ones whatever the tree, so a round's accepted
length depends only on the tree and on that text. Per prompt this script generates the greedy
text once (AR), runs the target over it once for the drafter's taps, and has the drafter propose
a block at every position the decoding could stand at. A policy then replays the rounds on the
host: the tree from the block at position L, its longest path along the text, L + a, until the
128 tokens are out. Same prompts, same drafts: the policies differ by their trees only.

A policy is a tree temperature per draft depth: "t" (every depth, `generate`'s
`tree_temperature`) or "a:b" (linear from a at depth 1 to b at the last depth). `--lookup L`
also replays each policy with a chain of L prompt-lookup tokens beside its tree. Replayed tau
equals `generate`'s up to floating point (the drafter's features here come from one causal
forward, in the decode loop from each round's verify).
"""

from __future__ import annotations

import argparse
import json
import time

import _args
import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import decode, model
from ddtree_jax import tree as trees
from ddtree_jax.cache import KVCache
from ddtree_jax.drafters import DFlashDrafter, dflash
from ddtree_jax.evaluation import prompt_set
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped


def depth_temperatures(policy: str, depths: int) -> np.ndarray:
    """A policy string ("t" or "a:b") -> temperatures [depths] (float32)."""
    try:
        ends = [float(v) for v in policy.split(":")]
    except ValueError:
        raise ValueError(f"policy {policy!r} is not 't' or 'a:b' with numbers") from None
    if len(ends) not in (1, 2) or not all(np.isfinite(v) and v > 0 for v in ends):
        raise ValueError(f"policy {policy!r}: one or two temperatures > 0, as 't' or 'a:b'")
    return np.linspace(ends[0], ends[-1], depths, dtype=np.float32)


@jax.jit(static_argnames=("numerics", "rows"))
def drafts_at_every_position(target, drafter: DFlashDrafter, seq, start, *, numerics: str, rows: int):
    """The drafter's logits [rows, D, V] for the block rooted at each position L = start ..
    start + rows - 1 of `seq` [S] (the text, padded past its end), its context the text before L
    (the target's taps of one causal forward over `seq`)."""
    s = seq.shape[0]
    # The barrier keeps XLA from constant-folding attention over the all-zero cache (slow to compile).
    cache = jax.lax.optimization_barrier(KVCache.init(target.config, 1, s, target.dtype))
    positions = jnp.arange(s, dtype=jnp.int32)[None]
    causal = jnp.tril(jnp.ones((1, s, s), bool))
    out = model.forward(target, seq[None], positions, cache, causal, tap_layers=drafter.tap_layers, numerics=numerics)
    # Every slot is written; a block rooted at L sees slots < L only (the padding lies past them).
    state = drafter.observe(drafter.init_state(target, 1, s), out.taps, positions, jnp.ones((1, s), bool))
    roots = start + jnp.arange(rows, dtype=jnp.int32)
    bs = drafter.block_size
    wide = state.replace(
        k=jnp.broadcast_to(state.k, (state.k.shape[0], rows, *state.k.shape[2:])),
        v=jnp.broadcast_to(state.v, (state.v.shape[0], rows, *state.v.shape[2:])),
        lengths=roots,
    )
    block = jnp.full((rows, bs), drafter.params.config.mask_token_id, jnp.int32).at[:, 0].set(seq[roots])
    return dflash.draft(drafter.params, wide, target.embed, target.unembed, block, roots[:, None] + jnp.arange(bs))


def _round_impl(logits, root, truth, budget):
    tree = trees.build_ddtree(logits[None], jnp.asarray([root], jnp.int32), budget)
    # The target's greedy choice after a node at depth d is the text's token d + 1 ahead of the
    # root wherever the node lies on the text; elsewhere the node is not accepted anyway.
    choices = truth[jnp.minimum(tree.depths, truth.shape[0] - 1)]
    return decode.accept(tree, choices).length[0]


_round = jax.jit(_round_impl, static_argnums=(3,))


def lookup_draft(seq: np.ndarray, at: int, length: int, ngrams=(4, 3, 2)) -> np.ndarray:
    """Prompt lookup: the `length` tokens that followed the latest earlier occurrence of the
    text's last n tokens (up to and including position `at`), the longest n that occurs; empty
    if none does."""
    for n in ngrams:
        if at + 1 < n + 1:
            continue
        tail = seq[at + 1 - n : at + 1]
        for j in range(at - n, -1, -1):  # occurrence seq[j : j + n], ending before the tail's end
            if np.array_equal(seq[j : j + n], tail):
                return seq[j + n : min(j + n + length, at + 1)]
    return seq[:0]


def replay(
    logits: jax.Array,
    seq: np.ndarray,
    start: int,
    new_tokens: int,
    budget: int,
    temps: np.ndarray,
    lookup: int = 0,
):
    """Rounds that emit `new_tokens` tokens (the first from the prefill) under one policy.

    `lookup` > 0: the tree also holds a chain of that many prompt-lookup tokens from the root
    (`lookup_draft`); the round then accepts the longer of the two matches (a trie of both
    accepts no path that is neither)."""
    d = logits.shape[1]
    scaled = jnp.asarray(logits) / jnp.asarray(temps)[None, :, None]
    emitted, rounds, at = 1, 0, start
    while emitted < new_tokens:
        truth = np.full((d + 2,), -1, np.int64)
        ahead = seq[at + 1 : at + d + 2]
        truth[: len(ahead)] = ahead
        a = int(_round(scaled[at - start], int(seq[at]), jnp.asarray(truth, jnp.int32), budget))
        if lookup:
            chain = lookup_draft(seq, at, lookup)
            hits = np.cumprod(chain == truth[: len(chain)]) if len(chain) else np.zeros(0)
            a = max(a, 1 + int(hits.sum()))
        a = min(a, new_tokens - emitted)
        emitted, rounds, at = emitted + a, rounds + 1, at + a
    return rounds


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", default=None)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--data", default="data")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[12, 32])
    ap.add_argument("--policies", nargs="+", default=["1", "0.8"])
    ap.add_argument(
        "--lookup",
        type=int,
        nargs="*",
        default=[],
        help="also replay each policy with a prompt-lookup chain of L tokens",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if any(lk < 1 for lk in args.lookup):
        ap.error(f"--lookup {args.lookup}: each chain length must be >= 1")
    # --limit -1 ran all prompts but the last (prompts[:-1]), 0 all of them
    _args.at_least(ap, 1, limit=args.limit, max_new_tokens=args.max_new_tokens)
    _args.budgets(ap, args.budgets)
    _args.out_file(ap, args.out)
    for policy in args.policies:  # used after the load (the drafter gives the depths), checked here
        try:
            depth_temperatures(policy, 1)
        except ValueError as e:
            ap.error(f"--policies: {e}")

    shipped = load_shipped(args.checkpoints, dtype=args.dtype)
    target = shipped.target
    drafter = DFlashDrafter(params=shipped.drafter, block_size=shipped.drafter.config.block_size)
    depths = drafter.block_size - 1
    policies = {p: depth_temperatures(p, depths) for p in args.policies}
    prompts = prompt_set(args.prompts, shipped.tokenizer, args.data, args.limit)
    lookups = [0, *args.lookup]
    rounds = {(b, p, lk): 0 for b in args.budgets for p in policies for lk in lookups}
    tokens, t0 = 0, time.time()
    # One shape for every prompt (one compile each): prompts padded to the longest, the text
    # padded to that plus the new tokens and a block.
    width = max(len(p) for p in prompts)
    span = width + args.max_new_tokens + drafter.block_size
    for i, prompt in enumerate(prompts):
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(prompt)] = prompt
        text = generate(
            target,
            ids,
            prompt_lengths=[len(prompt)],
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=(),
            numerics=args.numerics,
        ).to_lists()[0]
        seq = np.zeros((span,), np.int64)
        seq[: len(prompt) + len(text)] = list(prompt) + text
        logits = drafts_at_every_position(
            target, drafter, jnp.asarray(seq, jnp.int32), len(prompt), numerics=args.numerics, rows=len(text)
        )
        seq = seq[: len(prompt) + len(text)]
        for b, p, lk in rounds:
            rounds[b, p, lk] += replay(logits, seq, len(prompt), len(text), b, policies[p], lk)
        tokens += len(text)
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            best = {b: max(policies, key=lambda p, b=b: tokens / rounds[b, p, 0]) for b in args.budgets}
            print(f"{i + 1}/{len(prompts)} prompts, {time.time() - t0:.0f} s; best so far {best}", flush=True)
    rows = [
        dict(budget=b, policy=p, lookup=lk, temperatures=policies[p].tolist(), tau=tokens / n, rounds=n)
        for (b, p, lk), n in rounds.items()
    ]
    print(f"\n{len(prompts)} {args.prompts} prompts, {tokens} tokens, {args.dtype}, greedy")
    print("| budget | policy | lookup | tau |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['budget']} | {r['policy']} | {r['lookup']} | {r['tau']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
