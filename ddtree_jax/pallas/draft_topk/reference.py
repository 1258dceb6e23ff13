"""The drafter's log-probabilities' top k: the float32 reference and the dispatch's XLA path.

Notation: R rows (batch x drafted depths), V vocabulary, K ranks kept (K <= V).

For each row of drafter logits x [V]: the logits, if a temperature t is given, become
(x - max x) / t (`sampling.scaled_logits`); lp = log_softmax of them; the result is lp's K
largest values in descending order and their token ids, ties to the lower id (`lax.top_k`,
under the IEEE total order: NaN above +inf). What `tree.build_ddtree` ranks its paths by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax.sampling import scaled_logits
from ddtree_jax.topk import chunked_top_k


def log_probs(logits: jax.Array, temperature: jax.Array | None) -> jax.Array:
    """Float32 log_softmax [..., V] of logits [..., V], divided by `temperature` first unless None."""
    x = logits.astype(jnp.float32)
    if temperature is not None:
        x = scaled_logits(x, temperature)
    return jax.nn.log_softmax(x, axis=-1)


def log_softmax_top_k_reference(
    logits: jax.Array, k: int, temperature: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(values [..., K] float32, ids [..., K] int32): the top K of `log_probs(logits, temperature)`."""
    values, ids = jax.lax.top_k(log_probs(logits, temperature), k)
    return values, ids.astype(jnp.int32)


def log_softmax_top_k_xla(
    logits: jax.Array, k: int, temperature: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The reference's result, the top K taken by `topk.chunked_top_k` (two stages of sorts:
    on the GPU one `lax.top_k` of a long row costs more)."""
    values, ids = chunked_top_k(log_probs(logits, temperature), k)
    return values, ids.astype(jnp.int32)
