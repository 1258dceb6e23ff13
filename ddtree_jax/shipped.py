"""The shipped models: target + DFlash drafter + tokenizer under `checkpoints/`.

Layout: `checkpoints/target/` (HF format), `checkpoints/drafter/` (HF DFlash
format), `checkpoints/tokenizer.json`. `DDTREE_CHECKPOINTS` overrides the folder.
"""

from __future__ import annotations

import dataclasses
import os

from ddtree_jax import checkpoint
from ddtree_jax.data import Tokenizer
from ddtree_jax.drafters import dflash
from ddtree_jax.model import TargetParams

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


@dataclasses.dataclass
class Shipped:
    target: TargetParams
    drafter: dflash.DrafterParams | None
    tokenizer: Tokenizer


def checkpoints_dir(path: str | None = None) -> str:
    return path or os.environ.get("DDTREE_CHECKPOINTS") or DEFAULT_DIR


def load_shipped(
    path: str | None = None, *, dtype=None, need_drafter: bool = True, check_finite: bool = True
) -> Shipped:
    """Loads target, drafter and tokenizer from a checkpoints folder.

    Raises:
      FileNotFoundError: the folder or one of its parts is missing (named).
      CheckpointError: a weight is missing, mis-shaped or (with check_finite) NaN / Inf.
      ConfigError: a config the engine does not support, or a drafter made for another target.
      ValueError: a tokenizer whose vocabulary is not the target's.
    """
    root = checkpoints_dir(path)
    if not os.path.isdir(root):
        what = "is a file, not a folder" if os.path.exists(root) else "does not exist"
        raise FileNotFoundError(f"checkpoints folder {root!r} {what}")
    parts = {"target": os.path.join(root, "target"), "tokenizer": os.path.join(root, "tokenizer.json")}
    if need_drafter:
        parts["drafter"] = os.path.join(root, "drafter")
    for name, p in parts.items():
        if not os.path.exists(p):
            raise FileNotFoundError(f"{name} missing: expected {p!r}")
    tok = Tokenizer.load(parts["tokenizer"])
    target = checkpoint.load_target(parts["target"], dtype=dtype, check_finite=check_finite)
    draft = dflash.load_drafter(parts["drafter"], dtype=dtype, check_finite=check_finite) if need_drafter else None
    if target.config.vocab_size != tok.vocab_size:
        raise ValueError(f"tokenizer vocab {tok.vocab_size} != target vocab {target.config.vocab_size}")
    if draft is not None:  # at load, not at the first drafted generate call
        draft.config.check_compatible(target.config)
    return Shipped(target=target, drafter=draft, tokenizer=tok)
