"""One sharding path: every parameter's logical axes, mapped to mesh axes in one place.

Model code never names mesh axes. Each weight gets logical axis names from its
place in the params pytree (`target_logical_axes`, `drafter_logical_axes`);
`RULES` maps those names to the mesh axes of `make_mesh` ("data", "model"). A
dimension the mesh axis does not divide stays replicated, so any config shards.
`jax.jit` then propagates the shardings through `generate` (GSPMD).

Tensor parallelism over "model": attention heads, dense-MLP and shared-expert
intermediate units, routed experts (expert parallelism) and the vocabulary.
The absorbed-MLA latent cache has a single shared KV head, so it is replicated
over "model"; "data" is for the batch.

Pallas kernels are opaque to GSPMD, so under a mesh context (`jax.set_mesh`, which
`generate` enters for sharded params with implementation="pallas") their dispatch
functions run them per shard with `shard_map`, with specs from the same logical
axes (`context_mesh`, `spec_for`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")

RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "heads": "model",
    "mlp": "model",
    "experts": "model",
    "embed": None,
    "layers": None,
}
"""Logical axis -> mesh axis. Names not listed (None in the tables below) are replicated."""

# Logical axes of target weights by their field name (leading "layers" added for stacks).
_TARGET_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "attn.kv_a": ("embed", None),
    "attn.kv_a_norm": (None,),
    "attn.w_uk": ("heads", None, None),
    "attn.w_uv": ("heads", None, None),
    "attn.o": ("heads", None, "embed"),
    "attn.q": ("embed", "heads", None),
    "attn.q_a": ("embed", None),
    "attn.q_a_norm": (None,),
    "attn.q_b": (None, "heads", None),
    "mlp.gate": ("embed", "mlp"),
    "mlp.up": ("embed", "mlp"),
    "mlp.down": ("mlp", "embed"),
    "mlp.router": ("embed", None),
    "mlp.router_bias": (None,),
    "mlp.shared.gate": ("embed", "mlp"),
    "mlp.shared.up": ("embed", "mlp"),
    "mlp.shared.down": ("mlp", "embed"),
}
# Routed experts: [E, ...] with the expert axis sharded.
_EXPERT_AXES: dict[str, tuple[str | None, ...]] = {
    "mlp.gate": ("experts", "embed", None),
    "mlp.up": ("experts", "embed", None),
    "mlp.down": ("experts", None, "embed"),
}
_DRAFTER_AXES: dict[str, tuple[str | None, ...]] = {
    "fc": (None, "embed"),
    "hidden_norm": ("embed",),
    "norm": ("embed",),
    "input_norm": ("embed",),
    "post_norm": ("embed",),
    "q": ("embed", "heads", None),
    "k": ("embed", "heads", None),
    "v": ("embed", "heads", None),
    "q_norm": (None,),
    "k_norm": (None,),
    "o": ("heads", None, "embed"),
    "gate": ("embed", "mlp"),
    "up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
}


def _field_path(path) -> list[str]:
    return [getattr(k, "name", getattr(k, "key", str(k))) for k in path]


def target_logical_axes(params):
    """A pytree like `params` whose leaves are tuples of logical axis names (one per dim)."""

    def axes(path, leaf):
        names = _field_path(path)
        stacked = names[0] in ("dense_layers", "moe_layers")
        key = ".".join(names[1:] if stacked else names)
        table = _EXPERT_AXES if names[0] == "moe_layers" and key in _EXPERT_AXES else _TARGET_AXES
        if key not in table:
            raise KeyError(f"no logical axes for target weight {'.'.join(names)}")
        out = (("layers",) if stacked else ()) + table[key]
        if len(out) != leaf.ndim:
            raise ValueError(f"logical axes {out} do not fit {'.'.join(names)} of shape {leaf.shape}")
        return out

    return jax.tree_util.tree_map_with_path(axes, params)


def drafter_logical_axes(params):
    """Logical axes of a DFlash drafter's weights (see `target_logical_axes`)."""

    def axes(path, leaf):
        names = _field_path(path)
        stacked = names[0] == "layers"
        out = (("layers",) if stacked else ()) + _DRAFTER_AXES[names[-1]]
        if len(out) != leaf.ndim:
            raise ValueError(f"logical axes {out} do not fit drafter {'.'.join(names)} of shape {leaf.shape}")
        return out

    return jax.tree_util.tree_map_with_path(axes, params)


def context_mesh():
    """The ("data", "model") mesh of the current `jax.set_mesh` context, or None.

    None without a context, for a mesh of one device, or for a mesh with other axis
    names (then kernels run unsharded and GSPMD moves their operands).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != MESH_AXES or mesh.size == 1:
        return None
    return mesh


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh; `model` defaults to all devices left after `data`."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    if model is None:
        model = devices.size // data
    if data * model != devices.size:
        raise ValueError(f"mesh data={data} x model={model} != {devices.size} devices")
    return Mesh(devices.reshape(data, model), MESH_AXES)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules=None) -> PartitionSpec:
    """PartitionSpec of one array; dimensions the mesh axis does not divide stay replicated."""
    rules = RULES if rules is None else rules
    out = []
    for name, dim in zip(axes, shape, strict=True):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is not None and (dim % mesh.shape[mesh_axis] or mesh_axis in out):
            mesh_axis = None
        out.append(mesh_axis)
    return PartitionSpec(*out)


def shardings(params, logical_axes, mesh: Mesh, rules=None):
    """NamedShardings for every leaf of `params` from its logical axes."""
    return jax.tree.map(
        lambda a, axes: NamedSharding(mesh, spec_for(axes, a.shape, mesh, rules)),
        params,
        logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def shard_target(params, mesh: Mesh, rules=None):
    """Places target weights on `mesh` (tensor / expert parallel over "model")."""
    return jax.device_put(params, shardings(params, target_logical_axes(params), mesh, rules))


def shard_drafter(params, mesh: Mesh, rules=None):
    """Places DFlash drafter weights on `mesh`."""
    return jax.device_put(params, shardings(params, drafter_logical_axes(params), mesh, rules))
