"""The installed-distributions corpus: licences, deduplication, decontamination, the manifest."""

import gzip
import importlib.metadata
import json
import shutil

import numpy as np
import pytest

from ddtree_jax import corpus, data
from tests.test_data import _prepare_data, fake_root  # noqa: F401 (a fixture)

PROMPT = 'def add_pairs(xs: list) -> list:\n    """Sum each pair of neighbours.\n    >>> add_pairs([1, 2, 3])\n    [3, 5]\n    """\n'


def make_site(root, held_out_text):
    """A site-packages folder of five distributions (dist-info METADATA + RECORD)."""
    dists = {
        "pkg-a": ("License: MIT", {"a/core.py": "def core():\n    return 1\n", "a/dup.py": "SHARED = 1\n"}),
        "pkg-b": (
            "Classifier: License :: OSI Approved :: BSD License",
            {
                "b/dup.py": "SHARED = 1\n",  # the same content as pkg-a's: one copy is kept
                "b/vendored.py": held_out_text,  # a held-out stdlib file, vendored
                "b/leak.py": "# tests\n" + "  ".join(PROMPT.split(" ")) + "    return xs\n",  # re-spaced
                "b/big.py": "#" * (data.MAX_FILE_BYTES + 1),
                "b/__pycache__/c.py": "x = 1\n",
                "b/notes.txt": "text\n",
                "b/ok.py": "def add_pairs(xs):\n    return xs\n",  # the name alone is no leak
            },
        ),
        "pkg-c": ("License-Expression: GPL-3.0-or-later", {"c/gpl.py": "X = 3\n"}),
        "pkg-d": ("", {"d/none.py": "Y = 4\n"}),
        "mine": ("License: MIT", {"mine/self.py": "Z = 5\n"}),
    }
    for name, (licence, files) in dists.items():
        info = root / f"{name.replace('-', '_')}-1.{len(files)}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.{len(files)}\n{licence}\n")
        (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    return list(importlib.metadata.distributions(path=[str(root)]))


def test_collect_keeps_permissive_unique_clean_files(tmp_path):
    held = "def held_out():\n    pass\n"
    dists = make_site(tmp_path / "site", held)
    kept, report = corpus.collect([PROMPT], [held], distributions=dists, exclude=["MINE"])
    got = [(f.source, f.path.split("site/")[1]) for f, _ in kept]
    assert got == [("pkg-a", "a/core.py"), ("pkg-a", "a/dup.py"), ("pkg-b", "b/ok.py")]
    assert report["duplicate"] == 1 and report["held_out_copy"] == 1 and report["contains_prompt"] == 1
    assert report["skipped_licence"] == {"pkg-c": "GPL-3.0-or-later", "pkg-d": "(none given)"}
    assert report["excluded"] == ["mine"]
    f, text = kept[0]
    assert f.version == "1.2" and f.license == "MIT" and f.nbytes == len(text.encode())
    assert f.sha256 == __import__("hashlib").sha256(text.encode()).hexdigest()
    assert kept[2][0].license == "BSD License"


def test_a_crlf_copy_is_the_same_content(tmp_path):
    """The held-out splits are read with universal newlines, so a CRLF copy of one is held out
    too (it leaked into training), and a CRLF copy of a kept file is a duplicate."""
    held = "def held_out():\n    pass\n"
    root = tmp_path / "site"
    info = root / "pkg_e-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg-e\nVersion: 1.0\nLicense: MIT\n")
    files = {"e/held_crlf.py": held.replace("\n", "\r\n"), "e/a.py": "A = 1\n", "e/a_crlf.py": "A = 1\r\n"}
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode())
    kept, report = corpus.collect([], [held], distributions=list(importlib.metadata.distributions(path=[str(root)])))
    assert [f.path.split("site/")[1] for f, _ in kept] == ["e/a.py"]
    assert report["held_out_copy"] == 1 and report["duplicate"] == 1


def test_licences():
    assert corpus.is_permissive("Apache-2.0") and corpus.is_permissive("BSD License; MIT")
    assert corpus.is_permissive("Python Software Foundation License")
    for lic in ("GPL-2.0", "MIT; GNU Lesser General Public License v3 (LGPLv3)", "", "Proprietary"):
        assert not corpus.is_permissive(lic), lic


def test_prepare_data_installed_writes_a_manifest(fake_root, tmp_path_factory, monkeypatch):  # noqa: F811
    root, texts = fake_root  # the fake stdlib fills tmp_path: the site and the output go elsewhere
    held = texts[data.split_files("test", root)[0]]
    site = tmp_path_factory.mktemp("site")
    dists = make_site(site, held)
    monkeypatch.setattr(corpus.importlib.metadata, "distributions", lambda: dists)
    monkeypatch.setattr(data, "humaneval_prompts", lambda: [PROMPT])
    out = tmp_path_factory.mktemp("out")
    stats = _prepare_data().main(["--out", str(out), "--root", str(root), "--vocab-size", "600", "--installed"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert [f["source"] for f in manifest["files"]] == ["mine", "pkg-a", "pkg-a", "pkg-b"]
    assert manifest["report"]["held_out_copy"] == 1 and manifest["report"]["contains_prompt"] == 1, manifest["report"]
    assert set(manifest["files"][0]) == {"source", "version", "license", "path", "sha256", "nbytes"}
    assert stats["package_versions"] == {"mine": "1.1", "pkg-a": "1.2", "pkg-b": "1.7"}
    assert list(stats["train_sources"]) == ["stdlib", "mine", "pkg-a", "pkg-b"]
    tok = data.Tokenizer.load(out / "tokenizer.json")
    extra = [(site / r).read_text() for r in ("mine/self.py", "a/core.py", "a/dup.py", "b/ok.py")]
    extra = data.tokenize_texts(tok, extra)
    want = np.concatenate([data.tokenize_split(tok, "train", root), extra])
    np.testing.assert_array_equal(np.load(out / "train.npy"), want)


def test_prepare_data_replays_a_manifest_and_refuses_a_changed_file(fake_root, tmp_path_factory, monkeypatch):  # noqa: F811
    """--manifest reads the listed files back (no collection): the same train stream; a file
    edited since, or gone, stops the run naming it."""
    root, texts = fake_root
    site = tmp_path_factory.mktemp("site")
    dists = make_site(site, texts[data.split_files("test", root)[0]])
    monkeypatch.setattr(corpus.importlib.metadata, "distributions", lambda: dists)
    monkeypatch.setattr(data, "humaneval_prompts", lambda: [PROMPT])
    first, again = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("again")
    common = ["--root", str(root), "--vocab-size", "600", "--installed"]
    _prepare_data().main(["--out", str(first), *common])
    with open(first / "manifest.json", "rb") as src, gzip.open(first / "manifest.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    # Collecting would now find nothing: the replay must come from the manifest alone.
    monkeypatch.setattr(corpus.importlib.metadata, "distributions", lambda: [])
    _prepare_data().main(["--out", str(again), *common, "--manifest", str(first / "manifest.json.gz")])
    np.testing.assert_array_equal(np.load(again / "train.npy"), np.load(first / "train.npy"))
    assert (
        json.loads((again / "manifest.json").read_text())["files"]
        == json.loads((first / "manifest.json").read_text())["files"]
    )

    (site / "a" / "core.py").write_text("def core():\n    return 2\n")
    with pytest.raises(SystemExit):
        _prepare_data().main(["--out", str(again), *common, "--manifest", str(first / "manifest.json")])
    with pytest.raises(ValueError, match=r"a/core.py \(pkg-a 1.2\) has changed"):
        corpus.from_manifest(corpus.read_manifest(first / "manifest.json"))
    (site / "a" / "core.py").unlink()
    with pytest.raises(ValueError, match=r"a/core.py \(pkg-a 1.2\) cannot be read"):
        corpus.from_manifest(corpus.read_manifest(first / "manifest.json"))
    with pytest.raises(SystemExit):
        _prepare_data().main(["--out", str(again), "--root", str(root), "--manifest", "x.json"])  # no --installed
    (again / "other.json").write_text('{"files": 3}')
    with pytest.raises(ValueError, match="is not a corpus manifest"):
        corpus.read_manifest(again / "other.json")
    entry = json.loads((first / "manifest.json").read_text())["files"][0]
    for bad in ({k: v for k, v in entry.items() if k != "sha256"}, {**entry, "extra": 1}, ["a", "b"]):
        with pytest.raises(ValueError, match=r"manifest file entry 1 is not an object with exactly the keys"):
            corpus.from_manifest({"files": [entry, bad]})
