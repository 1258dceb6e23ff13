"""Target checkpoints: HF safetensors directories in and out, orbax save/restore.

The HF names and layout of every weight are declared once in `model.declare`;
`hf.py` reads and writes them.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import serialization

from ddtree_jax import hf
from ddtree_jax.checks import check_dtype, nonfinite_message
from ddtree_jax.config import TargetConfig
from ddtree_jax.hf import INDEX_FILE, CheckpointError
from ddtree_jax.model import TargetParams, abstract_params, declare

__all__ = ["INDEX_FILE", "CheckpointError", "load_target", "restore_checkpoint", "save_checkpoint", "save_hf"]

# Text weights of multimodal wrappers (Kimi-K2.5) live under this prefix.
PREFIXES = ("language_model.",)
# transformers saves a Kimi_K25ForConditionalGeneration with its load-time renames reversed,
# `blocks -> layers` among them, so its decoder layers are stored as `language_model.model.blocks.N`
# (Moonshot's own files say `layers`); both read the same model.
RENAMES = ((r"^language_model\.model\.blocks\.(\d+)\.", r"language_model.model.layers.\1."),)


def load_target(
    path: str | os.PathLike, *, dtype=None, check_finite: bool = True, mesh=None, rules=None
) -> TargetParams:
    """Loads an HF-format DeepSeek-V3 / Kimi-K2 checkpoint directory.

    Reads `config.json` and one or many `*.safetensors` files (with
    `model.safetensors.index.json` when present). Routed experts may be stored
    per expert (`mlp.experts.J.*_proj.weight`) or fused (transformers 5's
    `mlp.experts.gate_up_proj` / `down_proj`). The MTP layer (index
    num_hidden_layers) is ignored.

    Args:
      path: the checkpoint directory.
      dtype: parameter dtype (bfloat16, float16 or float32); None keeps the
        embedding's stored dtype. The router stays float32.
      check_finite: refuse a tensor holding NaN or Inf, as stored or once cast to
        `dtype` (one pass over the weights; False skips it).
      mesh: place each tensor straight onto its shards of this mesh (`sharding.make_mesh`):
        every device reads only the layers / experts it owns, one HF tensor at a time, and
        host memory never holds the whole model. None loads onto the default device.
      rules: logical -> mesh axis rules (default `sharding.RULES`).

    Raises:
      FileNotFoundError: no directory, config.json or weight files.
      CheckpointError: a missing, extra, mis-shaped or non-finite weight, or a corrupt file.
      ConfigError: a config the engine does not support.
      ValueError: an unsupported dtype.
    """
    params, reader = hf.load_declared(
        path,
        what="checkpoint",
        read_config=TargetConfig.from_json_file,
        declare=declare,
        dtype_from=lambda decl: decl.embed,
        dtype=dtype,
        check_finite=check_finite,
        mesh=mesh,
        rules=rules,
        prefixes=PREFIXES,
        renames=RENAMES,
        skip=_not_read,
        return_reader=True,
    )
    if params.config.tie_word_embeddings and reader.has("lm_head.weight"):
        warnings.warn(
            f"{path}: config.json ties the output head to the embedding (tie_word_embeddings), so the stored "
            "lm_head.weight is not read",
            stacklevel=2,
        )
    vision = [k for k in reader.where if re.match(VISION, k)]
    if vision:
        warnings.warn(
            f"{path}: skipped {len(vision)} vision tensors ({vision[0]!r}, ...): the engine runs text only",
            stacklevel=2,
        )
    return params


# A multimodal wrapper's (Kimi-K2.5's) vision tower and projector: a text engine skips them.
# transformers' K2.5 saves one projector norm under `model.` (it has no rename for it).
VISION = r"^(model\.)?(vision_tower|vision_model|mm_projector|multi_modal_projector)\."


def _not_read(cfg: TargetConfig) -> str:
    """The MTP layer (index num_hidden_layers), a tied model's stored lm_head, vision weights."""
    mtp = rf"^model\.layers\.{cfg.num_hidden_layers}\."
    return mtp + (r"|^lm_head\.weight$" if cfg.tie_word_embeddings else "") + "|" + VISION


def save_hf(
    params: TargetParams,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
    fused_experts: bool = False,
) -> None:
    """Writes an HF-format directory (config.json + safetensors) that HF and `load_target` read.

    Args:
      params: the weights.
      path: output directory (created).
      max_shard_bytes: split into several files plus an index above this size.
      fused_experts: write transformers-5 fused expert tensors instead of per-expert ones.
    """
    tensors = hf.hf_tensors(declare(params.config), params, "fused" if fused_experts else "default")
    hf.write(os.fspath(path), params.config.to_hf_config(), tensors, max_shard_bytes)


# ----------------------------------------------------------------------------------
# The project's own format: orbax for the arrays, config.json beside them.


def save_checkpoint(params: TargetParams, path: str | os.PathLike) -> None:
    """Saves params with orbax under `path/params` and the config as `path/config.json`.

    Over an earlier checkpoint, its config.json is removed first and the new one written last
    (through a temporary file): a save cut short leaves no config (restore says so), never one
    checkpoint's config beside another's params, which restore would take when the shapes agree.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    config = os.path.join(path, "config.json")
    if os.path.exists(config):
        os.remove(config)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), serialization.to_state_dict(params), force=True)
    hf.write_json(config, params.config.to_hf_config())


def _stored_dtypes(metadata) -> dict[str, Any]:
    """Each array an orbax checkpoint's `metadata` lists, by key path, with its stored dtype."""
    tree = getattr(metadata, "item_metadata", metadata)
    return {
        jax.tree_util.keystr(p): getattr(leaf, "dtype", None) for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def _check_nothing_extra(target, stored: dict[str, Any], path) -> None:
    """CheckpointError naming stored arrays (`_stored_dtypes`) the config's params have no place
    for (restoring into the template would drop them: an lm_head under a config.json changed to
    tie it)."""
    wanted = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    extra = [k for k in stored if k not in wanted]
    if extra:
        raise CheckpointError(
            f"{path}: stored arrays {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''} have no place in the "
            "params its config.json describes (was config.json changed after saving, e.g. tie_word_embeddings?)"
        )


def _wide_scales_as_stored(target, stored: dict[str, Any]):
    """The state dict of abstract arrays `target` with every bf16 INT4 `scale` that the orbax
    checkpoint holds (`_stored_dtypes`) in f16 / f32 / f64 made float32."""

    def widen(p, leaf):
        key = jax.tree_util.keystr(p)
        wide = stored.get(key) in (jnp.float16, jnp.float32, jnp.float64)
        if key.endswith("['scale']") and leaf.dtype == jnp.bfloat16 and wide:
            return jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
        return leaf

    return jax.tree_util.tree_map_with_path(widen, target)


def restore_checkpoint(path: str | os.PathLike, *, dtype=jnp.float32, check_finite: bool = True) -> TargetParams:
    """Restores what `save_checkpoint` wrote.

    Args:
      path: the checkpoint directory.
      dtype: parameter dtype (bfloat16, float16 or float32); the router stays float32.
      check_finite: refuse an array holding NaN or Inf (False skips the pass).

    Raises:
      FileNotFoundError: `path` or its parts are missing.
      CheckpointError: the stored arrays do not match the config, or hold NaN / Inf.
      ValueError: an unsupported dtype.
    """
    import orbax.checkpoint as ocp

    dtype = check_dtype(dtype)
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.join(path, "params")):
        raise FileNotFoundError(f"no orbax checkpoint at {path!r} (expected {path}/params and {path}/config.json)")
    cfg = TargetConfig.from_json_file(os.path.join(path, "config.json"))
    template = abstract_params(cfg, dtype)
    target = serialization.to_state_dict(template)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            stored = _stored_dtypes(ckptr.metadata(os.path.join(path, "params")))
            _check_nothing_extra(target, stored, path)
            if jnp.dtype(dtype) == jnp.float32:  # as load_target: INT4 scales stored wider stay f32
                target = _wide_scales_as_stored(target, stored)
            restored = ckptr.restore(os.path.join(path, "params"), target)
    except CheckpointError:
        raise
    except (ValueError, KeyError) as e:
        if "NOT_FOUND" in str(e):  # a file of the array store is gone: not a config mismatch
            raise CheckpointError(
                f"{path}: its stored arrays cannot be read (a file is missing: incomplete or corrupt? "
                f"{hf.orbax_error(e)})"
            ) from None
        raise CheckpointError(f"{path}: stored params do not match its config.json ({hf.orbax_error(e)})") from None
    except Exception as e:  # orbax / TensorStore raise bare Exceptions for unreadable array files
        raise CheckpointError(
            f"{path}: its stored arrays cannot be read (truncated or corrupt? {hf.orbax_error(e)})"
        ) from None
    params = serialization.from_state_dict(template, restored)
    if check_finite:
        for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if bad := nonfinite_message(leaf, f"array {jax.tree_util.keystr(key_path)} in {path}"):
                raise CheckpointError(f"{bad}; pass check_finite=False to load it anyway")
    return params
