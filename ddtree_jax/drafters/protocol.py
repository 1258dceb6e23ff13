"""The drafter protocol: what the decode loop asks of a drafter, so that AR, DFlash and
DDTree share one loop.

A drafter proposes per-depth distributions for the tokens after the root:
`propose(...) -> logits [B, D, V]` for depths 1..D (D = block_size - 1). It sees
the target's tapped features of committed tokens through `observe`. Drafters:
`dflash.DFlashDrafter` (the trained DFlash block-diffusion model) and, for tests,
`testing.OracleDrafter` / `testing.RandomDrafter`.
"""

from __future__ import annotations

from typing import Any

from ddtree_jax.checks import check_int
from ddtree_jax.drafters.dflash import DFlashDrafter, DrafterParams

PROTOCOL = ("block_size", "tap_layers", "tap_final_norm", "init_state", "observe", "propose")
"""What the decode loop uses of a drafter; any pytree with these members works. Optional:
`for_loop()`, the drafter prepared for a decode loop (called once, inside the jit, before it)."""


def is_drafter(x: Any) -> bool:
    return isinstance(x, DrafterParams) or all(hasattr(x, name) for name in PROTOCOL)


def as_drafter(drafter: Any, block_size: int | None):
    """Wraps DrafterParams; applies a smaller block size. Raises ValueError on a bad one."""
    if isinstance(drafter, DrafterParams):
        drafter = DFlashDrafter(params=drafter, block_size=drafter.config.block_size)
    if not is_drafter(drafter):
        raise TypeError(f"drafter must be DrafterParams or implement {PROTOCOL}, got {type(drafter).__name__}")
    own = drafter.params.config.block_size if isinstance(drafter, DFlashDrafter) else drafter.block_size
    if own < 2:
        raise ValueError(f"the drafter's block_size must be >= 2, got {own}")
    if block_size is None:
        return drafter
    block_size = check_int("block_size", block_size)
    if not 2 <= block_size <= own:
        raise ValueError(f"block_size={block_size!r} must be an int in [2, the drafter's block_size={own}]")
    return drafter.replace(block_size=block_size)
