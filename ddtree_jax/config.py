"""Target-model configuration: the DeepSeek-V3 / Kimi-K2 architecture.

`TargetConfig` holds every field of the HF `DeepseekV3Config` that changes the
math. Presets are module constants (`TINY`, `SMALL`, `KIMI_K2`, `DEEPSEEK_V3`);
variants are made with `dataclasses.replace`, which re-runs validation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

HF_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
"""What HF transformers' `DeepseekV3Config` (5.17; Kimi-K2.5's config class extends it) takes
for a key a `config.json` leaves out: `from_hf_config` reads the same model HF loads.
`TargetConfig`'s own defaults are for presets built in code."""


class ConfigError(ValueError):
    """A configuration the engine cannot run, with the offending field named."""


def _is_int(value: Any) -> bool:
    """An int and not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float and not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(name: str, value: Any) -> float:
    """`value` as a float; ConfigError naming `name` unless it is a number (float("abc") would not name it)."""
    if not is_number(value):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling, as HF's `rope_scaling` / `rope_parameters` with type "yarn"."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = 1.0
    mscale_all_dim: float | None = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not (is_number(self.factor) and self.factor > 0):
            raise ConfigError(f"yarn factor must be > 0, got {self.factor!r}")
        orig = self.original_max_position_embeddings
        if not (_is_int(orig) and orig >= 1):
            raise ConfigError(f"yarn original_max_position_embeddings must be an int >= 1, got {orig!r}")
        for name in ("beta_fast", "beta_slow"):
            if not is_number(getattr(self, name)):
                raise ConfigError(f"yarn {name} must be a number, got {getattr(self, name)!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not is_number(value):
                raise ConfigError(f"yarn {name} must be None or a number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shapes and hyper-parameters of a DeepSeek-V3-architecture target model.

    Field names follow HF `DeepseekV3Config`. `q_lora_rank=None` means a plain
    `q_proj`; `rope_scaling=None` means plain RoPE.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnConfig | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    # One id, or several (an HF config's list: generation stops at any of them).
    eos_token_id: int | tuple[int, ...] | None = None
    # Routed experts stored INT4 (W4A16, symmetric) in groups of this many inputs, as
    # compressed-tensors pack-quantized checkpoints ship them; None = unquantized.
    expert_int4_group_size: int | None = None

    def __post_init__(self):
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        # Counts that may be 0 (no MoE layers): a float or a string here would fail later, deep in a shape.
        counts = (
            "moe_intermediate_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "n_group",
            "topk_group",
            "first_k_dense_replace",
        )
        for name in counts:
            if not _is_int(getattr(self, name)):
                raise ConfigError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):  # "no" would count as true
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.q_lora_rank is not None and not (_is_int(self.q_lora_rank) and self.q_lora_rank >= 1):
            raise ConfigError(f"q_lora_rank must be None or an int >= 1, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace} must lie in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]"
            )
        if self.num_moe_layers:
            self._validate_moe()
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (is_number(value) and value > 0):
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        r = self.routed_scaling_factor
        if not (is_number(r) and math.isfinite(r) and r > 0):
            raise ConfigError(f"routed_scaling_factor must be finite and > 0, got {r!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) and name == "eos_token_id" and value else (value,)
            for i in ids:
                if i is not None and not (_is_int(i) and 0 <= i < self.vocab_size):
                    raise ConfigError(f"{name}={value!r} is not a token id in the vocabulary [0, {self.vocab_size})")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops at by default: `eos_token_id`'s, none if it is None."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def _validate_moe(self):
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if e < 1 or self.moe_intermediate_size < 1:
            raise ConfigError(
                f"MoE layers need n_routed_experts >= 1 and moe_intermediate_size >= 1, got {e} and "
                f"{self.moe_intermediate_size}"
            )
        if not 1 <= k <= e:
            raise ConfigError(f"num_experts_per_tok={k} must lie in [1, n_routed_experts={e}]")
        if self.n_group < 1 or e % self.n_group:
            raise ConfigError(f"n_routed_experts={e} must be divisible by n_group={self.n_group}")
        if e // self.n_group < 2:
            raise ConfigError(
                f"each router group needs >= 2 experts (group score = sum of its top 2), got "
                f"n_routed_experts={e}, n_group={self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
        if k > self.topk_group * (e // self.n_group):
            raise ConfigError(
                f"num_experts_per_tok={k} exceeds the experts left after group selection "
                f"(topk_group={self.topk_group} x {e // self.n_group})"
            )
        if self.n_shared_experts < 0:
            raise ConfigError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        g = self.expert_int4_group_size
        if g is not None:
            if not isinstance(g, int) or isinstance(g, bool) or g < 8 or g % 8:
                raise ConfigError(f"expert_int4_group_size must be None or a positive multiple of 8, got {g!r}")
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % g:
                    raise ConfigError(
                        f"{name}={getattr(self, name)} is not a multiple of expert_int4_group_size={g} "
                        "(INT4 groups run along each expert matrix's input dim)"
                    )

    # Derived sizes -----------------------------------------------------------------

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token per layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The model's attention scale, including YaRN's mscale^2 (as HF applies it)."""
        scale = self.qk_head_dim**-0.5
        ys = self.rope_scaling
        if ys is not None and ys.mscale_all_dim:
            m = yarn_get_mscale(ys.factor, ys.mscale_all_dim)
            scale *= m * m
        return scale

    def num_params(self) -> int:
        """Parameter count (router bias included), from shapes alone."""
        h, n = self.hidden_size, self.num_attention_heads
        if self.q_lora_rank is None:
            q = h * n * self.qk_head_dim
        else:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim
        attn = (
            q
            + h * self.latent_dim
            + self.kv_lora_rank
            + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            + n * self.v_head_dim * h
        )
        dense = 3 * h * self.intermediate_size
        moe = (
            h * self.n_routed_experts
            + self.n_routed_experts
            + 3 * h * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
        )
        per_layer_norms = 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (
            embed
            + h
            + self.num_hidden_layers * (attn + per_layer_norms)
            + self.num_dense_layers * dense
            + self.num_moe_layers * moe
        )

    # HF interop ----------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> TargetConfig:
        """Builds a config from an HF `config.json` dict (DeepSeek-V3 / Kimi-K2 layout).

        Accepts the classic `rope_theta` + `rope_scaling` keys and transformers 5's
        `rope_parameters`. A Kimi-K2.5-style wrapper with `text_config` is unwrapped.

        Raises:
            ConfigError: on a missing key or a feature the engine does not support.
        """
        from ddtree_jax.compressed import expert_group_size

        if not isinstance(hf, dict):
            raise ConfigError(f"an HF config must be a JSON object, got {type(hf).__name__}")
        group_size = expert_group_size(hf)
        if "text_config" in hf and "hidden_size" not in hf:
            outer, hf = hf, hf["text_config"]
            if not isinstance(hf, dict):
                raise ConfigError(f"text_config must be a JSON object, got {type(hf).__name__}")
            top, text = outer.get("tie_word_embeddings"), hf.get("tie_word_embeddings")
            if top is not None and text is not None and top != text:
                # transformers' Kimi_K25ForConditionalGeneration ties by the top-level flag, engines
                # that build the text model from text_config by its own: refused, not guessed.
                raise ConfigError(
                    f"tie_word_embeddings is {top!r} at the top level but {text!r} in text_config: readers "
                    "disagree on which one counts (transformers takes the top level); make them equal"
                )
            if text is None and top is not None:
                hf = {**hf, "tie_word_embeddings": top}
        model_type = hf.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported (want one of {SUPPORTED_MODEL_TYPES})")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("attention_bias", False):
            raise ConfigError("attention_bias=True is not supported")
        for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            if key in hf and hf[key] != want:
                raise ConfigError(f"{key} {hf[key]!r} is not supported (only {want!r})")
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq {hf['moe_layer_freq']!r} is not supported (only 1)")
        required = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        )
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks required keys: {missing}")
        nh = hf["num_attention_heads"]
        nkv = hf.get("num_key_value_heads")
        if nkv is not None and nkv != nh:
            raise ConfigError(f"num_key_value_heads={nkv} != num_attention_heads={nh} is not supported by MLA")

        rope_theta, yarn = parse_rope(hf, 10000.0)

        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = (eos[0] if len(eos) == 1 else tuple(eos)) if eos else None

        def get(name):  # a key absent (or null) reads as HF DeepseekV3Config's default, as HF loads it
            value = hf.get(name)
            return HF_DEFAULTS[name] if value is None else value

        def flag(name):  # bool("false") would be True
            value = get(name)
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be true or false, got {value!r}")
            return value

        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=nh,
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=get("moe_intermediate_size"),
            n_routed_experts=get("n_routed_experts"),
            num_experts_per_tok=get("num_experts_per_tok"),
            n_shared_experts=get("n_shared_experts"),
            n_group=get("n_group"),
            topk_group=get("topk_group"),
            routed_scaling_factor=number("routed_scaling_factor", get("routed_scaling_factor")),
            norm_topk_prob=flag("norm_topk_prob"),
            first_k_dense_replace=get("first_k_dense_replace"),
            q_lora_rank=hf["q_lora_rank"] if "q_lora_rank" in hf else HF_DEFAULTS["q_lora_rank"],  # null: plain q_proj
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=yarn,
            rope_interleave=flag("rope_interleave"),
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=flag("tie_word_embeddings"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            expert_int4_group_size=group_size,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (classic `rope_theta` / `rope_scaling` keys)."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_act": "silu",
            "attention_bias": False,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "num_key_value_heads": self.num_attention_heads,
        }
        for f in dataclasses.fields(self):
            if f.name not in ("rope_scaling", "expert_int4_group_size"):
                out[f.name] = getattr(self, f.name)
        if self.expert_int4_group_size is not None:
            from ddtree_jax.compressed import quantization_config

            out["quantization_config"] = quantization_config(self.expert_int4_group_size)
        if self.rope_scaling is not None:
            out["rope_scaling"] = yarn_hf_dict(self.rope_scaling)
        return out

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> TargetConfig:
        """Reads an HF `config.json` file (see `from_hf_config`)."""
        hf = read_json(path)  # its own errors name the file
        try:
            return cls.from_hf_config(hf)
        except ConfigError as e:  # the field named, and the file: a drafter's given as a target's, ...
            raise ConfigError(f"{os.fspath(path)}: {e}") from None


def parse_rope(hf: dict[str, Any], default_theta: float) -> tuple[float, YarnConfig | None]:
    """(rope_theta, YaRN scaling or None) of an HF config dict.

    Accepts the classic `rope_theta` + `rope_scaling` keys and transformers 5's
    `rope_parameters`.

    Raises:
      ConfigError: a RoPE type other than default and yarn, or a malformed field (named).
    """
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for name, value in (("rope_parameters", rope), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a JSON object, got {value!r}")
    theta = number("rope_theta", rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    # rope_scaling's type, where it names one, wins over rope_parameters' (as HF reads both)
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", rope.get("type", "default"))
    rope = {**rope, **scaling}
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ConfigError(f"rope type {rope_type!r} is not supported (only default and yarn)")
    # A top-level original_max_position_embeddings wins over the rope dict's: HF's models
    # standardize their rope parameters again once built, and then take it (transformers 5.17).
    orig = hf.get(
        "original_max_position_embeddings",
        rope.get("original_max_position_embeddings", hf.get("max_position_embeddings")),
    )
    factor = rope.get("factor")
    if factor is None:  # HF's default: the context extension max / original
        longest = hf.get("max_position_embeddings")
        if not (_is_int(longest) and _is_int(orig) and orig >= 1):
            raise ConfigError(
                f"yarn rope scaling without a factor needs max_position_embeddings and "
                f"original_max_position_embeddings, got {longest!r} and {orig!r}"
            )
        factor = longest / orig
    return theta, YarnConfig(
        factor=number("yarn factor", factor),
        original_max_position_embeddings=orig,
        beta_fast=number("yarn beta_fast", rope.get("beta_fast") or 32.0),
        beta_slow=number("yarn beta_slow", rope.get("beta_slow") or 1.0),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def yarn_hf_dict(ys: YarnConfig) -> dict[str, Any]:
    """The HF `rope_scaling` dict of a YaRN config."""
    return {"type": "yarn", "rope_type": "yarn", **{k: v for k, v in dataclasses.asdict(ys).items() if v is not None}}


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A config.json as a dict; FileNotFoundError / ConfigError naming the file otherwise."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (a JSON file): {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(hf).__name__}")
    return hf


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


TINY = TargetConfig(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=512,
)
"""A few-hundred-K-parameter model for unit tests."""

SMALL = TargetConfig(
    vocab_size=8192,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    intermediate_size=768,
    moe_intermediate_size=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)
"""The v1-v3 shipped target: ~10M parameters, so that target + drafter fit 25 MB in bf16."""

MEDIUM = TargetConfig(
    vocab_size=8192,
    hidden_size=384,
    num_hidden_layers=8,
    num_attention_heads=6,
    intermediate_size=1024,
    moe_intermediate_size=192,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    q_lora_rank=128,
    kv_lora_rank=96,
    qk_nope_head_dim=48,
    qk_rope_head_dim=32,
    v_head_dim=48,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)
"""The shipped target since v4 (issue 17): Kimi-K2's layout (a dense first layer, 16 routed experts,
top-2, no group limit, a shared expert) at 36.4M parameters (14.8M active per token), trained
in floating point and shipped with its routed experts INT4 (group 32,
`model.quantize_experts`). Stored so, it fits the 48 MB `checkpoints/` budget together with
a 3-layer drafter (`MEDIUM_DRAFTER`) and the tokenizer (tests/test_config.py)."""

MEDIUM_DRAFTER = dict(num_hidden_layers=3, intermediate_size=768, num_key_value_heads=1)
"""`dflash.drafter_config_for` arguments of MEDIUM's drafter."""

DEEPSEEK_V3 = TargetConfig(
    vocab_size=129280,
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=128,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=10000.0,
    rope_scaling=YarnConfig(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    max_position_embeddings=163840,
    bos_token_id=0,
    eos_token_id=1,
)
"""DeepSeek-V3 (671B) shapes, for abstract-shape work."""

KIMI_K2 = TargetConfig(
    vocab_size=163840,
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=64,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    first_k_dense_replace=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=50000.0,
    rope_scaling=YarnConfig(
        factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
    max_position_embeddings=131072,
    bos_token_id=163584,
    eos_token_id=163585,
)
"""Kimi-K2-Instruct (1.03T) shapes, for abstract-shape work."""

PRESETS = {"tiny": TINY, "small": SMALL, "medium": MEDIUM, "deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2}
