"""Session 37, offline: does mixing the previous round's block predictions for the same positions
into the tree's distributions raise greedy tau? Rounds replayed as in experiments/tree_replay.py
(same greedy text and drafts for every weight w; tree temperature 0.8; float32 on the CPU).

    PYTHONPATH=. python docs/results/s37/replay_mix_previous.py 40 > replay_mix_previous.log

At depth d of a round rooted at L, after a previous round rooted at L' = L - a, the tree uses
log((1 - w) p_L[d] + w p_L'[d + a]) where d + a is still inside the previous block, else p_L[d].
Not a feature of the project: it lowered tau at every w > 0 and was dropped."""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.drafters import DFlashDrafter
from ddtree_jax.evaluation import prompt_set
from ddtree_jax.generate import generate
from ddtree_jax.shipped import load_shipped

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "experiments"))
from tree_replay import _round, drafts_at_every_position

LIMIT = int(sys.argv[1]) if len(sys.argv) > 1 else 20
WS = [0.0, 0.15, 0.3, 0.5]
BUDGETS = [12, 32]
T = 0.8


@jax.jit
def mix(new_lp, old_lp, valid, w):
    # new_lp, old_lp [D, V] log-probs; valid [D] bool (old covers that depth)
    m = jnp.logaddexp(jnp.log1p(-w) + new_lp, jnp.log(w) + old_lp)
    return jnp.where(valid[:, None] & (w > 0), m, new_lp)


def replay(lp, seq, start, new_tokens, budget, w):
    d = lp.shape[1]
    emitted, rounds, at, prev = 1, 0, start, None
    while emitted < new_tokens:
        truth = np.full((d + 2,), -1, np.int64)
        ahead = seq[at + 1 : at + d + 2]
        truth[: len(ahead)] = ahead
        cur = lp[at - start]
        if prev is not None and w > 0:
            shift = at - prev  # depth d here is depth d + shift there
            idx = np.arange(d) + shift
            valid = idx < d
            old = lp[prev - start][np.minimum(idx, d - 1)]
            cur = mix(cur, old, jnp.asarray(valid), jnp.float32(w))
        a = int(_round(cur, int(seq[at]), jnp.asarray(truth, jnp.int32), budget))
        a = min(a, new_tokens - emitted)
        prev = at
        emitted, rounds, at = emitted + a, rounds + 1, at + a
    return rounds


shipped = load_shipped(None, dtype="float32")
target = shipped.target
drafter = DFlashDrafter(params=shipped.drafter, block_size=shipped.drafter.config.block_size)
prompts = prompt_set("humaneval", shipped.tokenizer, "data", LIMIT)
width = max(len(p) for p in prompts)
span = width + 128 + drafter.block_size
rounds = {(b, w): 0 for b in BUDGETS for w in WS}
tokens, t0 = 0, time.time()
for i, prompt in enumerate(prompts):
    ids = np.zeros((1, width), np.int32)
    ids[0, : len(prompt)] = prompt
    text = generate(
        target, ids, prompt_lengths=[len(prompt)], max_new_tokens=128, stop_token_ids=(), numerics="fast"
    ).to_lists()[0]
    seq = np.zeros((span,), np.int64)
    seq[: len(prompt) + len(text)] = list(prompt) + text
    logits = drafts_at_every_position(
        target, drafter, jnp.asarray(seq, jnp.int32), len(prompt), numerics="fast", rows=len(text)
    )
    lp = jax.nn.log_softmax(logits / T, axis=-1)
    seq = seq[: len(prompt) + len(text)]
    for b, w in rounds:
        rounds[b, w] += replay(lp, seq, len(prompt), len(text), b, w)
    tokens += len(text)
    print(i + 1, f"{time.time() - t0:.0f}s", {k: round(tokens / v, 3) for k, v in rounds.items()}, flush=True)
