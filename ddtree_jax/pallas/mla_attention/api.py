"""Dispatch for absorbed-MLA attention (see reference.py for the notation)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax import sharding
from ddtree_jax.pallas import check_implementation, check_rank, mosaic_interpret, on_hopper
from ddtree_jax.pallas.mla_attention.exact import mla_attention_exact
from ddtree_jax.pallas.mla_attention.mosaic import (
    MosaicMLATiles,
    mla_attention_mosaic,
    new_split_pays,
    new_split_runs,
)
from ddtree_jax.pallas.mla_attention.reference import mla_attention_xla

AVAILABLE = ("auto", "xla", "exact", "pallas", "mosaic")

MOSAIC_NEW_IN_KERNEL = 256
"""`MosaicMLATiles.new_in_kernel` of the model's calls: the most new tokens whose keys the
Mosaic kernel may attend itself, where `mosaic.new_split_pays` for the shard's shapes (else
XLA computes their partial). 256 from session 31's H200 run (docs/benchmarks.md): 4-10% off
TP-8 trees of 17 to 129 tokens at 32K; 0 gives XLA's partial everywhere. Read when a program
is traced: set it before the first call, or call `jax.clear_caches()` after changing it."""


def _mosaic_takes(q_lat, q_pe, cache_ckv) -> bool:
    """Whether the Mosaic kernel tiles these operands: a bf16 / f16 cache, R % 128, P % 64, S % block_k."""
    return (
        cache_ckv.dtype in (jnp.bfloat16, jnp.float16)
        and q_lat.shape[-1] % 128 == 0
        and q_pe.shape[-1] % 64 == 0
        and cache_ckv.shape[1] % MosaicMLATiles().block_k == 0
    )


_AXES = (
    *[("batch", None, "heads", None)] * 2,  # q_lat, q_pe
    *[("batch", None, None)] * 2,  # the cache (split further by `cache_split`)
    ("batch",),
    *[("batch", None, None)] * 3,  # new entries, new mask
)
"""Logical axes of the operands as the model makes them."""

_STACKED_AXES = (*_AXES[:2], *[(None, "batch", None, None)] * 2, *_AXES[4:], ())
"""The same with every layer's cache [L, B, S, *] and the layer's index last."""


def mla_attention(
    q_lat: jax.Array,  # [B, T, N, R]
    q_pe: jax.Array,  # [B, T, N, P]
    cache_ckv: jax.Array,  # [B, S, R]
    cache_kpe: jax.Array,  # [B, S, P]
    cache_len: jax.Array,  # [B]
    new_ckv: jax.Array,  # [B, T, R]
    new_kpe: jax.Array,  # [B, T, P]
    new_mask: jax.Array,  # [B, T, T] bool
    *,
    scale: float,
    implementation: str = "xla",
    positions: jax.Array | None = None,  # [B, T] int32, for "exact"
    span: int | None = None,
    layer: int | jax.Array | None = None,
) -> jax.Array:  # [B, T, N, R] float32
    """Absorbed-MLA attention of T query tokens over a latent cache plus themselves.

    Every cache entry s < cache_len[b] is visible to every query of sequence b;
    among the new tokens, query t sees key u iff new_mask[b, t, u].

    Args:
      q_lat: queries already multiplied by W_UK (the "absorbed" nope part).
      q_pe: RoPE'd rope part of the queries.
      cache_ckv, cache_kpe: the committed latent cache of one layer.
      cache_len: committed length per sequence.
      new_ckv, new_kpe: latent entries of the new tokens.
      new_mask: visibility among the new tokens (causal for prefill, the
        ancestor-or-self matrix for a draft tree).
      scale: the model's softmax scale (qk_head_dim^-0.5, times YaRN mscale^2).
      implementation: "xla" (pure jnp, `reference.mla_attention_xla`), "exact" (pure jnp in a rounding order fixed
        by absolute positions, exact.py), "mosaic" (the Mosaic GPU kernel in mosaic.py:
        a bf16 / f16 cache on the GPU, R % 128, P % 64, S % 64), "auto" ("mosaic" on a
        Hopper GPU where it takes the operands, else "xla") or "pallas", which means
        "xla" here: the Triton-lowered MLA kernel was removed once the Mosaic one beat
        it at every measured shape (docs/benchmarks.md), and "pallas" keeps selecting
        the Triton-lowered routed-expert kernel. The Mosaic kernel runs in interpret
        mode on a CPU backend; under a mesh context (`sharding.use_mesh`) per shard,
        batch and heads split by its rules.
      positions: absolute positions of the new tokens ("exact" only: it orders the
        keys by them). Each query's visible new tokens must sit at distinct positions
        in [cache_len, cache_len + span).
      span: a static bound on the new tokens' offsets from cache_len ("exact" only);
        default T.
      layer: with it, cache_ckv / cache_kpe hold every layer's cache [L, B, S, R] / [L, B, S, P]
        and this layer's is attended: read in place by the Mosaic kernel (per shard under a mesh),
        sliced first otherwise.

    Under a mesh whose latent cache is split by sequence (`sharding.cache_split`), each
    device attends for its own sequences with all heads (`_per_sequence`).

    Returns:
      The attention-weighted latent values, float32 (rounded to q_lat's dtype when the
      cache is split by sequence: the heads travel back in it).
    """
    check_implementation(implementation, AVAILABLE, "mla_attention")
    check_rank("mla_attention", "q_lat", q_lat, 4)
    check_rank("mla_attention", "cache_ckv", cache_ckv, 3 if layer is None else 4)
    b, t, n, r = q_lat.shape
    s, p = cache_ckv.shape[-2], q_pe.shape[-1]
    lead = cache_ckv.shape[:-3]  # (L,) with `layer`
    chex.assert_shape(q_pe, (b, t, n, p))
    chex.assert_shape(cache_ckv, (*lead, b, s, r))
    chex.assert_shape(cache_kpe, (*lead, b, s, p))
    chex.assert_shape(cache_len, (b,))
    chex.assert_shape(new_ckv, (b, t, r))
    chex.assert_shape(new_kpe, (b, t, p))
    chex.assert_shape(new_mask, (b, t, t))
    if q_lat.size == 0:  # no queries (T, B or N of 0): "exact"'s reductions have no identity
        return jnp.zeros(q_lat.shape, jnp.float32)
    if implementation == "auto":
        one = jax.ShapeDtypeStruct((b, s, r), cache_ckv.dtype)
        implementation = "mosaic" if on_hopper() and _mosaic_takes(q_lat, q_pe, one) else "xla"
    if implementation == "pallas":  # no Triton-lowered MLA kernel any more (see above)
        implementation = "xla"
    # The Mosaic kernel reads the layer in the stack, also per shard: a slice reached it as a
    # copy of every slot. The other paths take the slice (XLA fuses it into its consumers).
    stacked = layer is not None and implementation == "mosaic"
    if layer is not None and not stacked:
        cache_ckv, cache_kpe = cache_ckv[layer], cache_kpe[layer]
    args = (q_lat, q_pe, cache_ckv, cache_kpe, cache_len, new_ckv, new_kpe, new_mask)
    if implementation == "exact":
        if positions is None:
            raise ValueError("mla_attention(implementation='exact') needs the new tokens' positions")
        chex.assert_shape(positions, (b, t))
        span = t if span is None else span
        fn = lambda *a: mla_attention_exact(*a, scale, span)  # noqa: E731
        args, axes = (*args, positions), (*_AXES, ("batch", None))
    elif stacked:  # the layer index travels as the last operand, whole on every shard
        fn = lambda *a: _mosaic(*a[:-1], scale=scale, interpret=mosaic_interpret(), layer=a[-1])  # noqa: E731
        args, axes = (*args, jnp.asarray(layer, jnp.int32)), _STACKED_AXES
    elif implementation == "mosaic":
        fn = functools.partial(_mosaic, scale=scale, interpret=mosaic_interpret())
        axes = _AXES
    else:
        fn, axes = functools.partial(mla_attention_xla, scale=scale), _AXES
    if sharding.context_mesh() is None:
        return fn(*args)
    home, extra = sharding.cache_split(b)
    if extra:  # the cache split by sequence: each device attends for its own sequences
        return _per_sequence(fn, args, axes, home, extra)
    if implementation == "mosaic":
        # Per shard: the batch and the query heads as the mesh's rules split them.
        specs = tuple(sharding.kernel_spec(a, x.shape) for a, x in zip(axes, args, strict=True))
        # check_vma=False: pallas_call outputs carry no varying-axes annotation.
        return jax.shard_map(fn, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)
    return fn(*args)


def _mosaic(q_lat, q_pe, cache_ckv, *rest, scale, interpret, layer=None):
    """The Mosaic kernel with the new tokens in it where that pays for these (per-shard) shapes
    (and, in interpret mode, where XLA's CPU flag lets the interpreter run that split)."""
    b, t, n, _ = q_lat.shape
    tiles = MosaicMLATiles(new_in_kernel=MOSAIC_NEW_IN_KERNEL)
    if not (new_split_runs(interpret) and new_split_pays(b, t, n, cache_ckv.shape[-2], tiles)):
        tiles = MosaicMLATiles()
    kw = dict(scale=scale, tiles=tiles, interpret=interpret) | ({} if layer is None else {"layer": layer})
    return mla_attention_mosaic(q_lat, q_pe, cache_ckv, *rest, **kw)


def _per_sequence(fn, args, axes, home, extra):
    """`fn` in `shard_map` over a latent cache split by sequence over `home` + `extra` axes.

    The queries come split by heads (over the last `extra` axis, or not at all) and the
    batch over `home`; each device takes its sequences' rows of every operand, gathers
    all heads of its rows (all-to-all over the heads' axis), attends, and sends the
    heads back.
    """
    specs = [sharding.kernel_spec(a, x.shape) for a, x in zip(axes, args, strict=True)]
    stack = (None,) * (args[2].ndim - 3)  # a layer stack's axis, kept whole
    specs[2] = specs[3] = P(*stack, home + extra, None, None)
    heads = specs[0][2]
    if heads is not None and heads != extra[-1]:
        raise NotImplementedError(
            f"a latent cache split by sequence over {extra} needs the query heads split over {extra[-1]!r} "
            f"or not at all; the rules split them over {heads!r}"
        )
    lead = extra[:-1] if heads is not None else extra

    def local(q_lat, q_pe, ckv, kpe, *rest):
        q = [sharding.rows_here(x, lead) if lead else x for x in (q_lat, q_pe)]
        if heads is not None:
            q = [jax.lax.all_to_all(x, heads, 0, 2, tiled=True) for x in q]
        out = fn(*q, ckv, kpe, *(sharding.rows_here(x, extra) if x.ndim else x for x in rest))
        if heads is not None:
            # Sent in the queries' dtype: the caller rounds to it first thing anyway.
            sent = jax.lax.all_to_all(out.astype(q_lat.dtype), heads, 2, 0, tiled=True)
            out = sent.astype(out.dtype)
        return jax.lax.all_gather(out, lead, axis=0, tiled=True) if lead else out

    # check_vma=False: pallas_call outputs carry no varying-axes annotation.
    return jax.shard_map(local, in_specs=tuple(specs), out_specs=specs[0], check_vma=False)(*args)
