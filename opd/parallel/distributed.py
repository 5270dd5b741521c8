"""Multi-process (multi-host) start-up, helpers, and per-process batch placement.

Call ``initialize`` first thing in every process, before any other jax call
(it must run before jax creates its backends)::

    from opd.parallel import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=4, process_id=rank)

On CPU it selects the gloo collectives so that cross-process all-reduces
work (as of jax 0.10.2 the CPU client has no cross-process collectives
otherwise). With one process it does nothing, so the same launcher runs on a
laptop and on a pod. After it, meshes from ``opd.parallel.sharding.make_mesh`` span
every process's devices, and each process feeds its own rows of the batch
(``opd.training.train_step.process_batch_rows`` / ``shard_batch``).
"""
from __future__ import annotations

import math
import os
import socket
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from opd.parallel import sharding as sharding_lib

PyTree = Any


def _parse_address(coordinator_address: str) -> tuple[str, int]:
  if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
    raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator_address must be 'host:port' with a port in 1..65535, got "
                     f"{coordinator_address!r}")
  return host, int(port)


def initialize(coordinator_address: str | None, num_processes: int, process_id: int, *,
               local_device_ids=None, cpu_collectives: str | None = "gloo",
               initialization_timeout_s: int = 120) -> None:
  """Joins this process to a ``num_processes``-process jax job.

  Args:
    coordinator_address: ``"host:port"`` of process 0's coordinator service
      (every process passes the same value). Ignored when num_processes == 1.
    num_processes: total number of processes (>= 1).
    process_id: this process's rank in ``[0, num_processes)``.
    local_device_ids: restrict this process to these local devices.
    cpu_collectives: CPU cross-process collectives implementation ("gloo"
      or "mpi"); None leaves jax's setting alone.
    initialization_timeout_s: how long to wait for all processes to join.

  Raises:
    ValueError: invalid arguments (named with their values).
    RuntimeError: jax was already initialised differently.
  """
  if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
    raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
  if (not isinstance(process_id, int) or isinstance(process_id, bool)
      or not 0 <= process_id < num_processes):
    raise ValueError(f"process_id must be an int in [0, {num_processes}), got {process_id!r}")
  if cpu_collectives not in (None, "gloo", "mpi"):
    raise ValueError(f"cpu_collectives must be 'gloo', 'mpi' or None, got {cpu_collectives!r}")
  if num_processes == 1:
    return
  _parse_address(coordinator_address)
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids,
                             initialization_timeout=initialization_timeout_s)
  if jax.process_count() != num_processes or jax.process_index() != process_id:
    raise RuntimeError(f"jax reports process {jax.process_index()} of {jax.process_count()}, "
                       f"expected {process_id} of {num_processes}")


def initialize_from_env(prefix: str = "OPD_") -> None:
  """``initialize`` from ``{prefix}COORDINATOR``, ``{prefix}NUM_PROCESSES`` and
  ``{prefix}PROCESS_ID``; a no-op when ``{prefix}NUM_PROCESSES`` is unset."""
  n = os.environ.get(prefix + "NUM_PROCESSES")
  if n is None:
    return
  try:
    num, pid = int(n), int(os.environ.get(prefix + "PROCESS_ID", "0"))
  except ValueError as e:
    raise ValueError(f"{prefix}NUM_PROCESSES / {prefix}PROCESS_ID must be ints: {e}") from e
  initialize(os.environ.get(prefix + "COORDINATOR"), num, pid)


def shutdown() -> None:
  """Leaves the job (only needed to re-initialise within one process)."""
  if jax.process_count() > 1:
    jax.distributed.shutdown()


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_main_process() -> bool:
  """True on process 0: the one that logs, writes summaries and prints."""
  return jax.process_index() == 0


def sync(name: str) -> None:
  """Barrier: returns once every process has called ``sync`` with ``name``."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def gather_to_host(tree):
  """Every process gets the full value of each (possibly sharded) global array
  as numpy; works with one process too."""
  if jax.process_count() == 1:
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def local_mesh():
  """A data-parallel ``(n, 1, 1)`` mesh over this process's own devices.

  Host-driven work that every process repeats on the same inputs (the
  sampler, teacher forwards, diagnostics: docs/DESIGN.md §3, "Several
  processes") runs here, so its outputs are ordinary local arrays.
  """
  return sharding_lib.make_mesh((-1, 1, 1), jax.local_devices())


def host_work_mesh(mesh):
  """Where host-driven work runs: ``mesh`` with one process, this process's
  ``local_mesh()`` with several."""
  return local_mesh() if jax.process_count() > 1 else mesh


def replicate_on(tree, mesh):
  """Every (possibly cross-process sharded) array of ``tree`` as a full copy
  replicated over ``mesh`` (a local mesh): ``gather_to_host`` then
  ``device_put``. Costs one all-gather of the tree per call."""
  return jax.device_put(gather_to_host(tree), sharding_lib.replicated(mesh))


def batch_shard_count(sharding: NamedSharding) -> int:
  """How many ways ``sharding`` splits dim 0 (the batch)."""
  entry = sharding.spec[0] if len(sharding.spec) else None
  names = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(sharding.mesh.shape[n] for n in names)


def process_batch_rows(mesh, rules, global_batch_size: int) -> slice:
  """The rows of a ``global_batch_size`` batch that this process must load.

  Raises ValueError when the mesh's batch axes do not divide the batch or
  this process's rows are not one contiguous block.
  """
  sharding = sharding_lib.batch_sharding(mesh, rules, 1)
  shards = batch_shard_count(sharding)
  if global_batch_size % shards:
    raise ValueError(f"{global_batch_size=} is not divisible by the {shards} batch shards of "
                     f"mesh {dict(mesh.shape)}")
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  rows = sorted({(idx[0].start or 0, global_batch_size if idx[0].stop is None else idx[0].stop)
                 for idx in index_map.values()})
  for (_, stop), (start, _) in zip(rows, rows[1:]):
    if stop != start:
      raise ValueError(f"this process's batch rows {rows} are not contiguous on mesh "
                       f"{dict(mesh.shape)}")
  return slice(rows[0][0], rows[-1][1])


def shard_batch(batch: PyTree, mesh, rules=sharding_lib.DEFAULT_RULES) -> PyTree:
  """Places a host batch (pytree of ``[B_local, ...]`` arrays) on the mesh.

  The leading dimension of every leaf is the batch and is sharded over the
  mesh axes the rules give ``batch``. With one process ``B_local`` is the
  global batch; with several, each process passes its own rows
  (``process_batch_rows``) and the global array has
  ``B_local * process_count`` rows.
  """
  rules = sharding_lib.validate_rules(rules)
  multi = jax.process_count() > 1

  def put(path, x):
    x = np.asarray(x)
    if x.ndim == 0:
      raise ValueError(f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a "
                       "leading batch dimension")
    sharding = sharding_lib.batch_sharding(mesh, rules, x.ndim)
    shards = batch_shard_count(sharding)
    if not multi:
      if x.shape[0] % shards:
        raise ValueError(f"batch{jax.tree_util.keystr(path)} has {x.shape=}; its batch dim is not "
                         f"divisible by the {shards} batch shards of mesh {dict(mesh.shape)}")
      return jax.device_put(x, sharding)
    local_shards = shards * len(sharding.addressable_devices) // len(mesh.devices.flat)
    if x.shape[0] % max(local_shards, 1):
      raise ValueError(f"batch{jax.tree_util.keystr(path)} has local {x.shape=}; not divisible by "
                       f"this process's {local_shards} batch shards")
    return jax.make_array_from_process_local_data(sharding, x)

  return jax.tree_util.tree_map_with_path(put, batch)


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (for local multi-process tests)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]
