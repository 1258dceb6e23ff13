"""HF checkpoint directories (config.json + safetensors), for the target and the drafter.

`Reader` opens a directory (one file, or many with `model.safetensors.index.json`)
through the `safetensors` package, memory-mapped. `load_weights` fills a declaration
tree (`weights.py`) from it, `hf_tensors` / `write` go the other way. Every error
names the file and the tensor.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ddtree_jax.checks import check_dtype, nonfinite_message, stored_dtype
from ddtree_jax.quant import PACK, QuantizedArray
from ddtree_jax.weights import HFTensor, Weight, is_weight, transpose

__all__ = ["INDEX_FILE", "CheckpointError", "Reader", "hf_tensors", "load_declared", "load_weights", "write"]

INDEX_FILE = "model.safetensors.index.json"
# Tensors no engine computes from: RoPE buffers some exporters save.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A missing, extra, mis-shaped, non-finite or corrupt weight, with file and tensor named."""


class Reader:
    """All tensors of an HF checkpoint directory, by name, with `prefixes` stripped.

    `get` checks the shape, converts to `dtype` (when given) and, with `check_finite`,
    refuses a tensor holding NaN or Inf, before or after the conversion, naming it.
    `unused()` lists what no `get` asked for.
    """

    def __init__(self, path: str, *, dtype=None, check_finite: bool = True, prefixes: tuple[str, ...] = ()):
        self.path = path
        self.dtype = dtype
        self.check_finite = check_finite
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: corrupt index file ({e!r})") from None
            for fname in files:
                if not os.path.exists(os.path.join(path, fname)):
                    raise CheckpointError(f"{index} lists {fname!r}, which is missing from {path}")
        else:
            files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files (and no {INDEX_FILE}) in {path}")
        self.where: dict[str, tuple[str, str]] = {}  # name -> (file, stored name)
        self._files = {}
        for fname in files:
            file = os.path.join(path, fname)
            if os.path.getsize(file) < 8:
                raise CheckpointError(f"{file}: not a safetensors file ({os.path.getsize(file)} bytes, no header)")
            try:
                handle = safe_open(file, framework="numpy")
                names = list(handle.keys())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: corrupt safetensors file ({e})") from None
            self._files[file] = handle
            for raw in names:
                key = raw
                for prefix in prefixes:
                    key = key.removeprefix(prefix)
                self.where[key] = (file, raw)
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        file, raw = self.where[name]
        return tuple(self._files[file].get_slice(raw).get_shape())

    def get(self, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
        """The tensor `name`, checked against `shape`, in `dtype` (default: the reader's, else as stored)."""
        if name not in self.where:
            raise CheckpointError(f"missing weight {name!r} (expected shape {tuple(shape)}) in {self.path}")
        file, raw = self.where[name]
        if self.shape(name) != tuple(shape):
            raise CheckpointError(f"weight {name!r} in {file} has shape {self.shape(name)}, expected {tuple(shape)}")
        self.used.add(name)
        try:
            a = self._files[file].get_tensor(raw)
        except (SafetensorError, OSError, TypeError, ValueError) as e:
            raise CheckpointError(f"weight {name!r} in {file} cannot be read ({e})") from None
        if self.check_finite and (bad := nonfinite_message(a, f"weight {name!r} in {file}")):
            raise CheckpointError(f"{bad}; pass check_finite=False to load it anyway")
        dtype = dtype or self.dtype
        if dtype is None or a.dtype == dtype:
            return a
        with np.errstate(over="ignore"):
            cast = np.asarray(a, dtype)
        if self.check_finite and (bad := nonfinite_message(cast, f"weight {name!r} in {file} cast to {dtype}")):
            raise CheckpointError(f"{bad} (the stored values overflow it); pass check_finite=False to load it anyway")
        return cast

    def unused(self, ignore: re.Pattern | None = None) -> list[str]:
        """Names no `get` asked for, except those matching IGNORED or `ignore`."""
        return sorted(
            k
            for k in self.where
            if k not in self.used and not IGNORED.match(k) and not (ignore is not None and ignore.match(k))
        )

    def check_all_used(self, ignore: re.Pattern | None = None) -> None:
        """Raises CheckpointError naming up to five tensors nothing read."""
        extra = self.unused(ignore)
        if extra:
            shown = ", ".join(repr(k) for k in extra[:5])
            more = " ..." if len(extra) > 5 else ""
            raise CheckpointError(f"{len(extra)} unexpected weight(s) in {self.path}: {shown}{more}")


def _names(h: HFTensor, layer: int | None, experts: int) -> list[str]:
    if "{expert}" in h.name:
        return [h.name.format(layer=layer, expert=j) for j in range(experts)]
    return [h.name.format(layer=layer)]


def _all_names(w: Weight) -> list[str]:
    h = w.hf[0]
    return [n for layer in (w.layers if w.layers is not None else (None,)) for n in _names(h, layer, _experts(w))]


def _experts(w: Weight) -> int:
    return w.shape[1 if w.layers is not None else 0]


def _quantized_names(name: str) -> tuple[str, str, str]:
    """weight_packed, weight_scale and weight_shape beside a quantized Linear's `.weight`."""
    base = name.removesuffix(".weight")
    return f"{base}.weight_packed", f"{base}.weight_scale", f"{base}.weight_shape"


def _read_int4(reader: Reader, w: Weight) -> QuantizedArray:
    """A compressed-tensors pack-quantized weight: HF [out, in / 8] / [out, in / G] -> ours transposed."""
    h = w.hf[0]
    per_layer = []
    for layer in w.layers if w.layers is not None else (None,):
        entries = [_int4_entry(reader, w, name) for name in _names(h, layer, _experts(w))]
        expert = "{expert}" in h.name
        per_layer.append(tuple(np.stack([e[i] for e in entries]) if expert else entries[0][i] for i in range(2)))
    if w.layers is not None:
        packed, scale = (np.stack([layer[i] for layer in per_layer]) for i in range(2))
    else:
        packed, scale = per_layer[0]
    return QuantizedArray(packed=packed, scale=scale)


def _read(reader: Reader, w: Weight, dtype) -> np.ndarray | QuantizedArray:
    if w.quant is not None:
        return _read_int4(reader, w)
    dtype = np.dtype(w.dtype_for(dtype))
    per_layer = []
    for layer in w.layers if w.layers is not None else (None,):
        layouts = [h for h in w.hf if reader.has(_names(h, layer, _experts(w))[0])] or list(w.hf[:1])
        h = layouts[0]
        parts = [h.to_ours(reader.get(n, h.shape, dtype)) for n in _names(h, layer, _experts(w))]
        per_layer.append(np.stack(parts) if "{expert}" in h.name else parts[0])
    a = np.stack(per_layer) if w.layers is not None else per_layer[0]
    if a.shape != w.shape:
        raise AssertionError(f"declaration maps {w.hf[0].name} to shape {a.shape}, not {w.shape}")
    return np.asarray(a, dtype)


def _read_sharded(reader: Reader, w: Weight, dtype, sharding):
    """One weight placed straight onto `sharding`: each device's callback reads the HF
    tensors of the layers / experts it owns, one at a time, and keeps only its slice."""
    stacked, experts = w.layers is not None, _experts(w)
    layer0 = w.layers[0] if stacked else None
    h = next((h for h in w.hf if reader.has(_names(h, layer0, experts)[0])), w.hf[0])
    per_expert = "{expert}" in h.name
    dtype = np.dtype(w.dtype_for(dtype))
    last: dict = {}  # the one HF tensor held: consecutive slices of it are not re-read

    def entry(k, e):  # ours, for stack entry k and expert e
        if (k, e) not in last:
            last.clear()
            name = h.name.format(layer=w.layers[k] if stacked else None, expert=e)
            if w.quant is None:
                last[(k, e)] = (np.asarray(h.to_ours(reader.get(name, h.shape, dtype)), dtype),)
            else:
                last[(k, e)] = _int4_entry(reader, w, name)
        return last[(k, e)]

    def array(part: int, shape: tuple[int, ...], part_sharding):
        def callback(index):
            index = tuple(index)
            ks = range(*index[0].indices(shape[0])) if stacked else [None]
            axis = 1 if stacked else 0
            es = range(*index[axis].indices(shape[axis])) if per_expert else [None]
            rest = index[axis + (1 if per_expert else 0) :]
            rows = []
            for k in ks:
                row = [entry(k, e)[part][rest] for e in es]
                rows.append(np.stack(row) if per_expert else row[0])
            return np.stack(rows) if stacked else rows[0]

        return jax.make_array_from_callback(shape, part_sharding, callback)

    if w.quant is None:
        return array(0, w.shape, sharding)
    stored = w.quant.stored(w.shape)
    return QuantizedArray(
        packed=array(0, stored.packed.shape, sharding.packed), scale=array(1, stored.scale.shape, sharding.scale)
    )


def _int4_entry(reader: Reader, w: Weight, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(packed [in / 8, out], scale [in / G, out]) of one quantized Linear named `name`."""
    fan_out, fan_in = w.hf[0].shape
    p_name, s_name, shape_name = _quantized_names(name)
    stored = reader.get(shape_name, (2,), np.int64)
    if tuple(int(v) for v in stored) != (fan_out, fan_in):
        raise CheckpointError(f"{shape_name} is {stored.tolist()}, expected [{fan_out}, {fan_in}]")
    packed = transpose(reader.get(p_name, (fan_out, fan_in // PACK), np.int32))
    scale = transpose(reader.get(s_name, (fan_out, fan_in // w.quant.group_size), np.dtype(w.quant.scale_dtype)))
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale)


def load_weights(reader: Reader, decl, dtype):
    """Params for a declaration tree, read from `reader` (numpy arrays, each in its weight's dtype)."""
    return jax.tree.map(lambda w: _read(reader, w, dtype), decl, is_leaf=is_weight)


def hf_tensors(decl, params, layout: str = "default") -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every tensor of `params`, in `layout` where a weight has several."""
    pieces: dict[str, list[tuple[HFTensor, np.ndarray]]] = {}
    weights = jax.tree.leaves(decl, is_leaf=is_weight)
    arrays = jax.tree.leaves(jax.tree.map(lambda w, a: [a], decl, params, is_leaf=is_weight), is_leaf=is_list)
    for w, (a,) in zip(weights, arrays, strict=True):
        h = next((h for h in w.hf if h.layout == layout), w.hf[0])
        if w.quant is not None:
            yield from _int4_tensors(w, a)
            continue
        a = np.asarray(a)
        for k, layer in enumerate(w.layers if w.layers is not None else (None,)):
            entry = a[k] if w.layers is not None else a
            for j, name in enumerate(_names(h, layer, _experts(w))):
                pieces.setdefault(name, []).append((h, entry[j] if "{expert}" in h.name else entry))
    for name, parts in pieces.items():
        h = parts[0][0]
        if h.join_axis is None:
            yield name, h.to_hf(parts[0][1])
        else:
            joined = np.concatenate([p.to_hf(a) for p, a in parts], axis=h.join_axis)
            yield name, joined.reshape(h.shape)


def load_declared(
    path: str | os.PathLike,
    *,
    what: str,
    read_config: Callable[[str], Any],
    declare: Callable[[Any], Any],
    dtype_from: Callable[[Any], Weight],
    dtype=None,
    check_finite: bool = True,
    prefixes: tuple[str, ...] = (),
    skip: Callable[[Any], str | None] = lambda cfg: None,
    return_reader: bool = False,
    mesh=None,
    rules=None,
):
    """Params of an HF directory: its config.json read by `read_config`, every weight `declare`s.

    Args:
      path: the directory.
      what: what it holds, for error messages ("checkpoint", "drafter").
      read_config: config.json path -> config.
      declare: config -> declaration tree.
      dtype_from: the weight whose stored dtype is the default `dtype`.
      dtype: parameter dtype (bf16, f16 or f32); None keeps `dtype_from`'s stored one.
      check_finite: refuse NaN / Inf, as stored or once cast.
      prefixes: name prefixes to strip.
      skip: config -> a regex of stored names that are not read (nor refused as extra).
      return_reader: also return the `Reader` (to report what was skipped).
      mesh: place every tensor straight onto its shards of this mesh (`sharding.RULES`,
        or `rules`): each device reads what it owns, one HF tensor at a time, so host
        memory never holds the whole model.
      rules: logical -> mesh axis rules for `mesh`.

    Returns:
      The params, as jax arrays (and the reader).
    """
    path = os.fspath(path)
    if dtype is not None:
        dtype = check_dtype(dtype)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} directory {path!r} does not exist")
    cfg = read_config(os.path.join(path, "config.json"))
    reader = Reader(path, dtype=dtype, check_finite=check_finite, prefixes=prefixes)
    decl = declare(cfg)
    declared = {
        _quantized_names(n)[0] for w in jax.tree.leaves(decl, is_leaf=is_weight) if w.quant for n in _all_names(w)
    }
    stray = sorted(k for k in reader.where if k.endswith(".weight_packed") and k not in declared)
    if stray:
        raise CheckpointError(
            f"{path}: {stray[0]!r} is pack-quantized, but only routed experts may be (and only when "
            "config.json's quantization_config says so)"
        )
    if dtype is None:
        h = dtype_from(decl).hf[0]
        stored = reader.get(h.name, h.shape).dtype
        dtype = reader.dtype = stored_dtype(stored, f"the stored dtype of {h.name} in {path}")
    if mesh is None:
        params = jax.tree.map(jnp.asarray, load_weights(reader, decl, dtype))
    else:
        from ddtree_jax import sharding, weights

        placement = sharding.shardings(weights.abstract(decl, dtype), weights.axes(decl), mesh, rules)
        params = jax.tree.map(lambda w, s: _read_sharded(reader, w, dtype, s), decl, placement, is_leaf=is_weight)
    pattern = skip(cfg)
    reader.check_all_used(None if pattern is None else re.compile(pattern))
    return (params, reader) if return_reader else params


def _int4_tensors(w: Weight, q: QuantizedArray) -> Iterator[tuple[str, np.ndarray]]:
    """weight_packed / weight_scale / weight_shape of every layer and expert of an INT4 weight."""
    h = w.hf[0]
    packed, scale = np.asarray(q.packed), np.asarray(q.scale)
    for k, layer in enumerate(w.layers if w.layers is not None else (None,)):
        p_l, s_l = (packed[k], scale[k]) if w.layers is not None else (packed, scale)
        for j, name in enumerate(_names(h, layer, _experts(w))):
            p_e, s_e = (p_l[j], s_l[j]) if "{expert}" in h.name else (p_l, s_l)
            p_name, s_name, shape_name = _quantized_names(name)
            yield p_name, np.ascontiguousarray(transpose(p_e))
            yield s_name, np.ascontiguousarray(transpose(s_e))
            yield shape_name, np.asarray(h.shape, np.int64)


def is_list(x) -> bool:
    return isinstance(x, list)


def write(path: str, config: dict, tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int | None) -> None:
    """Writes config.json and the tensors, split into files (plus an index) above `max_shard_bytes`."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors:
        if max_shard_bytes is not None and size + a.nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(a)
        size += a.nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata)
        return
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
