"""ddtree_jax: DDTree speculative decoding in JAX/Pallas.

    import ddtree_jax as dj
    s = dj.load_shipped()
    out = dj.generate(s.target, s.drafter, [s.tokenizer.encode("def f(", bos=True)], method="ddtree")

The names below are the public API; submodules (`model`, `decode`, `tree`,
`sharding`, ...) hold the pure functions underneath.
"""

from ddtree_jax.checkpoint import load_target, restore_checkpoint, save_checkpoint, save_hf
from ddtree_jax.config import DEEPSEEK_V3, KIMI_K2, PRESETS, SMALL, TINY, ConfigError, TargetConfig
from ddtree_jax.drafters import (
    DFlashDrafter,
    DrafterConfig,
    DrafterParams,
    OracleDrafter,
    RandomDrafter,
    drafter_config_for,
    load_drafter,
    save_drafter_hf,
)
from ddtree_jax.generate import METHODS, GenerateResult, generate
from ddtree_jax.hf import CheckpointError
from ddtree_jax.model import TargetParams, abstract_params, init_params
from ddtree_jax.sampling import SamplingConfig
from ddtree_jax.sharding import make_mesh, shard_drafter, shard_target
from ddtree_jax.shipped import Shipped, load_shipped

__all__ = [
    "DEEPSEEK_V3",
    "KIMI_K2",
    "METHODS",
    "PRESETS",
    "SMALL",
    "TINY",
    "CheckpointError",
    "ConfigError",
    "DFlashDrafter",
    "DrafterConfig",
    "DrafterParams",
    "GenerateResult",
    "OracleDrafter",
    "RandomDrafter",
    "SamplingConfig",
    "Shipped",
    "TargetConfig",
    "TargetParams",
    "abstract_params",
    "drafter_config_for",
    "generate",
    "init_params",
    "load_drafter",
    "load_shipped",
    "load_target",
    "make_mesh",
    "restore_checkpoint",
    "save_checkpoint",
    "save_drafter_hf",
    "save_hf",
    "shard_drafter",
    "shard_target",
]
