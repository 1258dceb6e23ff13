"""The DeepSeek-V3 / Kimi-K2 target model as pure functions over a params pytree.

Notation:
  B batch, T new tokens in this forward, S cache capacity, V vocab, H hidden,
  N heads, D qk_nope_head_dim, P qk_rope_head_dim, Dv v_head_dim,
  R kv_lora_rank, Q q_lora_rank, I (expert) intermediate size, E routed experts,
  K experts per token, L layers (Ld dense + Lm MoE).

Weights are stored [in, out] (x @ w). Layers of one kind are stacked on a
leading axis and run with `lax.scan`: one compiled layer body per kind, whatever
the depth; with "fast" numerics, stacks of at most `UNROLL_MAX_LAYERS` layers are unrolled instead.
Attention is absorbed MLA against a latent cache (`cache.KVCache`); kv_b_proj
is kept split as W_UK [N, D, R] and W_UV [N, Dv, R].
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax import sharding, topk, weights
from ddtree_jax.cache import KVCache, LatentKV
from ddtree_jax.config import TargetConfig
from ddtree_jax.layers import (
    LATENT_NORM_EPS,
    OutMajor,
    Unstacked,
    apply_rope,
    einsum,
    layer_count,
    layer_structure,
    linear,
    rms_norm,
    rope_tables,
    scan_layers,
    swiglu,
    unstack,
)
from ddtree_jax.numerics import ROW_TILE, routed_in_pair_tiles, tile_rows
from ddtree_jax.numerics import resolve as resolve_numerics
from ddtree_jax.pallas.mla_attention import mla_attention
from ddtree_jax.pallas.moe import moe_experts
from ddtree_jax.pallas.moe.api import moe_pairs
from ddtree_jax.pallas.moe.api import resolve as resolve_moe
from ddtree_jax.pallas.moe.reference import moe_experts_reference, weighted_sum
from ddtree_jax.quant import Int4, QuantizedArray
from ddtree_jax.weights import HFTensor, Weight, identity, transpose

# A scan is a device loop: on the GPU each iteration pays its own launches and a host
# round trip for the predicate, which dominates a small, launch-bound target. Deep
# stacks (Kimi-K2: 60 MoE layers) keep the loop for compile time and code size.
UNROLL_MAX_LAYERS = 8


@struct.dataclass
class AttentionParams:
    """MLA weights of one layer (a leading layer axis when stacked)."""

    kv_a: jax.Array  # [H, R + P]
    kv_a_norm: jax.Array  # [R]
    w_uk: jax.Array  # [N, D, R]
    w_uv: jax.Array  # [N, Dv, R]
    o: jax.Array  # [N, Dv, H]
    q: jax.Array | None = None  # [H, N, D + P] when q_lora_rank is None
    q_a: jax.Array | None = None  # [H, Q]
    q_a_norm: jax.Array | None = None  # [Q]
    q_b: jax.Array | None = None  # [Q, N, D + P]


@struct.dataclass
class MLPParams:
    """SwiGLU weights: gate, up [H, I]; down [I, H]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


@struct.dataclass
class MoEParams:
    """Sigmoid-routed experts plus shared experts."""

    router: jax.Array  # [H, E] float32
    router_bias: jax.Array  # [E] float32, e_score_correction_bias (selection only)
    gate: jax.Array  # [E, H, I]
    up: jax.Array  # [E, H, I]
    down: jax.Array  # [E, I, H]
    shared: MLPParams | SharedAsExpert | None  # I_shared = n_shared_experts * I


@struct.dataclass
class SharedAsExpert:
    """`MoEParams.shared` of a layer prepared for the decode loop (`HOIST_SHARED_AS_EXPERT`): its
    shared expert is the last of the routed stacks ([E + 1, ...]), which every token chooses
    with weight 1."""


@struct.dataclass
class LayerParams:
    """One decoder layer (stacked: every leaf gains a leading layer axis)."""

    attn_norm: jax.Array  # [H]
    attn: AttentionParams
    mlp_norm: jax.Array  # [H]
    mlp: MLPParams | MoEParams


@struct.dataclass
class TargetParams:
    """All target weights plus the (static) config."""

    config: TargetConfig = struct.field(pytree_node=False)
    embed: jax.Array  # [V, H]
    dense_layers: LayerParams | None  # leaves [Ld, ...] (or `layers.Unstacked`: `hoist_layers`)
    moe_layers: LayerParams | None  # leaves [Lm, ...] (or `layers.Unstacked`)
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [H, V]; None when tied to embed

    @property
    def dtype(self):
        return self.embed.dtype

    @property
    def unembed(self) -> jax.Array:
        return self.embed.T if self.lm_head is None else self.lm_head


@struct.dataclass
class ForwardOutput:
    """What one target forward returns."""

    hidden: jax.Array  # [B, T, H] after the final norm
    kv: LatentKV  # new tokens' latent entries, [L, B, T, *]
    taps: jax.Array | None  # [len(tap_layers), B, T, H] outputs of the tapped layers
    expert_counts: jax.Array | None = None  # [Lm, E] tokens routed to each expert (when asked)


def check_params(params: TargetParams) -> None:
    """Raises ValueError, naming the array, unless the embedding, the unembedding and each layer
    stack's layer count and attention projections have the shapes `params.config` gives (a config
    put on other weights would otherwise fail deep inside XLA). Reads a few shapes, no array."""
    cfg = params.config
    h, v = cfg.hidden_size, cfg.vocab_size

    def want(name, shape, expected):
        if tuple(shape) != tuple(expected):
            raise ValueError(f"params.{name} has shape {tuple(shape)}, but params.config gives {tuple(expected)}")

    want("embed", params.embed.shape, (v, h))
    if params.lm_head is not None:
        want("lm_head", params.lm_head.shape, (h, v))
    for name, stack, n in (
        ("dense_layers", params.dense_layers, cfg.first_k_dense_replace),
        ("moe_layers", params.moe_layers, cfg.num_moe_layers),
    ):
        if stack is None or n == 0:
            if (stack is None) != (n == 0):
                raise ValueError(f"params.{name} is {'None' if stack is None else 'set'}, but params.config has {n}")
            continue
        layer = layer_structure(stack)
        lead = () if isinstance(stack, Unstacked) else (n,)
        count = len(stack) if isinstance(stack, Unstacked) else layer.attn_norm.shape[0]
        if count != n:
            raise ValueError(f"params.{name} holds {count} layers, but params.config has {n}")
        want(f"{name}.attn.kv_a", layer.attn.kv_a.shape, (*lead, h, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
        want(f"{name}.attn.o", layer.attn.o.shape, (*lead, cfg.num_attention_heads, cfg.v_head_dim, h))


# ----------------------------------------------------------------------------------
# Weight declarations (weights.py): init, abstract shapes, sharding and HF I/O derive from them.

# Keys `init_params` splits its key into; each weight's `seed` picks one (kept fixed so
# a seed gives the same weights as before the declarations existed).
NUM_INIT_KEYS = 64


def _rope_perm(p: int, interleave: bool) -> np.ndarray:
    """Index map new[j] = old[perm[j]] taking HF's interleaved rope layout to halves."""
    if not interleave:
        return np.arange(p)
    return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])


def declare(cfg: TargetConfig) -> TargetParams:
    """Every target weight, declared once: a TargetParams whose leaves are `weights.Weight`s.

    HF layout (torch Linear stores [out, in]) -> ours ([in, out], heads split out):
      q_proj / q_b_proj [N*(D+P), in]  -> [in, N, D+P]   (rope columns de-interleaved)
      kv_a_proj_with_mqa [R+P, H]      -> [H, R+P]       (rope columns de-interleaved)
      kv_b_proj [N*(D+Dv), R]          -> W_UK [N, D, R], W_UV [N, Dv, R]
      o_proj [H, N*Dv]                 -> [N, Dv, H]
      routed experts, per expert (mlp.experts.J.*) or fused (mlp.experts.gate_up_proj
      [E, 2I, H], mlp.experts.down_proj [E, H, I]) -> gate/up [E, H, I], down [E, I, H]
    With `rope_interleave`, the rope output columns are permuted (evens, then odds),
    which makes HF's interleaved rotation equal to the rotate-half one we compute.
    """
    h, n, r, p = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d, dv, v = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.vocab_size
    perm = _rope_perm(p, cfg.rope_interleave)
    q_cols = np.concatenate([np.arange(d), d + perm])
    kv_cols = np.concatenate([np.arange(r), r + perm])
    seeds = itertools.count()  # keys in the order the weights were first drawn

    def layer_weight(ids, shape, axes, hf_name, hf_shape, to_ours=identity, to_hf=identity, **kw):
        layout = kw.pop("layouts", ())
        hf = (HFTensor(f"model.layers.{{layer}}.{hf_name}", hf_shape, to_ours, to_hf, kw.pop("join_axis", None)),)
        seed = next(seeds) if kw.get("init", "normal") != "ones" else 0
        return Weight((len(ids), *shape), ("layers", *axes), hf=hf + layout, layers=tuple(ids), seed=seed, **kw)

    def norm(ids, size, axis, hf_name):
        return layer_weight(ids, (size,), (axis,), hf_name, (size,), init="ones")

    def q_proj(fan_in):
        inv = np.argsort(q_cols)
        return (
            lambda a: np.transpose(a.reshape(n, d + p, fan_in)[:, q_cols, :], (2, 0, 1)),
            lambda a: np.transpose(a, (1, 2, 0))[:, inv, :].reshape(n * (d + p), fan_in),
        )

    def attn(ids):
        kv_inv = np.argsort(kv_cols)
        fields = dict(
            kv_a=layer_weight(
                ids,
                (h, r + p),
                ("embed", None),
                "self_attn.kv_a_proj_with_mqa.weight",
                (r + p, h),
                lambda a: transpose(a[kv_cols]),
                lambda a: transpose(a)[kv_inv],
            ),
            kv_a_norm=norm(ids, r, None, "self_attn.kv_a_layernorm.weight"),
            # kv_b_proj holds W_UK and W_UV of each head, one after the other.
            w_uk=layer_weight(
                ids,
                (n, d, r),
                ("heads", None, None),
                "self_attn.kv_b_proj.weight",
                (n * (d + dv), r),
                lambda a: a.reshape(n, d + dv, r)[:, :d],
                join_axis=1,
            ),
            w_uv=layer_weight(
                ids,
                (n, dv, r),
                ("heads", None, None),
                "self_attn.kv_b_proj.weight",
                (n * (d + dv), r),
                lambda a: a.reshape(n, d + dv, r)[:, d:],
                join_axis=1,
            ),
            o=layer_weight(
                ids,
                (n, dv, h),
                ("heads", None, "embed"),
                "self_attn.o_proj.weight",
                (h, n * dv),
                lambda a: transpose(a).reshape(n, dv, h),
                lambda a: transpose(a.reshape(n * dv, h)),
            ),
        )
        if cfg.q_lora_rank is None:
            q = layer_weight(
                ids, (h, n, d + p), ("embed", "heads", None), "self_attn.q_proj.weight", (n * (d + p), h), *q_proj(h)
            )
            return AttentionParams(q=q, **fields)
        ql = cfg.q_lora_rank
        q_a = layer_weight(ids, (h, ql), ("embed", None), "self_attn.q_a_proj.weight", (ql, h), transpose, transpose)
        q_b = layer_weight(
            ids, (ql, n, d + p), (None, "heads", None), "self_attn.q_b_proj.weight", (n * (d + p), ql), *q_proj(ql)
        )
        return AttentionParams(
            q_a=q_a, q_a_norm=norm(ids, ql, None, "self_attn.q_a_layernorm.weight"), q_b=q_b, **fields
        )

    def mlp(ids, inter, hf_prefix):
        def lin(shape, axes, name):
            return layer_weight(ids, shape, axes, f"{hf_prefix}.{name}.weight", shape[::-1], transpose, transpose)

        return MLPParams(
            gate=lin((h, inter), ("embed", "mlp"), "gate_proj"),
            up=lin((h, inter), ("embed", "mlp"), "up_proj"),
            down=lin((inter, h), ("mlp", "embed"), "down_proj"),
        )

    def experts(ids):
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        quant = None if cfg.expert_int4_group_size is None else Int4(cfg.expert_int4_group_size)

        def expert(name, shape, axes, fused_name, fused_shape, fused_to_ours):
            fused = HFTensor(
                f"model.layers.{{layer}}.mlp.experts.{fused_name}",
                fused_shape,
                fused_to_ours,
                transpose,
                join_axis=1 if fused_name == "gate_up_proj" else None,
                layout="fused",
            )
            # INT4 experts are stored per expert (weight_packed / weight_scale / weight_shape).
            return layer_weight(
                ids,
                (e, *shape),
                ("experts", *axes),
                f"mlp.experts.{{expert}}.{name}.weight",
                shape[::-1],
                transpose,
                transpose,
                layouts=() if quant else (fused,),
                quant=quant,
            )

        return dict(
            gate=expert(
                "gate_proj", (h, i), ("embed", None), "gate_up_proj", (e, 2 * i, h), lambda a: transpose(a[:, :i])
            ),
            up=expert("up_proj", (h, i), ("embed", None), "gate_up_proj", (e, 2 * i, h), lambda a: transpose(a[:, i:])),
            down=expert("down_proj", (i, h), (None, "embed"), "down_proj", (e, h, i), transpose),
        )

    def layers(ids, ffn):
        return LayerParams(
            attn_norm=norm(ids, h, "embed", "input_layernorm.weight"),
            attn=attn(ids),
            mlp_norm=norm(ids, h, "embed", "post_attention_layernorm.weight"),
            mlp=ffn,
        )

    dense_ids = range(cfg.num_dense_layers)
    moe_ids = range(cfg.num_dense_layers, cfg.num_hidden_layers)
    dense = layers(dense_ids, mlp(dense_ids, cfg.intermediate_size, "mlp")) if dense_ids else None
    moe = None
    if moe_ids:
        e = cfg.n_routed_experts
        router = layer_weight(
            moe_ids, (h, e), ("embed", None), "mlp.gate.weight", (e, h), transpose, transpose, dtype=jnp.float32
        )
        bias = layer_weight(
            moe_ids, (e,), (None,), "mlp.gate.e_score_correction_bias", (e,), init="uniform", dtype=jnp.float32
        )
        routed = experts(moe_ids)
        shared = None
        if cfg.n_shared_experts:
            shared = mlp(moe_ids, cfg.moe_intermediate_size * cfg.n_shared_experts, "mlp.shared_experts")
        moe = layers(moe_ids, MoEParams(router=router, router_bias=bias, shared=shared, **routed))
    embed = Weight((v, h), ("vocab", "embed"), hf=(HFTensor("model.embed_tokens.weight", (v, h)),), seed=next(seeds))
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = Weight(
            (h, v), ("embed", "vocab"), hf=(HFTensor("lm_head.weight", (v, h), transpose, transpose),), seed=next(seeds)
        )
    final_norm = Weight((h,), ("embed",), init="ones", hf=(HFTensor("model.norm.weight", (h,)),))
    return TargetParams(
        config=cfg, embed=embed, dense_layers=dense, moe_layers=moe, final_norm=final_norm, lm_head=lm_head
    )


def init_params(cfg: TargetConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> TargetParams:
    """Random weights: normal(0, std) matrices, unit norms, a small random router bias."""
    return weights.init(declare(cfg), key, dtype, std, NUM_INIT_KEYS)


def abstract_params(cfg: TargetConfig, dtype=jnp.bfloat16) -> TargetParams:
    """The params' `jax.ShapeDtypeStruct`s (nothing allocated): for compile-only work on full-size configs."""
    return weights.abstract(declare(cfg), dtype)


def cast_params(params: TargetParams, dtype) -> TargetParams:
    """Casts every weight to dtype except the router and its bias (kept float32) and INT4 experts."""
    return weights.cast(declare(params.config), params, dtype)


def quantize_experts(params: TargetParams, group_size: int = 32) -> TargetParams:
    """The same model with its routed experts stored INT4 (round to nearest, one scale per
    `group_size` inputs): what `python -m ddtree_jax quantize` writes."""
    if params.config.expert_int4_group_size is not None:
        raise ValueError(f"the routed experts are INT4 already (group size {params.config.expert_int4_group_size})")
    if params.moe_layers is None:
        raise ValueError("the model has no routed experts to quantize")
    cfg = dataclasses.replace(params.config, expert_int4_group_size=group_size)
    return jax.tree.map(
        lambda w, a: a if w.quant is None else w.quant.quantize(a),
        declare(cfg),
        params.replace(config=cfg),
        is_leaf=weights.is_weight,
    )


def dequantize_experts(params: TargetParams, dtype=jnp.float32) -> TargetParams:
    """The same model with its INT4 routed experts expanded to `dtype` (the inverse of
    `quantize_experts` up to its rounding): a quantized export to continue training from."""
    if params.config.expert_int4_group_size is None:
        raise ValueError("the routed experts are not INT4")
    cfg = dataclasses.replace(params.config, expert_int4_group_size=None)
    return jax.tree.map(
        lambda a: a.dequantize(dtype) if isinstance(a, QuantizedArray) else a,
        params.replace(config=cfg),
        is_leaf=lambda a: isinstance(a, QuantizedArray),
    )


def _routed_path(stack: LayerParams, implementation: str, dtype) -> str | None:
    """The implementation a stacked layer stack's routed experts run on (None: no MoE)."""
    mlp = stack.mlp
    if not isinstance(mlp, MoEParams):
        return None
    return resolve_moe(implementation, mlp.gate, mlp.up, mlp.down, dtype, stacked=True)


def _unrolled(numerics: str, n_layers: int, routed_path: str | None) -> bool:
    """Whether `forward` unrolls a stack of `n_layers` (else it scans them). "exact" loops
    over row tiles and key blocks anyway; unrolling its layers would only multiply the compile
    time (the shipped target's generate: 20 s unrolled, 14 s scanned). Layers whose routed
    experts the Mosaic kernels index stay a loop: unrolled, the 4-layer K2 shard's verify died
    on the H200 (CUDA_ERROR_LAUNCH_FAILED, cause not established) while the scan ran; at >= 64
    MB of experts a layer the loop's overhead is small anyway."""
    return numerics == "fast" and n_layers <= UNROLL_MAX_LAYERS and routed_path != "mosaic"


HOIST_MAX_BYTES = 1 << 30
"""`hoist_layers` prepares a layer stack of at most this many bytes (as prepared)."""

HOIST_SHARED_AS_EXPERT = False
"""Whether `hoist_layers` appends the shared expert of an unrolled "fast" stack on the XLA path to
the routed stacks, as one more expert every token chooses with weight 1 (`SharedAsExpert`),
where its width is a routed expert's (one shared expert): the routed pass then computes it too,
one down GEMM instead of two in a verify's dense pass, one gather instead of the shared GEMMs in
an AR step. A verify of the shipped target ran the shared down projection as a GEMM of its own,
2.9 us in each of 7 layers (session 51's stage profile). Off: on an H100 (session 52, interleaved
pairs) a DDTree(12) round cost the same with it (1.578 AR steps) and a DDTree(32) round more
(1.816 against the joined attention's 1.585, both from budget-32 pairs whose AR step session 53
found slow, so the two compare with each other, not with the eval). It changes
a forward's last bits (the shared output summed with the routed ones in float32 before one
rounding)."""

HOIST_SHARED_OUT_MAJOR: bool | None = None
"""Whether `hoist_layers` holds the shared experts' gate and up as [I, H] (`layers.OutMajor`);
None: on a GPU. XLA merges them with the dense routed pass of a verify into one GEMM that reads
every weight [out, in], and otherwise transposes the two [H, I] weights of each layer for it
every round (14 transposes a DDTree(12) round of the shipped pair). End to end on one H100
(session 42, all 164 HumanEval prompts, T = 0, one machine start, two processes each way;
docs/benchmarks.md): AR 1974 / 1973 -> 2195 / 2158 tokens/s (+9-11%), DDTree(12) 4293 / 4213
-> 4302 (one process; no loss). In interleaved pairs its round was 2-3% faster and its AR step 5-7% (sessions
34, 41). Off on the CPU, where it was not timed. It changes a float32 forward's last bits."""


def _shared_as_expert(mlp):
    """A stack's MoE weights (dense: the XLA path's, INT4 already dequantized) with the shared
    expert appended to the routed stacks (`SharedAsExpert`), where there is one of a routed
    expert's width; else unchanged."""
    if not isinstance(mlp, MoEParams) or not isinstance(mlp.shared, MLPParams):
        return mlp
    if mlp.shared.gate.shape[-1] != mlp.gate.shape[-1]:
        return mlp

    def join(routed, shared):  # [L, E, ...] and [L, ...] -> [L, E + 1, ...]
        return jnp.concatenate([routed, shared[:, None].astype(routed.dtype)], axis=1)

    return mlp.replace(
        gate=join(mlp.gate, mlp.shared.gate),
        up=join(mlp.up, mlp.shared.up),
        down=join(mlp.down, mlp.shared.down),
        shared=SharedAsExpert(),
    )


def _out_major(mlp: MLPParams) -> MLPParams:
    """gate and up [H, I] as `OutMajor` ([I, H], the same values); down unchanged."""
    return mlp.replace(gate=OutMajor(mlp.gate.T), up=OutMajor(mlp.up.T))


def hoist_layers(params: TargetParams, numerics: str, implementation: str = "auto") -> TargetParams:
    """The target as a decode loop should hold it: the loop-invariant work on its weights
    done once, before the loop, instead of in every round.

    Each layer stack that takes at most `HOIST_MAX_BYTES` once prepared has its INT4 routed
    experts dequantized to the model's dtype where the XLA path runs them (the kernels take
    INT4 as it is), and a stack that `forward` unrolls ("fast" numerics, at most
    `UNROLL_MAX_LAYERS` layers, routed experts not on the Mosaic kernels, which index the
    stack in place) is split into per-layer weights (`layers.Unstacked`). Inside the loop,
    XLA copied each layer's slice of every stacked weight a GEMM reads, and dequantized the
    experts every round ("exact" numerics: once per tile of (token, expert) pairs). Same
    values: dequantization is exact and deterministic, and slicing moves bytes unchanged.
    With `HOIST_SHARED_OUT_MAJOR` the shared experts' gate and up of an unrolled stack are
    also held transposed (`layers.OutMajor`).

    Args:
      params: the target (stacked layers, as loaded).
      numerics: "exact" or "fast", as resolved for the forward passes.
      implementation: the kernels' `implementation` (as in `forward`).

    Returns:
      params, its stacks prepared as above (`Unstacked` where unrolled; the others unchanged).
    """

    def prepare(stack):
        if stack is None or isinstance(stack, Unstacked):
            return stack
        # "Exact" numerics run the routed experts on XLA whatever the kernels would take.
        path = "xla" if numerics == "exact" else _routed_path(stack, implementation, params.dtype)
        # Only the XLA path dequantizes INT4 experts itself (the others take them or refuse them).
        int4 = lambda a: path == "xla" and isinstance(a, QuantizedArray)  # noqa: E731
        leaves = jax.tree.leaves(stack, is_leaf=int4)
        size = sum(np.prod(a.shape) * (params.dtype.itemsize if int4(a) else a.dtype.itemsize) for a in leaves)
        if size > HOIST_MAX_BYTES:
            return stack
        dense = jax.tree.map(lambda a: a.dequantize(params.dtype) if int4(a) else a, stack, is_leaf=int4)
        if not _unrolled(numerics, layer_count(stack), path):
            return dense
        if HOIST_SHARED_AS_EXPERT and path == "xla" and sharding.context_mesh() is None:
            dense = dense.replace(mlp=_shared_as_expert(dense.mlp))
        layers = unstack(dense)
        out_major = jax.default_backend() == "gpu" if HOIST_SHARED_OUT_MAJOR is None else HOIST_SHARED_OUT_MAJOR
        if not out_major or not isinstance(getattr(layers.layers[0].mlp, "shared", None), MLPParams):
            return layers
        return Unstacked(
            tuple(lp.replace(mlp=lp.mlp.replace(shared=_out_major(lp.mlp.shared))) for lp in layers.layers)
        )

    return params.replace(dense_layers=prepare(params.dense_layers), moe_layers=prepare(params.moe_layers))


# ----------------------------------------------------------------------------------
# Layers


ROUTER_RANK_MAX_EXPERTS = 0
"""`route` picks among at most this many experts (or groups) with `topk.rank_top_k` instead of
`lax.top_k` (0: always top_k). The same indices either way; on the GPU top_k is a sort kernel per
MoE layer (about 1.8 us each, seven in an AR step and seven in a verify of the shipped pair),
where the ranks could fuse with the router's other elementwise work. Off: on an H100 (session
47, docs/benchmarks.md) at 64 it took 2% off a DDTree(32) round in interleaved pairs, but the
HumanEval run, one process each way, showed no gain (AR +1.7%, DDTree(32) -1.3% tokens/s). At
16 (session 53, pairs): AR step 0.404 -> 0.388 ms and DDTree(12) round 0.592 -> 0.579 ms, across
processes whose AR step varies as much."""


ROUTER_REDUCE_MAX_TOKENS = 64
"""`route` computes the router logits of at most this many tokens as a float32 multiply and sum
over the hidden axis, one reduction kernel, instead of a float32 dot at "highest" precision (0:
always the dot). Same products and float32 sums, in another order. On an H100 the dot of a
DDTree(12) verify's 13 tokens ([13, 384] x [384, 16]) ran as a GEMM of 4.4 us in each of the
shipped target's 7 MoE layers, where an AR step's one token, which XLA turns into a reduction
itself, took 1.5 us (session 51, profile_round's stage kernels). Beyond it a prefill's dot
stays a GEMM."""


def route(cfg: TargetConfig, x: jax.Array, router: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """noaux_tc sigmoid routing. x [T, H] -> (idx [T, K] int32, weights [T, K] float32).

    The correction bias only chooses experts (groups and top-k); the weights are
    the unbiased sigmoid scores, renormalised if norm_topk_prob, times
    routed_scaling_factor.
    """
    if x.shape[0] <= ROUTER_REDUCE_MAX_TOKENS:
        z = jnp.sum(x.astype(jnp.float32)[:, :, None] * router.astype(jnp.float32), axis=1)  # [T, E]
    else:
        z = jnp.dot(x.astype(jnp.float32), router, precision="highest")
    scores = jax.nn.sigmoid(z)
    choice = scores + bias
    t, e = choice.shape
    if cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(t, cfg.n_group, e // cfg.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        group_idx = topk.top_k(group_scores, cfg.topk_group, ROUTER_RANK_MAX_EXPERTS)[1]
        keep = jnp.any(jax.nn.one_hot(group_idx, cfg.n_group, dtype=jnp.bool_), axis=1)  # [T, G]
        keep = jnp.repeat(keep, e // cfg.n_group, axis=1)
        choice = jnp.where(keep, choice, -jnp.inf)
    idx = topk.top_k(choice, cfg.num_experts_per_tok, ROUTER_RANK_MAX_EXPERTS)[1]
    w = jnp.take_along_axis(scores, idx, axis=1)
    # The sigmoid saturates and top_k ranks NaN: a non-finite router logit or bias would
    # still pick experts with finite weights. Such a token's weights are made NaN, so it shows.
    ok = jnp.all(jnp.isfinite(z), axis=-1, keepdims=True) & jnp.all(jnp.isfinite(bias))
    w = jnp.where(ok, w, jnp.nan)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def _moe_tokens(cfg: TargetConfig, p: MoEParams, flat: jax.Array, experts) -> tuple[jax.Array, jax.Array]:
    """Routed experts (computed by `experts`) + shared experts. flat [T, H] -> ([T, H], idx [T, K])."""
    with jax.named_scope("moe"):
        idx, w = route(cfg, flat, p.router, p.router_bias)
        if isinstance(p.shared, SharedAsExpert):  # the last expert, chosen by every token
            t, e = idx.shape[0], p.gate.shape[-3] - 1
            both = jnp.concatenate([idx, jnp.full((t, 1), e, idx.dtype)], axis=1)
            return experts(
                flat, both, jnp.concatenate([w, jnp.ones((t, 1), w.dtype)], axis=1), p.gate, p.up, p.down
            ), idx
        y = experts(flat, idx, w, p.gate, p.up, p.down)
        if p.shared is not None:
            y = y + swiglu(flat, p.shared.gate, p.shared.up, p.shared.down)
        return y, idx


def _expert_counts(cfg: TargetConfig, idx: jax.Array) -> jax.Array:
    """Tokens routed to each expert [E] from expert ids [T, K]."""
    return jnp.sum(jax.nn.one_hot(idx, cfg.n_routed_experts, dtype=jnp.float32), axis=(0, 1))


def moe_ffn(
    cfg: TargetConfig, p: MoEParams, x: jax.Array, implementation: str, layer: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Routed experts + shared experts. x [B, T, H] -> ([B, T, H], tokens per expert [E]).

    `layer`: None, or the index into routed-expert stacks [L, E, ...] held in `p` (see
    `moe_experts`).
    """
    b, t, h = x.shape
    experts = functools.partial(moe_experts, implementation=implementation, layer=layer)
    y, idx = _moe_tokens(cfg, p, x.reshape(b * t, h), experts)
    return y.reshape(b, t, h), _expert_counts(cfg, idx)


def _attn_inputs(cfg: TargetConfig, p: AttentionParams, x: jax.Array, cos: jax.Array, sin: jax.Array, kv_dtype):
    """Normed x [B, T, H] -> q_lat [B, T, N, R], q_pe [B, T, N, P] (x's dtype), c_kv [B, T, R], k_pe [B, T, P]."""
    d, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = linear(x, p.q)
    else:
        q = linear(rms_norm(linear(x, p.q_a), p.q_a_norm, LATENT_NORM_EPS), p.q_b)  # [B, T, N, D + P]
    q_nope, q_pe = q[..., :d], apply_rope(q[..., d:], cos, sin)
    kv = linear(x, p.kv_a)  # [B, T, R + P]
    # Rounded to the cache dtype so that a token attends to itself exactly as it
    # will later attend to its committed cache entry.
    c_kv = rms_norm(kv[..., :r], p.kv_a_norm, LATENT_NORM_EPS).astype(kv_dtype)
    k_pe = apply_rope(kv[..., r:], cos, sin).astype(kv_dtype)
    q_lat = einsum("btnd,ndr->btnr", q_nope, p.w_uk).astype(x.dtype)
    return q_lat, q_pe, c_kv, k_pe


def _attn_output(p: AttentionParams, o_lat: jax.Array, dtype) -> jax.Array:
    """Attention-weighted latents [B, T, N, R] -> the layer's attention output [B, T, H]."""
    o = einsum("btnr,nvr->btnv", o_lat.astype(dtype), p.w_uv).astype(dtype)
    return einsum("btnv,nvh->bth", o, p.o).astype(dtype)


def mla(
    cfg: TargetConfig,
    p: AttentionParams,
    x: jax.Array,  # [B, T, H]
    cos: jax.Array,  # [B, T, P/2]
    sin: jax.Array,
    cache_ckv: jax.Array,  # [B, S, R]
    cache_kpe: jax.Array,  # [B, S, P]
    cache_len: jax.Array,  # [B]
    new_mask: jax.Array,  # [B, T, T]
    implementation: str,
    layer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Absorbed MLA. Returns (out [B, T, H], c_kv [B, T, R], k_pe [B, T, P]) of the new tokens.

    With `layer` the caches are every layer's ([L, B, S, R] / [L, B, S, P]) and this one's is
    attended (`mla_attention`)."""
    q_lat, q_pe, c_kv, k_pe = _attn_inputs(cfg, p, x, cos, sin, cache_ckv.dtype)
    o_lat = mla_attention(
        q_lat,
        q_pe,
        cache_ckv,
        cache_kpe,
        cache_len,
        c_kv,
        k_pe,
        new_mask,
        scale=cfg.softmax_scale,
        implementation=implementation,
        layer=layer,
    )
    return _attn_output(p, o_lat, x.dtype), c_kv, k_pe


def _in_pair_tiles(cfg: TargetConfig) -> bool:
    """Whether "exact" numerics run the routed experts as (token, expert) pair tiles."""
    return routed_in_pair_tiles(
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    )


def _exact_layer(
    cfg: TargetConfig,
    lp: LayerParams,
    x: jax.Array,  # [B, T, H]
    positions: jax.Array,  # [B, T]
    cache_ckv: jax.Array,  # [B, S, R]
    cache_kpe: jax.Array,  # [B, S, P]
    cache_len: jax.Array,  # [B]
    new_mask: jax.Array,  # [B, T, T]
    span: int,
    routed: tuple | None = None,
    layer: jax.Array | None = None,
):
    """One decoder layer in "exact" numerics (numerics.py): the per-token work in row
    tiles, attention in position-aligned key blocks. `routed`: every layer's routed-expert
    stacks (gate, up, down), `layer` this one's index in them (lp's are then None); `layer`
    is unused without `routed`.

    Returns (x, c_kv [B, T, R], k_pe [B, T, P], expert ids [B * T, K] | None).
    """
    b, t, h = x.shape
    n, r = cfg.num_attention_heads, cfg.kv_lora_rank

    def pre(xt, pt):  # [TM, H], [TM]
        cos, sin = rope_tables(cfg, pt[None])
        out = _attn_inputs(cfg, lp.attn, rms_norm(xt, lp.attn_norm, cfg.rms_norm_eps)[None], cos, sin, cache_ckv.dtype)
        return jax.tree.map(lambda a: a[0], out)

    q_lat, q_pe, c_kv, k_pe = tile_rows(pre, x.reshape(b * t, h), positions.reshape(b * t))
    c_kv, k_pe = c_kv.reshape(b, t, r), k_pe.reshape(b, t, -1)
    o_lat = mla_attention(
        q_lat.reshape(b, t, n, r),
        q_pe.reshape(b, t, n, -1),
        cache_ckv,
        cache_kpe,
        cache_len,
        c_kv,
        k_pe,
        new_mask,
        scale=cfg.softmax_scale,
        implementation="exact",
        positions=positions,
        span=span,
    )
    mlp = lp.mlp
    is_moe = isinstance(mlp, MoEParams)
    # Many, large experts: the routed pairs in tiles of one expert, after the row tiles.
    pair_tiles = is_moe and _in_pair_tiles(cfg)

    def post(xt, ot):  # [TM, H], [TM, N, R]
        xt = xt + _attn_output(lp.attn, ot[None], xt.dtype)[0]
        hx = rms_norm(xt, lp.mlp_norm, cfg.rms_norm_eps)
        if not is_moe:
            return xt + swiglu(hx, mlp.gate, mlp.up, mlp.down), None
        if pair_tiles:
            return xt, hx, *route(cfg, hx, mlp.router, mlp.router_bias)
        y, idx = _moe_tokens(cfg, mlp, hx, moe_experts_reference)  # every expert per tile: fixed shapes
        return xt + y, idx

    out = tile_rows(post, x.reshape(b * t, h), o_lat.reshape(b * t, n, r))
    if not pair_tiles:
        x, idx = out
        return x.reshape(b, t, h), c_kv, k_pe, idx
    x, hx, idx, w = out
    experts, at = ((mlp.gate, mlp.up, mlp.down), None) if routed is None else (routed, layer)
    ys = moe_pairs(hx, idx, *experts, ROW_TILE, at)  # [M, K, H], expert-parallel on a mesh

    def finish(xt, hxt, wt, yt):  # per token: the weighted sum, the shared experts, the residual
        y = weighted_sum(wt, yt)
        if mlp.shared is not None:
            y = y + swiglu(hxt, mlp.shared.gate, mlp.shared.up, mlp.shared.down)
        return xt + y

    x = tile_rows(finish, x, hx, w, ys)
    return x.reshape(b, t, h), c_kv, k_pe, idx


def _run_layers(
    cfg: TargetConfig,
    layers: LayerParams,
    x: jax.Array,  # [B, T, H]
    positions: jax.Array,  # [B, T]
    cache_ckv: jax.Array,  # [L, B, S, R] every layer's
    cache_kpe: jax.Array,
    cache_len: jax.Array,
    new_mask: jax.Array,
    keep_hidden: bool,
    implementation: str,
    numerics: str,
    span: int,
    unroll_layers: bool = True,
    first: int = 0,
):
    """Scans one stack of same-kind layers, the model's layers `first` .. (unrolled where
    `_unrolled` says, unless `unroll_layers` is False).

    Returns (x, c_kv [Lk,B,T,R], k_pe, hidden [Lk,B,T,H] | None, expert counts [Lk,E] | None).
    """
    is_moe = isinstance(layer_structure(layers).mlp, MoEParams)
    cos, sin = rope_tables(cfg, positions) if numerics == "fast" else (None, None)
    n_layers = layer_count(layers)
    stacked = not isinstance(layers, Unstacked)
    path = _routed_path(layers, implementation, x.dtype) if stacked and numerics == "fast" else None
    routed = None  # routed-expert stacks indexed in place
    if path == "mosaic" or (numerics == "exact" and stacked and is_moe and _in_pair_tiles(cfg)):
        # Scanned, each layer's slice of the stacks reaches the kernel (or the "exact" pair
        # tiles) as a copy XLA makes first (experiments/moe_layer_stack.py); they take the
        # layer index instead. "Exact" on a 2-core CPU: docs/benchmarks.md (session 47).
        routed = (layers.mlp.gate, layers.mlp.up, layers.mlp.down)
        layers = layers.replace(mlp=layers.mlp.replace(gate=None, up=None, down=None))

    def body(x, xs):
        lp, li = xs
        counts = None
        # Each layer's cache stays in the stack: the attention takes the stack and the layer.
        at = first + li
        if numerics == "exact":
            ckv, kpe = cache_ckv[at], cache_kpe[at]
            x, c_new, k_new, idx = _exact_layer(cfg, lp, x, positions, ckv, kpe, cache_len, new_mask, span, routed, li)
            counts = _expert_counts(cfg, idx) if is_moe else None
            return x, (c_new, k_new, x if keep_hidden else None, counts)
        attn_out, c_new, k_new = mla(
            cfg,
            lp.attn,
            rms_norm(x, lp.attn_norm, cfg.rms_norm_eps),
            cos,
            sin,
            cache_ckv,
            cache_kpe,
            cache_len,
            new_mask,
            implementation,
            layer=at,
        )
        x = x + attn_out
        hx = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        if is_moe:
            mlp, layer = (
                (lp.mlp, None) if routed is None else (lp.mlp.replace(gate=routed[0], up=routed[1], down=routed[2]), li)
            )
            y, counts = moe_ffn(cfg, mlp, hx, implementation, layer=layer)
            x = x + y
        else:
            x = x + swiglu(hx, lp.mlp.gate, lp.mlp.up, lp.mlp.down)
        return x, (c_new, k_new, x if keep_hidden else None, counts)

    unroll = unroll_layers and _unrolled(numerics, n_layers, path)
    xs = (layers, jnp.arange(n_layers, dtype=jnp.int32))
    x, (c_kv, k_pe, hidden, counts) = scan_layers(body, x, xs, unroll=unroll)
    return x, c_kv, k_pe, hidden, counts


# ----------------------------------------------------------------------------------
# Forward


def forward(
    params: TargetParams,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32
    cache: KVCache,
    new_mask: jax.Array,  # [B, T, T] bool
    *,
    tap_layers: Sequence[int] = (),
    tap_final_norm: bool = True,
    implementation: str = "auto",
    numerics: str | None = None,
    span: int | None = None,
    unroll_layers: bool = True,
) -> ForwardOutput:
    """Runs T new tokens per sequence against a committed latent cache.

    Every committed cache entry (slot < cache.lengths[b]) is visible to every new
    token; among the new tokens, t sees u iff new_mask[b, t, u]. Prefill passes a
    causal mask, tree verification the ancestor-or-self matrix. The cache is read,
    never written: commit the returned `kv` with `KVCache.write`.

    Args:
      params: target weights.
      tokens: token ids.
      positions: absolute position of each token (RoPE angle, not a slot).
      cache: the committed latent cache.
      new_mask: visibility among the new tokens.
      tap_layers: layer indices whose outputs to return (for the drafter).
      tap_final_norm: the last layer's tap is taken after the final norm, as HF's
        `hidden_states[i + 1]` is (DFlash tooling's convention); False: its raw output.
      implementation: the attention / MoE kernels, as in `generate` ("auto", "xla", "pallas", "mosaic").
      numerics: "exact" or "fast" (numerics.py); default "exact" for float32
        weights on the XLA path. "exact" needs the new tokens a query sees at
        distinct positions in [cache.lengths, cache.lengths + span) (causal and
        tree masks are), and is for inference: its key-block loop has a
        data-dependent length, which reverse-mode autodiff cannot run (training
        passes "fast").
      span: static bound on the new tokens' offsets from cache.lengths ("exact"
        only; default T).
      unroll_layers: False loops over each stack of stacked layers (one compiled body a
        kind) even where "fast" numerics would unroll it (`UNROLL_MAX_LAYERS`): a pass that
        runs once, such as a prefill, then costs less to compile. Layers given per layer
        (`hoist_layers`) always run unrolled.

    Returns:
      ForwardOutput with the final-normed hidden states; apply `logits` to the
      rows you need.
    """
    cfg = params.config
    b, t = tokens.shape
    chex.assert_shape(positions, (b, t))
    chex.assert_shape(new_mask, (b, t, t))
    chex.assert_type(tokens, jnp.int32)
    if cache.batch != b:
        raise ValueError(f"cache batch {cache.batch} != tokens batch {b}")
    for layer in tap_layers:
        if not 0 <= layer < cfg.num_hidden_layers:
            raise ValueError(f"tap layer {layer} outside [0, {cfg.num_hidden_layers})")
    numerics = resolve_numerics(numerics, params.dtype, implementation)
    span = t if span is None else span
    if not isinstance(span, int) or span < 1:
        raise ValueError(f"span must be a positive int, got {span!r}")
    keep_hidden = bool(tap_layers)
    x = sharding.embed_rows(params.embed, tokens)
    ld = cfg.num_dense_layers
    c_parts, k_parts, h_parts = [], [], []
    for layers, sl in ((params.dense_layers, slice(0, ld)), (params.moe_layers, slice(ld, None))):
        if layers is None:
            continue
        x, c_kv, k_pe, hidden, counts = _run_layers(
            cfg,
            layers,
            x,
            positions,
            cache.c_kv,
            cache.k_pe,
            cache.lengths,
            new_mask,
            keep_hidden,
            implementation,
            numerics,
            span,
            unroll_layers,
            first=sl.start,
        )
        c_parts.append(c_kv)
        k_parts.append(k_pe)
        h_parts.append(hidden)
    kv = LatentKV(c_kv=jnp.concatenate(c_parts), k_pe=jnp.concatenate(k_parts))
    if numerics == "exact":
        hidden = tile_rows(lambda xt: rms_norm(xt, params.final_norm, cfg.rms_norm_eps), x.reshape(b * t, -1))
        hidden = hidden.reshape(x.shape)
    else:
        hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    taps = None
    if keep_hidden:
        taps = jnp.concatenate(h_parts)[jnp.asarray(tap_layers)]
        last = [i for i, layer in enumerate(tap_layers) if layer == cfg.num_hidden_layers - 1]
        if tap_final_norm and last:
            taps = taps.at[jnp.asarray(last)].set(hidden.astype(taps.dtype))
    return ForwardOutput(hidden=hidden, kv=kv, taps=taps, expert_counts=counts)


def logits(params: TargetParams, hidden: jax.Array, *, numerics: str | None = None) -> jax.Array:
    """Float32 logits [..., V] from final-normed hidden states [..., H].

    numerics: as in `forward` ("exact" computes each row in a fixed-shape tile).
    """
    if resolve_numerics(numerics, params.dtype) == "fast":
        return jnp.dot(hidden, params.unembed, preferred_element_type=jnp.float32)
    rows = hidden.reshape(-1, hidden.shape[-1])
    out = tile_rows(lambda h: jnp.dot(h, params.unembed, preferred_element_type=jnp.float32), rows)
    return out.reshape((*hidden.shape[:-1], out.shape[-1]))


def causal_mask(lengths: jax.Array, t: int) -> jax.Array:
    """[B, T, T] causal visibility over T new tokens, keys at index >= lengths[b] hidden."""
    idx = jnp.arange(t)
    causal = idx[None, :] <= idx[:, None]
    return causal[None] & (idx[None, None, :] < lengths[:, None, None])


def append(
    params: TargetParams,
    cache: KVCache,
    tokens: jax.Array,  # [B, T] right-padded
    lengths: jax.Array,  # [B] valid tokens per row
    *,
    tap_layers: Sequence[int] = (),
    tap_final_norm: bool = True,
    implementation: str = "auto",
    numerics: str | None = None,
    unroll_layers: bool = True,
) -> tuple[ForwardOutput, KVCache]:
    """Runs `tokens[b, :lengths[b]]` causally after each row's committed cache and commits them.

    Returns the forward output (hidden states and taps of every slot; padding
    slots are meaningless) and the cache with the valid entries written and
    lengths advanced. `unroll_layers` as in `forward`.
    """
    t = tokens.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = cache.lengths[:, None] + idx
    out = forward(
        params,
        tokens,
        positions,
        cache,
        causal_mask(lengths, t),
        tap_layers=tap_layers,
        tap_final_norm=tap_final_norm,
        implementation=implementation,
        numerics=numerics,
        unroll_layers=unroll_layers,
    )
    slots = jnp.where(idx < lengths[:, None], positions, cache.capacity)
    return out, cache.write(out.kv, slots).replace(lengths=cache.lengths + lengths)


def prefill(
    params: TargetParams,
    cache: KVCache,
    tokens: jax.Array,  # [B, T] right-padded
    lengths: jax.Array,  # [B] valid tokens per row
    *,
    implementation: str = "auto",
    numerics: str | None = None,
) -> tuple[jax.Array, KVCache]:
    """Appends `tokens[b, :lengths[b]]` after each sequence's committed cache.

    Returns (logits [B, V] float32 at each row's last valid token, updated cache).
    Rows with lengths[b] == 0 are left unchanged (their logits are meaningless).
    """
    out, cache = append(params, cache, tokens, lengths, implementation=implementation, numerics=numerics)
    last = out.hidden[jnp.arange(tokens.shape[0]), jnp.maximum(lengths - 1, 0)]
    return logits(params, last, numerics=resolve_numerics(numerics, params.dtype, implementation)), cache
