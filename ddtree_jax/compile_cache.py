"""JAX's persistent compilation cache, on by default for the CLI and the experiment scripts.

A compiled `generate` program is written to disk the first time it is built, and a later
process that builds the same program (same model shapes, method, budget, batch, dtype, jax
version and device) loads it instead of compiling again: a sweep or an eval re-run pays for
tracing and lowering only.

Folder: `$DDTREE_JAX_CACHE` if set, else `~/.cache/ddtree_jax/xla`. Set `DDTREE_JAX_CACHE=off`
to compile everything afresh. Entries are evicted least recently used beyond `MAX_BYTES`.
"""

from __future__ import annotations

import os

import jax

ENV = "DDTREE_JAX_CACHE"
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ddtree_jax", "xla")
MAX_BYTES = 8 << 30
"""Disk bound of the cache; setting any bound also makes jax lock the folder, so that
concurrent processes (pytest workers, parallel sweeps) never read a half-written entry."""

_OFF = ("", "0", "off", "none", "false")


def cache_dir() -> str | None:
    """The folder `enable` uses: `$DDTREE_JAX_CACHE`, or the default; None when turned off."""
    path = os.environ.get(ENV, DEFAULT_DIR)
    return None if path.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(path))


def enable(path: str | None = None) -> str | None:
    """Turns on jax's persistent compilation cache in `path` (default: `cache_dir()`).

    A folder already configured through jax (`jax_compilation_cache_dir`, or the
    `JAX_COMPILATION_CACHE_DIR` environment variable) is kept. Every compiled program is
    cached, however quick its compile: the launch-bound decode loops compile in seconds.

    Returns:
      The folder in use, or None when the cache is turned off.
    """
    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return configured
    path = path if path is not None else cache_dir()
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
