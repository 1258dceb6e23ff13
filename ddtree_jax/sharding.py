"""One sharding path: every parameter's logical axes, mapped to mesh axes in one place.

Model code never names mesh axes. Each weight declares logical axis names
(`model.declare`, `drafters.dflash.declare`); `RULES` maps those names to the mesh
axes of `make_mesh` ("data", "model"). A dimension the mesh axis does not divide
stays replicated, so any config shards. `jax.jit` then propagates the shardings
through `generate` (GSPMD).

Tensor parallelism over "model": attention heads, dense-MLP and shared-expert
intermediate units, routed experts (expert parallelism) and the vocabulary.
The absorbed-MLA latent cache has a single shared KV head, which no head split can
divide: it is split by sequence over "data" and "model" instead ("cache_batch",
data-parallel attention) when the mesh divides the batch, else over "data" only. "data"
is for the batch. Attention and cache writes then run in `shard_map` (`cache_split`):
each device takes its sequences' rows, the queries move from the head split to the
sequence split and the outputs back (two all-to-alls per layer), and GSPMD never sees
the sequence split outside the cache (left to it, it spread that split into the whole
decode loop and all-gathered activations back at every layer).

Pallas kernels are opaque to GSPMD, so their dispatch functions run them per shard
with `shard_map` under `use_mesh(mesh, rules)`, with specs from the same logical
axes and the same rules (`kernel_spec`). `generate` enters it for sharded params
with the rules read back from how the weights were placed (`placed_rules`), so
custom rules given to `shard_target` reach the kernels too.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ddtree_jax.checks import check_int

MESH_AXES = ("data", "model")

RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "cache_batch": ("data", "model"),
    "vocab": "model",
    "heads": "model",
    "mlp": "model",
    "experts": "model",
    "embed": None,
    "layers": None,
}
"""Logical axis -> mesh axis. Names not listed (or None) are replicated."""

_CONTEXT_RULES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ddtree_sharding_rules", default=None)


def _declaration(params):
    from ddtree_jax.drafters.dflash import DrafterParams
    from ddtree_jax.drafters.dflash import declare as declare_drafter
    from ddtree_jax.model import TargetParams
    from ddtree_jax.model import declare as declare_target

    if isinstance(params, TargetParams):
        return declare_target(params.config)
    if isinstance(params, DrafterParams):
        return declare_drafter(params.config)
    raise TypeError(f"no weight declarations for {type(params).__name__}; expected TargetParams or DrafterParams")


def logical_axes(params):
    """A pytree like `params` whose leaves are tuples of logical axis names (one per dim)."""
    from ddtree_jax import weights

    return weights.axes(_declaration(params))


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: dict | None = None):
    """`jax.set_mesh(mesh)`, with `rules` (default RULES) for the kernels' `shard_map` specs.

    The rules are read while tracing: a function jitted under other rules keeps those
    (jit caches by mesh and input shardings, not by rules). `generate` takes them from
    the weights' placement, which is part of its cache key.
    """
    token = _CONTEXT_RULES.set(dict(RULES if rules is None else rules))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _CONTEXT_RULES.reset(token)


def context_mesh():
    """The mesh of the current `jax.set_mesh` / `use_mesh` context, or None.

    None without a context or for a mesh of one device (then kernels run unsharded).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh


def context_rules() -> dict:
    """The rules of the current `use_mesh` context (RULES under a bare `jax.set_mesh`)."""
    rules = _CONTEXT_RULES.get()
    return RULES if rules is None else rules


def kernel_spec(axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec | None:
    """PartitionSpec of a kernel operand under the current mesh and rules; None without a mesh."""
    mesh = context_mesh()
    if mesh is None:
        return None
    return spec_for(axes, shape, mesh, context_rules())


def cache_split(batch: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """How the latent cache of `batch` sequences is split under the current mesh and rules.

    Returns:
      (home, extra): the mesh axes that split the batch everywhere ("batch"), and the
      further axes that split the cache alone ("cache_batch" beyond them). Both () without
      a mesh; extra is () when "cache_batch" does not extend the batch's own split.
    """
    mesh = context_mesh()
    if mesh is None:
        return (), ()
    rules = context_rules()

    def axes(name):
        a = spec_for((name,), (batch,), mesh, rules)[0]
        return () if a is None else (a,) if isinstance(a, str) else tuple(a)

    home, cache = axes("batch"), axes("cache_batch")
    return home, (cache[len(home) :] if cache[: len(home)] == home else ())


def rows_here(x: jax.Array, extra: tuple[str, ...], axis: int = 0) -> jax.Array:
    """Inside `shard_map`: this device's share of x's rows along `axis`, split over `extra`."""
    n = int(np.prod([jax.lax.axis_size(a) for a in extra]))
    size = x.shape[axis] // n
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(extra) * size, size, axis)


def placed_rules(params) -> dict:
    """The logical -> mesh axis rules the weights of `params` were placed with.

    Read back from each weight's sharding: a logical axis some weight splits maps to
    that mesh axis, one every weight keeps whole to None; names no weight carries
    ("batch") keep RULES.

    Raises:
      ValueError: two weights split one logical axis over different mesh axes.
    """
    rules = dict(RULES)
    seen: dict[str, str | None] = {}
    for leaf, ax in zip(jax.tree.leaves(params), jax.tree.leaves(logical_axes(params), is_leaf=_is_axes), strict=True):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        if spec is None:
            continue
        spec = tuple(spec) + (None,) * (len(ax) - len(spec))
        for name, mesh_axis in zip(ax, spec, strict=True):
            if name is None:
                continue
            if mesh_axis is not None and seen.get(name) not in (None, mesh_axis):
                raise ValueError(f"logical axis {name!r} is split over both {seen[name]!r} and {mesh_axis!r}")
            if mesh_axis is not None or name not in seen:
                seen[name] = mesh_axis
    rules.update(seen)
    return rules


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh; `model` defaults to all devices left after `data`."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    if devices.size == 0:
        raise ValueError("make_mesh needs at least one device, got an empty list")
    data = check_int("mesh data size", data, minimum=1)
    if model is not None:
        model = check_int("mesh model size", model, minimum=1)
    if model is None:
        model = devices.size // data
    if data * model != devices.size:
        raise ValueError(f"mesh data={data} x model={model} != {devices.size} devices")
    return Mesh(devices.reshape(data, model), MESH_AXES)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, rules=None) -> PartitionSpec:
    """PartitionSpec of one array.

    A rule names one mesh axis or a tuple of them (split over their product). Mesh axes
    an earlier dimension of the array already uses are skipped; of a tuple, trailing
    axes are dropped until the product divides the dimension; a dimension nothing
    divides stays replicated.
    """
    rules = RULES if rules is None else rules
    out, used = [], set()
    for name, dim in zip(axes, shape, strict=True):
        rule = rules.get(name) if name is not None else None
        cand = [a for a in ((rule,) if isinstance(rule, str) else rule or ()) if a in mesh.shape and a not in used]
        while cand and dim % int(np.prod([mesh.shape[a] for a in cand])):
            cand.pop()
        used.update(cand)
        out.append(None if not cand else cand[0] if isinstance(rule, str) else tuple(cand))
    return PartitionSpec(*out)


def check_rules(rules, mesh: Mesh) -> None:
    """Raises ValueError naming a rule whose mesh axes `mesh` lacks (`spec_for` skips such an axis,
    so a misspelt axis, or a mesh with other axis names, left every weight it names replicated, with
    no word) or whose value is not a mesh axis name, a tuple of them or None."""
    for name, rule in (RULES if rules is None else rules).items():
        targets = (rule,) if isinstance(rule, str) else rule or ()
        if not isinstance(targets, tuple | list) or not all(isinstance(a, str) for a in targets):
            raise ValueError(f"sharding rule {name!r}: {rule!r} is not a mesh axis name, a tuple of them or None")
        missing = [a for a in targets if a not in mesh.shape]
        if missing:
            raise ValueError(
                f"sharding rule {name!r} -> {rule!r} names {missing[0]!r}, which is not an axis of the mesh "
                f"(its axes: {tuple(mesh.axis_names)})"
            )


def shardings(params, axes, mesh: Mesh, rules=None):
    """NamedShardings for every leaf of `params` from its logical axes `axes` (`logical_axes`).

    Raises:
      ValueError: a rule names an axis the mesh lacks (`check_rules`).
    """
    check_rules(rules, mesh)
    return jax.tree.map(lambda a, ax: NamedSharding(mesh, spec_for(ax, a.shape, mesh, rules)), params, axes)


def shard_target(params, mesh: Mesh, rules=None):
    """Places target weights on `mesh` (tensor / expert parallel over "model")."""
    return jax.device_put(params, shardings(params, logical_axes(params), mesh, rules))


def shard_drafter(params, mesh: Mesh, rules=None):
    """Places DFlash drafter weights on `mesh`."""
    return jax.device_put(params, shardings(params, logical_axes(params), mesh, rules))


def embed_rows(table: jax.Array, ids: jax.Array) -> jax.Array:  # [V, H], [...] -> [..., H]
    """`table[ids]`, vocabulary-parallel under a mesh context whose rules split "vocab".

    Each device looks up the ids that fall in its rows (zeros for the rest) and a sum over
    the axis adds them: one nonzero term per id, so the rows are `table[ids]` exactly
    (a -0.0 entry comes back 0.0: the sum starts from 0.0), negative ids wrapping and
    others clamping as jnp indexing does. Left to GSPMD, the GPU
    compile of a 2-GPU AR step all-gathered the whole table (587 MB) every step
    (docs/scaling.md).
    """
    spec = kernel_spec(("vocab", None), table.shape)
    axis = None if spec is None else spec[0]
    if axis is None:
        return table[ids]
    vocab = table.shape[0]
    ids = jnp.clip(jnp.where(ids < 0, ids + vocab, ids), 0, vocab - 1)

    def local(table, ids):
        rows = table.shape[0]
        first = jax.lax.axis_index(axis) * rows
        mine = (ids >= first) & (ids < first + rows)
        found = table[jnp.where(mine, ids - first, 0)]
        return jax.lax.psum(jnp.where(mine[..., None], found, jnp.zeros_like(found)), axis)

    in_specs = (PartitionSpec(axis, None), PartitionSpec())
    return jax.shard_map(local, in_specs=in_specs, out_specs=PartitionSpec(), check_vma=False)(table, ids)
