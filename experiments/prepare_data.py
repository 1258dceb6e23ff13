"""Builds the real-text data set: a BPE tokenizer and token streams of real Python source.

Sources: the Python stdlib, split by file into train / validation / test, and the source of
the pinned packages in `ddtree_jax.data.TRAIN_PACKAGES` (jax, flax, optax, chex, orbax, numpy),
or with --installed of every installed distribution with a permissive licence
(`ddtree_jax.corpus`), appended to train only. The tokenizer is trained on the stdlib's train
split alone.
Writes into --out:
  tokenizer.json                       the tokenizer (`ddtree_jax.data.Tokenizer.load`)
  train.npy, validation.npy, test.npy  uint16 token streams, each file as [bos] + ids + [eos];
                                       train = stdlib train files, then each package's files
  humaneval_prompts.json               the 164 HumanEval prompt strings, in task-id order
  manifest.json                        with --installed: each package file's distribution,
                                       version, licence, path and SHA-256, and what was dropped
  stats.json                           files, bytes and tokens per split and per train source,
                                       package versions, wall time

    python experiments/prepare_data.py --out data --vocab-size 8192 [--installed]
    python experiments/prepare_data.py --out data2 --installed --manifest data/manifest.json   # the same again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sysconfig
import time

import numpy as np
from tqdm import tqdm

from ddtree_jax import corpus, data


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data", help="output directory (created)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--root", default=None, help="source tree to use instead of the stdlib")
    parser.add_argument(
        "--packages",
        nargs="*",
        default=list(data.TRAIN_PACKAGES),
        choices=list(data.TRAIN_PACKAGES),
        help="installed packages whose source joins the train split (none: stdlib only)",
    )
    parser.add_argument(
        "--installed",
        action="store_true",
        help="instead of --packages: every installed distribution with a permissive licence "
        "(ddtree_jax.corpus: deduplicated, held-out copies and HumanEval prompts removed; manifest.json)",
    )
    parser.add_argument(
        "--manifest",
        default=None,
        help="with --installed: read the files an earlier run's manifest.json(.gz) lists, each checked "
        "against its SHA-256, instead of collecting them (the same data again on the same image)",
    )
    parser.add_argument(
        "--any-versions",
        action="store_true",
        help="accept package versions other than the pins (the data then differs from the shipped models')",
    )
    args = parser.parse_args(argv)

    if args.manifest and not args.installed:
        parser.error("--manifest needs --installed")
    try:  # before the work, not after it
        data.check_tokenizer_settings(args.vocab_size, args.min_frequency)
    except ValueError as e:
        parser.error(str(e))
    if args.root is not None and not os.path.isdir(args.root):
        parser.error(f"--root {args.root!r} is not a directory")
    t0 = time.perf_counter()
    try:
        versions = {} if args.installed else data.check_package_versions(args.packages, strict=not args.any_versions)
    except ValueError as e:
        parser.error(f"{e} (pass --any-versions to use it anyway)")
    os.makedirs(args.out, exist_ok=True)
    texts = {split: data.read_texts(split, args.root, progress=True) for split in data.SPLITS}
    prompts = data.humaneval_prompts()
    if args.installed:
        if args.manifest:
            try:
                manifest = corpus.read_manifest(args.manifest)
                files = corpus.from_manifest(manifest, progress=True)
            except (OSError, ValueError) as e:
                parser.error(f"--manifest {args.manifest}: {e}")
            report = manifest.get("report", {})
        else:
            held_out = texts["validation"] + texts["test"]
            files, report = corpus.collect(prompts, held_out, exclude=("ddtree_jax",), progress=True)
        extra = {}
        for f, text in files:
            extra.setdefault(f.source, []).append(text)
            versions[f.source] = f.version
        _write_manifest(os.path.join(args.out, "manifest.json"), files, report, args.root)
    else:
        extra = {name: data.package_texts(name, progress=True) for name in args.packages}
        stale = os.path.join(args.out, "manifest.json")
        if os.path.exists(stale):  # an earlier --installed run's: it no longer describes train.npy
            os.remove(stale)
            print(f"removed {stale}: this run is not --installed")
    train = tqdm(texts["train"], desc="train tokenizer", unit="file")
    tok = data.train_tokenizer(train, vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    t_tok = time.perf_counter() - t0

    sources = {"stdlib": texts["train"], **extra}
    train_sources = {name: _tokenize(tok, t) for name, t in sources.items()}
    streams = {
        "train": np.concatenate([stream for stream, _ in train_sources.values()]),
        **{split: _tokenize(tok, texts[split])[0] for split in data.SPLITS[1:]},
    }
    all_texts = {"train": [t for ts in sources.values() for t in ts], **{s: texts[s] for s in data.SPLITS[1:]}}
    splits = {}
    for split in data.SPLITS:
        np.save(os.path.join(args.out, f"{split}.npy"), streams[split])
        splits[split] = _stats(all_texts[split], streams[split])

    with open(os.path.join(args.out, "humaneval_prompts.json"), "w") as f:
        json.dump(prompts, f, indent=1)

    stats = {
        "source_root": args.root or sysconfig.get_paths()["stdlib"],
        "python": platform.python_version(),
        "vocab_size": tok.vocab_size,
        "vocab_size_requested": args.vocab_size,
        "min_frequency": args.min_frequency,
        "splits": splits,
        "train_sources": {name: stats for name, (_, stats) in train_sources.items()},
        "package_versions": versions,
        "humaneval_prompts": len(prompts),
        "tokenizer_time_s": round(t_tok, 2),
        "wall_time_s": round(time.perf_counter() - t0, 2),
    }
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)

    print(f"vocab {tok.vocab_size}, {len(prompts)} HumanEval prompts -> {args.out}")
    print(f"{'split':<11}{'files':>7}{'MB':>8}{'tokens':>12}{'bytes/tok':>11}")
    for split, s in splits.items():
        print(f"{split:<11}{s['files']:>7}{s['bytes'] / 1e6:>8.2f}{s['tokens']:>12,}{s['bytes_per_token']:>11.3f}")
    print(f"tokenizer trained in {t_tok:.1f} s, total {stats['wall_time_s']:.1f} s")
    return stats


def _write_manifest(path: str, files, report: dict, root: str | None) -> None:
    """Every training file beyond the stdlib: distribution, version, licence, path, SHA-256, bytes."""
    manifest = {
        "python": platform.python_version(),
        "stdlib_root": root or sysconfig.get_paths()["stdlib"],
        "report": report,
        "files": [dataclasses.asdict(f) for f, _ in files],
    }
    with open(path, "w") as f:
        json.dump(manifest, f, indent=0)


def _tokenize(tok: data.Tokenizer, texts: list[str]) -> tuple[np.ndarray, dict]:
    stream = data.tokenize_texts(tok, texts, progress=True)
    return stream, _stats(texts, stream)


def _stats(texts: list[str], stream: np.ndarray) -> dict:
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    # bos/eos are not text: leave them out of the compression ratio.
    content = len(stream) - 2 * len(texts)
    return {
        "files": len(texts),
        "bytes": nbytes,
        "tokens": len(stream),
        "bytes_per_token": round(nbytes / max(content, 1), 4),
    }


if __name__ == "__main__":
    main()
