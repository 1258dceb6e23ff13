"""Where DFlash chain rounds end: the target's own certainty at each rejected draft.

    python experiments/chain_misses.py --prompts humaneval --out misses.json
    python experiments/chain_misses.py --prompts validation --num-prompts 64 --prompt-len 160
    python experiments/chain_misses.py --prompts test   # the CLI eval's 64 test-split windows

Greedy decoding is deterministic, so a DFlash chain round can be replayed offline:
the AR continuation of each prompt is the text every method produces; one target
pass over prompt + continuation gives the drafter's context features and the
target's next-token distribution at every position; the drafter's training forward
(`dflash.train_logits`) drafts a block at every anchor. Walking anchor to anchor
(each round accepts the drafts that match, plus the target's bonus token) replays
the rounds, and the replayed tau is checked against `generate`'s own.

For every round that ends on a wrong draft it records the target's top-1
probability and top-1 minus top-2 logit margin at that position, and whether the
drafter picked the target's second choice; for every generated position, the same
target figures (the base rate), and whether the token repeats a 4-gram already in
the text; and the drafts' acceptance split by that (repetition is cheap to draft).
A drafter that misses mostly where the target itself is unsure is limited by the
target's entropy more than by its own size.
float32 throughout.
"""

from __future__ import annotations

import argparse
import json
import sys

import _args
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ddtree_jax import checkpoint, compile_cache, data, evaluation, train
from ddtree_jax.drafters import dflash
from ddtree_jax.generate import generate
from ddtree_jax.model import logits


def replay(block_argmax: np.ndarray, sequence: np.ndarray, start: int, max_new_tokens: int) -> list[tuple[int, int]]:
    """Replays greedy DFlash chain rounds of one row from teacher-forced blocks.

    Args:
      block_argmax: [A, bs-1] the drafter's argmax at each slot of the block anchored
        at start + a (a = 0 .. A-1).
      sequence: [T] prompt + the target's greedy continuation (at least
        max_new_tokens + bs - 1 tokens after `start`).
      start: position of the first generated token (the prefill's; the first anchor).
      max_new_tokens: generation length; rounds run until it is reached.

    Returns:
      (anchor, accepted drafts) per round; a round emits accepted + 1 tokens.
    """
    rounds, generated, anchor = [], 1, start
    while generated < max_new_tokens:
        drafts = block_argmax[anchor - start]
        hit = drafts == sequence[anchor + 1 : anchor + 1 + len(drafts)]
        accepted = len(drafts) if hit.all() else int(np.argmin(hit))
        rounds.append((anchor, accepted))
        generated += accepted + 1
        anchor += accepted + 1
    return rounds


def repeated_ngrams(sequence, start: int, end: int, n: int = 4) -> np.ndarray:
    """[end - start] bool: whether token t completes an n-gram (t-n+1 .. t) already seen in sequence[:t].

    A continuation that repeats itself is cheap to draft; this says how much of it does
    (`train.repeated_ngram_mask`, the mask the unlikelihood loss trains on).
    """
    seq = jnp.asarray(np.asarray(sequence[:end], np.int32))[None]
    return np.asarray(train.repeated_ngram_mask(seq, n)[0, start:end])


def _rate(counts: list[int]) -> float | None:
    return round(counts[1] / counts[0], 4) if counts[0] else None


def quantiles(x) -> dict:
    x = np.asarray(x, np.float64)
    if not len(x):
        return {}
    return {f"q{int(q * 100)}": round(float(np.quantile(x, q)), 4) for q in (0.1, 0.25, 0.5, 0.75, 0.9)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="checkpoints/target")
    ap.add_argument("--drafter", default="checkpoints/drafter")
    ap.add_argument("--tokenizer", default="checkpoints/tokenizer.json")
    ap.add_argument("--data", default="data")
    ap.add_argument(
        "--prompts",
        choices=["humaneval", "validation", "test"],
        default="humaneval",
        help="test = the CLI eval's test-split windows",
    )
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="first N prompts (HumanEval, test) / N windows (validation)"
    )
    ap.add_argument("--prompt-len", type=int, default=160, help="validation window length")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.max_new_tokens < 2:
        sys.exit(f"error: --max-new-tokens must be >= 2, got {args.max_new_tokens}")
    if args.num_prompts is not None and args.num_prompts < 1:
        sys.exit(f"error: --num-prompts must be >= 1, got {args.num_prompts}")
    _args.at_least(ap, 1, prompt_len=args.prompt_len)
    _args.out_file(ap, args.out)  # written at the end: a bad path lost the whole run

    tok = data.Tokenizer.load(args.tokenizer)
    target = checkpoint.load_target(args.target, dtype=jnp.float32)
    params = dflash.load_drafter(args.drafter, dtype=jnp.float32)
    if args.prompts == "humaneval":
        prompts = data.eval_humaneval_prompts(tok, args.data)[: args.num_prompts]
    elif args.prompts == "test":
        prompts = data.eval_test_prompts(tok, args.data)[: args.num_prompts]
    else:
        prompts = evaluation.validation_windows(args.data, args.num_prompts or 32, args.prompt_len)
    m, bs = args.max_new_tokens, params.config.block_size

    measured = generate(target, params, prompts, method="dflash", max_new_tokens=m, stop_token_ids=())
    # The continuation runs bs - 1 tokens past max_new_tokens so that every block has its labels.
    ar = generate(target, prompts, max_new_tokens=m + bs - 1, stop_token_ids=()).to_lists()
    width = max(len(p) for p in prompts) + m + bs
    seqs = np.zeros((len(prompts), width), np.int32)
    for i, (p, g) in enumerate(zip(prompts, ar, strict=True)):
        seqs[i, : len(p) + len(g)] = p + g

    @jax.jit
    def teacher_forced(tokens, anchors):  # [1, T], [1, A]
        feats, hidden = train.target_outputs(
            target, tokens, params.config.target_layer_ids, params.config.tap_final_norm
        )
        drafted = jnp.argmax(dflash.train_logits(params, target.embed, target.unembed, feats, tokens, anchors), -1)
        lg = logits(target, hidden, numerics="fast").astype(jnp.float32)  # [1, T, V]; row t predicts token t + 1
        top2, idx2 = jax.lax.top_k(lg, 2)
        p1 = jnp.max(jax.nn.softmax(lg, -1), -1)
        return drafted[0], p1[0], (top2[..., 0] - top2[..., 1])[0], idx2[0, :, 1]

    misses, base_p1, base_margin, accepts, repeats = [], [], [], [], []
    tested = {True: [0, 0], False: [0, 0]}  # repeats a 4-gram -> [drafts checked, drafts accepted]
    for i, p in enumerate(tqdm(prompts, desc="replay", mininterval=5)):
        start = len(p)
        anchors = jnp.arange(start, start + m, dtype=jnp.int32)[None]
        drafted, p1, margin, second = jax.device_get(teacher_forced(jnp.asarray(seqs[i : i + 1]), anchors))
        base_p1 += p1[start : start + m - 1].tolist()
        base_margin += margin[start : start + m - 1].tolist()
        repeated = repeated_ngrams(seqs[i], start, len(p) + len(ar[i]))
        repeats += repeated[:m].tolist()
        for anchor, accepted in replay(drafted, seqs[i], start, m):
            accepts.append(accepted + 1)
            # The drafts this round checked: the accepted ones and, unless all were, the first wrong one.
            for k in range(1, min(accepted + 1, bs - 1) + 1):
                kind = tested[bool(repeated[anchor + k - start])]
                kind[0] += 1
                kind[1] += k <= accepted
            if accepted < bs - 1:
                q = anchor + accepted  # the target's distribution for the rejected position
                misses.append(
                    {
                        "p1": float(p1[q]),
                        "margin": float(margin[q]),
                        "second": bool(drafted[anchor - start, accepted] == second[q]),
                    }
                )
    accepts = np.asarray(accepts)
    p1_miss = [r["p1"] for r in misses]
    summary = {
        "args": vars(args),
        "prompts": len(prompts),
        "rounds": len(accepts),
        "tau_measured": round(measured.tau, 4),
        "tau_replayed": round(float(accepts.mean()), 4),
        "accept_histogram": np.bincount(accepts, minlength=bs + 1)[1:].tolist(),
        "share_of_tokens_in_full_block_rounds": round(float(accepts[accepts == bs].sum() / accepts.sum()), 4),
        "generated_tokens_repeating_a_4gram": round(float(np.mean(repeats)), 4),
        "draft_acceptance_where_the_token_repeats_a_4gram": _rate(tested[True]),
        "draft_acceptance_elsewhere": _rate(tested[False]),
        "drafts_checked_accepted": {"repeating_a_4gram": tested[True], "elsewhere": tested[False]},
        "misses": len(misses),
        "miss_p1": quantiles(p1_miss),
        "miss_margin": quantiles([r["margin"] for r in misses]),
        "miss_share_p1_below_0.5": round(float(np.mean(np.asarray(p1_miss) < 0.5)), 4) if misses else None,
        "miss_was_target_second_choice": round(float(np.mean([r["second"] for r in misses])), 4) if misses else None,
        "all_positions_p1": quantiles(base_p1),
        "all_positions_margin": quantiles(base_margin),
        "all_positions_share_p1_below_0.5": round(float(np.mean(np.asarray(base_p1) < 0.5)), 4),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    compile_cache.enable()
    main()
