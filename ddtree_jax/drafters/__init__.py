"""Drafters: the DFlash model (`dflash`), the protocol the decode loop uses
(`protocol`), and drafters for tests and experiments (`testing`)."""

from ddtree_jax.drafters import dflash
from ddtree_jax.drafters.dflash import (
    DFlashDrafter,
    DrafterCache,
    DrafterConfig,
    DrafterParams,
    drafter_config_for,
    load_drafter,
    save_drafter_hf,
)
from ddtree_jax.drafters.protocol import PROTOCOL, as_drafter, is_drafter
from ddtree_jax.drafters.testing import OracleDrafter, RandomDrafter

__all__ = [
    "PROTOCOL",
    "DFlashDrafter",
    "DrafterCache",
    "DrafterConfig",
    "DrafterParams",
    "OracleDrafter",
    "RandomDrafter",
    "as_drafter",
    "dflash",
    "drafter_config_for",
    "is_drafter",
    "load_drafter",
    "save_drafter_hf",
]
