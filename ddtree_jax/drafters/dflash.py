"""The DFlash drafter (block diffusion, one forward proposes a block) as pure functions.

Notation:
  B batch, C context tokens in one `extend_context` call, T block tokens (bs),
  S cache capacity, V vocab, H hidden, Nq query heads, Nkv key/value heads,
  G = Nq // Nkv query heads per kv head, hd head_dim, I intermediate size,
  Ld drafter layers, n_taps tapped target layers.

A Qwen3-style stack without embedding or LM head: the block [root, MASK, ...] is
embedded with the target's table and the final hidden states are unembedded with
the target's lm_head. The target's tapped hidden states, concatenated and
projected (`fc`, `hidden_norm`), give one context vector per committed token;
every layer projects it to keys/values of its own (cached in `DrafterCache`).
The block's queries attend, without a mask, to all committed context keys (on
"sliding_attention" layers only to those less than `sliding_window` positions
back) and to all block keys; the block's keys/values are never kept.

Weights are stored [in, out] (x @ w), heads split out; layers are stacked on a
leading axis and run with `lax.scan`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ddtree_jax import hf, sharding, weights
from ddtree_jax.cache import KVCache
from ddtree_jax.config import (
    ConfigError,
    TargetConfig,
    YarnConfig,
    is_number,
    number,
    parse_rope,
    read_json,
    yarn_hf_dict,
)
from ddtree_jax.layers import (
    Unstacked,
    apply_rope,
    einsum,
    linear,
    rms_norm,
    rope_inv_freq,
    scan_layers,
    swiglu,
    unstack,
)
from ddtree_jax.model import TargetParams
from ddtree_jax.pallas.drafter_attention.api import drafter_attention
from ddtree_jax.pallas.drafter_attention.reference import masked_attention
from ddtree_jax.pallas.drafter_layer.api import JointQKV, drafter_qkv
from ddtree_jax.pallas.drafter_layer.api import uses_kernel as uses_qkv_kernel
from ddtree_jax.pallas.drafter_layer.reference import keys_values
from ddtree_jax.weights import HFTensor, Weight, identity, transpose

__all__ = [
    "KIMI_K25_DFLASH",
    "DFlashDrafter",
    "DrafterCache",
    "DrafterConfig",
    "DrafterLayerParams",
    "DrafterParams",
    "abstract_params",
    "declare",
    "default_target_layer_ids",
    "draft",
    "drafter_config_for",
    "extend_context",
    "init_params",
    "load_drafter",
    "save_drafter_hf",
    "tap_features",
]

# transformers 5.17's Qwen3Config (the DFlash drafter's layout) for keys a config.json leaves out:
# the published model reads such a config with these.
QWEN3_DEFAULTS = {"rope_theta": 10000.0, "head_dim": 128, "max_position_embeddings": 32768, "sliding_window": 4096}
# dflash_config / top-level keys of later DFlash variants that change the math: the values that
# leave it unchanged (as the message names them) and the test for them. The published model caps
# the logits only at a cap > 0.
_NEUTRAL_EXTRAS = {
    "input_embedding_scale": ("1.0", lambda v: v == 1.0),
    "output_multiplier": ("1.0", lambda v: v == 1.0),
    "final_logit_softcapping": ("None or <= 0: no cap", lambda v: v is None or (is_number(v) and v <= 0)),
}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default taps: evenly spaced from target layer 1 to N - 3 (the middle one for one layer).

    E.g. 5 draft layers on a 36-layer target -> (1, 9, 17, 25, 33).
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Shapes and hyper-parameters of a DFlash drafter (HF Qwen3Config names plus `dflash_config`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: YarnConfig | None = None  # YaRN (Kimi-K2.5-DFlash: factor 64, theta 50 000)
    num_target_layers: int | None = None
    max_position_embeddings: int = 40960
    # HF Qwen3 sliding windows: a "sliding_attention" layer's query at position q sees
    # context keys at positions k with q - k < sliding_window. None = all full attention.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # Attention among block tokens (context keys are always visible, up to the window). None is
    # DFlash's rule: sliding_attention layers causal, full_attention layers bidirectional;
    # True / False: every layer.
    is_causal: bool | None = None
    # What "target layer i" feeds: HF's hidden_states[i + 1], so the last layer's tap comes after
    # the final norm (DFlash tooling's convention). False: the last layer's raw output, what
    # drafters trained before the convention (the shipped one among them) were fed.
    tap_final_norm: bool = True

    def __post_init__(self):
        positive = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "block_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (root + at least one mask), got {self.block_size}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (rotate-half RoPE), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not isinstance(self.target_layer_ids, tuple | list) or not self.target_layer_ids:
            raise ConfigError(f"target_layer_ids must be a non-empty sequence, got {self.target_layer_ids!r}")
        # A tuple keeps the config hashable: it is a static field of DrafterParams.
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        if self.num_target_layers is not None and (
            not isinstance(self.num_target_layers, int) or self.num_target_layers < 1
        ):
            raise ConfigError(f"num_target_layers must be None or a positive int, got {self.num_target_layers!r}")
        upper = self.num_target_layers
        for layer in self.target_layer_ids:
            if not isinstance(layer, int) or layer < 0 or (upper is not None and layer >= upper):
                bound = f"[0, num_target_layers={upper})" if upper is not None else "non-negative ints"
                raise ConfigError(f"target_layer_ids {self.target_layer_ids} must lie in {bound}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.is_causal not in (None, True, False):
            raise ConfigError(f"is_causal must be None, True or False, got {self.is_causal!r}")
        if not isinstance(self.tap_final_norm, bool):
            raise ConfigError(f"tap_final_norm must be a bool, got {self.tap_final_norm!r}")
        self._check_windows()

    def _check_windows(self) -> None:
        types = self.layer_types
        if types is None:
            types = ("full_attention",) * self.num_hidden_layers
        if not isinstance(types, tuple | list) or len(types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types must list one type per layer ({self.num_hidden_layers}), got {types!r}")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ConfigError(f"layer_types {unknown} are not supported (full_attention / sliding_attention)")
        # All-full is stored as None so that dataclasses.replace(num_hidden_layers=...) keeps working.
        object.__setattr__(self, "layer_types", tuple(types) if "sliding_attention" in types else None)
        w = self.sliding_window
        if "sliding_attention" in types:
            if not isinstance(w, int) or w < self.block_size:
                raise ConfigError(
                    f"sliding_window must be an int >= block_size={self.block_size} for sliding_attention "
                    f"layers, got {w!r}"
                )
        elif w is not None:
            raise ConfigError(f"sliding_window={w!r} is set but no layer is sliding_attention")

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    def with_sliding_window(self, window: int | None) -> DrafterConfig:
        """This config with every layer sliding over the last `window` positions (None or 0: all full),
        each layer's block attention (bidirectional or causal) unchanged.

        Raises:
            ConfigError: window < block_size.
        """
        # Only the context changes: block attention that is the same in every layer stays so
        # (DFlash's default rule would make sliding layers causal and full ones not).
        causal = self.is_causal
        if causal is None and len(set(self.causal_layers)) == 1:
            causal = self.causal_layers[0]
        if not window:
            return dataclasses.replace(self, layer_types=None, sliding_window=None, is_causal=causal)
        types = ("sliding_attention",) * self.num_hidden_layers
        return dataclasses.replace(self, layer_types=types, sliding_window=window, is_causal=causal)

    @property
    def windows(self) -> tuple[int, ...]:
        """Per layer: how far back (q - k < window) a query sees context; full layers get 2**31 - 1."""
        full = int(np.iinfo(np.int32).max)
        return tuple(self.sliding_window if t == "sliding_attention" else full for t in self.types)

    @property
    def causal_layers(self) -> tuple[bool, ...]:
        """Per layer: whether block token q sees only block tokens at positions <= its own."""
        if self.is_causal is not None:
            return (self.is_causal,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.types)

    @property
    def types(self) -> tuple[str, ...]:
        """The attention type of each layer ("full_attention" or "sliding_attention")."""
        return self.layer_types or ("full_attention",) * self.num_hidden_layers

    @property
    def num_kv_groups(self) -> int:
        """G: query heads served by each kv head."""
        return self.num_attention_heads // self.num_key_value_heads

    # HF interop ----------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DrafterConfig:
        """Builds a config from a published DFlash `config.json` dict.

        `target_layer_ids`, `mask_token_id` and `block_size` are read from
        `dflash_config` first, then from the top level. Missing
        `target_layer_ids` default to `default_target_layer_ids(num_target_layers,
        num_hidden_layers)`. Accepts `rope_theta` or transformers 5's `rope_parameters`.

        Raises:
            ConfigError: on a missing key or a feature the drafter does not support.
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"a DFlash config must be a JSON object, got {type(hf).__name__}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("attention_bias", False):
            raise ConfigError("attention_bias=True is not supported")
        rope_theta, yarn = parse_rope(hf, QWEN3_DEFAULTS["rope_theta"])
        dflash = hf.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ConfigError(f"dflash_config must be a JSON object, got {dflash!r}")
        dflash2 = sorted({"selector_rank", "conv_kernel_size"} & ({*hf, *dflash}))
        if "DFlash2DraftModel" in (hf.get("architectures") or ()) or dflash2:
            raise ConfigError(
                f"DFlash2 drafters (candidate selector, dynamic convolutions{': ' if dflash2 else ''}"
                f"{', '.join(dflash2)}) are not supported; DFlashDraftModel is"
            )

        def value(name, default=None):
            return dflash.get(name, hf.get(name, default))

        for name, (neutral, is_neutral) in _NEUTRAL_EXTRAS.items():
            if name in dflash or name in hf:
                v = value(name)
                if not is_neutral(v):
                    raise ConfigError(f"{name}={v!r} is not supported (only {neutral})")
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in required if k not in hf]
        if value("mask_token_id") is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ConfigError(f"config.json lacks required keys: {missing}")
        n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
        # Qwen3Config: the window exists only with use_sliding_window (4096 when the key is left
        # out, none when null); absent layer_types make layers from max_window_layers on sliding.
        window = hf.get("sliding_window", QWEN3_DEFAULTS["sliding_window"]) if hf.get("use_sliding_window") else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", 28)
            layer_types = [
                "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)
            ]
        if not isinstance(layer_types, list | tuple):  # `in` below: a bare TypeError, or a string's substring
            raise ConfigError(f"layer_types must be a list of one type per layer, got {layer_types!r}")
        if "sliding_attention" not in layer_types:
            window = None
        elif window is None:
            raise ConfigError(
                f"layer_types has sliding_attention layers but no window (use_sliding_window="
                f"{hf.get('use_sliding_window')!r}, sliding_window={hf.get('sliding_window')!r})"
            )
        num_target_layers = hf.get("num_target_layers")
        target_layer_ids = value("target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ConfigError("config.json has neither dflash_config.target_layer_ids nor num_target_layers")
            target_layer_ids = default_target_layer_ids(num_target_layers, n)
        return cls(
            hidden_size=hf["hidden_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            # Absent or null: as Qwen3Config (0 is refused below, not read as absent).
            num_key_value_heads=heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
            head_dim=hf.get("head_dim", QWEN3_DEFAULTS["head_dim"]),
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            block_size=value("block_size", 16),
            target_layer_ids=tuple(target_layer_ids),
            mask_token_id=value("mask_token_id"),
            rms_norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=yarn,
            num_target_layers=num_target_layers,
            max_position_embeddings=hf.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"]),
            layer_types=layer_types,
            sliding_window=window,
            is_causal=hf.get("is_causal"),
            tap_final_norm=dflash.get("tap_final_norm", True),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (`DFlashDraftModel`, Qwen3 layout); `from_hf_config` reads it back."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "use_sliding_window": self.sliding_window is not None,
            "layer_types": list(self.types),
        }
        written_below = ("target_layer_ids", "mask_token_id", "num_target_layers", "layer_types", "rope_scaling")
        for f in dataclasses.fields(self):
            if f.name not in (*written_below, "is_causal", "tap_final_norm"):
                out[f.name] = getattr(self, f.name)
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.rope_scaling is not None:
            out["rope_scaling"] = yarn_hf_dict(self.rope_scaling)
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        out["dflash_config"] = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        if not self.tap_final_norm:
            out["dflash_config"]["tap_final_norm"] = False  # read by ddtree_jax only: DFlash tooling would differ
        return out

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> DrafterConfig:
        """Reads a DFlash `config.json` file (see `from_hf_config`)."""
        hf = read_json(path)  # its own errors name the file
        try:
            return cls.from_hf_config(hf)
        except ConfigError as e:  # the field named, and the file: a drafter's given as a target's, ...
            raise ConfigError(f"{os.fspath(path)}: {e}") from None

    def check_compatible(self, target: TargetConfig) -> None:
        """Raises ConfigError if this drafter cannot run on `target`, naming the first mismatch
        in this order: vocabulary, hidden size, tapped layers. (The mask token then lies in the
        target's vocabulary: the drafter's own config keeps it below its vocab_size.)"""
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size={self.vocab_size} != target vocab_size={target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter hidden_size={self.hidden_size} != target hidden_size={target.hidden_size}")
        n = target.num_hidden_layers
        if self.num_target_layers is not None and self.num_target_layers != n:
            raise ConfigError(f"drafter num_target_layers={self.num_target_layers} != target num_hidden_layers={n}")
        bad = [layer for layer in self.target_layer_ids if not 0 <= layer < n]
        if bad:
            raise ConfigError(f"drafter target_layer_ids {bad} outside the target's layers [0, {n})")


KIMI_K25_DFLASH = DrafterConfig(
    hidden_size=7168,
    num_hidden_layers=6,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=18432,
    vocab_size=163840,
    block_size=16,
    target_layer_ids=(1, 12, 24, 35, 47, 58),
    mask_token_id=163838,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    rope_scaling=YarnConfig(factor=64.0, original_max_position_embeddings=4096, mscale=None, mscale_all_dim=None),
    num_target_layers=61,
    max_position_embeddings=262144,
)
"""The shape of z-lab/Kimi-K2.5-DFlash as its public model card gives it: 6 Qwen3 layers of
width 7168 (64 query / 8 KV heads, intermediate 18432) on Kimi-K2.5's 163840-token vocabulary,
YaRN RoPE (factor 64, theta 50 000), 262144 positions. The card does not give head_dim (here
Qwen3's default 128), YaRN's original window (here 262144 / 64), the taps (here DFlash's default
for 61 layers) or the mask id (here 163838): the downloaded config.json is authoritative."""


def drafter_config_for(
    target: TargetConfig,
    *,
    num_hidden_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
) -> DrafterConfig:
    """A drafter config that fits `target`, with defaults derived from it.

    Defaults: the target's hidden size, vocabulary, head count, intermediate
    size, RMSNorm eps and max positions; Nkv = Nq // 4 when that divides
    (else Nq); hd = H // Nq; mask token = the last vocabulary id; taps
    `default_target_layer_ids`, or evenly spread over all layers of a target
    too shallow for that rule.
    """
    n = target.num_hidden_layers
    nq = num_attention_heads or target.num_attention_heads
    if num_key_value_heads is None:
        num_key_value_heads = nq // 4 if nq % 4 == 0 else nq
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n, num_hidden_layers)
        ids = target_layer_ids
        if not (all(0 <= x < n for x in ids) and all(a < b for a, b in itertools.pairwise(ids))):
            # Targets too shallow for DFlash's 1 .. N-3 rule: spread over all layers instead.
            target_layer_ids = tuple(
                sorted({round(i * (n - 1) / max(num_hidden_layers - 1, 1)) for i in range(num_hidden_layers)})
            )
    return DrafterConfig(
        hidden_size=target.hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=nq,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or target.hidden_size // nq,
        intermediate_size=intermediate_size or target.intermediate_size,
        vocab_size=target.vocab_size,
        block_size=block_size,
        target_layer_ids=tuple(target_layer_ids),
        mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
        rms_norm_eps=target.rms_norm_eps,
        num_target_layers=n,
        max_position_embeddings=target.max_position_embeddings,
    )


# ----------------------------------------------------------------------------------
# Parameters and cache


@struct.dataclass
class DrafterLayerParams:
    """One drafter layer (stacked: every leaf gains a leading layer axis)."""

    input_norm: jax.Array  # [H]
    q: jax.Array  # [H, Nq, hd]
    k: jax.Array  # [H, Nkv, hd]
    v: jax.Array  # [H, Nkv, hd]
    q_norm: jax.Array  # [hd]
    k_norm: jax.Array  # [hd]
    o: jax.Array  # [Nq, hd, H]
    post_norm: jax.Array  # [H]
    gate: jax.Array  # [H, I]
    up: jax.Array  # [H, I]
    down: jax.Array  # [I, H]


@struct.dataclass
class DrafterParams:
    """All drafter weights plus the (static) config."""

    config: DrafterConfig = struct.field(pytree_node=False)
    fc: jax.Array  # [n_taps * H, H]
    hidden_norm: jax.Array  # [H]
    layers: DrafterLayerParams  # leaves [Ld, ...] (or `layers.Unstacked` in a decode loop)
    norm: jax.Array  # [H]

    @property
    def dtype(self):
        return self.fc.dtype


# Keys `init_params` splits its key into; each weight's `seed` picks one.
NUM_INIT_KEYS = 8


def declare(cfg: DrafterConfig) -> DrafterParams:
    """Every drafter weight, declared once: a DrafterParams whose leaves are `weights.Weight`s.

    HF (torch Linear [out, in]) -> ours: q/k/v_proj [n * hd, H] -> [H, n, hd];
    o_proj [H, Nq * hd] -> [Nq, hd, H]; fc [H, n_taps * H] and the MLP transposed.
    """
    nl, h, i, hd = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ids = tuple(range(nl))

    def layer(shape, axes, hf_name, hf_shape, to_ours=identity, to_hf=identity, init="normal", seed=0):
        hf = (HFTensor(f"layers.{{layer}}.{hf_name}", hf_shape, to_ours, to_hf),)
        return Weight((nl, *shape), ("layers", *axes), init=init, hf=hf, layers=ids, seed=seed)

    def norm(size, axis, hf_name):
        return layer((size,), (axis,), hf_name, (size,), init="ones")

    def heads_in(n, name, seed):  # [n * hd, H] <-> [H, n, hd]
        return layer(
            (h, n, hd),
            ("embed", "heads", None),
            f"self_attn.{name}.weight",
            (n * hd, h),
            lambda a: transpose(a).reshape(h, n, hd),
            lambda a: transpose(a.reshape(h, n * hd)),
            seed=seed,
        )

    def mlp(shape, axes, name, seed):
        return layer(shape, axes, f"mlp.{name}.weight", shape[::-1], transpose, transpose, seed=seed)

    layers = DrafterLayerParams(
        input_norm=norm(h, "embed", "input_layernorm.weight"),
        q=heads_in(nq, "q_proj", 0),
        k=heads_in(nkv, "k_proj", 1),
        v=heads_in(nkv, "v_proj", 2),
        q_norm=norm(hd, None, "self_attn.q_norm.weight"),
        k_norm=norm(hd, None, "self_attn.k_norm.weight"),
        o=layer(
            (nq, hd, h),
            ("heads", None, "embed"),
            "self_attn.o_proj.weight",
            (h, nq * hd),
            lambda a: transpose(a).reshape(nq, hd, h),
            lambda a: transpose(a.reshape(nq * hd, h)),
            seed=3,
        ),
        post_norm=norm(h, "embed", "post_attention_layernorm.weight"),
        gate=mlp((h, i), ("embed", "mlp"), "gate_proj", 4),
        up=mlp((h, i), ("embed", "mlp"), "up_proj", 5),
        down=mlp((i, h), ("mlp", "embed"), "down_proj", 6),
    )
    n_in = cfg.n_taps * h
    return DrafterParams(
        config=cfg,
        fc=Weight((n_in, h), (None, "embed"), hf=(HFTensor("fc.weight", (h, n_in), transpose, transpose),), seed=7),
        hidden_norm=Weight((h,), ("embed",), init="ones", hf=(HFTensor("hidden_norm.weight", (h,)),)),
        layers=layers,
        norm=Weight((h,), ("embed",), init="ones", hf=(HFTensor("norm.weight", (h,)),)),
    )


def init_params(cfg: DrafterConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> DrafterParams:
    """Random weights: normal(0, std) matrices, unit norms."""
    return weights.init(declare(cfg), key, dtype, std, NUM_INIT_KEYS)


def abstract_params(cfg: DrafterConfig, dtype=jnp.bfloat16) -> DrafterParams:
    """The params' `jax.ShapeDtypeStruct`s (nothing allocated)."""
    return weights.abstract(declare(cfg), dtype)


@struct.dataclass
class DrafterCache:
    """Per-layer context keys (k_norm'd, RoPE'd) and values; slot s holds position s."""

    k: jax.Array  # [Ld, B, S, Nkv, hd]
    v: jax.Array  # [Ld, B, S, Nkv, hd]
    lengths: jax.Array  # [B] int32, committed context entries (slots < lengths are visible)

    @classmethod
    def init(cls, cfg: DrafterConfig, batch: int, capacity: int, dtype=jnp.float32) -> DrafterCache:
        """An empty cache: zeros, all lengths 0."""
        if batch < 1:
            raise ValueError(f"cache batch must be >= 1, got {batch}")
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self):
        return self.k.dtype

    def write(self, k: jax.Array, v: jax.Array, slots: jax.Array) -> DrafterCache:
        """Writes entry c of row b (k, v: [Ld, B, C, Nkv, hd]) into slot slots[b, c].

        Slots >= capacity are dropped (negative ones wrap around, as in numpy).
        Lengths are unchanged.
        """
        b, c = slots.shape
        chex.assert_shape([k, v], (self.k.shape[0], b, c, *self.k.shape[3:]))
        rows = jnp.arange(b)[:, None]
        return self.replace(
            k=self.k.at[:, rows, slots].set(k.astype(self.dtype), mode="drop"),
            v=self.v.at[:, rows, slots].set(v.astype(self.dtype), mode="drop"),
        )


# ----------------------------------------------------------------------------------
# Forward


def tap_features(taps: jax.Array) -> jax.Array:
    """[n_taps, B, T, H] (`ForwardOutput.taps`) -> [B, T, n_taps * H], i.e. concat([taps[0], taps[1], ...], -1)."""
    n, b, t, h = taps.shape
    return jnp.transpose(taps, (1, 2, 0, 3)).reshape(b, t, n * h)


def _rope(cfg: DrafterConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, hd // 2] float32 at integer positions [B, T] (YaRN's attention factor folded in)."""
    inv_freq, factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * factor, jnp.sin(freqs) * factor


def _per_layer_keys_values(params, ctx, cos, sin) -> tuple[jax.Array, jax.Array]:
    """Every layer's context k, v [Ld, B, T, Nkv, hd] of context vectors ctx [B, T, H]."""
    # An unrolled scan: per-layer dots stay unbatched (XLA:CPU lacks batched bf16 dots), and no
    # device loop runs (each GPU loop iteration costs a launch and a host round trip).
    cfg = params.config

    def body(_, lp):
        return None, keys_values(ctx, lp.k, lp.v, lp.k_norm, cos, sin, cfg.rms_norm_eps)

    return scan_layers(body, None, params.layers, unroll=True)[1]


FUSED_CONTEXT_KV = True
"""Whether `DFlashDrafter.for_loop` joins every layer's context key and value weights into one
matrix (`ContextKV`), so that a round's context keys / values are one GEMM and one norm + RoPE
fusion instead of a few per layer. Read when traced."""


@struct.dataclass
class ContextKV:
    """Every layer's context key / value projection as one matrix, for the decode loop."""

    weight: jax.Array  # [H, Ld, 2, Nkv, hd]: one GEMM's [H, Ld * 2 * Nkv * hd], heads split as the layers'
    k_norm: jax.Array  # [Ld, hd]

    @classmethod
    def of(cls, layers: DrafterLayerParams) -> ContextKV:
        """From stacked layers (k, v: [Ld, H, Nkv, hd])."""
        kv = jnp.stack([layers.k, layers.v], axis=1)  # [Ld, 2, H, Nkv, hd]
        return cls(weight=jnp.moveaxis(kv, 2, 0), k_norm=layers.k_norm)


def _joint_keys_values(cfg: DrafterConfig, ckv: ContextKV, ctx, cos, sin) -> tuple[jax.Array, jax.Array]:
    """`_per_layer_keys_values` from one GEMM: k, v [Ld, B, T, Nkv, hd]."""
    kv = linear(ctx, ckv.weight)  # [B, T, Ld, 2, Nkv, hd]
    k = apply_rope(rms_norm(kv[:, :, :, 0], ckv.k_norm[:, None, :], cfg.rms_norm_eps), cos, sin)
    return jnp.moveaxis(k, 2, 0), jnp.moveaxis(kv[:, :, :, 1], 2, 0)


def _blocks(
    params,
    embed,
    unembed,
    x_tokens,
    positions,
    layer_kv,
    attend,
    slots,
    stacked_kv=False,
    implementation="xla",
    joint_qkv=None,
):
    """Shared drafter body: layers over block tokens, then logits at `slots` [B, M] of the block axis.

    attend(q, k_ctx, v_ctx, k_blk, v_blk, window, causal, layer) -> [B, T, Nq, hd] is a layer's
    attention, given its window and causal flag (traced scalars). `layer_kv` holds every layer's
    context keys / values [Ld, ...]: each layer gets its own slice (layer None), or, with
    `stacked_kv`, all of them and its index (static where the layers are unrolled).
    `implementation` picks the layers' QKV projection (`pallas.drafter_layer.api`), and
    `joint_qkv` holds its joined weights (`JointQKV` per layer, as `params.layers`) or None."""
    cfg = params.config
    eps = cfg.rms_norm_eps
    x = sharding.embed_rows(embed, x_tokens).astype(params.dtype)
    cos, sin = _rope(cfg, positions)
    windows = jnp.asarray(cfg.windows, jnp.int32)
    causal = jnp.asarray(cfg.causal_layers)

    def body(x, xs):
        lp, kv, joint, window, is_causal, li = xs
        k_ctx, v_ctx = layer_kv if stacked_kv else kv
        q, k_blk, v_blk = drafter_qkv(x, lp, cos, sin, eps, joint=joint, implementation=implementation)
        o = attend(q, k_ctx, v_ctx, k_blk, v_blk, window, is_causal, li if stacked_kv else None)
        x = x + einsum("btnd,ndh->bth", o, lp.o).astype(x.dtype)
        x = x + swiglu(rms_norm(x, lp.post_norm, eps), lp.gate, lp.up, lp.down)
        return x, None

    # A host arange: unrolled (`Unstacked` layers), each layer's index is a static int.
    kv = None if stacked_kv else layer_kv
    xs = (params.layers, kv, joint_qkv, windows, causal, np.arange(cfg.num_hidden_layers))
    x, _ = scan_layers(body, x, xs, unroll=True)  # few layers: no device loop
    hidden = rms_norm(jnp.take_along_axis(x, slots[..., None], axis=1), params.norm, eps)
    return jnp.dot(hidden, unembed, preferred_element_type=jnp.float32)


def extend_context(
    params: DrafterParams,
    cache: DrafterCache,
    features: jax.Array,  # [B, C, n_taps * H]
    positions: jax.Array,  # [B, C] int32
    valid: jax.Array,  # [B, C] bool
    context_kv: ContextKV | None = None,
) -> DrafterCache:
    """Commits context tokens: their per-layer keys/values go to slot = position.

    Valid entries of row b must be contiguous and start at position
    cache.lengths[b]; invalid entries are dropped (their positions may be
    anything, including >= capacity). lengths[b] grows by the valid count.

    Args:
      params: drafter weights.
      cache: the drafter cache.
      features: the target's tapped hidden states (`tap_features`) at those tokens.
      positions: absolute positions of the tokens.
      valid: which entries to commit.
      context_kv: the layers' key / value weights joined (`ContextKV`, the decode loop's):
        the same keys and values from one GEMM.

    Returns:
      The updated cache.
    """
    cfg = params.config
    b, c = positions.shape
    chex.assert_shape(features, (b, c, cfg.n_taps * cfg.hidden_size))
    chex.assert_shape(valid, (b, c))
    if cache.batch != b:
        raise ValueError(f"cache batch {cache.batch} != features batch {b}")
    with jax.named_scope("drafter_context"):
        ctx = rms_norm(linear(features.astype(params.dtype), params.fc), params.hidden_norm, cfg.rms_norm_eps)
        cos, sin = _rope(cfg, positions)
        if context_kv is None:
            k, v = _per_layer_keys_values(params, ctx, cos, sin)
        else:
            k, v = _joint_keys_values(cfg, context_kv, ctx, cos, sin)
        slots = jnp.where(valid, positions, cache.capacity)
        cache = cache.write(k, v, slots)
        return cache.replace(lengths=cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32))


def draft(
    params: DrafterParams,
    cache: DrafterCache,
    embed: jax.Array,  # [V, H] the target's embedding table
    unembed: jax.Array,  # [H, V] the target's lm_head
    block_tokens: jax.Array,  # [B, T] int32: [root, mask, ...]
    block_positions: jax.Array,  # [B, T] int32
    implementation: str = "xla",
    joint_qkv: Unstacked | JointQKV | None = None,
) -> jax.Array:
    """One drafter forward over a block; float32 logits [B, T - 1, V] for block slots 1 .. T-1.

    Slot d's logits are the distribution of the token at block_positions[:, d]
    (no shift). T is normally `config.block_size`. The cache is only read.

    Args:
      params: drafter weights.
      cache: committed context keys/values.
      embed: the target's input embedding.
      unembed: the target's output projection.
      block_tokens: the root (bonus) token followed by mask tokens.
      block_positions: absolute positions of the block, L .. L + T - 1.
      implementation: the block attention's (`pallas.drafter_attention.api`) and the layers'
        QKV projection's (`pallas.drafter_layer.api`): "xla", or "auto" / "pallas" for their
        kernels; the attention kernel reads only the slots in a sliding layer's window ("auto":
        on a GPU, where every layer's window or the cache is short; the projection's on a GPU
        for a narrow drafter).
      joint_qkv: each layer's `JointQKV`, as `params.layers` holds the layers (stacked, or
        `Unstacked` in a decode loop), made once for the projection's kernel; None: made
        where the kernel runs.

    Returns:
      Logits of the masked slots.
    """
    cfg = params.config
    b, t = block_tokens.shape
    chex.assert_shape(block_positions, (b, t))
    chex.assert_shape(embed, (cfg.vocab_size, cfg.hidden_size))
    chex.assert_shape(unembed, (cfg.hidden_size, cfg.vocab_size))
    if cache.batch != b:
        raise ValueError(f"cache batch {cache.batch} != block batch {b}")
    if t < 2:
        raise ValueError(f"a block needs the root and >= 1 mask slot, got {t} tokens")
    with jax.named_scope("draft"):
        reach = min(max(cfg.windows), cache.capacity)  # the most context slots a query sees

        def attend(q, k_ctx, v_ctx, k_blk, v_blk, window, causal, layer):
            return drafter_attention(
                q,
                k_ctx,
                v_ctx,
                cache.lengths,
                block_positions,
                k_blk,
                v_blk,
                window=window,
                causal=causal,
                reach=reach,
                implementation=implementation,
                layer=layer,
            )

        slots = jnp.broadcast_to(jnp.arange(1, t), (b, t - 1))
        kv = (cache.k, cache.v)
        return _blocks(
            params,
            embed,
            unembed,
            block_tokens,
            block_positions,
            kv,
            attend,
            slots,
            stacked_kv=True,
            implementation=implementation,
            joint_qkv=joint_qkv,
        )


def train_logits(
    params: DrafterParams,
    embed: jax.Array,  # [V, H]
    unembed: jax.Array,  # [H, V]
    features: jax.Array,  # [B, T, n_taps * H] target taps of a whole sequence
    tokens: jax.Array,  # [B, T] int32 the sequence
    anchors: jax.Array,  # [B, A] int32 anchor positions, each <= T - block_size
) -> jax.Array:  # [B, A, bs - 1, V] float32
    """Training forward (the DFlash recipe): one block per anchor, all blocks in one pass.

    Block a is [tokens[anchor], MASK x (bs - 1)] at positions anchor .. anchor + bs - 1;
    it sees the target context strictly before its anchor, every token of its own
    block (bidirectional; in a causal layer, up to itself), and nothing of the other blocks. Its logits at slot k
    predict tokens[anchor + k].
    """
    cfg = params.config
    b, t = tokens.shape
    a = anchors.shape[1]
    bs = cfg.block_size
    chex.assert_shape(features, (b, t, cfg.n_taps * cfg.hidden_size))
    with jax.named_scope("draft_train"):
        ctx = rms_norm(linear(features.astype(params.dtype), params.fc), params.hidden_norm, cfg.rms_norm_eps)
        ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cos, sin = _rope(cfg, ctx_pos)
        layer_kv = _per_layer_keys_values(params, ctx, cos, sin)
        blk = (
            jnp.full((b, a, bs), cfg.mask_token_id, jnp.int32).at[:, :, 0].set(jnp.take_along_axis(tokens, anchors, 1))
        )
        positions = (anchors[:, :, None] + jnp.arange(bs, dtype=jnp.int32)).reshape(b, a * bs)
        owner = jnp.repeat(jnp.arange(a), bs)  # block of each query / block key
        q_anchor = jnp.repeat(anchors, bs, axis=1)  # [B, A*bs]
        ctx_visible = jnp.arange(t)[None, None, :] < q_anchor[:, :, None]
        blk_visible = jnp.broadcast_to(owner[:, None] == owner[None, :], (b, a * bs, a * bs))
        distance = positions[:, :, None] - jnp.arange(t, dtype=jnp.int32)  # context slot s holds position s
        earlier = positions[:, None, :] <= positions[:, :, None]  # [B, A*bs, A*bs] key at or before query

        def attend(q, k_ctx, v_ctx, k_blk, v_blk, window, causal, layer):  # layer: None (sliced)
            own = blk_visible & (earlier | ~causal)
            return masked_attention(q, k_ctx, v_ctx, ctx_visible & (distance < window), k_blk, v_blk, own)

        slots = (jnp.arange(a)[:, None] * bs + jnp.arange(1, bs)[None, :]).reshape(-1)
        out = _blocks(
            params,
            embed,
            unembed,
            blk.reshape(b, a * bs),
            positions,
            layer_kv,
            attend,
            jnp.broadcast_to(slots, (b, a * (bs - 1))),
        )
        return out.reshape(b, a, bs - 1, -1)


# ----------------------------------------------------------------------------------
# HF checkpoints


def load_drafter(
    path: str | os.PathLike, *, dtype=None, check_finite: bool = True, mesh=None, rules=None
) -> DrafterParams:
    """Loads an HF-format DFlash drafter directory (config.json + safetensors, index optional).

    Weight names may carry a "model." prefix.

    Args:
      path: the checkpoint directory.
      dtype: parameter dtype (bfloat16, float16 or float32); None keeps the stored
        dtype of `fc.weight`.
      check_finite: refuse a tensor holding NaN or Inf, as stored or once cast to
        `dtype` (False skips the pass).
      mesh: place each tensor straight onto its shards of this mesh (see `load_target`).
      rules: logical -> mesh axis rules (default `sharding.RULES`).

    Raises:
      FileNotFoundError: no directory, config.json or weight files.
      CheckpointError: a missing, extra, mis-shaped or non-finite weight, or a corrupt file.
      ConfigError: a config the drafter does not support.
      ValueError: an unsupported dtype.
    """
    return hf.load_declared(
        path,
        what="drafter",
        read_config=DrafterConfig.from_json_file,
        declare=declare,
        dtype_from=lambda decl: decl.fc,
        dtype=dtype,
        check_finite=check_finite,
        mesh=mesh,
        rules=rules,
        prefixes=("model.",),
    )


def save_drafter_hf(params: DrafterParams, path: str | os.PathLike) -> None:
    """Writes an HF-format DFlash directory (config.json + model.safetensors) that `load_drafter` reads."""
    tensors = hf.hf_tensors(declare(params.config), params)
    hf.write(os.fspath(path), params.config.to_hf_config(), tensors, None)


# ----------------------------------------------------------------------------------
# The decode loop's view of it (drafters.protocol)


@struct.dataclass
class DFlashDrafter:
    """Adapter: a DFlash drafter's params as a decode-loop drafter."""

    params: DrafterParams
    block_size: int = struct.field(pytree_node=False)
    implementation: str = struct.field(pytree_node=False, default="xla")  # the block's kernels (`draft`)
    context_kv: ContextKV | None = None  # set by `for_loop` (`FUSED_CONTEXT_KV`)
    joint_qkv: Unstacked | None = None  # set by `for_loop` where the layers' QKV kernel runs

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.params.config.target_layer_ids)

    @property
    def tap_final_norm(self) -> bool:
        return self.params.config.tap_final_norm

    def for_loop(self) -> DFlashDrafter:
        """This drafter with its layers split per layer, done once before a decode loop
        (`layers.Unstacked`: unrolled in the loop, each layer's slice of a stacked weight
        was a device copy every round)."""
        if isinstance(self.params.layers, Unstacked):
            return self
        cfg, layers = self.params.config, self.params.layers
        joint = ContextKV.of(layers) if FUSED_CONTEXT_KV else None
        qkv = None
        if uses_qkv_kernel(self.implementation, cfg.hidden_size, cfg.head_dim):
            qkv = unstack(JointQKV.of(layers))
        return self.replace(params=self.params.replace(layers=unstack(layers)), context_kv=joint, joint_qkv=qkv)

    def init_state(self, target: TargetParams, batch: int, capacity: int) -> DrafterCache:
        return DrafterCache.init(self.params.config, batch, capacity, self.params.fc.dtype)

    def observe(self, state, taps, positions, valid):
        return extend_context(self.params, state, tap_features(taps), positions, valid, self.context_kv)

    def propose(self, state, target: TargetParams, cache: KVCache, roots: jax.Array, key: jax.Array) -> jax.Array:
        b, bs = roots.shape[0], self.block_size
        mask_id = self.params.config.mask_token_id
        block = jnp.full((b, bs), mask_id, jnp.int32).at[:, 0].set(roots)
        positions = cache.lengths[:, None] + jnp.arange(bs, dtype=jnp.int32)
        return draft(
            self.params, state, target.embed, target.unembed, block, positions, self.implementation, self.joint_qkv
        )
