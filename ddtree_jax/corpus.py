"""A training corpus of real Python source from the machine's own installed distributions.

Every installed distribution (`importlib.metadata`) whose licence is permissive
contributes its .py files (the `data.stdlib_files` size rule), and the manifest records
each file's distribution, version, licence, path and SHA-256 of its bytes, so that a
run on the same image can be reproduced and checked file by file. Files are
deduplicated by content hash (line endings aside) across all sources (vendored copies
are common), and a
file is kept out when its content also appears in the stdlib's validation or test split
or when it contains a HumanEval prompt (its signature and docstring, whitespace
normalized), so neither held-out set leaks into training.

Licences are read from the `License-Expression` field, the `License` field and the
`License :: ...` trove classifiers; a distribution whose licences name a copyleft or
unknown licence, or none at all, is left out and listed in the manifest's `skipped`.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
from collections.abc import Iterable, Sequence

from tqdm import tqdm

from ddtree_jax import data

PERMISSIVE = re.compile(
    r"\b(MIT|BSD|Apache|PSF|Python Software Foundation|Python-2\.0|ISC|Unlicense|Zlib|CC0|HPND|"
    r"MPL|Mozilla Public License|Historical Permission|Public Domain|0BSD|BSL-1\.0|Boost)\b",
    re.IGNORECASE,
)
COPYLEFT = re.compile(r"\b(GPL|LGPL|AGPL|GNU|EUPL|CDDL|SSPL|Commons Clause|proprietary)\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One .py file of the corpus."""

    source: str  # distribution name, or "stdlib"
    version: str
    license: str
    path: str  # absolute
    sha256: str
    nbytes: int


def license_of(meta) -> str:
    """A distribution's licences as one string: License-Expression, License (first line), classifiers."""
    parts = [meta.get("License-Expression") or "", (meta.get("License") or "").strip().split("\n")[0][:200]]
    parts += [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or () if c.startswith("License ::")]
    return "; ".join(p for p in parts if p and p.upper() not in ("UNKNOWN", "OSI APPROVED"))


def is_permissive(license: str) -> bool:
    """True when the licence string names a permissive licence and no copyleft one."""
    return bool(PERMISSIVE.search(license)) and not COPYLEFT.search(license)


def distribution_files(dist) -> list[str]:
    """Absolute paths of a distribution's .py files at most `data.MAX_FILE_BYTES` (sorted)."""
    out = []
    for f in dist.files or ():
        if f.suffix != ".py" or "__pycache__" in f.parts:
            continue
        path = os.path.abspath(str(dist.locate_file(f)))
        if os.path.isfile(path) and os.path.getsize(path) <= data.MAX_FILE_BYTES:
            out.append(path)
    return sorted(set(out))


def normalize(text: str) -> str:
    """Whitespace collapsed: how prompts are matched inside files."""
    return " ".join(text.split())


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _content_key(text: str) -> str:
    """The digest of `text` with universal newlines, as text-mode reads give it: the held-out
    splits are read that way, so a CRLF copy of one is the same content (and a CRLF copy of
    a kept file a duplicate)."""
    return _digest(text.replace("\r\n", "\n").replace("\r", "\n").encode("utf-8"))


def _needles(prompts: Sequence[str]) -> list[tuple[str, str]]:
    """(marker, normalized prompt): a cheap "def name(" test (the prompt's last def) before the full match."""
    out = []
    for p in prompts:
        names = re.findall(r"def\s+(\w+)\s*\(", p)
        if p.strip():
            out.append((f"{names[-1]}(" if names else p.strip()[:40], normalize(p)))
    return out


def collect(
    prompts: Sequence[str] = (),
    held_out_texts: Iterable[str] = (),
    distributions: Iterable | None = None,
    exclude: Sequence[str] = (),
    progress: bool = False,
) -> tuple[list[tuple[SourceFile, str]], dict]:
    """Reads the permissive distributions' .py files, deduplicated and decontaminated.

    Args:
      prompts: texts that must not appear in a kept file (HumanEval prompts), matched
        whitespace-normalized.
      held_out_texts: file contents of held-out splits; a file with the same content is dropped.
      distributions: `importlib.metadata.Distribution`s to read (default: all installed).
      exclude: distribution names to leave out (e.g. this project itself).
      progress: tqdm bars.

    Returns:
      ([(SourceFile, text)] in distribution-name then path order, report): the report
      counts the files dropped for each reason and lists the distributions skipped for
      their licence, with the licence read.
    """
    dists = list(importlib.metadata.distributions() if distributions is None else distributions)
    dists.sort(key=lambda d: (d.metadata["Name"] or "").lower())
    held = {_content_key(t) for t in held_out_texts}
    needles = _needles(prompts)
    excluded = {e.lower() for e in exclude}
    report = {"skipped_licence": {}, "excluded": [], "duplicate": 0, "held_out_copy": 0, "contains_prompt": 0}
    kept: list[tuple[SourceFile, str]] = []
    seen, names = set(), set()
    for dist in tqdm(dists, desc="distributions", unit="dist", disable=not progress):
        name = dist.metadata["Name"] or "?"
        if name.lower() in names:  # two installs of one name: the first on the path wins
            continue
        names.add(name.lower())
        if name.lower() in excluded:
            report["excluded"].append(name)
            continue
        lic = license_of(dist.metadata)
        if not is_permissive(lic):
            report["skipped_licence"][name] = lic or "(none given)"
            continue
        for path in distribution_files(dist):
            with open(path, "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8", errors="replace")
            key = _content_key(text)
            if key in held:
                report["held_out_copy"] += 1
                continue
            if key in seen:
                report["duplicate"] += 1
                continue
            seen.add(key)
            if any(marker in text and full in normalize(text) for marker, full in needles):
                report["contains_prompt"] += 1
                continue
            kept.append((SourceFile(name, dist.version, lic, path, _digest(raw), len(raw)), text))
    return kept, report


def read_manifest(path: str | os.PathLike) -> dict:
    """A manifest written by `experiments/prepare_data.py --installed` (.json, or .json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise ValueError(f"{path} is not a corpus manifest: no 'files' list")
    return manifest


def from_manifest(manifest: dict, progress: bool = False) -> list[tuple[SourceFile, str]]:
    """The files a manifest lists, read back in its order and checked against their SHA-256:
    the same corpus on the same image, without collecting it afresh.

    Raises:
      ValueError: a malformed entry, or a listed file missing or changed (the first such is named).
    """
    out = []
    fields = [field.name for field in dataclasses.fields(SourceFile)]
    for i, entry in enumerate(tqdm(manifest["files"], desc="manifest", unit="file", disable=not progress)):
        if not isinstance(entry, dict) or sorted(entry) != sorted(fields):
            raise ValueError(f"manifest file entry {i} is not an object with exactly the keys {fields}: {entry!r}")
        f = SourceFile(**entry)
        try:
            with open(f.path, "rb") as fh:
                raw = fh.read()
        except OSError as err:
            raise ValueError(f"manifest file {f.path} ({f.source} {f.version}) cannot be read: {err}") from None
        digest = _digest(raw)
        if digest != f.sha256:
            raise ValueError(
                f"manifest file {f.path} ({f.source} {f.version}) has changed: SHA-256 {digest}, "
                f"the manifest says {f.sha256}"
            )
        out.append((f, raw.decode("utf-8", errors="replace")))
    return out
