"""JAX's persistent compilation cache, on by default for the CLI and the experiment scripts.

A compiled `generate` program is written to disk the first time it is built, and a later
process that builds the same program (same model shapes, method, budget, batch, dtype, jax
version and device) loads it instead of compiling again: a sweep or an eval re-run pays for
tracing and lowering only.

Tracing and lowering still cost a second or two per program before jax's cache is even
consulted, so `generate` also keeps whole executables (`executable`): serialized under
`<folder>/executables`, keyed by everything that shapes the program (the arguments' tree,
shapes, dtypes and placement, the static settings, this package's source and live
module-level settings, jax's version and config, XLA_FLAGS and the devices). A hit loads the
program without tracing it.

Entries are pickled executables, loaded as code: as with jax's own cache, whoever can write to
the folder can run code in the processes that use it.

Folder: `$DDTREE_JAX_CACHE` if set, else `~/.cache/ddtree_jax/xla`. Set `DDTREE_JAX_CACHE=off`
to compile everything afresh. Entries are evicted least recently used beyond `MAX_BYTES`
(executables: beyond `MAX_EXECUTABLE_BYTES`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV = "DDTREE_JAX_CACHE"
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ddtree_jax", "xla")
MAX_BYTES = 8 << 30
"""Disk bound of the cache; setting any bound also makes jax lock the folder, so that
concurrent processes (pytest workers, parallel sweeps) never read a half-written entry."""

MAX_EXECUTABLE_BYTES = 2 << 30
"""Disk bound of the serialized `generate` executables (least recently used go first)."""
IN_MEMORY = 64
"""Executables kept in the process (least recently used dropped; `clear` drops all)."""

_OFF = ("", "0", "off", "none", "false")
_executables_dir: str | None = None
_loaded: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()
_source_digest: str | None = None


def cache_dir() -> str | None:
    """The folder `enable` uses: `$DDTREE_JAX_CACHE`, or the default; None when turned off."""
    path = os.environ.get(ENV, DEFAULT_DIR)
    return None if path.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(path))


def enable(path: str | None = None, *, executables: bool = True) -> str | None:
    """Turns on jax's persistent compilation cache in `path` (default: `cache_dir()`).

    A folder already configured through jax (`jax_compilation_cache_dir`, or the
    `JAX_COMPILATION_CACHE_DIR` environment variable) is kept. Every compiled program is
    cached, however quick its compile: the launch-bound decode loops compile in seconds.

    Args:
      path: the folder; default `cache_dir()`.
      executables: also keep `generate`'s whole executables in `<folder>/executables`
        (`executable`), so that a warm call skips tracing and lowering.

    Returns:
      The folder in use, or None when the cache is turned off.
    """
    global _executables_dir
    configured = jax.config.jax_compilation_cache_dir
    if not configured:
        path = path if path is not None else cache_dir()
        if path is None:
            return None
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        configured = path
    _executables_dir = os.path.join(configured, "executables") if executables else None
    return configured


def clear() -> None:
    """`jax.clear_caches()`, and the executables this module holds in the process."""
    _loaded.clear()
    jax.clear_caches()


def executable(jitted, args: tuple, static: dict[str, Any]) -> Callable[..., Any] | None:
    """`jitted` compiled for `args` (static keywords `static`), loaded from disk when cached.

    Returns None when the cache is off (`enable` not called, or turned off): the caller
    then calls `jitted` itself. Otherwise returns the compiled program, to be called with
    `args` alone. In the process, programs are found again by the arguments' tree, avals
    and placement and the static keywords alone, as jit finds its own, and forgotten by
    `jax.clear_caches()` (or `clear`), as jit's are: a module-level setting changed at
    run time takes effect after either. On disk the key is the whole digest (`_key`). A
    miss traces, lowers and compiles, and stores the executable if the compile took at
    least `jax_persistent_cache_min_compile_time_secs`. A corrupt entry is compiled again
    and overwritten, with a warning.
    """
    if _executables_dir is None:
        return None
    if _jax_caches_cleared():
        _loaded.clear()
    leaves, treedef = jax.tree.flatten(args)
    fast = (jitted, treedef, tuple(_aval(x) for x in leaves), tuple(sorted(static.items())))
    hit = _loaded.get(fast)
    if hit is not None:
        _loaded.move_to_end(fast)
        return hit
    path = os.path.join(_executables_dir, _key(jitted, treedef, leaves, static) + ".exe")
    compiled = _load(path)
    if compiled is None:
        t0 = time.perf_counter()
        with _without_jax_cache():
            compiled = jitted.lower(*args, **static).compile()
        if time.perf_counter() - t0 >= jax.config.jax_persistent_cache_min_compile_time_secs:
            _store(path, compiled)
    _loaded[fast] = compiled
    while len(_loaded) > IN_MEMORY:
        _loaded.popitem(last=False)
    return compiled


@jax.jit
def _canary():
    return jax.numpy.int32(0)


def _jax_caches_cleared() -> bool:
    """Whether `jax.clear_caches()` ran since the last call: it empties every jitted
    function's cache, this module's canary's too, which is then compiled again (tiny)."""
    cleared = _canary._cache_size() == 0
    if cleared:
        _canary()
    return cleared


def _aval(x):
    """What a jitted function's cache tells arguments apart by (hashable)."""
    if isinstance(x, jax.Array):
        return x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding
    if isinstance(x, np.ndarray | np.generic):
        return "np", x.shape, x.dtype
    return type(x), (x if isinstance(x, _SIMPLE) else id(x))


@contextlib.contextmanager
def _without_jax_cache():
    """jax's persistent cache off for one compile: an executable jax loaded from it and
    serialized again lacks some of its functions on XLA:CPU (jax 0.11.2: "Function
    compare_reduce_fusion.7 not found" when the copy runs), so what is stored is always a
    fresh compile."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()  # jax decides once whether the cache is used; ask it again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        jax_cache.reset_cache()


def _load(path: str) -> jax.stages.Compiled | None:
    try:
        with open(path, "rb") as f:
            blob = f.read()
        payload, in_tree, out_tree = pickle.loads(blob)
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable, truncated or foreign: compile instead
        warnings.warn(
            f"compile cache: unreadable executable {path} ({type(e).__name__}: {e}); compiling again", stacklevel=3
        )
        return None
    with contextlib.suppress(OSError):  # recency for eviction; a read-only folder still serves
        os.utime(path)
    return compiled


def _store(path: str, compiled: jax.stages.Compiled) -> None:
    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception as e:  # some backends cannot serialize: keep the in-process copy only
        warnings.warn(f"compile cache: executable not serializable ({type(e).__name__}: {e})", stacklevel=3)
        return
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        # Written whole, then renamed: a concurrent reader sees the old file or the new one.
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        _evict(folder)
    except OSError as e:  # a read-only or full disk: generate still runs, uncached
        warnings.warn(f"compile cache: could not store {path} ({type(e).__name__}: {e})", stacklevel=3)


def _evict(folder: str) -> None:
    entries = []
    for name in os.listdir(folder):
        if name.endswith(".exe"):
            try:
                st = os.stat(os.path.join(folder, name))
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            entries.append((st.st_mtime, st.st_size, name))
    total = sum(size for _, size, _ in entries)
    for _, size, name in sorted(entries):
        if total <= MAX_EXECUTABLE_BYTES:
            break
        with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
            os.remove(os.path.join(folder, name))
        total -= size


def _key(jitted, treedef, leaves, static: dict[str, Any]) -> str:
    """A digest of everything that shapes the program `jitted.lower(*args, **static)` builds
    (`treedef` and `leaves`: the flattened args)."""
    parts = [
        f"{getattr(jitted, '__module__', '')}.{getattr(jitted, '__qualname__', repr(jitted))}",
        str(treedef),
        repr(sorted(static.items())),
        _leaf_signature(leaves),
        jax.__version__,
        jax.default_backend(),
        repr([(d.platform, d.device_kind, d.id) for d in jax.devices()]),
        os.environ.get("XLA_FLAGS", ""),
        repr(sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)),
        _package_source_digest(),
        _package_settings(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def _leaf_signature(leaves) -> str:
    out = []
    for x in leaves:
        if isinstance(x, jax.Array):
            out.append(f"{x.shape}{x.dtype}{getattr(x, 'weak_type', False)}{x.sharding}")
        elif isinstance(x, np.ndarray | np.generic):
            out.append(f"np{x.shape}{x.dtype}")
        else:
            out.append(f"{type(x).__name__}:{x!r}")
    return ";".join(out)


def _package_source_digest() -> str:
    """SHA-256 of this package's .py files (once per process): a code change is a new program."""
    global _source_digest
    if _source_digest is None:
        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
        _source_digest = h.hexdigest()
    return _source_digest


_SIMPLE = (bool, int, float, str, type(None), tuple, frozenset)


def _package_settings() -> str:
    """The live module-level names of this package's loaded modules: constants by value,
    functions and classes by qualified name, so that a setting changed at run time
    (`profile_round --set`, a test's monkeypatch) is part of the key."""
    out = []
    for name in sorted(sys.modules):
        if name == __name__ or (name != __package__ and not name.startswith(f"{__package__}.")):
            continue
        module = sys.modules[name]
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("__"):
                continue
            if isinstance(value, _SIMPLE):
                out.append(f"{name}.{attr}={value!r}")
            elif callable(value):
                out.append(f"{name}.{attr}->{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}")
    return "\n".join(out)
