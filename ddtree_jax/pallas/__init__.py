"""Kernels, each beside its pure-jnp reference (tokamax style).

`ddtree_jax/pallas/<op>/` holds `reference.py` (float32 math, also the XLA
fallback) and `api.py` (one dispatch function with `implementation=`).
"""

IMPLEMENTATIONS = ("xla", "pallas")
"""What a user picks (`generate(implementation=...)`); an op may have more (mla_attention's "exact")."""


def check_implementation(implementation: str, available: tuple[str, ...], op: str) -> None:
    """Raises a clear error for an unknown or not-yet-available implementation."""
    if implementation not in IMPLEMENTATIONS + available:
        raise ValueError(f"{op}: implementation must be one of {available}, got {implementation!r}")
    if implementation not in available:
        raise NotImplementedError(
            f"{op}: implementation={implementation!r} is not available yet (have {available}); use implementation='xla'"
        )


def check_tiles(**tiles: int) -> None:
    """Raises ValueError naming the first tile size that is not a power of two (Triton blocks must be)."""
    for name, size in tiles.items():
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two, got {size}")
