"""`generate()`: batched decoding, the whole loop in one jitted `lax.while_loop`.

Notation: B batch, P padded prompt length, M max_new_tokens, S cache capacity.

Prompts of different lengths share a batch right-padded; each sequence keeps its
own committed length in the cache and its own position counter, so a row's
tokens do not depend on the other rows. Output tokens past a row's length are -1.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax.cache import KVCache
from ddtree_jax.model import TargetParams, forward, logits, prefill
from ddtree_jax.sampling import SamplingConfig, choose

METHODS = ("ar",)
PAD = -1


@struct.dataclass
class GenerateResult:
    """Output of `generate`, kept on the device until read.

    Attributes:
      tokens: [B, M] generated ids; -1 past `lengths[b]`. A stop token that
        ended a row is included.
      lengths: [B] number of generated tokens.
      prompt_lengths: [B].
      rounds: [B] decoding rounds (target forwards after prefill) a row took part in.
      accept_lengths: [M, B] tokens committed by each round (0 once a row is done).
      stopped: [B] True where a stop token ended the row (else max_new_tokens did).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    rounds: jax.Array
    accept_lengths: jax.Array
    stopped: jax.Array

    def to_lists(self) -> list[list[int]]:
        """Generated ids per row as Python lists (one host transfer)."""
        tokens, lengths = jax.device_get((self.tokens, self.lengths))
        return [row[:n].tolist() for row, n in zip(tokens, lengths, strict=True)]

    @property
    def tau(self) -> float:
        """Mean tokens committed per decoding round over all rows."""
        rounds, lengths = jax.device_get((self.rounds, self.lengths))
        return float((lengths - 1).sum() / max(int(rounds.sum()), 1))


@struct.dataclass
class _ARState:
    cache: KVCache
    last: jax.Array  # [B] newest token, not yet in the cache
    tokens: jax.Array  # [B, M]
    lengths: jax.Array  # [B]
    done: jax.Array  # [B]
    stopped: jax.Array  # [B]
    rounds: jax.Array  # [B]
    accept: jax.Array  # [M, B]
    key: jax.Array


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)


@functools.partial(
    jax.jit,
    static_argnames=("max_new_tokens", "sampling", "cache_capacity", "cache_dtype", "implementation"),
)
def _generate_ar(
    params: TargetParams,
    prompts: jax.Array,  # [B, P]
    prompt_lengths: jax.Array,  # [B]
    stop_ids: jax.Array,  # [n_stop] (-1 = none)
    key: jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    cache_capacity: int,
    cache_dtype: str,
    implementation: str,
) -> GenerateResult:
    b, m = prompts.shape[0], max_new_tokens
    # Allocated inside the jit: the cache never crosses the boundary, and the
    # while_loop updates it in place.
    cache = KVCache.init(params.config, b, cache_capacity, jnp.dtype(cache_dtype))
    rows = jnp.arange(b)
    first_logits, cache = prefill(params, cache, prompts, prompt_lengths, implementation=implementation)
    key, sub = jax.random.split(key)
    first = choose(first_logits, sub, sampling)
    stopped = _is_stop(first, stop_ids)
    state = _ARState(
        cache=cache,
        last=first,
        tokens=jnp.full((b, m), PAD, jnp.int32).at[:, 0].set(first),
        lengths=jnp.ones((b,), jnp.int32),
        done=stopped | (m <= 1),
        stopped=stopped,
        rounds=jnp.zeros((b,), jnp.int32),
        accept=jnp.zeros((m, b), jnp.int32),
        key=key,
    )

    def cond(s: _ARState):
        return ~jnp.all(s.done)

    def body(s: _ARState) -> _ARState:
        active = ~s.done
        c = s.cache
        out = forward(
            params,
            s.last[:, None],
            c.lengths[:, None],
            c,
            jnp.ones((b, 1, 1), jnp.bool_),
            implementation=implementation,
        )
        c = c.write(out.kv, jnp.where(active, c.lengths, c.capacity)[:, None])
        c = c.replace(lengths=c.lengths + active)
        key, sub = jax.random.split(s.key)
        nxt = choose(logits(params, out.hidden[:, 0]), sub, sampling)
        nxt = jnp.where(active, nxt, s.last)
        tokens = s.tokens.at[rows, jnp.where(active, s.lengths, m)].set(nxt, mode="drop")
        is_stop = active & _is_stop(nxt, stop_ids)
        lengths = s.lengths + active
        accept = s.accept.at[jnp.where(active, s.rounds, m), rows].set(1, mode="drop")
        return _ARState(
            cache=c,
            last=nxt,
            tokens=tokens,
            lengths=lengths,
            done=s.done | is_stop | (lengths >= m),
            stopped=s.stopped | is_stop,
            rounds=s.rounds + active,
            accept=accept,
            key=key,
        )

    with jax.named_scope("decode_loop"):
        s = jax.lax.while_loop(cond, body, state)
    return GenerateResult(
        tokens=s.tokens,
        lengths=s.lengths,
        prompt_lengths=prompt_lengths,
        rounds=s.rounds,
        accept_lengths=s.accept,
        stopped=s.stopped,
    )


def _as_batch(prompts, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Validates prompts on the host; returns right-padded ids [B, P] int32 and lengths [B]."""
    if isinstance(prompts, (list, tuple)) and (len(prompts) == 0 or not np.isscalar(prompts[0])):
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt")
        rows = []
        for i, row in enumerate(prompts):
            arr = np.asarray(row)
            if arr.ndim != 1:
                raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got shape {arr.shape}")
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"prompt {i} token ids must be integers, got dtype {arr.dtype}")
            rows.append(arr.astype(np.int64))
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for a padded [B, P] array; a list of prompts carries its lengths")
        lengths = np.array([len(r) for r in rows], np.int64)
        padded = np.zeros((len(rows), max(1, lengths.max())), np.int64)
        for i, r in enumerate(rows):
            padded[i, : len(r)] = r
    else:
        padded = np.asarray(prompts)
        if padded.ndim == 1:
            padded = padded[None]
        if padded.ndim != 2:
            raise ValueError(f"prompts must be [batch, length] token ids, got shape {padded.shape}")
        if not np.issubdtype(padded.dtype, np.integer):
            raise TypeError(f"prompt token ids must be integers, got dtype {padded.dtype}")
        if prompt_lengths is None:
            lengths = np.full((padded.shape[0],), padded.shape[1], np.int64)
        else:
            lengths = np.asarray(prompt_lengths).astype(np.int64).reshape(-1)
            if lengths.shape != (padded.shape[0],):
                raise ValueError(f"prompt_lengths has shape {lengths.shape}, expected ({padded.shape[0]},)")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if n > padded.shape[1]:
            raise ValueError(f"prompt_lengths[{i}]={n} exceeds the padded prompt length {padded.shape[1]}")
    valid = np.arange(padded.shape[1])[None, :] < lengths[:, None]
    bad = valid & ((padded < 0) | (padded >= vocab_size))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"prompt {i} token {j} has id {padded[i, j]}, outside the vocabulary [0, {vocab_size})")
    return np.where(valid, padded, 0).astype(np.int32), lengths.astype(np.int32)


def generate(
    target: TargetParams,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
    *,
    method: str = "ar",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    stop_token_ids: Sequence[int] | None = None,
    prompt_lengths: Sequence[int] | np.ndarray | None = None,
    cache_capacity: int | None = None,
    cache_dtype=None,
    implementation: str = "xla",
) -> GenerateResult:
    """Generates continuations of a batch of prompts.

    Args:
      target: target weights (`init_params`, `load_target`, `restore_checkpoint`).
      prompts: a list of token-id lists (any lengths), or a right-padded
        [B, P] integer array with `prompt_lengths`.
      method: "ar" (plain autoregressive decoding).
      max_new_tokens: the most tokens generated per row (>= 1).
      temperature: 0 for greedy, else sampling temperature.
      top_k: sampling keeps the k most likely tokens (0 = all).
      top_p: sampling keeps the nucleus of mass top_p (1.0 = all).
      key: PRNG key; required when temperature > 0.
      stop_token_ids: a row ends after emitting one of these (it is included).
        Defaults to the config's eos_token_id, if any; pass () for none.
      prompt_lengths: valid length of each row of a padded array.
      cache_capacity: KV-cache slots per row; default: longest prompt + max_new_tokens.
      cache_dtype: latent-cache dtype; default the params' dtype.
      implementation: "xla" or "pallas" kernels.

    Returns:
      A `GenerateResult` (device arrays; `to_lists()` for Python ids).

    Raises:
      ValueError / TypeError: on bad input, naming the offending value.
    """
    if not isinstance(target, TargetParams):
        raise TypeError(f"target must be TargetParams, got {type(target).__name__}")
    cfg = target.config
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    sampling = SamplingConfig(temperature=float(temperature), top_k=top_k, top_p=float(top_p))
    if not sampling.greedy and key is None:
        raise ValueError(f"temperature={temperature} samples: pass a PRNG key, e.g. key=jax.random.key(0)")
    if key is None:
        key = jax.random.key(0)
    ids, lengths = _as_batch(prompts, prompt_lengths, cfg.vocab_size)
    if stop_token_ids is None:
        stop_token_ids = () if cfg.eos_token_id is None else (cfg.eos_token_id,)
    stop = [int(t) for t in stop_token_ids]
    for t in stop:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    needed = int(lengths.max()) + int(max_new_tokens) - 1
    if cache_capacity is None:
        cache_capacity = int(lengths.max()) + int(max_new_tokens)
    if cache_capacity < needed:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"prompt {i} ({lengths[i]} tokens) + max_new_tokens={max_new_tokens} needs {needed} cache slots, "
            f"more than cache_capacity={cache_capacity}"
        )
    return _generate_ar(
        target,
        jnp.asarray(ids),
        jnp.asarray(lengths),
        jnp.asarray(stop or [PAD], jnp.int32),
        key,
        max_new_tokens=int(max_new_tokens),
        sampling=sampling,
        cache_capacity=int(cache_capacity),
        cache_dtype=jnp.dtype(cache_dtype or target.dtype).name,
        implementation=implementation,
    )
