"""Target checkpoints: HF safetensors directories in and out, orbax save/restore.

HF layout (torch Linear stores [out, in]) -> ours ([in, out], heads split out):
  q_proj / q_b_proj [N*(D+P), in]  -> [in, N, D+P]   (rope columns de-interleaved)
  kv_a_proj_with_mqa [R+P, H]      -> [H, R+P]       (rope columns de-interleaved)
  kv_b_proj [N*(D+Dv), R]          -> W_UK [N, D, R], W_UV [N, Dv, R]
  o_proj [H, N*Dv]                 -> [N, Dv, H]
  routed experts, per expert (mlp.experts.J.*) or fused (mlp.experts.gate_up_proj
  [E, 2I, H], mlp.experts.down_proj [E, H, I]) -> gate/up [E, H, I], down [E, I, H]
With `rope_interleave`, the rope output columns are permuted (evens, then odds),
which makes HF's interleaved rotation equal to the rotate-half one we compute.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from ddtree_jax.checks import check_dtype, nonfinite_message, stored_dtype
from ddtree_jax.config import TargetConfig
from ddtree_jax.model import AttentionParams, LayerParams, MLPParams, MoEParams, TargetParams
from ddtree_jax.safetensors_io import CheckpointError, SafetensorsFile, save_file

__all__ = ["CheckpointError", "load_target", "restore_checkpoint", "save_checkpoint", "save_hf"]

INDEX_FILE = "model.safetensors.index.json"
IGNORED = re.compile(r"(.*rotary_emb\.inv_freq$)")
PREFIXES = ("language_model.",)


def _rope_perm(p: int, interleave: bool) -> np.ndarray:
    """Index map new[j] = old[perm[j]] taking HF's interleaved rope layout to halves."""
    if not interleave:
        return np.arange(p)
    return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])


# A converter: HF array(s) -> our array, and back. Each entry of the table below is
# (HF name suffix, HF shape, our field path, to_ours, to_hf).
Entry = tuple[str, tuple[int, ...], str, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


def _t(a):
    return np.swapaxes(a, -1, -2)


def _layer_entries(cfg: TargetConfig, moe: bool) -> list[Entry]:
    h, n, r, p = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    perm = _rope_perm(p, cfg.rope_interleave)
    q_cols = np.concatenate([np.arange(d), d + perm])
    q_inv = np.argsort(q_cols)
    kv_cols = np.concatenate([np.arange(r), r + perm])
    kv_inv = np.argsort(kv_cols)

    def q_in(fan_in):
        return (
            lambda a: np.transpose(a.reshape(n, d + p, fan_in)[:, q_cols, :], (2, 0, 1)),
            lambda a: np.transpose(a, (1, 2, 0))[:, q_inv, :].reshape(n * (d + p), fan_in),
        )

    e: list[Entry] = [
        ("input_layernorm.weight", (h,), "attn_norm", lambda a: a, lambda a: a),
        ("post_attention_layernorm.weight", (h,), "mlp_norm", lambda a: a, lambda a: a),
        (
            "self_attn.kv_a_proj_with_mqa.weight",
            (r + p, h),
            "attn.kv_a",
            lambda a: _t(a[kv_cols]),
            lambda a: _t(a)[kv_inv],
        ),
        ("self_attn.kv_a_layernorm.weight", (r,), "attn.kv_a_norm", lambda a: a, lambda a: a),
        (
            "self_attn.kv_b_proj.weight",
            (n * (d + dv), r),
            "attn.w_uk",
            lambda a: a.reshape(n, d + dv, r)[:, :d],
            None,  # written together with w_uv below
        ),
        (
            "self_attn.o_proj.weight",
            (h, n * dv),
            "attn.o",
            lambda a: _t(a).reshape(n, dv, h),
            lambda a: _t(a.reshape(n * dv, h)),
        ),
    ]
    if cfg.q_lora_rank is None:
        e.append(("self_attn.q_proj.weight", (n * (d + p), h), "attn.q", *q_in(h)))
    else:
        q = cfg.q_lora_rank
        e += [
            ("self_attn.q_a_proj.weight", (q, h), "attn.q_a", _t, _t),
            ("self_attn.q_a_layernorm.weight", (q,), "attn.q_a_norm", lambda a: a, lambda a: a),
            ("self_attn.q_b_proj.weight", (n * (d + p), q), "attn.q_b", *q_in(q)),
        ]
    if not moe:
        i = cfg.intermediate_size
        e += [
            ("mlp.gate_proj.weight", (i, h), "mlp.gate", _t, _t),
            ("mlp.up_proj.weight", (i, h), "mlp.up", _t, _t),
            ("mlp.down_proj.weight", (h, i), "mlp.down", _t, _t),
        ]
        return e
    ne, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    e += [
        ("mlp.gate.weight", (ne, h), "mlp.router", lambda a: _t(a).astype(np.float32), _t),
        ("mlp.gate.e_score_correction_bias", (ne,), "mlp.router_bias", lambda a: a.astype(np.float32), lambda a: a),
    ]
    if cfg.n_shared_experts:
        si = i * cfg.n_shared_experts
        e += [
            ("mlp.shared_experts.gate_proj.weight", (si, h), "mlp.shared.gate", _t, _t),
            ("mlp.shared_experts.up_proj.weight", (si, h), "mlp.shared.up", _t, _t),
            ("mlp.shared_experts.down_proj.weight", (h, si), "mlp.shared.down", _t, _t),
        ]
    return e


class _Reader:
    """All tensors of an HF checkpoint directory, by name (prefixes stripped).

    `get` converts to `dtype` (when given) and, with `check_finite`, refuses a tensor
    holding NaN or Inf, before or after the conversion, naming it.
    """

    def __init__(self, path: str, *, dtype=None, check_finite: bool = True):
        self.dtype = dtype
        self.check_finite = check_finite
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index file ({e!r})") from None
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not os.path.exists(os.path.join(path, fname)):
                    raise CheckpointError(f"{index} lists {fname!r}, which is missing from {path}")
        else:
            files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files (and no {INDEX_FILE}) in {path}")
        self.where: dict[str, tuple[SafetensorsFile, str]] = {}
        for fname in files:
            st = SafetensorsFile(os.path.join(path, fname))
            for raw in st.table:
                key = raw
                for prefix in PREFIXES:
                    key = key.removeprefix(prefix)
                self.where[key] = (st, raw)
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
        """The tensor `name`, checked against `shape`, in `dtype` (default: the reader's, else as stored)."""
        if name not in self.where:
            raise CheckpointError(f"missing weight {name!r} (expected shape {shape})")
        st, raw = self.where[name]
        if st.shape(raw) != tuple(shape):
            raise CheckpointError(f"weight {name!r} in {st.path} has shape {st.shape(raw)}, expected {tuple(shape)}")
        self.used.add(name)
        a = st.get(raw)
        if self.check_finite and (bad := nonfinite_message(a, f"weight {name!r} in {st.path}")):
            raise CheckpointError(f"{bad}; pass check_finite=False to load it anyway")
        dtype = dtype or self.dtype
        if dtype is None or a.dtype == dtype:
            return a
        with np.errstate(over="ignore"):
            cast = np.asarray(a, dtype)
        if self.check_finite and (bad := nonfinite_message(cast, f"weight {name!r} in {st.path} cast to {dtype}")):
            raise CheckpointError(f"{bad} (the stored values overflow it); pass check_finite=False to load it anyway")
        return cast


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _build_layers(cfg: TargetConfig, fields: dict, moe: bool) -> LayerParams:
    attn = AttentionParams(**fields["attn"])
    if moe:
        shared = MLPParams(**fields["mlp"].pop("shared")) if "shared" in fields["mlp"] else None
        mlp = MoEParams(shared=shared, **fields["mlp"])
    else:
        mlp = MLPParams(**fields["mlp"])
    return LayerParams(attn_norm=fields["attn_norm"], attn=attn, mlp_norm=fields["mlp_norm"], mlp=mlp)


def _load_experts(reader: _Reader, cfg: TargetConfig, prefix: str) -> dict[str, np.ndarray]:
    h, ne, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    fused = f"{prefix}mlp.experts.gate_up_proj"
    if reader.has(fused):
        gu = reader.get(fused, (ne, 2 * i, h))
        down = reader.get(f"{prefix}mlp.experts.down_proj", (ne, h, i))
        return {"gate": _t(gu[:, :i]), "up": _t(gu[:, i:]), "down": _t(down)}
    if reader.has(f"{prefix}mlp.experts.0.weight_packed") or reader.has(
        f"{prefix}mlp.experts.0.gate_proj.weight_packed"
    ):
        raise CheckpointError(f"{prefix}mlp.experts: INT4 pack-quantized experts are not supported yet")
    out = {}
    for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        out[name] = np.stack([_t(reader.get(f"{prefix}mlp.experts.{j}.{name}_proj.weight", shape)) for j in range(ne)])
    return out


def load_target(path: str | os.PathLike, *, dtype=None, check_finite: bool = True) -> TargetParams:
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

    Raises:
      FileNotFoundError: no directory, config.json or weight files.
      CheckpointError: a missing, extra, mis-shaped or non-finite weight, or a corrupt file.
      ConfigError: a config the engine does not support.
      ValueError: an unsupported dtype.
    """
    path = os.fspath(path)
    if dtype is not None:
        dtype = check_dtype(dtype)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    cfg = TargetConfig.from_json_file(os.path.join(path, "config.json"))
    reader = _Reader(path, dtype=dtype, check_finite=check_finite)
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = reader.get("model.embed_tokens.weight", (v, h))
    if dtype is None:
        dtype = stored_dtype(embed.dtype, f"the stored dtype of model.embed_tokens.weight in {path}")
        reader.dtype = dtype
        embed = reader.get("model.embed_tokens.weight", (v, h))
    f32 = np.dtype(np.float32)

    def cast(a: np.ndarray, field: str) -> jax.Array:
        keep32 = field.endswith(("router", "router_bias"))
        return jnp.asarray(np.asarray(a, f32 if keep32 else dtype))

    stacks: dict[bool, dict] = {}
    for moe, layers in (
        (False, range(cfg.num_dense_layers)),
        (True, range(cfg.num_dense_layers, cfg.num_hidden_layers)),
    ):
        if not layers:
            continue
        entries = _layer_entries(cfg, moe)
        per_field: dict[str, list[np.ndarray]] = {}
        for li in layers:
            prefix = f"model.layers.{li}."
            for suffix, shape, field, to_ours, _ in entries:
                keep32 = field.endswith(("router", "router_bias"))
                a = to_ours(reader.get(prefix + suffix, shape, f32 if keep32 else None))
                per_field.setdefault(field, []).append(a)
            kvb = reader.get(prefix + "self_attn.kv_b_proj.weight", entries[4][1])
            per_field.setdefault("attn.w_uv", []).append(
                kvb.reshape(cfg.num_attention_heads, -1, cfg.kv_lora_rank)[:, cfg.qk_nope_head_dim :]
            )
            if moe:
                for name, a in _load_experts(reader, cfg, prefix).items():
                    per_field.setdefault(f"mlp.{name}", []).append(a)
        fields: dict = {}
        for field, arrays in per_field.items():
            _set(fields, field, cast(np.stack(arrays), field))
        stacks[moe] = _build_layers(cfg, fields, moe)

    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = cast(_t(reader.get("lm_head.weight", (v, h))), "lm_head")
    elif reader.has("lm_head.weight"):
        reader.used.add("lm_head.weight")
    final_norm = cast(reader.get("model.norm.weight", (h,)), "final_norm")

    mtp = re.compile(rf"^model\.layers\.{cfg.num_hidden_layers}\.")
    extra = sorted(k for k in reader.where if k not in reader.used and not mtp.match(k) and not IGNORED.match(k))
    if extra:
        shown = ", ".join(repr(k) for k in extra[:5])
        raise CheckpointError(f"{len(extra)} unexpected weight(s) in {path}: {shown}{' ...' if len(extra) > 5 else ''}")
    return TargetParams(
        config=cfg,
        embed=cast(embed, "embed"),
        dense_layers=stacks.get(False),
        moe_layers=stacks.get(True),
        final_norm=final_norm,
        lm_head=lm_head,
    )


def _hf_tensors(params: TargetParams, fused_experts: bool) -> Iterator[tuple[str, np.ndarray]]:
    cfg = params.config

    def get(tree, field):
        for part in field.split("."):
            tree = getattr(tree, part)
        return np.asarray(tree)

    yield "model.embed_tokens.weight", np.asarray(params.embed)
    for moe, stack, first in ((False, params.dense_layers, 0), (True, params.moe_layers, cfg.num_dense_layers)):
        if stack is None:
            continue
        entries = _layer_entries(cfg, moe)
        for k in range(jax.tree.leaves(stack)[0].shape[0]):
            prefix = f"model.layers.{first + k}."
            layer = jax.tree.map(lambda a, k=k: a[k], stack)
            for suffix, _, field, _, to_hf in entries:
                if to_hf is not None:
                    yield prefix + suffix, to_hf(get(layer, field))
            kvb = np.concatenate([get(layer, "attn.w_uk"), get(layer, "attn.w_uv")], axis=1)
            yield prefix + "self_attn.kv_b_proj.weight", kvb.reshape(-1, cfg.kv_lora_rank)
            if moe:
                gate, up, down = (get(layer, f"mlp.{n}") for n in ("gate", "up", "down"))
                if fused_experts:
                    yield prefix + "mlp.experts.gate_up_proj", np.concatenate([_t(gate), _t(up)], axis=1)
                    yield prefix + "mlp.experts.down_proj", _t(down)
                else:
                    for j in range(cfg.n_routed_experts):
                        yield prefix + f"mlp.experts.{j}.gate_proj.weight", _t(gate[j])
                        yield prefix + f"mlp.experts.{j}.up_proj.weight", _t(up[j])
                        yield prefix + f"mlp.experts.{j}.down_proj.weight", _t(down[j])
    yield "model.norm.weight", np.asarray(params.final_norm)
    if params.lm_head is not None:
        yield "lm_head.weight", _t(np.asarray(params.lm_head))


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
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(params.config.to_hf_config(), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in _hf_tensors(params, fused_experts):
        if max_shard_bytes is not None and size + a.nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(a)
        size += a.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname))
        weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


# ----------------------------------------------------------------------------------
# The project's own format: orbax for the arrays, config.json beside them.


def save_checkpoint(params: TargetParams, path: str | os.PathLike) -> None:
    """Saves params with orbax under `path/params` and the config as `path/config.json`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(params.config.to_hf_config(), f, indent=2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), serialization.to_state_dict(params), force=True)


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

    from ddtree_jax.model import init_params

    dtype = check_dtype(dtype)
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.join(path, "params")):
        raise FileNotFoundError(f"no orbax checkpoint at {path!r} (expected {path}/params and {path}/config.json)")
    cfg = TargetConfig.from_json_file(os.path.join(path, "config.json"))
    template = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype))
    target = serialization.to_state_dict(template)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(os.path.join(path, "params"), target)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: stored params do not match its config.json ({e})") from None
    params = serialization.from_state_dict(template, restored)
    if check_finite:
        for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if bad := nonfinite_message(leaf, f"array {jax.tree_util.keystr(key_path)} in {path}"):
                raise CheckpointError(f"{bad}; pass check_finite=False to load it anyway")
    return params
