"""`generate()`: batched decoding, the whole loop in one jitted `lax.while_loop`.

Notation: B batch, P padded prompt length, M max_new_tokens, S cache capacity.

Prompts of different lengths share a batch right-padded; each sequence keeps its
own committed length in the cache and its own position counter, so a row's
tokens do not depend on the other rows. Output tokens past a row's length are -1.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax import compile_cache, decode, sharding
from ddtree_jax.cache import KVCache
from ddtree_jax.checks import check_dtype, check_int
from ddtree_jax.config import TargetConfig
from ddtree_jax.drafters import DFlashDrafter, as_drafter, is_drafter
from ddtree_jax.model import TargetParams, append, check_params, hoist_layers, logits
from ddtree_jax.numerics import resolve as resolve_numerics
from ddtree_jax.pallas import IMPLEMENTATIONS
from ddtree_jax.sampling import Sampler, SamplingConfig, choose
from ddtree_jax.tree import check_budget, check_tree_temperature

METHODS = ("ar", "dflash", "ddtree")
DEFAULT_BUDGET = 64
CACHE_ALIGN = 64
PREFILL_CHUNK = 512
"""Prompt tokens per row the prefill runs at once: its attention scores and expert pairs
grow with the chunk, so long prompts go in a loop of chunks."""
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
      accept_lengths: [M, B] acceptance length of each round (accepted drafts + the bonus
        token; 0 once a row is done). A row's last round counts its whole acceptance even
        when a stop token or max_new_tokens emits fewer of those tokens.
      stopped: [B] True where a stop token ended the row (else max_new_tokens did).
      nonfinite_at: [B] where the target's logits for a row's next token held a NaN or
        Inf, the index of that token (the row ended there, that token not emitted);
        -1 where all were finite.
      draft_nonfinite: [B] True where the drafter's logits held a NaN or Inf in some
        round (the output is still the target's own; only acceptance suffers).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    rounds: jax.Array
    accept_lengths: jax.Array
    stopped: jax.Array
    nonfinite_at: jax.Array
    draft_nonfinite: jax.Array

    def to_lists(self) -> list[list[int]]:
        """Generated ids per row as Python lists (one host transfer)."""
        tokens, lengths = jax.device_get((self.tokens, self.lengths))
        return [row[:n].tolist() for row, n in zip(tokens, lengths, strict=True)]

    def nonfinite_errors(self) -> list[str]:
        """One message per row that met non-finite logits (target or drafter); empty if none."""
        at, draft = jax.device_get((self.nonfinite_at, self.draft_nonfinite))
        errors = [
            f"row {i}: the target's logits for new token {int(j)} were not finite" for i, j in enumerate(at) if j >= 0
        ]
        errors += [f"row {i}: the drafter's logits were not finite" for i, bad in enumerate(draft) if bad]
        return errors

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted drafts + bonus) per round over all rows; 0.0 when no
        round ran (every row ended at its first token, which the prefill chooses)."""
        rounds, accept = jax.device_get((self.rounds, self.accept_lengths))
        return float(accept.sum() / max(int(rounds.sum()), 1))


@struct.dataclass
class _State:
    cache: KVCache
    draft_state: Any  # the drafter's own state (DrafterCache for DFlash)
    root: jax.Array  # [B] newest token, not yet in the cache
    tokens: jax.Array  # [B, M]
    lengths: jax.Array  # [B]
    done: jax.Array  # [B]
    stopped: jax.Array  # [B]
    rounds: jax.Array  # [B]
    accept: jax.Array  # [M, B]
    nonfinite_at: jax.Array  # [B]
    draft_nonfinite: jax.Array  # [B]
    key: jax.Array


def _is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


HOIST_LOOP_INVARIANTS = True
"""Do the loop-invariant work on the weights once, before the decode loop
(`model.hoist_layers`, the drafter's `for_loop`): per-layer slices of the layer stacks,
small INT4 stacks dequantized. False: in every round (for before / after profiles)."""


SCAN_PREFILL_LAYERS = True
"""Whether the prefill loops over each layer stack of the weights as loaded (`model.append`'s
`unroll_layers=False`) instead of running the decode loop's unrolled, hoisted layers: the
program then holds one compiled prefill layer a kind rather than one a layer. On one H200
(`experiments/compile_time.py --budgets 32`, `docs/results/s21/`) the shipped pair's cold
compiles fell from 14.3 / 15.8 / 16.6 s to 9.4 / 12.7 / 11.9 s (ar / dflash / ddtree(32)),
and a one-token call (a 256-token prefill and one step) from 4.44 to 3.70 ms (ar) and 4.53
to 4.15 ms (ddtree(32)). False: the unrolled prefill (for before / after runs)."""


def for_loop(target: TargetParams, drafter, numerics: str, implementation: str):
    """(target, drafter) as the decode loop holds them (`HOIST_LOOP_INVARIANTS`), the DFlash
    drafter's attention and QKV projection on `implementation`'s kernels; drafter may be None."""
    if isinstance(drafter, DFlashDrafter):
        drafter = drafter.replace(implementation=implementation)
    if not HOIST_LOOP_INVARIANTS:
        return target, drafter
    if drafter is not None and hasattr(drafter, "for_loop"):
        drafter = drafter.for_loop()
    return hoist_layers(target, numerics, implementation), drafter


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that shapes the compiled loop."""

    method: str
    budget: int
    max_new_tokens: int
    sampling: tuple[bool, int, bool]  # SamplingConfig.signature; its values are the program's `knobs`
    cache_capacity: int
    cache_dtype: str
    implementation: str
    numerics: str
    prefill_chunk: int
    tree_scaled: bool  # DDTree divides its drafter logits by knobs[2] (a tree temperature other than 1)


def _prefill(target, drafter, cache, prompts, prompt_lengths, st: _Static, unroll_layers: bool = True):
    """Prompt into the target cache (and its tapped features into the drafter's), in chunks of
    `st.prefill_chunk` tokens per row. Returns (logits [B, V] at each row's last prompt token,
    cache, drafter state). `unroll_layers` as in `model.forward`."""
    b, p = prompts.shape
    c = min(p, st.prefill_chunk)
    n = -(-p // c)
    prompts = jnp.pad(prompts, ((0, 0), (0, n * c - p)))
    rows = jnp.arange(b)
    draft_state = None if drafter is None else drafter.init_state(target, b, st.cache_capacity)

    def chunk(carry, start):  # the prompt tokens [start, start + c) of every row
        cache, draft_state, last = carry
        out, cache = append(
            target,
            cache,
            jax.lax.dynamic_slice_in_dim(prompts, start, c, axis=1),
            jnp.clip(prompt_lengths - start, 0, c),
            tap_layers=drafter.tap_layers if drafter is not None else (),
            tap_final_norm=drafter.tap_final_norm if drafter is not None else True,
            implementation=st.implementation,
            numerics=st.numerics,
            unroll_layers=unroll_layers,
        )
        if drafter is not None:
            idx = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
            draft_state = drafter.observe(draft_state, out.taps, idx, idx < prompt_lengths[:, None])
        at = prompt_lengths - 1 - start  # the row's last prompt token, if in this chunk
        here = (at >= 0) & (at < c)
        last = jnp.where(here[:, None], out.hidden[rows, jnp.clip(at, 0, c - 1)], last)
        return (cache, draft_state, last), None

    last = jnp.zeros((b, target.config.hidden_size), target.dtype)
    starts = jnp.arange(n, dtype=jnp.int32) * c
    if n == 1:
        (cache, draft_state, last), _ = chunk((cache, draft_state, last), starts[0])
    else:
        with jax.named_scope("prefill_chunks"):
            (cache, draft_state, last), _ = jax.lax.scan(chunk, (cache, draft_state, last), starts)
    return logits(target, last, numerics=st.numerics), cache, draft_state


def _round(target, drafter, stop_ids, st: _Static, sampler: Sampler, tree_temperature, s: _State) -> _State:
    """`decode.step` for every active row, then the output bookkeeping: stop tokens,
    the room left, rows ended by non-finite logits, per-round records."""
    b, m = s.tokens.shape
    rows = jnp.arange(b)[:, None]
    active = ~s.done
    key, k_draft, k_choice = jax.random.split(s.key, 3)
    cache, draft_state, r = decode.step(
        target,
        drafter,
        s.cache,
        s.draft_state,
        s.root,
        active,
        k_draft,
        k_choice,
        method=st.method,
        budget=st.budget,
        sampling=sampler,
        implementation=st.implementation,
        numerics=st.numerics,
        tree_temperature=tree_temperature,
    )
    j = jnp.arange(r.tokens.shape[1])[None, :]
    # A token chosen from non-finite logits is not emitted: the row ends before it.
    n_room = jnp.minimum(r.length, m - s.lengths)
    n_emit = jnp.minimum(n_room, r.first_nonfinite)[:, None]
    is_stop = _is_stop(r.tokens, stop_ids) & (j < n_emit)
    has_stop = jnp.any(is_stop, axis=1) & active
    nonfinite = active & ~has_stop & (r.first_nonfinite < n_room)
    n_emit = jnp.where(has_stop, jnp.argmax(is_stop, axis=1) + 1, n_emit[:, 0]) * active
    tokens = s.tokens.at[rows, jnp.where(j < n_emit[:, None], s.lengths[:, None] + j, m)].set(r.tokens, mode="drop")
    lengths = s.lengths + n_emit
    stopped = s.stopped | has_stop
    return _State(
        cache=cache,
        draft_state=draft_state,
        root=jnp.where(active, r.bonus, s.root),
        tokens=tokens,
        lengths=lengths,
        done=s.done | stopped | nonfinite | (lengths >= m),
        stopped=stopped,
        rounds=s.rounds + active,
        accept=s.accept.at[jnp.where(active, s.rounds, m), rows[:, 0]].set(r.length, mode="drop"),
        nonfinite_at=jnp.where(nonfinite, s.lengths + r.first_nonfinite, s.nonfinite_at),
        draft_nonfinite=s.draft_nonfinite | r.draft_nonfinite,
        key=key,
    )


@functools.partial(jax.jit, static_argnames=("st",))
def _generate(target, drafter, prompts, prompt_lengths, stop_ids, key, knobs, *, st: _Static) -> GenerateResult:
    """The whole call; knobs: [3] float32 (temperature, top_p, tree temperature), traced, so
    that one program serves every value (`st` holds what shapes the program)."""
    b, m = prompts.shape[0], st.max_new_tokens
    sampler = Sampler.of(st.sampling, knobs[:2])
    tree_temperature = knobs[2] if st.tree_scaled else 1.0
    loaded = target
    target, drafter = for_loop(target, drafter, st.numerics, st.implementation)
    # Allocated inside the jit: the cache never crosses the boundary, and the
    # while_loop updates it in place.
    # The barrier keeps XLA from constant-folding attention over the all-zero cache (slow to compile).
    cache = jax.lax.optimization_barrier(KVCache.init(target.config, b, st.cache_capacity, jnp.dtype(st.cache_dtype)))
    scan = SCAN_PREFILL_LAYERS
    first_logits, cache, draft_state = _prefill(
        loaded if scan else target, drafter, cache, prompts, prompt_lengths, st, unroll_layers=not scan
    )
    key, sub = jax.random.split(key)
    first = choose(first_logits, sub, sampler)
    finite = jnp.all(jnp.isfinite(first_logits), axis=-1)
    stopped = _is_stop(first, stop_ids) & finite
    state = _State(
        cache=cache,
        draft_state=draft_state,
        root=first,
        tokens=jnp.full((b, m), PAD, jnp.int32).at[:, 0].set(jnp.where(finite, first, PAD)),
        lengths=finite.astype(jnp.int32),
        done=stopped | ~finite | (m <= 1),
        stopped=stopped,
        rounds=jnp.zeros((b,), jnp.int32),
        accept=jnp.zeros((m, b), jnp.int32),
        nonfinite_at=jnp.where(finite, -1, 0).astype(jnp.int32),
        draft_nonfinite=jnp.zeros((b,), jnp.bool_),
        key=key,
    )
    with jax.named_scope("decode_loop"):
        s = jax.lax.while_loop(
            lambda s: ~jnp.all(s.done),
            functools.partial(_round, target, drafter, stop_ids, st, sampler, tree_temperature),
            state,
        )
    return GenerateResult(
        tokens=s.tokens,
        lengths=s.lengths,
        prompt_lengths=prompt_lengths,
        rounds=s.rounds,
        accept_lengths=s.accept,
        stopped=s.stopped,
        nonfinite_at=s.nonfinite_at,
        draft_nonfinite=s.draft_nonfinite,
    )


def _as_batch(prompts, prompt_lengths, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Validates prompts on the host; returns right-padded ids [B, P] int32 and lengths [B]."""
    if isinstance(prompts, (list, tuple)) and (len(prompts) == 0 or not np.isscalar(prompts[0])):
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one prompt")
        rows = []
        for i, row in enumerate(prompts):
            try:
                arr = np.asarray(row)
            except ValueError:  # numpy's "inhomogeneous shape" names no prompt
                raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got {row!r}") from None
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
        try:
            padded = np.asarray(prompts)
        except ValueError:  # ragged rows
            raise ValueError("prompts must be a list of token-id lists or a [batch, length] array of ids") from None
        if padded.ndim == 1:
            padded = padded[None]
        if padded.ndim != 2:
            raise ValueError(f"prompts must be [batch, length] token ids, got shape {padded.shape}")
        if not np.issubdtype(padded.dtype, np.integer):
            raise TypeError(f"prompt token ids must be integers, got dtype {padded.dtype}")
        if padded.shape[0] == 0:
            raise ValueError("prompts is empty: pass at least one prompt")
        if prompt_lengths is None:
            lengths = np.full((padded.shape[0],), padded.shape[1], np.int64)
        else:
            lengths = np.asarray(prompt_lengths)
            # astype(int64) would truncate 2.7 to 2 and read "3" or True as a length
            if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
                raise TypeError(f"prompt_lengths must be integers, got {prompt_lengths!r} (dtype {lengths.dtype})")
            if lengths.ndim > 1 or lengths.size != padded.shape[0]:
                raise ValueError(f"prompt_lengths has shape {lengths.shape}, expected ({padded.shape[0]},)")
            lengths = lengths.astype(np.int64).reshape(-1)
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


@functools.cache
def _greedy_key() -> jax.Array:
    """The key of a greedy call (no draw uses it), made once: making it is a device computation."""
    return jax.random.key(0)


def _check_key(key: Any) -> None:
    """TypeError unless `key` is one PRNG key: a typed key array of shape () or a raw uint32 key
    (`jax.random.PRNGKey`); JAX would otherwise fail inside the jitted loop, naming no argument."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape == ():
            return
    elif dtype == np.uint32 and shape is not None and len(shape) == 1:
        return
    got = repr(key) if dtype is None else f"an array of shape {shape}, dtype {dtype}"
    raise TypeError(f"key must be one PRNG key (e.g. jax.random.key(0)), got {got}")


def check_positions(cfg: TargetConfig, prompt_lengths, max_new_tokens: int) -> None:
    """Raises ValueError, naming the prompt, if the longest prompt + max_new_tokens outgrows the
    target's max_position_embeddings (positions past it were never trained)."""
    lengths = np.asarray(prompt_lengths)
    i = int(np.argmax(lengths))
    total = int(lengths[i]) + int(max_new_tokens)
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt {i} ({int(lengths[i])} tokens) + max_new_tokens={max_new_tokens} is {total} positions, "
            f"more than the target's max_position_embeddings={cfg.max_position_embeddings}"
        )


def generate(
    target: TargetParams,
    drafter: Any = None,
    prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array | None = None,
    *,
    method: str = "ar",
    tree_budget: int | None = None,
    tree_temperature: float = 1.0,
    block_size: int | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    stop_token_ids: Sequence[int] | None = None,
    prompt_lengths: Sequence[int] | np.ndarray | None = None,
    cache_capacity: int | None = None,
    cache_dtype=None,
    implementation: str = "auto",
    numerics: str | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
) -> GenerateResult:
    """Generates continuations of a batch of prompts, by AR, DFlash or DDTree decoding.

    Call as `generate(target, drafter, prompts, method=...)`, or for plain AR
    decoding `generate(target, prompts)`. All methods share one jitted loop: a
    round drafts, builds a tree (root only for "ar", the drafter's argmax chain for
    "dflash", the best `tree_budget`-node tree for "ddtree"), verifies it in one
    target forward and commits the accepted path. Greedy output is identical across
    methods; sampled output has the target's distribution whatever the drafter.

    Args:
      target: target weights (`init_params`, `load_target`, `restore_checkpoint`).
      drafter: DFlash `DrafterParams`, an `OracleDrafter` / `RandomDrafter`, or None for "ar".
      prompts: a list of token-id lists (any lengths), or a right-padded
        [B, P] integer array with `prompt_lengths`.
      method: "ar", "dflash" or "ddtree".
      tree_budget: DDTree node budget (root not counted), 1..1024; default 64.
      tree_temperature: DDTree builds its tree from the drafter's logits divided by this
        (> 0; 1.0: as they are, below 1 sharper). It changes which tokens are drafted, not
        the output's law: greedy tokens are the same, sampled ones keep the target's
        distribution (their draws differ with the tree).
      block_size: use a smaller block than the drafter's (>= 2).
      max_new_tokens: the most tokens generated per row (>= 1); the longest
        prompt plus this must fit the target's max_position_embeddings.
      temperature: 0 for greedy, else sampling temperature.
      top_k: sampling keeps the k most likely tokens (0 = all).
      top_p: sampling keeps the nucleus of mass top_p (1.0 = all).
      key: PRNG key; required when temperature > 0.
      stop_token_ids: a row ends after emitting one of these (it is included).
        Defaults to the config's eos_token_id (each id of a list), if any; pass () for none.
      prompt_lengths: valid length of each row of a padded array.
      cache_capacity: KV-cache slots per row; default: padded prompt width +
        max_new_tokens + draft depth, rounded up to a multiple of 64 (shapes
        alone fix it, so padded batches of one width compile once).
      cache_dtype: latent-cache dtype; default the params' dtype.
      implementation: "auto" (default: the Mosaic GPU kernels for MLA attention and
        the routed experts on a Hopper GPU where they take the operands, bf16 / f16,
        else XLA; the DFlash drafter's Triton-lowered kernels on a GPU), "xla", "pallas"
        (the Triton-lowered kernels: routed experts, the drafter's attention and QKV
        projection; MLA attention on XLA) or "mosaic"
        (`ddtree_jax.pallas.IMPLEMENTATIONS`; kernels run in interpret mode on a CPU
        backend). With weights placed by `sharding.shard_target`, the kernels run per
        shard under that mesh: heads and experts over "model", the batch over "data".
      numerics: "exact" or "fast" (`ddtree_jax.numerics`). Default "exact" for
        float32 weights with implementation "xla" or "auto": greedy output is then bitwise the
        same at any cache capacity, for every method, alone or in a padded batch;
        "fast" otherwise.
      prefill_chunk: prompt tokens per row the prefill forward takes at once (a loop runs
        the chunks): bounds its attention scores and expert pairs on long prompts.

    Returns:
      A `GenerateResult` (device arrays; `to_lists()` for Python ids, `tau`;
      `nonfinite_at` / `draft_nonfinite` flag NaN or Inf logits met).

    Raises:
      ValueError / TypeError / ConfigError: on bad input, naming the offending value.
    """
    return _run(_generate, **locals())


def lower(target: TargetParams, drafter: Any = None, prompts=None, **kwargs) -> jax.stages.Lowered:
    """`generate`'s jitted loop lowered, not run: same arguments, checked the same way.

    The params may be `jax.ShapeDtypeStruct`s (`model.abstract_params`, with shardings), so
    `lower(...).compile().memory_analysis()` plans a full-size model without its weights.
    """
    bound = inspect.signature(generate).bind(target, drafter, prompts, **kwargs)
    bound.apply_defaults()
    return _run(_generate.lower, **bound.arguments)


def _run(
    fn,
    target,
    drafter,
    prompts,
    *,
    method,
    tree_budget,
    tree_temperature,
    block_size,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    key,
    stop_token_ids,
    prompt_lengths,
    cache_capacity,
    cache_dtype,
    implementation,
    numerics,
    prefill_chunk,
):
    """Checks `generate`'s arguments and calls fn(*jit arguments, st=...) (the loop, or its `lower`)."""
    if prompts is None and not is_drafter(drafter):
        drafter, prompts = None, drafter
    if not isinstance(target, TargetParams):
        raise TypeError(f"target must be TargetParams, got {type(target).__name__}")
    check_params(target)
    cfg = target.config
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
    numerics = resolve_numerics(numerics, target.dtype, implementation)
    if prompts is None:
        raise ValueError("no prompts given")
    budget = 0
    if tree_budget is not None:  # checked for every method: a bad budget is a bug even where unused
        check_budget(tree_budget)
    tree_temperature = check_tree_temperature(tree_temperature)
    if block_size is not None:
        check_int("block_size", block_size)
    if method == "ar":
        drafter = None
    else:
        if drafter is None:
            raise ValueError(f"method={method!r} needs a drafter (e.g. DrafterParams, OracleDrafter, RandomDrafter)")
        drafter = as_drafter(drafter, block_size)
        if isinstance(drafter, DFlashDrafter):
            drafter.params.config.check_compatible(cfg)
        if method == "ddtree":
            budget = DEFAULT_BUDGET if tree_budget is None else tree_budget
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    if not sampling.greedy and key is None:
        raise ValueError(f"temperature={temperature} samples: pass a PRNG key, e.g. key=jax.random.key(0)")
    if key is None:
        key = _greedy_key()
    _check_key(key)
    ids, lengths = _as_batch(prompts, prompt_lengths, cfg.vocab_size)
    if stop_token_ids is None:
        stop_token_ids = cfg.stop_token_ids
    if isinstance(stop_token_ids, (np.ndarray, jax.Array)) and stop_token_ids.ndim == 1:
        stop_token_ids = np.asarray(stop_token_ids).tolist()  # array elements as Python numbers
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Sequence):
        raise TypeError(f"stop_token_ids must be a sequence of ints, got {stop_token_ids!r}")
    stop = [check_int(f"stop_token_ids[{i}]", t) for i, t in enumerate(stop_token_ids)]
    for t in stop:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {cfg.vocab_size})")
    check_positions(cfg, lengths, max_new_tokens)
    depth = 0 if drafter is None else drafter.block_size - 1
    needed = int(lengths.max()) + int(max_new_tokens) + depth
    if cache_capacity is None:
        # From the padded width, not the longest valid prompt: the capacity is a static
        # shape, and padded batches of one width must share one compilation. Rounded up
        # so that kernels streaming the cache in blocks never pad (copy) it.
        widest = ids.shape[1] + int(max_new_tokens) + depth
        cache_capacity = -(-widest // CACHE_ALIGN) * CACHE_ALIGN
    cache_capacity = check_int("cache_capacity", cache_capacity, minimum=1)
    if cache_capacity < needed:
        i = int(np.argmax(lengths))
        raise ValueError(
            f"prompt {i} ({lengths[i]} tokens) + max_new_tokens={max_new_tokens} + draft depth {depth} needs "
            f"{needed} cache slots, more than cache_capacity={cache_capacity}"
        )
    st = _Static(
        method=method,
        budget=int(budget),
        max_new_tokens=int(max_new_tokens),
        sampling=sampling.signature,
        cache_capacity=int(cache_capacity),
        cache_dtype=check_dtype(cache_dtype or target.dtype, "cache_dtype").name,
        implementation=implementation,
        numerics=numerics,
        prefill_chunk=check_int("prefill_chunk", prefill_chunk, minimum=1),
        # DDTree alone reads it; at 1 the program skips the division.
        tree_scaled=method == "ddtree" and tree_temperature != 1.0,
    )
    # Traced, not static: a sweep over temperatures, top-p or tree temperatures compiles once.
    knobs = np.concatenate([sampling.values(), np.asarray([tree_temperature], np.float32)])
    # Host arrays, not jnp.asarray: the call moves them to the device with its other arguments
    # instead of an eager conversion each (three more device launches a call on a GPU).
    args = (target, drafter, ids, lengths, np.asarray(stop or [PAD], np.int32), key, knobs)
    _check_same_devices(target, drafter)
    mesh = _params_mesh(target)
    if mesh is None:
        # A whole executable from disk skips tracing and lowering (`compile_cache`); sharded
        # calls are traced under the mesh's rules, which that key does not cover.
        compiled = compile_cache.executable(fn, args, {"st": st}) if fn is _generate else None
        return compiled(*args) if compiled is not None else fn(*args, st=st)
    # Under the params' mesh, with the rules the weights were placed by, the Pallas kernels
    # (opaque to GSPMD) run per shard, and so do the routed experts on the XLA path.
    with sharding.use_mesh(mesh, sharding.placed_rules(target)):
        return fn(*args, st=st)


def _placement(params) -> tuple[tuple[int, ...], str] | None:
    """The devices the first placed weight of `params` lives on, in the order jit sees them
    (a mesh's, flattened), and their description; None where no weight is placed (a committed
    array is, and so is a shape given a sharding, as `lower` takes; an uncommitted array is not)."""
    for leaf in jax.tree.leaves(params):
        where = getattr(leaf, "sharding", None)
        if where is None or (isinstance(leaf, jax.Array) and not leaf.committed):
            continue  # jit moves an uncommitted array wherever the others are
        mesh = getattr(where, "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh):
            ids = tuple(int(d.id) for d in mesh.devices.flat)
            return ids, f"devices {list(ids)} (a mesh of {dict(mesh.shape)})"
        if mesh is not None:
            continue  # an abstract mesh: no devices yet
        ids = tuple(sorted(int(d.id) for d in where.device_set))
        return ids, f"device{'s' * (len(ids) > 1)} {list(ids)}"
    return None


def _check_same_devices(target: TargetParams, drafter: Any) -> None:
    """Raises ValueError naming both placements unless the drafter's placed weights live on the
    target's devices, in the same order (jit's rule: meshes of other shapes over them are fine).
    Without it jit refused the call with "incompatible devices", naming one weight of each."""
    if drafter is None:
        return
    theirs, ours = _placement(target), _placement(drafter)
    if theirs is None or ours is None or theirs[0] == ours[0]:
        return
    raise ValueError(
        f"the target's weights are on {theirs[1]} but the drafter's on {ours[1]}: place both on the same "
        f"devices in the same order (e.g. sharding.shard_drafter(drafter, mesh) with the target's mesh), or "
        f"leave the drafter's arrays uncommitted"
    )


def _params_mesh(target: TargetParams):
    """The mesh the target's weights are placed on, if any; `sharding.context_mesh`
    decides whether the kernels can use it."""
    for leaf in jax.tree.leaves(target):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return mesh
    return None
