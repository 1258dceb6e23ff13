"""Argument checks shared by the public API: clear errors that name the value."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
"""Parameter, cache and compute dtypes the engine runs (float64 needs jax_enable_x64, which it does not use)."""


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Returns `value` as an int; TypeError unless it is an int (not a bool or a float), ValueError out of range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def check_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """The numpy dtype for `dtype` (a name or dtype-like); ValueError unless it is bfloat16, float16 or float32."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in FLOAT_DTYPES:
        raise ValueError(f"{name}={dtype!r} is not supported; choose one of {FLOAT_DTYPES}")
    return dt


def stored_dtype(dtype: Any, name: str) -> np.dtype:
    """The parameter dtype for weights stored as `dtype`: itself, or float32 for float64 (JAX holds no float64 here)."""
    if np.dtype(dtype) == np.float64:
        return np.dtype(np.float32)
    return check_dtype(dtype, name)


def nonfinite_message(a: Any, name: str) -> str | None:
    """None if `a` holds no NaN / Inf (or is not floating), else a message naming `name`, the count and the first index."""
    a = np.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return None
    bad = ~np.isfinite(a)
    if not bad.any():
        return None
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    kinds = "NaN" if np.isnan(a[first]) else "Inf"
    return f"{name} holds {int(bad.sum())} non-finite value(s) ({kinds} at index {first}, dtype {a.dtype})"
