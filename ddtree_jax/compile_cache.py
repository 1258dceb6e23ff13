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

On the GPU most of a cold compile is XLA autotuning its Triton GEMM fusions (each candidate
tiling compiled and timed). XLA keeps what it picks per fusion in
`<folder>/xla_gpu_per_fusion_autotune_cache_dir`, the folder jax's own cache gives it, and
`generate`'s compiles get the same folder. Before the first of them the results shipped with
this package are extracted into it (`SHIPPED_AUTOTUNE`: the shipped pair's programs, tuned on
the GPU models it names), so that a first compile of those programs on such a GPU skips the
tuning. XLA keys each result by the GPU model, its own version and the fusion's HLO: any other
fusion, GPU or XLA is tuned as before.

Folder: `$DDTREE_JAX_CACHE` if set, else `~/.cache/ddtree_jax/xla`. Set `DDTREE_JAX_CACHE=off`
to compile everything afresh. Entries are evicted least recently used beyond `MAX_BYTES`
(executables: beyond `MAX_EXECUTABLE_BYTES`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import glob
import hashlib
import importlib
import os
import pickle
import pkgutil
import sys
import tarfile
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
AUTOTUNE_DIR = "xla_gpu_per_fusion_autotune_cache_dir"
"""XLA's per-fusion autotuning results, in the cache folder (the name jax's own cache uses)."""
SHIPPED_AUTOTUNE: str | None = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autotune")
"""The folder of autotuning results shipped with the package (`.tar.gz` archives, one a GPU
model, made by `experiments/compile_time.py --no-shipped-autotune --save-autotune`), extracted
into the cache folder before `generate`'s first compile on a GPU (`compiler_options`; None: not,
e.g. to time a compile without them)."""

_OFF = ("", "0", "off", "none", "false")
_executables_dir: str | None = None
_loaded: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()
_source_digest: str | None = None
_seeded: set[tuple[str, str]] = set()


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


def _autotune_enabled() -> bool:
    """Whether jax's cache settings give XLA the per-fusion autotuning folder (the default)."""
    flags = jax.config.jax_persistent_cache_enable_xla_caches or ""
    return flags == "all" or AUTOTUNE_DIR in flags


def seed_autotune(source: str, folder: str) -> int:
    """Extracts the autotuning results of the `.tar.gz` archives in `source` that `folder`
    lacks (XLA files each result under a folder named by its GPU model's hash); returns how many.

    A result already in `folder` is kept (XLA wrote it on this machine). Each one is written
    whole, then renamed, so that a concurrent compile never reads half a file. A missing
    `source`, or a folder that cannot be written, extracts nothing.
    """
    copied, folder = 0, os.path.abspath(folder)
    for archive in sorted(glob.glob(os.path.join(source, "*.tar.gz"))):
        try:
            with tarfile.open(archive) as tar:
                for member in tar:
                    target = os.path.normpath(os.path.join(folder, member.name))
                    if not member.isfile() or not target.startswith(os.path.join(folder, "")):
                        continue  # folders are made below; a path leaving `folder` is not followed
                    if os.path.exists(target):
                        continue
                    _write_whole(target, tar.extractfile(member).read())
                    copied += 1
        except (OSError, tarfile.TarError) as e:  # a read-only or full disk, a damaged archive
            warnings.warn(f"compile cache: autotuning results of {archive} not used ({e})", stacklevel=2)
    return copied


def save_autotune(folder: str, archive: str) -> int:
    """Writes the autotuning results under `folder` into the `.tar.gz` `archive` (what
    `SHIPPED_AUTOTUNE` holds, one archive a GPU model); returns how many."""
    names = sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, files in os.walk(folder) for f in files)
    names = [n for n in names if not os.path.basename(n).startswith(".")]
    os.makedirs(os.path.dirname(os.path.abspath(archive)), exist_ok=True)
    with tarfile.open(archive + ".tmp", "w:gz") as tar:
        for name in names:
            info = tar.gettarinfo(os.path.join(folder, name), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # the same bytes each time
            with open(os.path.join(folder, name), "rb") as f:
                tar.addfile(info, f)
    os.replace(archive + ".tmp", archive)
    return len(names)


def _write_whole(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def compiler_options() -> dict[str, str]:
    """XLA options for `generate`'s own compiles: on the GPU, the autotuning folder that
    jax's cache would have given it (the executable cache compiles with jax's cache off),
    with the shipped results extracted into it first (once a folder and process)."""
    if _executables_dir is None or jax.default_backend() != "gpu" or not _autotune_enabled():
        return {}
    folder = os.path.join(os.path.dirname(_executables_dir), AUTOTUNE_DIR)
    if SHIPPED_AUTOTUNE is not None and (SHIPPED_AUTOTUNE, folder) not in _seeded:
        seed_autotune(SHIPPED_AUTOTUNE, folder)
        _seeded.add((SHIPPED_AUTOTUNE, folder))
    return {AUTOTUNE_DIR: folder}


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
            compiled = jitted.lower(*args, **static).compile(compiler_options=compiler_options())
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


@functools.cache
def _import_package() -> None:
    """Imports every module of this package, once a process."""
    for info in pkgutil.walk_packages(sys.modules[__package__].__path__, f"{__package__}."):
        importlib.import_module(info.name)


def _stable_repr(value) -> str:
    """repr with sets' members sorted: a frozenset of strings prints in the order of the
    process's string hashes (PYTHONHASHSEED), so its plain repr made each process's key its own."""
    if isinstance(value, frozenset):
        return "frozenset({" + ", ".join(sorted(_stable_repr(v) for v in value)) + "})"
    if isinstance(value, tuple):
        return "tuple(" + ", ".join(_stable_repr(v) for v in value) + ")"
    return repr(value)


def _package_settings() -> str:
    """The live module-level names of this package's modules: constants by value, functions
    and classes by qualified name, so that a setting changed at run time (`profile_round
    --set`, a test's monkeypatch) is part of the key.

    Every module of the package is imported first (once a process, ~0.1 s): with only the
    loaded ones read, a process that had imported one module more computed other keys for the
    same programs and never loaded what another had stored."""
    _import_package()
    out = []
    for name in sorted(sys.modules):
        if name == __name__ or (name != __package__ and not name.startswith(f"{__package__}.")):
            continue
        module = sys.modules[name]
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("__"):
                continue
            if isinstance(value, _SIMPLE):
                out.append(f"{name}.{attr}={_stable_repr(value)}")
            elif callable(value):
                out.append(f"{name}.{attr}->{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}")
    return "\n".join(out)
