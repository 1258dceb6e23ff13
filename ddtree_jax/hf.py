"""HF checkpoint directories (config.json + safetensors), for the target and the drafter.

`Reader` opens a directory (one file, or many with `model.safetensors.index.json`)
through the `safetensors` package, memory-mapped. `load_weights` fills a declaration
tree (`weights.py`) from it, `hf_tensors` / `write` go the other way. Every error
names the file and the tensor.
"""

from __future__ import annotations

import glob
import json
import math
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
from ddtree_jax.quant import PACK, QuantizedArray, from_words, to_words
from ddtree_jax.weights import HFTensor, Weight, identity, is_weight, transpose

__all__ = ["INDEX_FILE", "CheckpointError", "Reader", "hf_tensors", "load_declared", "load_weights", "write"]

INDEX_FILE = "model.safetensors.index.json"
# Tensors no engine computes from: RoPE buffers some exporters save.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# safetensors dtypes that read into numpy (FP8 and the other narrow floats have no numpy dtype).
READABLE_KINDS = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32", "F64"})


class CheckpointError(ValueError):
    """A missing, extra, mis-shaped, non-finite or corrupt weight, with file and tensor named."""


def orbax_error(e: Exception) -> str:
    """The first line of an orbax / TensorStore error, without the TensorStore spec that follows it
    (hundreds of lines of JSON, cut mid-way to `TensorStore({`)."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return text.splitlines()[0].split(" See full TensorStore details")[0][:300]


class Reader:
    """All tensors of an HF checkpoint directory, by name, with `renames` applied and `prefixes` stripped.

    `get` checks the shape, converts to `dtype` (when given) and, with `check_finite`,
    refuses a tensor holding NaN or Inf, before or after the conversion, naming it.
    `unused()` lists what no `get` asked for.
    """

    def __init__(
        self,
        path: str,
        *,
        dtype=None,
        check_finite: bool = True,
        prefixes: tuple[str, ...] = (),
        renames: tuple[tuple[str, str], ...] = (),
    ):
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
                for pattern, repl in renames:
                    key = re.sub(pattern, repl, key)
                for prefix in prefixes:
                    key = key.removeprefix(prefix)
                if key in self.where:  # else the last file read would silently win
                    raise CheckpointError(f"weight {key!r} is stored twice: in {self.where[key][0]} and {file}")
                self.where[key] = (file, raw)
        self.used: set[str] = set()
        self._last: tuple | None = None

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        file, raw = self.where[name]
        return tuple(self._files[file].get_slice(raw).get_shape())

    def stored_kind(self, name: str) -> str:
        """The tensor's dtype as the safetensors header names it ("BF16", "F32", "F8_E4M3", ...)."""
        file, raw = self.where[name]
        return self._files[file].get_slice(raw).get_dtype()

    def get(self, name: str, shape: tuple[int, ...], dtype=None, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor `name`, checked against `shape`, in `dtype` (default: the reader's, else as stored).

        With `index` (one slice per axis) only that block is read from the file (safetensors'
        lazy slicing). The last block returned is kept: asking for it again (kv_b_proj holds
        two of our weights; device shards of one tensor) neither re-reads nor re-checks it.
        """
        dtype = dtype or self.dtype
        key = (name, tuple(shape), dtype, None if index is None else tuple((i.start, i.stop, i.step) for i in index))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = None  # the previous block is released before the next one is read
        a = self._read(name, shape, dtype, index)
        self._last = (key, a)
        return a

    def _read(self, name: str, shape: tuple[int, ...], dtype, index) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"missing weight {name!r} (expected shape {tuple(shape)}) in {self.path}")
        file, raw = self.where[name]
        if self.shape(name) != tuple(shape):
            raise CheckpointError(f"weight {name!r} in {file} has shape {self.shape(name)}, expected {tuple(shape)}")
        self.used.add(name)
        if (kind := self.stored_kind(name)) not in READABLE_KINDS:
            raise CheckpointError(
                f"weight {name!r} in {file} is stored as {kind}, which this engine does not read (it reads "
                f"{', '.join(sorted(READABLE_KINDS))}); an FP8 checkpoint such as DeepSeek-V3's own needs its weights "
                "dequantized to bf16 first"
            )
        try:
            handle = self._files[file]
            a = handle.get_tensor(raw) if index is None else handle.get_slice(raw)[index]
        except (SafetensorError, OSError, TypeError, ValueError) as e:
            raise CheckpointError(f"weight {name!r} in {file} cannot be read ({e})") from None
        if dtype is not None and not _readable_as(a.dtype, np.dtype(dtype)):
            kind = "a float dtype" if jnp.issubdtype(dtype, jnp.floating) else np.dtype(dtype).name
            raise CheckpointError(f"weight {name!r} in {file} is stored as {a.dtype}, expected {kind}")
        if self.check_finite and (bad := nonfinite_message(a, f"weight {name!r} in {file}")):
            raise CheckpointError(f"{bad}; pass check_finite=False to load it anyway")
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
        """Raises CheckpointError naming up to five tensors nothing read. Tensors of no elements
        are let be: they hold nothing (transformers saves a config's zero-width layers, such as
        shared experts of n_shared_experts = 0, as [64, 0] tensors)."""
        extra = [k for k in self.unused(ignore) if math.prod(self.shape(k))]
        if extra:
            shown = ", ".join(repr(k) for k in extra[:5])
            more = " ..." if len(extra) > 5 else ""
            raise CheckpointError(f"{len(extra)} unexpected weight(s) in {self.path}: {shown}{more}")


def _readable_as(stored: np.dtype, wanted: np.dtype) -> bool:
    """Whether a tensor stored as `stored` reads as `wanted` without changing its meaning: a float
    weight from any float (a cast), integers (INT4 words, shapes) from an integer type that
    `wanted` holds exactly (a float or a wider integer cast would silently change the values)."""
    if jnp.issubdtype(wanted, jnp.floating):
        return jnp.issubdtype(stored, jnp.floating)
    return jnp.issubdtype(stored, jnp.integer) and np.can_cast(stored, wanted)


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


def _blocks(reader: Reader, w: Weight, dtype) -> Callable[[int, tuple[int, ...], tuple[slice, ...]], np.ndarray]:
    """block(part, shape, index): the numpy block `index` of stored array `part` of `w` (0: the
    weight, or an INT4 weight's packed words; 1: its scales), whose full shape is `shape`.

    Reads the HF tensors of the layers / experts the block covers, one at a time (the
    reader keeps only the last). Each layer is read from whichever of the weight's layouts
    the checkpoint holds for it.
    """
    stacked, experts = w.layers is not None, _experts(w)
    dtype = np.dtype(w.dtype_for(dtype))
    layouts: dict = {}

    def layout(k) -> HFTensor:
        if k not in layouts:
            layer = w.layers[k] if stacked else None
            layouts[k] = next((h for h in w.hf if reader.has(_names(h, layer, experts)[0])), w.hf[0])
        return layouts[k]

    def tensor(part: int, k, e, index) -> np.ndarray:  # block `index` of ours, one layer (and expert)
        h = layout(k)
        name = h.name.format(layer=w.layers[k] if stacked else None, expert=e)
        if w.quant is not None:
            return _int4_part(reader, w, name, part)[index]
        if h.to_ours is identity or (h.to_ours is transpose and len(h.shape) == 2):
            # Plain layouts map a block of ours to one block of the HF tensor: read only it.
            index = (*index, *(slice(None),) * (len(h.shape) - len(index)))
            hf_index = index if h.to_ours is identity else index[::-1]
            return np.asarray(h.to_ours(reader.get(name, h.shape, dtype, hf_index)), dtype)
        return np.asarray(h.to_ours(reader.get(name, h.shape, dtype)), dtype)[index]

    def block(part: int, shape: tuple[int, ...], index) -> np.ndarray:
        index = tuple(index)
        axis = 1 if stacked else 0  # the expert axis, after the layer axis
        rows = []
        for k in range(*index[0].indices(shape[0])) if stacked else [None]:
            if "{expert}" in layout(k).name:
                es = range(*index[axis].indices(shape[axis]))
                rows.append(np.stack([tensor(part, k, e, index[axis + 1 :]) for e in es]))
            else:
                rows.append(tensor(part, k, None, index[axis:]))
        return np.stack(rows) if stacked else rows[0]

    return block


def scale_dtype(reader: Reader, name: str, quant) -> np.dtype:
    """The dtype INT4 group scales `name` load in: `quant.scale_dtype` (bfloat16, as Kimi-K2.5
    ships them and the W4A16 kernel reads them), except float32 where the model loads in float32
    and the scales are stored wider than bfloat16 (compressed-tensors writes an f32 model's
    scales in f32): rounded to bf16, such a model's logits moved by ~4e-3."""
    if (
        reader.dtype is not None
        and np.dtype(reader.dtype) == np.float32
        and reader.stored_kind(name) in ("F16", "F32", "F64")
    ):
        return np.dtype(np.float32)
    return np.dtype(quant.scale_dtype)


def _int4_part(reader: Reader, w: Weight, name: str, part: int) -> np.ndarray:
    """Grouped int4 values [in / G, out, G] (part 0, after checking weight_shape) or scales
    [in / G, out] (part 1) of one pack-quantized Linear named `name` (`quant` says how HF
    stores them)."""
    fan_out, fan_in = w.hf[0].shape
    p_name, s_name, shape_name = _quantized_names(name)
    if part == 1:
        scale_shape = (fan_out, fan_in // w.quant.group_size)
        return np.ascontiguousarray(transpose(reader.get(s_name, scale_shape, scale_dtype(reader, s_name, w.quant))))
    if not reader.has(p_name) and reader.has(name):
        # compressed-tensors' `ignore` can keep some layers' experts dense; the stacks hold one format.
        raise CheckpointError(
            f"{name!r} is stored unquantized, but config.json's quantization_config makes the routed experts "
            "pack-quantized INT4, and they are loaded as one stack: a checkpoint with some routed experts INT4 and "
            "others dense is not supported (quantize them all, e.g. `python -m ddtree_jax quantize`, or none)"
        )
    stored = reader.get(shape_name, (2,), np.int64)
    if tuple(int(v) for v in stored) != (fan_out, fan_in):
        raise CheckpointError(f"{shape_name} is {stored.tolist()}, expected [{fan_out}, {fan_in}]")
    return from_words(reader.get(p_name, (fan_out, fan_in // PACK), np.int32), w.quant.group_size)


def _read(reader: Reader, w: Weight, dtype, sharding=None):
    """One weight: numpy array(s) on the host, or, with `sharding`, jax arrays whose every
    device shard is read straight from the checkpoint."""
    block = _blocks(reader, w, dtype)

    def build(part, shape, where):
        if where is None:
            return block(part, shape, (slice(None),) * len(shape))
        # One device at a time, each block sent before the next is read (make_array_from_callback
        # would hold every device's block on the host at once).
        shards = [
            jax.device_put(block(part, shape, i), d) for d, i in where.addressable_devices_indices_map(shape).items()
        ]
        return jax.make_array_from_single_device_arrays(shape, where, shards)

    if w.quant is None:
        a = build(0, w.shape, sharding)
        if a.shape != w.shape:
            raise AssertionError(f"declaration maps {w.hf[0].name} to shape {a.shape}, not {w.shape}")
        return a
    stored = w.quant.stored(w.shape)
    return QuantizedArray(
        packed=build(0, stored.packed.shape, None if sharding is None else sharding.packed),
        scale=build(1, stored.scale.shape, None if sharding is None else sharding.scale),
    )


def load_weights(reader: Reader, decl, dtype):
    """Params for a declaration tree, read from `reader` (numpy arrays, each in its weight's dtype)."""
    return jax.tree.map(lambda w: _read(reader, w, dtype), decl, is_leaf=is_weight)


def hf_tensors(decl, params, layout: str = "default") -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every tensor of `params`, in `layout` where a weight has several."""
    pieces: dict[str, list[tuple[HFTensor, np.ndarray]]] = {}
    weights = jax.tree.leaves(decl, is_leaf=is_weight)
    arrays = jax.tree.leaves(jax.tree.map(lambda w, a: [a], decl, params, is_leaf=is_weight), is_leaf=_is_list)
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
    renames: tuple[tuple[str, str], ...] = (),
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
      renames: (regex, replacement) pairs applied to each stored name, in order, before `prefixes`.
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
        state = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"{what} directory {path!r} {state}")
    cfg = read_config(os.path.join(path, "config.json"))
    reader = Reader(path, dtype=dtype, check_finite=check_finite, prefixes=prefixes, renames=renames)
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
        params = jax.tree.map(lambda w, s: _read(reader, w, dtype, s), decl, placement, is_leaf=is_weight)
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
            yield p_name, to_words(p_e)
            yield s_name, np.ascontiguousarray(transpose(s_e))
            yield shape_name, np.asarray(h.shape, np.int64)


def _is_list(x) -> bool:
    return isinstance(x, list)


def write(path: str, config: dict, tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int | None) -> None:
    """Writes config.json and the tensors, split into files (plus an index) above `max_shard_bytes`.

    Over an earlier checkpoint, what a write puts there (config.json, the index, model.safetensors,
    model-*-of-*.safetensors) is removed first, and config.json is written last: a sharded
    checkpoint's index outlived a one-file save over it, so the old weights were read under the
    new config; a write cut short leaves no config.json, never a config beside other weights.
    """
    os.makedirs(path, exist_ok=True)
    config_path = os.path.join(path, "config.json")
    earlier = [config_path, os.path.join(path, INDEX_FILE), os.path.join(path, "model.safetensors")]
    for file in earlier + glob.glob(os.path.join(path, "model-*-of-*.safetensors")):
        if os.path.exists(file):
            os.remove(file)
    _write_tensors(path, tensors, max_shard_bytes)
    write_json(config_path, config)


def write_json(path: str, obj) -> None:
    """`obj` as JSON at `path`, through a temporary file: a write cut short leaves no partial file."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def _write_tensors(path: str, tensors: Iterator[tuple[str, np.ndarray]], max_shard_bytes: int | None) -> None:
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
