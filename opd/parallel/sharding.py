"""Meshes and logical→mesh sharding (mesh axes ``data``, ``fsdp``, [``expert``,] ``tensor``).

Parameters carry logical axis names (see ``opd.models.decoder``); a short rule
table, kept in the experiment config, maps them to mesh axes. The helpers
here fail loudly: a mesh that does not match the device count raises, a rule
table that names an unknown mesh axis or an unknown logical axis (a typo such
as ``"vocabb"``) raises, an array whose logical axis has no rule raises, a
batch the mesh's batch shards do not divide raises naming the config field
(``check_batch_divisible``), a parameter dimension that the mesh does not
divide is replicated *and logged*, and ``check_sharded`` raises when a large
parameter is left fully replicated on a multi-device mesh.

A 3-entry mesh shape gives the dense ``(data, fsdp, tensor)`` mesh; a 4-entry
one adds ``expert`` (``(data, fsdp, expert, tensor)``) along which MoE
experts are sharded (``opd.models.moe``). A rule target naming a mesh axis the
mesh lacks (``expert`` on a 3-axis mesh) is that axis at size 1.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")  # a 4-entry mesh shape

# Logical name -> mesh axis (or tuple of axes, or None for replicated).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("latent", None),  # MLA's compressed query / key-value width (opd.models.mla)
    ("length", None),
    ("cache_length", None),
    ("norm", None),
    ("scalar", None),
    ("expert", "expert"),
)
# Every logical axis name the decoder, sampler and prefill use: a rule for any
# other name can only be a typo, which would leave the intended axis replicated.
LOGICAL_AXES: tuple[str, ...] = tuple(name for name, _ in DEFAULT_RULES)


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all devices).

  A 4-entry ``shape`` makes a ``(data, fsdp, expert, tensor)`` mesh (expert
  parallelism for MoE models). One entry may be -1: it takes the devices the
  others leave, e.g. ``(-1, 1, 1)`` is data parallelism over every device.

  Raises ValueError naming the shape and the device count when they disagree.
  """
  shape = tuple(int(s) for s in shape)
  if len(shape) not in (len(MESH_AXES), len(EXPERT_MESH_AXES)):
    raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries for axes {MESH_AXES} "
                     f"or {len(EXPERT_MESH_AXES)} for {EXPERT_MESH_AXES}")
  axes = MESH_AXES if len(shape) == len(MESH_AXES) else EXPERT_MESH_AXES
  devices = list(jax.devices() if devices is None else devices)
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {shape} may contain at most one -1")
  if shape.count(-1) == 1:
    rest = math.prod(s for s in shape if s != -1)
    if rest <= 0 or len(devices) % rest:
      raise ValueError(f"mesh shape {dict(zip(axes, shape))}: the {len(devices)} devices "
                       f"are not divisible by the fixed axes' product {rest}")
    shape = tuple(len(devices) // rest if s == -1 else s for s in shape)
  if any(s <= 0 for s in shape):
    raise ValueError(f"mesh shape {shape} must be positive (or one -1)")
  if math.prod(shape) != len(devices):
    raise ValueError(
        f"mesh shape {dict(zip(axes, shape))} needs {math.prod(shape)} devices "
        f"but {len(devices)} are available")
  if jax.process_count() > 1 and len(devices) == jax.device_count():
    # Multi-host: lay devices out so that each host's devices are contiguous.
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
  else:
    grid = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def validate_rules(rules: Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
  """Checks a rule table and returns it as a tuple of pairs.

  Every logical name must be one of ``LOGICAL_AXES`` (named once) and every
  target None, a mesh axis, or a tuple of them. Raises ValueError naming the
  offending rule and the known names.
  """
  out = []
  seen = set()
  for item in rules:
    if isinstance(item, str) or len(item) != 2:
      raise ValueError(f"sharding rule {item!r} must be (logical_name, mesh_axes)")
    name, target = item
    if name not in LOGICAL_AXES:
      raise ValueError(f"sharding rule names logical axis {name!r}, which nothing uses "
                       f"(a typo?); known logical axes: {LOGICAL_AXES}")
    if name in seen:
      raise ValueError(f"sharding rules name logical axis {name!r} twice")
    seen.add(name)
    targets = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    for t in targets:
      if t not in EXPERT_MESH_AXES:
        raise ValueError(f"sharding rule for {name!r} names mesh axis {t!r}; known: "
                         f"{EXPERT_MESH_AXES}")
    out.append((name, target if isinstance(target, (str, type(None))) else tuple(target)))
  return tuple(out)


def _axis_size(mesh: Mesh, entry) -> int:
  if entry is None:
    return 1
  names = (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape.get(n, 1) for n in names)


def _on_mesh(mesh: Mesh, spec: P) -> P:
  """``spec`` without the mesh axes ``mesh`` lacks (``expert`` on a 3-axis mesh)."""
  def keep(entry):
    if entry is None:
      return None
    names = tuple(n for n in ((entry,) if isinstance(entry, str) else entry) if n in mesh.shape)
    return None if not names else names[0] if isinstance(entry, str) or len(names) == 1 else names
  return P(*(keep(e) for e in spec))


def _mesh_spec(logical_spec, rules, what: str) -> P:
  """``nn.logical_to_mesh_axes``, but a logical axis without a rule raises.

  Flax replicates such an axis silently; a table that lost a rule (or a
  misspelt one, already refused by ``validate_rules``) must not.
  """
  names = {name for name, _ in rules}
  for axis in logical_spec:
    for a in (() if axis is None else (axis,) if isinstance(axis, str) else axis):
      if a not in names:
        raise ValueError(f"{what}: logical axis {a!r} has no sharding rule; the rules name "
                         f"{tuple(sorted(names))} (add ({a!r}, None) to replicate it)")
  return nn.logical_to_mesh_axes(logical_spec, rules)


def logical_to_sharding(logical_spec: P, shape: Sequence[int], mesh: Mesh, rules,
                        name: str = "") -> NamedSharding:
  """One array's NamedSharding; dimensions the mesh does not divide are replicated (logged).

  Raises ValueError when a logical axis of ``logical_spec`` has no rule.
  """
  mesh_spec = _on_mesh(mesh, _mesh_spec(logical_spec, rules, name or "array"))
  entries = list(mesh_spec) + [None] * (len(shape) - len(mesh_spec))
  for i, (dim, entry) in enumerate(zip(shape, entries)):
    size = _axis_size(mesh, entry)
    if size > 1 and dim % size:
      log.warning("%s: dim %d of shape %s is not divisible by mesh axes %s (size %d); "
                  "replicating that dim", name or "array", i, tuple(shape), entry, size)
      entries[i] = None
  return NamedSharding(mesh, P(*entries))


def tree_shardings(logical_specs, abstract_tree, mesh: Mesh, rules):
  """Maps a pytree of logical specs (and matching shapes) to NamedShardings."""
  rules = validate_rules(rules)
  paths_specs = jax.tree_util.tree_flatten_with_path(
      logical_specs, is_leaf=lambda x: isinstance(x, P))[0]
  leaves, treedef = jax.tree_util.tree_flatten(abstract_tree)
  if len(paths_specs) != len(leaves):
    raise ValueError(f"logical specs have {len(paths_specs)} leaves but the tree has {len(leaves)}")
  out = [logical_to_sharding(spec, leaf.shape, mesh, rules, jax.tree_util.keystr(path))
         for (path, spec), leaf in zip(paths_specs, leaves)]
  return jax.tree_util.tree_unflatten(treedef, out)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES, ndim: int = 2) -> NamedSharding:
  """Shards the leading (batch) dim over the mesh axes the rules give ``batch``."""
  spec = _mesh_spec(("batch",) + (None,) * (ndim - 1), validate_rules(rules), "batch")
  return NamedSharding(mesh, _on_mesh(mesh, spec))


def batch_shards(mesh: Mesh, rules=DEFAULT_RULES) -> int:
  """How many ways the mesh splits a batch: the product of the axes ``batch`` maps to."""
  return _axis_size(mesh, batch_sharding(mesh, rules, 1).spec[0])


def check_batch_divisible(batch_size: int, mesh: Mesh, rules=DEFAULT_RULES, *,
                          field: str = "batch_size") -> int:
  """Raises unless ``batch_size`` rows split evenly over the mesh's batch shards.

  Call it where the value enters (a job's start), so that a bad config fails
  before any work instead of at the first step or the first sampling call.

  Args:
    batch_size: the global batch (rows per step, or prompts per sampler call).
    mesh, rules: the mesh and logical rules the batch will be sharded with.
    field: the config field that set ``batch_size``, for the message
      (e.g. ``"config.train.batch_size"``).

  Returns:
    The number of batch shards.

  Raises:
    ValueError: naming ``field``, its value, the shard count and the mesh.
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
    raise ValueError(f"{field}={batch_size!r} must be a positive int")
  shards = batch_shards(mesh, rules)
  if batch_size % shards:
    raise ValueError(f"{field}={batch_size} is not divisible by the {shards} batch shards of "
                     f"mesh {dict(mesh.shape)} (rule 'batch' -> "
                     f"{dict(validate_rules(rules))['batch']!r}); use a multiple of {shards}")
  return shards


def check_sharded(tree, *, min_size: int = 2 ** 14, what: str = "params") -> list[str]:
  """Raises if an array with >= ``min_size`` elements is fully replicated.

  Only meaningful on a mesh with more than one device on its model axes
  (``fsdp`` x ``tensor`` > 1); otherwise returns the list of replicated
  names without raising. Returns the names of replicated small arrays.
  """
  offenders, small = [], []
  model_axes = 1
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      continue
    model_axes = max(model_axes, math.prod(sharding.mesh.shape.get(a, 1)
                                           for a in ("fsdp", "expert", "tensor")))
    if sharding.is_fully_replicated:
      (offenders if x.size >= min_size else small).append(f"{jax.tree_util.keystr(path)} {x.shape}")
  if small:
    log.log(logging.INFO if model_axes > 1 else logging.DEBUG,
            "%s left replicated (small): %s", what, ", ".join(small))
  if offenders and model_axes > 1:
    raise ValueError(
        f"{len(offenders)} large {what} (>= {min_size} elements) are fully replicated on a "
        f"mesh with fsdp*tensor={model_axes}: {offenders}. Check the logical axis rules.")
  return small + offenders
