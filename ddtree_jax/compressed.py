"""The compressed-tensors `pack-quantized` format, as Kimi-K2-Thinking / K2.5 ship it.

Only the routed experts are quantized: W4A16, symmetric INT4, one scale per group of
`group_size` inputs (`quant.Int4`). Per quantized Linear [out, in] the checkpoint holds
`weight_packed` int32 [out, in / 8], `weight_scale` [out, in / group_size] and
`weight_shape` [2] = (out, in). Its `config.json` says so in `quantization_config`:
`quant_method` "compressed-tensors", `format` "pack-quantized", one entry of
`config_groups` with the weights' scheme, and an `ignore` list of the modules kept dense.

`expert_group_size(hf)` reads that (and refuses what the engine does not run, naming the
field); `quantization_config(group_size)` writes it.
"""

from __future__ import annotations

from typing import Any

from ddtree_jax.config import ConfigError
from ddtree_jax.quant import PACK

# Modules kept dense, as compressed-tensors `ignore` entries ("re:" marks a regex).
IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|down)_proj$",  # the dense layers' MLPs
    r"re:.*mlp\.gate$",  # the router
]


def expert_group_size(hf: dict[str, Any]) -> int | None:
    """The INT4 group size of a checkpoint's routed experts, or None when unquantized.

    Reads `quantization_config` from the config.json dict `hf` (or from its
    `text_config`, for a multimodal wrapper).

    Raises:
      ConfigError: a quantization the engine does not run, naming the field.
    """
    qc = hf.get("quantization_config")
    if qc is None and isinstance(hf.get("text_config"), dict):
        qc = hf["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"quantization_config.quant_method={method!r} is not supported (only 'compressed-tensors' "
            "pack-quantized INT4 routed experts; e.g. DeepSeek-V3's FP8 block scales are not)"
        )
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ConfigError(f"quantization_config.format={fmt!r} is not supported (only 'pack-quantized')")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        n = len(groups) if isinstance(groups, dict) else groups
        raise ConfigError(f"quantization_config.config_groups must hold exactly one scheme, got {n!r}")
    ((name, scheme),) = groups.items()
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(scheme, dict) or not isinstance(scheme.get("weights"), dict):
        raise ConfigError(f"{where}.weights is missing")
    for key in ("input_activations", "output_activations"):
        if scheme.get(key) is not None:
            raise ConfigError(f"{where}.{key} must be null (W4A16: activations stay bf16), got {scheme[key]!r}")
    w = scheme["weights"]
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in want.items():
        if w.get(key) != value:
            raise ConfigError(f"{where}.weights.{key}={w.get(key)!r} is not supported (only {value!r})")
    if w.get("dynamic", False):
        raise ConfigError(f"{where}.weights.dynamic={w['dynamic']!r} is not supported (only false)")
    group = w.get("group_size")
    if not (isinstance(group, int) and not isinstance(group, bool) and group >= PACK and group % PACK == 0):
        raise ConfigError(
            f"{where}.weights.group_size={group!r} is not supported (a multiple of {PACK}: 32 as Kimi-K2.5 ships, "
            "128 as compressed-tensors' W4A16 preset)"
        )
    return group


def quantization_config(group_size: int) -> dict[str, Any]:
    """The `quantization_config` of a checkpoint whose routed experts are INT4 in groups of `group_size`."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(IGNORE),
    }
