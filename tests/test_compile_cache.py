"""`compile_cache.executable`: generate's whole executables on disk, keyed by what shapes them."""

import io
import os
import subprocess
import sys
import tarfile

import jax
import numpy as np
import pytest

from ddtree_jax import compile_cache, model
from ddtree_jax.generate import generate
from ddtree_jax.pallas.moe import reference as moe_reference
from tests.conftest import REPO, random_target, tiny

PROMPT = [[5, 17, 33, 2, 9]]
pytestmark = pytest.mark.clears_jax_caches  # `folder`: as in a new process, nothing compiled in memory


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A fresh executables folder; every executable stored, however quick its compile."""
    monkeypatch.setattr(compile_cache, "_executables_dir", str(tmp_path / "executables"))
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compile_cache.clear()
    yield tmp_path / "executables"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    compile_cache.clear()


@pytest.fixture(scope="module")
def params():
    return random_target(tiny(), seed=4)


def _no_compiling(monkeypatch):
    """Any lowering compiled from here on fails the test."""

    def refuse(self, *a, **k):
        raise AssertionError("compiled, but the executable was on disk")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)


def test_a_new_process_loads_the_executable_instead_of_compiling(params, folder, monkeypatch):
    first = generate(params, PROMPT, max_new_tokens=6).to_lists()
    (entry,) = os.listdir(folder)
    compile_cache.clear()  # as in a new process: nothing compiled in memory
    _no_compiling(monkeypatch)
    assert generate(params, PROMPT, max_new_tokens=6).to_lists() == first
    assert os.listdir(folder) == [entry]


def test_what_shapes_the_program_is_in_the_key(params, folder, monkeypatch):
    generate(params, PROMPT, max_new_tokens=6)
    generate(params, PROMPT, max_new_tokens=7)  # static settings
    generate(params, [PROMPT[0] * 2], max_new_tokens=6)  # argument shapes
    generate(model.cast_params(params, jax.numpy.bfloat16), PROMPT, max_new_tokens=6)  # dtypes
    assert len(os.listdir(folder)) == 4
    # A module setting changed at run time: like jit, the process sees it after jax.clear_caches().
    monkeypatch.setattr(moe_reference, "DENSE_MAX_TOKENS", 0)
    generate(params, PROMPT, max_new_tokens=6)
    assert len(os.listdir(folder)) == 4
    jax.clear_caches()
    generate(params, PROMPT, max_new_tokens=6)
    assert len(os.listdir(folder)) == 5


def test_an_executable_stored_after_jax_cache_hit_runs(params, folder, tmp_path):
    """What is stored is a fresh compile even when jax's own cache could serve it: on XLA:CPU a
    copy of an executable jax loaded from its cache fails to run ("Function ... not found")."""
    jax_folder = jax.config.jax_compilation_cache_dir
    if not jax_folder:
        pytest.skip("jax's persistent cache is off in this session")
    kw = dict(method="ar", max_new_tokens=9, temperature=0.0)
    executables = str(folder)
    compile_cache._executables_dir = None  # jax's cache alone: it now holds this program
    expected = generate(params, PROMPT, **kw).to_lists()
    compile_cache._executables_dir = executables
    compile_cache.clear()
    assert generate(params, PROMPT, **kw).to_lists() == expected  # stored
    compile_cache.clear()
    assert generate(params, PROMPT, **kw).to_lists() == expected  # loaded and run


def test_a_corrupt_entry_is_compiled_again_with_a_warning(params, folder):
    expected = generate(params, PROMPT, max_new_tokens=6).to_lists()
    (entry,) = os.listdir(folder)
    (folder / entry).write_bytes(b"not an executable")
    compile_cache.clear()
    with pytest.warns(UserWarning, match="unreadable executable"):
        assert generate(params, PROMPT, max_new_tokens=6).to_lists() == expected
    compile_cache.clear()
    assert generate(params, PROMPT, max_new_tokens=6).to_lists() == expected  # rewritten whole


def test_eviction_keeps_the_folder_under_its_bound(params, folder, monkeypatch):
    generate(params, PROMPT, max_new_tokens=6)
    size = sum(os.path.getsize(folder / f) for f in os.listdir(folder))
    monkeypatch.setattr(compile_cache, "MAX_EXECUTABLE_BYTES", int(size * 1.5))
    generate(params, PROMPT, max_new_tokens=7)
    assert len(os.listdir(folder)) == 1  # the older one went


def test_a_read_only_folder_warns_and_still_generates(params, folder, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(compile_cache.tempfile, "mkstemp", refuse)
    with pytest.warns(UserWarning, match="could not store"):
        out = generate(params, PROMPT, max_new_tokens=6).to_lists()
    assert out == generate(params, PROMPT, max_new_tokens=6, numerics="exact").to_lists()


def test_off_without_enable(params, monkeypatch):
    monkeypatch.setattr(compile_cache, "_executables_dir", None)
    assert compile_cache.executable(jax.jit(lambda x: x), (np.ones(2),), {}) is None


def test_shipped_autotuning_results_are_extracted_once_and_never_over_local_ones(tmp_path):
    tuned, folder, shipped = tmp_path / "tuned", tmp_path / "cache" / compile_cache.AUTOTUNE_DIR, tmp_path / "shipped"
    (tuned / "gpu").mkdir(parents=True)
    (tuned / "gpu" / "a.pb").write_text("shipped a")
    (tuned / "gpu" / "b.pb").write_text("shipped b")
    assert compile_cache.save_autotune(str(tuned), str(shipped / "h100.tar.gz")) == 2
    (folder / "gpu").mkdir(parents=True)
    (folder / "gpu" / "b.pb").write_text("tuned here")
    assert compile_cache.seed_autotune(str(shipped), str(folder)) == 1
    assert (folder / "gpu" / "a.pb").read_text() == "shipped a"
    assert (folder / "gpu" / "b.pb").read_text() == "tuned here"
    assert sorted(os.listdir(folder / "gpu")) == ["a.pb", "b.pb"]  # no temporary left
    assert compile_cache.seed_autotune(str(shipped), str(folder)) == 0
    assert compile_cache.seed_autotune(str(tmp_path / "missing"), str(folder)) == 0
    # The same results give the same archive, byte for byte (no times or owners in it).
    first = (shipped / "h100.tar.gz").read_bytes()
    compile_cache.save_autotune(str(tuned), str(shipped / "h100.tar.gz"))
    assert (shipped / "h100.tar.gz").read_bytes() == first


def test_a_damaged_or_escaping_archive_extracts_nothing_outside(tmp_path):
    shipped, folder = tmp_path / "shipped", tmp_path / "cache"
    shipped.mkdir()
    with tarfile.open(shipped / "evil.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("../outside.pb")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    (shipped / "broken.tar.gz").write_bytes(b"not a tar")
    with pytest.warns(UserWarning, match="broken.tar.gz"):
        assert compile_cache.seed_autotune(str(shipped), str(folder)) == 0
    assert not (tmp_path / "outside.pb").exists()


def test_on_a_gpu_generate_compiles_with_the_folder_jax_gives_xla_seeded(tmp_path, monkeypatch):
    (tmp_path / "tuned" / "gpu").mkdir(parents=True)
    (tmp_path / "tuned" / "gpu" / "k.pb").write_text("result")
    compile_cache.save_autotune(str(tmp_path / "tuned"), str(tmp_path / "shipped" / "h100.tar.gz"))
    monkeypatch.setattr(compile_cache, "SHIPPED_AUTOTUNE", str(tmp_path / "shipped"))
    monkeypatch.setattr(compile_cache, "_executables_dir", None)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
    try:
        assert compile_cache.enable() == str(tmp_path / "cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    autotune = tmp_path / "cache" / compile_cache.AUTOTUNE_DIR
    assert compile_cache.compiler_options() == {}  # the CPU: nothing to tune, nothing extracted
    assert not autotune.exists()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert compile_cache.compiler_options() == {compile_cache.AUTOTUNE_DIR: str(autotune)}
    assert (autotune / "gpu" / "k.pb").read_text() == "result"
    flags = jax.config.jax_persistent_cache_enable_xla_caches
    jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_kernel_cache_file")
    try:
        assert compile_cache.compiler_options() == {}  # turned off through jax's own setting
    finally:
        jax.config.update("jax_persistent_cache_enable_xla_caches", flags)


def test_the_shipped_autotuning_archives_hold_results_per_gpu_model(tmp_path):
    """`ddtree_jax/autotune`: readable archives of XLA's per-fusion results (a folder a GPU model)."""
    archives = sorted(os.listdir(compile_cache.SHIPPED_AUTOTUNE))
    assert archives and all(a.endswith(".tar.gz") for a in archives), archives
    assert compile_cache.seed_autotune(compile_cache.SHIPPED_AUTOTUNE, str(tmp_path)) > 100
    for model_folder in os.listdir(tmp_path):
        assert all(name.endswith(".pb") for name in os.listdir(tmp_path / model_folder))


KEY_SCRIPT = """
import sys
import jax, jax.numpy as jnp
if sys.argv[1] == "generate":
    import ddtree_jax.generate  # one process with more of the package loaded than the other
from ddtree_jax import compile_cache
leaves, treedef = jax.tree.flatten((jnp.zeros(3),))
print(compile_cache._key(jax.jit(lambda x: x + 1), treedef, leaves, {"a": 1}))
"""


def test_the_key_is_the_same_in_every_process(tmp_path):
    """Two processes with other string hashes (PYTHONHASHSEED) and other modules loaded compute
    one key for one program: a frozenset setting (`hf.READABLE_KINDS`) printed in hash order, and
    the settings of only the loaded modules, made every process's keys its own, so no process
    loaded what another had stored."""
    script = tmp_path / "key.py"
    script.write_text(KEY_SCRIPT)
    keys = set()
    for seed, imports in (("1", "cache"), ("2", "generate")):
        env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
        proc = subprocess.run([sys.executable, str(script), imports], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        keys.add(proc.stdout.strip())
    assert len(keys) == 1, keys
