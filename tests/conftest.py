"""Shared fixtures: small random targets and the HF reference runner."""

import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile

# The tests run tiny models on the CPU, where XLA's compile time is most of what they wait
# for. LLVM at -O1 keeps most of -O0's compile saving without its slower code. Measured alone on
# this 2-core machine: test_decode's stop-token test takes 72 s at the default level, 52 s at -O1,
# 48 s at -O0; the 512-token shipped-pair numerics test 50 s at -O2, 48 s at -O1, 144 s at -O0
# (that one with another test running). Set before jax creates its backend; subprocesses
# inherit it (`xla_flags`).
if not os.path.exists("/dev/nvidia0") and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()
# The MLA kernel's new-token split deadlocks Mosaic GPU's interpreter under XLA:CPU's default
# scheduler (mosaic.INTERPRET_NEW_FLAG).
if not os.path.exists("/dev/nvidia0") and "concurrency_optimized_scheduler" not in os.environ.get("XLA_FLAGS", ""):
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

# XLA:CPU's legacy fusion emitters compile the tests' programs about 25-30% faster (measured on
# the decode tests' generate programs, whose tokens and logits stay bit for bit the same; the
# whole suite 13 min against 16-18), but their loops over row tiles rewrite the loop's whole
# output each iteration, so a run's time grows with the square of its rows: the one test that
# samples thousands of rows at once runs them in a subprocess without it (`default_emitters_env`
# sets DDTREE_TEST_XLA_EMITTERS=default).
if (
    not os.path.exists("/dev/nvidia0")
    and os.environ.get("DDTREE_TEST_XLA_EMITTERS") != "default"
    and "xla_backend_extra_options" not in os.environ.get("XLA_FLAGS", "")
):
    flag = "--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

import jax
import numpy as np
import pytest

from ddtree_jax import compile_cache, config, model

jax.config.update("jax_default_matmul_precision", "highest")

_SESSION_CACHE = None
MIN_CACHED_COMPILE_S = 1.0


def pytest_configure(config):
    """One persistent compilation cache per test session (unless $DDTREE_JAX_CACHE names one).

    The xdist workers and the experiment scripts the tests run inherit the folder through
    the environment, so a program compiled once (the shipped pair's loops, a fixture's
    model) is loaded, not compiled again, by every later process and by this one after
    `_free_compiled_code` drops it.

    Only programs that took MIN_CACHED_COMPILE_S or more to compile are written: every write
    scans the whole folder (jax's LRU eviction stats and reads each entry's access-time file,
    under the folder's lock), and the suite's thousands of tiny op-by-op programs, cheaper to
    compile again than to store, made those scans quadratic (0.2 s a write at 3000 entries).
    The workers and subprocesses get the same settings through jax's environment variables
    (read when jax is imported; `compile_cache.enable` keeps a folder configured that way), so
    the experiment scripts do not write their tiny programs either.
    """
    config.addinivalue_line("markers", f"{CLEARS_CACHES}: the test empties jax's in-process caches (jax.clear_caches)")
    global _SESSION_CACHE
    if "PYTEST_XDIST_WORKER" not in os.environ and compile_cache.ENV not in os.environ:
        _SESSION_CACHE = tempfile.mkdtemp(prefix="ddtree_jax_xla_")
        os.environ[compile_cache.ENV] = _SESSION_CACHE
    folder = compile_cache.enable()
    if folder is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
        os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(jax.config.jax_compilation_cache_max_size)
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(MIN_CACHED_COMPILE_S)


# Module-scoped fixtures that take tens of seconds or more to build (the 8-device sharding
# subprocess, the shipped pair's and the decode tests' greedy runs, the HF and DFlash references).
SHARED_FIXTURES = {"sharded_runs", "shipped", "greedy", "parity", "drafter_parity", "end_to_end"}
# Tests that call jax.clear_caches() (test_compile_cache's fresh-process checks, kernel flags read
# when traced): one group, so that they run one after another on one worker. Spread over both,
# each clear made the worker's next tests compile again every small program they had compiled.
CLEARS_CACHES = "clears_jax_caches"


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(items):
    """The tests that use one of SHARED_FIXTURES form one xdist group per module (`make test`
    passes `--dist loadgroup`), so one worker builds the fixture; under plain "load" each worker
    built it again. Other tests are sent one by one: grouping every module-scoped fixture (most
    are a random init of a second) put whole modules on one worker and left the other idle.

    The groups run first, the 8-device sharding subprocess (1.5-2 min) first of all: xdist hands
    out work in collection order, and a long group handed out last keeps one worker busy
    while the other has nothing left."""
    for item in items:
        if item.get_closest_marker(CLEARS_CACHES) is not None:
            item.add_marker(pytest.mark.xdist_group(CLEARS_CACHES))
        elif SHARED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))

    def rank(item):
        names = set(getattr(item, "fixturenames", ()))
        grouped = SHARED_FIXTURES & names or item.get_closest_marker(CLEARS_CACHES) is not None
        return 0 if "sharded_runs" in names else 1 if grouped else 2

    items.sort(key=rank)  # stable: each module keeps its order


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


PROC_MAPS = "/proc/self/maps"
MAX_MAPS = 20_000


@pytest.fixture(autouse=True)
def _free_compiled_code():
    """Drops JAX's compiled executables once the process holds more than MAX_MAPS memory maps.

    XLA:CPU maps the code of every executable it compiles into the process, several
    maps each (test_decode.py alone leaves ~38k). A worker that keeps a whole suite's
    executables passes Linux's vm.max_map_count (65530), and its next compile segfaults
    inside XLA. Cleared, the count falls to a few hundred. Elsewhere than Linux: no-op.
    """
    yield
    if not os.path.exists(PROC_MAPS):
        return
    with open(PROC_MAPS) as f:
        maps = sum(1 for _ in f)
    if maps > MAX_MAPS:
        compile_cache.clear()
        gc.collect()


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a subprocess: the session's flags plus `flags`."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


def default_emitters_env() -> dict[str, str]:
    """The environment for a subprocess on XLA:CPU's default fusion emitters: the session's
    settings without the legacy emitters' option set above."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "disable_new_fusion_emitters" not in f]
    return dict(os.environ, XLA_FLAGS=" ".join(flags), DDTREE_TEST_XLA_EMITTERS="default")


def tiny(**overrides) -> config.TargetConfig:
    """TINY with overrides, eos off (so greedy runs never stop early)."""
    return dataclasses.replace(config.TINY, **{"eos_token_id": None, "bos_token_id": None, **overrides})


_init_params_jit = jax.jit(model.init_params, static_argnums=0, static_argnames=("dtype", "std"))


def random_target(cfg: config.TargetConfig, seed: int = 0, std: float = 0.15, jit: bool = False) -> model.TargetParams:
    """Random float32 weights large enough that attention and routing are far from uniform.

    jit: drawn by one compiled program (one compile a config) instead of op by op (one compile
    per op and weight shape, seconds for a new config in a fresh process); other values than
    op by op (XLA fuses the draws), so only for checks that compare two runs on the same weights."""
    if jit:
        return _init_params_jit(cfg, jax.random.PRNGKey(seed), std=std)
    return model.init_params(cfg, jax.random.PRNGKey(seed), std=std)


def same(a, b) -> bool:
    """Two pytrees of arrays with equal dtypes and values."""
    return jax.tree.all(jax.tree.map(lambda x, y: x.dtype == y.dtype and bool((x == y).all()), a, b))


def rewrite(path, edit) -> None:
    """Loads path/model.safetensors as a dict, lets `edit` change it, writes it back."""
    import safetensors.numpy

    tensors = {k: np.array(v) for k, v in safetensors.numpy.load_file(path / "model.safetensors").items()}
    edit(tensors)
    safetensors.numpy.save_file(tensors, path / "model.safetensors", {"format": "pt"})


def hf_python() -> str | None:
    """The Python that has torch + transformers (Makefile's .venv-hf), or None."""
    candidates = [os.environ.get("DDTREE_HF_PYTHON"), os.path.join(HERE, "..", ".venv-hf", "bin", "python")]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    return None


def run_hf_reference(cases: list[dict], workdir: str, script: str = "hf_reference.py") -> list[dict[str, np.ndarray]]:
    """Runs tests/`script` (hf_reference.py or dflash_reference.py) once for all cases in the HF
    environment; returns one dict of arrays per case."""
    py = hf_python()
    if py is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs the HF reference environment: run `make venv-hf` (see Makefile)")
        pytest.skip("HF reference environment missing: `make venv-hf` creates .venv-hf")
    job = os.path.join(workdir, "job.json")
    for i, case in enumerate(cases):
        case["out"] = os.path.join(workdir, f"case{i}.npz")
    with open(job, "w") as f:
        json.dump({"cases": cases}, f)
    # No timeout: on a loaded machine torch's start-up alone can take minutes.
    proc = subprocess.run([py, os.path.join(HERE, script), job], capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        pytest.fail(f"{script} failed with exit code {proc.returncode}")
    return [dict(np.load(c["out"])) for c in cases]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A checkpoints folder like `checkpoints/` (target/, drafter/, tokenizer.json) holding a
    random 2-layer target (one dense, one MoE layer) and a 1-layer block-16 drafter over the
    shipped tokenizer: the experiment scripts' smoke tests compile it in a fraction of the
    shipped pair's time."""
    import shutil

    from ddtree_jax import checkpoint
    from ddtree_jax.drafters import dflash

    out = tmp_path_factory.mktemp("tiny_pair")
    shutil.copy(os.path.join(HERE, "..", "checkpoints", "tokenizer.json"), out / "tokenizer.json")
    with open(os.path.join(HERE, "..", "checkpoints", "target", "config.json")) as f:
        shipped = json.load(f)
    cfg = tiny(
        vocab_size=shipped["vocab_size"],
        num_hidden_layers=2,
        max_position_embeddings=shipped["max_position_embeddings"],
        eos_token_id=shipped["eos_token_id"],
        bos_token_id=shipped["bos_token_id"],
    )
    checkpoint.save_hf(random_target(cfg), out / "target")
    dcfg = dflash.drafter_config_for(cfg, num_hidden_layers=1, block_size=16, mask_token_id=3)
    dflash.save_drafter_hf(dflash.init_params(dcfg, jax.random.PRNGKey(1), std=0.3), out / "drafter")
    return out
