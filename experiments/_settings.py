"""`--set MODULE.NAME=VALUE`: module constants overridden before a run, so that one GPU call can
measure a setting on and off (e.g. `ddtree_jax.generate.SCAN_PREFILL_LAYERS=True`)."""

from __future__ import annotations

import argparse
import ast
import importlib


def add_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="override module constants first, e.g. ddtree_jax.topk.TOP_K_CHUNK=0 (before / after runs)",
    )


def apply(items: list[str]) -> None:
    """Sets each MODULE.NAME to the Python literal VALUE; exits naming a malformed item or an
    unknown constant."""
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or "." not in name:
            raise SystemExit(f"error: --set {item!r}: expected MODULE.NAME=VALUE")
        module, attr = name.rsplit(".", 1)
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise SystemExit(f"error: {module} has no constant {attr}")
        setattr(mod, attr, ast.literal_eval(value))
