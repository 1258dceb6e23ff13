"""Kernels, each beside its pure-jnp reference (tokamax style).

`ddtree_jax/pallas/<op>/` holds `reference.py` (float32 math, also the XLA
fallback), `kernel.py` (the Triton-lowered kernel and its frozen tile config, where one
is kept: the routed experts', the drafter's block attention and its QKV projection, DDTree's
per-depth top-K), `mosaic.py` (the Mosaic GPU kernel: TMA, wgmma, warp
specialization, and its tiles),
`api.py` (one dispatch function with `implementation=`) and `bench.py`; `shapes.py`
names the real shapes that bench and tests share.
"""

import jax
from jax.experimental import pallas as pl

from ddtree_jax import sharding

IMPLEMENTATIONS = ("auto", "xla", "pallas", "mosaic")
"""What a user picks (`generate(implementation=...)`); an op may have more (mla_attention's "exact").

"auto": each op takes its Mosaic GPU kernel on a Hopper GPU where the kernel takes the
operands (bf16 / f16, widths that fit its tiles; for the routed experts also weights big
enough to stream, `moe.api.AUTO_MIN_BYTES`), and the XLA path otherwise (the CPU,
float32, shapes the kernel does not tile, small launch-bound models); the DFlash drafter's
block attention takes its Triton-lowered kernel on a GPU (`drafter_attention.api.uses_kernel`),
a narrow drafter's QKV projection its own (`drafter_layer.api.uses_kernel`), and DDTree's
log-softmax top-K of up to 16 ranks its own (`draft_topk.api.uses_kernel`).
"pallas": the Triton-lowered kernels: the routed experts', the drafter's attention and QKV
projection, the tree's top-K; MLA
attention, whose Triton kernel was removed (the Mosaic one beat it at every measured shape),
on the XLA path.
"mosaic": the Mosaic GPU kernels (interpret mode on a CPU backend)."""


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x)."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def mosaic_interpret():
    """None on a GPU (compile the Mosaic GPU kernel), else Mosaic GPU's CPU interpreter."""
    if jax.default_backend() == "gpu":
        return None
    # A private module of jax 0.11 (public API has no Mosaic GPU interpreter yet).
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def check_implementation(implementation: str, available: tuple[str, ...], op: str) -> None:
    """Raises a clear error for an unknown or not-yet-available implementation."""
    if implementation not in IMPLEMENTATIONS + available:
        raise ValueError(f"{op}: implementation must be one of {available}, got {implementation!r}")
    if implementation not in available:
        raise NotImplementedError(
            f"{op}: implementation={implementation!r} is not available yet (have {available}); use implementation='xla'"
        )


def runs_unpartitioned_kernel(
    implementation: str, available: tuple[str, ...], op: str, takes: bool, auto: bool
) -> bool:
    """Whether an op runs its Triton-lowered kernel, which is not partitioned: never under a mesh
    or where the kernel does not take the operands (`takes`); for "pallas" otherwise; for "auto"
    on a GPU where the op's measured rule (`auto`) holds, unless its `AUTO_KERNEL` is off (the
    caller folds that into `auto`). Raises for an unknown `implementation`."""
    check_implementation(implementation, available, op)
    if not takes or sharding.context_mesh() is not None:
        return False
    if implementation == "pallas":
        return True
    return implementation == "auto" and auto and jax.default_backend() == "gpu"


def check_rank(op: str, name: str, array, rank: int) -> None:
    """Raises ValueError naming `name` and its shape unless `array` has `rank` dimensions."""
    if len(array.shape) != rank:
        raise ValueError(f"{op}: {name} must have {rank} dimensions, got shape {tuple(array.shape)}")


def check_tiles(**tiles: int) -> None:
    """Raises ValueError naming the first tile size that is not a power of two (Triton blocks must be)."""
    for name, size in tiles.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two, got {size!r}")


TRITON_MIN_DOT = 16
"""The smallest dot the Triton lowering takes, in each of its dimensions."""


def dot_rows(n: int) -> int:
    """n rounded up to a power of two >= `TRITON_MIN_DOT`: the rows a Triton-lowered kernel pads
    a small operand (a block's tokens, a call's rows) to."""
    return max(TRITON_MIN_DOT, pl.next_power_of_2(n))


def check_dot_tiles(**tiles: int) -> None:
    """`check_tiles`, and each at least `TRITON_MIN_DOT` (a tile that is a dot's dimension)."""
    check_tiles(**tiles)
    for name, size in tiles.items():
        if size < TRITON_MIN_DOT:
            raise ValueError(f"{name} must be >= {TRITON_MIN_DOT} (the Triton dot's smallest), got {size}")


def check_compiler(num_warps: int, num_stages: int) -> None:
    """Raises ValueError for Triton launch parameters it cannot take."""
    check_tiles(num_warps=num_warps)
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
