"""Command-line checks the experiment scripts share, run right after parse_args: a bad flag is
refused naming its value, not met as a traceback from `generate` after the checkpoints loaded,
or (--out) as an error at the end of the run that loses what it measured."""

from __future__ import annotations

import argparse
import os

from ddtree_jax.checks import check_dtype
from ddtree_jax.generate import METHODS
from ddtree_jax.tree import MAX_BUDGET


def at_least(ap: argparse.ArgumentParser, minimum: int, **flags) -> None:
    """Exits naming the first flag (a number, a list of them, or None: not given) below `minimum`;
    keyword max_new_tokens stands for --max-new-tokens."""
    for name, value in flags.items():
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(v < minimum for v in values):
            ap.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def budgets(ap: argparse.ArgumentParser, values: list[int], flag: str = "--budgets") -> None:
    """Exits naming the tree budgets outside [1, MAX_BUDGET]."""
    bad = [b for b in values if not 1 <= b <= MAX_BUDGET]
    if bad:
        ap.error(f"{flag} must lie in [1, {MAX_BUDGET}], got {bad}")


def methods(ap: argparse.ArgumentParser, values: list[str]) -> None:
    """Exits naming the methods `generate` does not know."""
    # An unknown name used to be skipped: a run of no method wrote an empty table, exit status 0.
    bad = [m for m in values if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; choose from {list(METHODS)}")


def out_file(ap: argparse.ArgumentParser, path: str | None) -> None:
    """Exits unless `path` (None: no --out) can be written as a file once the run is done."""
    if path is not None and (os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path)))):
        ap.error(f"--out {path!r} is not a file path in an existing folder")


def dtype(ap: argparse.ArgumentParser, value: str, flag: str = "--dtype"):
    """The jnp dtype `value` names (`checks.check_dtype`); exits naming an unsupported one."""
    try:
        return check_dtype(value, flag)
    except ValueError as e:
        ap.error(str(e))
