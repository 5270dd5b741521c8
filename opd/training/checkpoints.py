"""Training checkpoints: state, data-iterator position and config, via Orbax.

One checkpoint (a directory ``<root>/<step>/``) holds four items:

* ``state``: any pytree of ``jax.Array`` (normally a ``TrainState``: step,
  fp32 params, optimizer state, RNG), written sharded (each process writes
  its shards, OCDBT format);
* ``data``: a JSON dict, the data iterator's position (``grain`` iterators
  give one with ``get_state()``);
* ``config``: a JSON dict, the experiment config. By convention
  ``config["model"]`` is ``ModelConfig.to_dict()``; ``restore`` compares any
  ``expected_config`` against it field by field;
* ``meta``: a JSON dict, the checksum of every array of ``state`` and the
  caller's ``extra`` (the loop keeps its first-step metrics and the lengths
  of its metric logs there).

Guarantees:

* Atomic writes: Orbax writes ``<step>.orbax-checkpoint-tmp`` and renames it
  to ``<step>`` only after every item is on disk. A save that dies midway
  (exception, SIGKILL) leaves at most a tmp directory, which readers ignore
  and the next save of that step replaces; the previous checkpoints are
  untouched. Old checkpoints are garbage-collected only after a newer one
  has been committed, and an existing step is never overwritten.
* Retention: the ``max_to_keep`` newest checkpoints, plus the ``keep_best``
  best by ``metrics[best_metric]`` (Orbax ``LatestN`` + ``BestN``
  preservation policies).
* Resharding: ``restore(target)`` reads onto the shardings of ``target``
  (arrays or ``jax.ShapeDtypeStruct`` with ``sharding``), whatever mesh the
  checkpoint was written from.
* Integrity: ``save`` stores a 64-bit checksum of every array of the state
  (``opd.training.integrity``: computed on device from the global values, so it is
  the same whatever the mesh); ``restore`` and ``load_params`` recompute it on
  what they read and raise ``CheckpointCorruptError`` naming the step and the
  array on a mismatch (any single flipped bit is caught). The error names the
  previous checkpoint; ``quarantine`` moves a corrupt step aside so that a
  relaunch resumes from that one. Checkpoints written before the checksums
  existed restore unchecked, with a warning.
* Loud failures: a shape or config mismatch raises ``ValueError`` naming the
  field and both values; an unreadable (corrupted) checkpoint raises
  ``CheckpointCorruptError`` naming its path. Restoring never deletes or
  modifies anything on disk.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from opd.config.overrides import config_mismatches
from opd.training.integrity import path_key, tree_checksums

log = logging.getLogger(__name__)


class _QuietOrbax(logging.Filter):
  """Drops Orbax's INFO/DEBUG records (a dozen lines per save, through absl's
  logger); warnings and errors still pass. Set ``OPD_VERBOSE_ORBAX=1`` to
  keep them."""

  def filter(self, record: logging.LogRecord) -> bool:
    if "/orbax/" not in record.pathname:
      return True
    # An unranked save under keep_best is deliberate (CheckpointManager.save).
    return (record.levelno >= logging.WARNING
            and "did not provide metrics" not in record.getMessage())


if not os.environ.get("OPD_VERBOSE_ORBAX"):
  logging.getLogger("absl").addFilter(_QuietOrbax())
PyTree = Any



class CheckpointCorruptError(RuntimeError):
  """A checkpoint exists but cannot be read back, or reads back other values
  than were saved. ``step`` and ``leaf`` (the array, for a checksum mismatch)
  say where; ``previous`` is the newest earlier committed step, or None."""

  def __init__(self, message: str, *, step: int | None = None, leaf: str | None = None,
               previous: int | None = None):
    super().__init__(message)
    self.step, self.leaf, self.previous = step, leaf, previous


@dataclasses.dataclass
class Restored:
  """What ``CheckpointManager.restore`` returns (``extra``: what ``save`` got as ``extra``)."""
  step: int
  state: PyTree
  data_state: dict
  config: dict
  path: str
  extra: dict = dataclasses.field(default_factory=dict)


def _type_handler_registry(replica_parallel: bool):
  """The default Orbax type handlers, with jax.Array's replica-parallel
  writes switchable: they slice every replicated array on device, which on
  CPU costs one XLA compile per distinct shard shape (~10 s for a tiny model
  on 8 fake devices, as of orbax 0.12.8)."""
  th = ocp.type_handlers
  registry = th.create_type_handler_registry(
      *[(ty, th.get_type_handler(ty)) for ty in th.supported_types()])
  registry.add(jax.Array, th.ArrayHandler(use_replica_parallel=replica_parallel), override=True,
               ignore_warnings=True)
  return registry


def _json_or_raise(value, name: str) -> dict:
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise ValueError(f"{name} must be a JSON-able dict, got {type(value).__name__}")
  try:
    return json.loads(json.dumps(dict(value)))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} is not JSON-serialisable: {e}") from e


def _shapes_by_path(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(path_key(k) for k in path): tuple(getattr(x, "shape", ()))
          for path, x in leaves if x is not None}


def abstract_like(tree) -> PyTree:
  """``jax.ShapeDtypeStruct``s (with shardings) for a pytree of arrays."""
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  return jax.tree.map(one, tree)


class CheckpointManager:
  """Saves and restores training checkpoints under one root directory.

  Args:
    directory: root directory (created if missing).
    max_to_keep: keep this many newest checkpoints (None keeps all).
    keep_best: additionally keep this many best checkpoints by
      ``metrics[best_metric]`` (0 disables).
    best_metric: the metric name that ranks checkpoints.
    best_mode: "min" or "max".
    async_save: return from ``save`` once arrays are copied to host and write
      in a background thread (call ``wait()`` before relying on the files).
    replica_parallel: spread writes of replicated arrays over replicas
      (default: off on CPU, where it only costs compiles).
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
               keep_best: int = 0, best_metric: str = "loss", best_mode: str = "min",
               async_save: bool = False, replica_parallel: bool | None = None):
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
    if not isinstance(keep_best, int) or keep_best < 0:
      raise ValueError(f"keep_best must be a non-negative int, got {keep_best!r}")
    if best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.async_save = async_save
    self.best_metric = best_metric
    policies = [checkpoint_managers.LatestN(n=max_to_keep)]
    best_fn = None
    if keep_best:
      worst = float("inf") if best_mode == "min" else float("-inf")

      def best_fn(m):
        # Saves without the metric (save_every off the eval cadence) are
        # saved without metrics; older ones may hold others: rank them last.
        value = float(m.get(best_metric, worst)) if isinstance(m, Mapping) else worst
        return worst if value != value else value

      policies.append(checkpoint_managers.BestN(
          get_metric_fn=best_fn, reverse=best_mode == "min", n=keep_best,
          keep_checkpoints_without_metrics=False))
    # best_fn is also set on the options: Orbax writes metrics to disk only
    # then, and reloaded checkpoints need them for the BestN policy.
    options = ocp.CheckpointManagerOptions(
        preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
        best_fn=best_fn, best_mode=best_mode,
        enable_async_checkpointing=async_save, create=True)
    if replica_parallel is None:
      replica_parallel = jax.default_backend() != "cpu"
    state_handler = ocp.PyTreeCheckpointHandler(
        type_handler_registry=_type_handler_registry(replica_parallel))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state_handler)
    registry.add("state", ocp.args.PyTreeRestore, state_handler)
    for item in ("data", "config", "meta"):
      json_handler = ocp.JsonCheckpointHandler()
      registry.add(item, ocp.args.JsonSave, json_handler)
      registry.add(item, ocp.args.JsonRestore, json_handler)
    self._mngr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """Committed steps, ascending (tmp directories of unfinished saves excluded)."""
    return sorted(self._mngr.all_steps())

  def reload(self) -> None:
    """Re-reads the directory, for checkpoints written by another manager.
    Not during an async save (the pending step would be forgotten)."""
    self._mngr.reload()

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def previous_step(self, step: int) -> int | None:
    """The newest committed step before ``step``, or None."""
    older = [s for s in self.all_steps() if s < step]
    return older[-1] if older else None

  def quarantine(self, step: int) -> str:
    """Moves checkpoint ``step`` aside to ``<root>/<step>.corrupt[.N]`` (never
    deleted: kept for inspection) so that the newest remaining step is the one
    a relaunch resumes from; returns the new path."""
    self._resolve_step(step)
    src = self.step_path(step)
    dst, n = f"{src}.corrupt", 1
    while os.path.exists(dst):
      dst, n = f"{src}.corrupt.{n}", n + 1
    if jax.process_index() == 0:  # one rename on a directory every process sees
      os.rename(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"quarantine {src}")
    self.reload()
    log.warning("moved checkpoint %s aside to %s", src, dst)
    return dst

  # -- save ------------------------------------------------------------------

  def save(self, step: int, state: PyTree, *, data_state: Mapping | None = None,
           config: Mapping | None = None, metrics: Mapping[str, float] | None = None,
           extra: Mapping | None = None) -> None:
    """Writes checkpoint ``step``; raises ValueError if it already exists on disk.

    Args:
      step: the step number (normally ``int(state.step)``).
      state: pytree of arrays.
      data_state: JSON dict, e.g. ``iterator.get_state()``.
      config: JSON dict, e.g. ``{"model": model_cfg.to_dict(), ...}``.
      metrics: scalars; ``metrics[best_metric]`` ranks checkpoints for
        ``keep_best`` (a save without it is kept by ``max_to_keep`` only).
      extra: JSON dict restored as ``Restored.extra``.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise ValueError(f"step must be a non-negative int, got {step!r}")
    data = _json_or_raise(data_state, "data_state")
    cfg = _json_or_raise(config, "config")
    more = _json_or_raise(extra, "extra")
    if metrics is not None:
      metrics = {k: float(v) for k, v in metrics.items()}
      if self.best_metric not in metrics:
        metrics = None  # unranked (see best_fn)
    # The disk, not this manager's list: another process may have committed it.
    if os.path.exists(self.step_path(step)):
      raise ValueError(f"checkpoint step {step} already exists at {self.step_path(step)}; "
                       "refusing to overwrite it")
    meta = {"checksums": tree_checksums(state), "extra": more}
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data),
        config=ocp.args.JsonSave(cfg), meta=ocp.args.JsonSave(meta)), metrics=metrics,
        force=True)
    log.info("checkpoint %s %s", self.step_path(step),
             "committing in the background" if self.async_save else "committed")

  def wait(self) -> None:
    """Blocks until an in-flight async save is committed."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- restore ---------------------------------------------------------------

  def read_config(self, step: int | None = None) -> dict:
    """The config dict saved with ``step`` (default: the latest)."""
    step = self._resolve_step(step)
    try:
      return dict(self._mngr.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore())).config or {})
    except Exception as e:  # orbax/tensorstore raise many types on bad files
      raise CheckpointCorruptError(
          f"cannot read the config of checkpoint {self.step_path(step)}: "
          f"{type(e).__name__}: {e}") from e

  def restore(self, target: PyTree, step: int | None = None, *,
              expected_config: Mapping | None = None) -> Restored:
    """Reads checkpoint ``step`` (default: the latest) onto ``target``'s shardings.

    Args:
      target: pytree like the saved state, of arrays or
        ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``; its structure,
        shapes, dtypes and shardings are those of the result (the mesh may
        differ from the one the checkpoint was written from).
      step: which checkpoint.
      expected_config: nested dict that must agree with the saved config on
        every key it has, e.g. ``{"model": model_cfg.to_dict()}``.

    Raises:
      FileNotFoundError: no checkpoint under the directory, or no such step.
      ValueError: config or shape mismatch (names the field and both values).
      CheckpointCorruptError: the checkpoint's files cannot be read.
    """
    step = self._resolve_step(step)
    path = self.step_path(step)
    config = self.read_config(step)
    if expected_config is not None:
      bad = config_mismatches(config, expected_config)
      if bad:
        detail = "; ".join(f"{name}: checkpoint has {have!r}, expected {want!r}"
                           for name, have, want in bad)
        raise ValueError(f"checkpoint {path} was saved with a different config: {detail}")
    abstract = abstract_like(target)
    self._check_shapes(step, abstract)
    meta = self._read_meta(step)
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)),
          data=ocp.args.JsonRestore()))
    except Exception as e:
      raise CheckpointCorruptError(
          f"cannot restore checkpoint {path}: {type(e).__name__}: {e}{self._offer(step)}",
          step=step, previous=self.previous_step(step)) from e
    self._verify(step, out.state, meta)
    log.info("restored checkpoint %s", path)
    return Restored(step=step, state=out.state, data_state=dict(out.data or {}), config=config,
                    path=path, extra=dict((meta or {}).get("extra") or {}))

  def _offer(self, step: int) -> str:
    prev = self.previous_step(step)
    if prev is None:
      return "; there is no earlier checkpoint to fall back to"
    return (f"; the previous checkpoint is step {prev} ({self.step_path(prev)}): move "
            f"{self.step_path(step)} aside (CheckpointManager.quarantine, or "
            f"`mv {self.step_path(step)} {self.step_path(step)}.corrupt`) and relaunch to "
            "resume from it")

  def _read_meta(self, step: int) -> dict | None:
    """The ``meta`` item of ``step``; None for a checkpoint written without one."""
    if not os.path.isdir(os.path.join(self.step_path(step), "meta")):
      log.warning("checkpoint %s has no checksums (written before they existed): restored "
                  "unverified", self.step_path(step))
      return None
    try:
      meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:
      raise CheckpointCorruptError(
          f"cannot read the checksums of checkpoint {self.step_path(step)}: "
          f"{type(e).__name__}: {e}{self._offer(step)}", step=step,
          previous=self.previous_step(step)) from e
    if not isinstance(meta, Mapping) or not isinstance(meta.get("checksums"), Mapping):
      raise CheckpointCorruptError(
          f"checkpoint {self.step_path(step)} has a malformed meta item{self._offer(step)}",
          step=step, previous=self.previous_step(step))
    return dict(meta)

  def _verify(self, step: int, state: PyTree, meta: dict | None) -> None:
    """Raises ``CheckpointCorruptError`` naming the first array of ``state``
    whose checksum differs from the one saved with ``step``."""
    if meta is None:
      return
    saved = meta["checksums"]
    for name, got in tree_checksums(state).items():
      if name in saved and saved[name] != got:
        raise CheckpointCorruptError(
            f"checkpoint {self.step_path(step)} (step {step}) is corrupt: array {name} reads "
            f"back with checksum {got}, but {saved[name]} was saved{self._offer(step)}",
            step=step, leaf=name, previous=self.previous_step(step))

  def _resolve_step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no checkpoint under {self.directory}")
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} under {self.directory}; "
                              f"available: {steps}")
    return step

  def _check_shapes(self, step: int, abstract) -> None:
    path = self.step_path(step)
    try:
      meta = self._mngr.item_metadata(step)["state"]
    except Exception as e:
      raise CheckpointCorruptError(
          f"cannot read the metadata of checkpoint {path}: {type(e).__name__}: {e}") from e
    tree = getattr(meta, "tree", meta)
    if tree is None:
      raise CheckpointCorruptError(f"checkpoint {path} has no state metadata")
    saved, wanted = _shapes_by_path(tree), _shapes_by_path(abstract)
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
      fmt = lambda keys: [".".join(k) for k in keys[:8]]
      raise ValueError(f"checkpoint {path} has a different state structure: missing "
                       f"{fmt(missing)}, unexpected {fmt(extra)}")
    for key, shape in wanted.items():
      if saved[key] != shape:
        raise ValueError(f"checkpoint {path}: state.{'.'.join(key)} has shape {saved[key]} in "
                         f"the checkpoint but {shape} in the target")


def load_params(directory: str | os.PathLike, model_cfg, *, step: int | None = None,
                mesh=None, rules=None) -> PyTree:
  """The model parameters of a training checkpoint (optimizer state skipped).

  A LoRA run's checkpoint (a ``lora`` entry in its config) holds only the
  adapters: its base is restored from the checkpoint its config references
  (``lora.base``: path, step, checksum; ``opd.training.lora_state``) and the
  adapters merged in, in ``model_cfg``'s storage dtype; a base that is gone
  or changed raises ``lora_state.LoRABaseError`` naming paths and checksums.

  For starting one stage from another (SFT from the base, GRPO from SFT, a
  teacher in OPD). The checkpoint's saved ``config["model"]`` must equal
  ``model_cfg`` (a mismatch names the field and both values). Parameters are
  placed with the logical shardings of ``mesh`` when one is given, else on
  the default device.

  Args:
    directory: a ``CheckpointManager`` root (e.g. ``WORKDIR/checkpoints``).
    model_cfg: the ``ModelConfig`` the parameters are for.
    step: which checkpoint (default: the latest).
    mesh, rules: target mesh and logical rules (``opd.parallel.sharding``).
  """
  from opd.parallel import sharding
  from opd.models import init_params, param_logical_axes
  from opd.models.config import with_added_fields
  from opd.training import lora_state

  mngr = CheckpointManager(directory, max_to_keep=None)
  try:
    step = mngr._resolve_step(step)
    path = mngr.step_path(step)
    saved = mngr.read_config(step).get("model")
    if saved is None:
      raise ValueError(f"checkpoint {path} has no 'model' entry in its config; cannot check "
                       "that it matches the requested ModelConfig")
    # A field the model config gained after this checkpoint was written takes
    # its "off" default: what the checkpoint's model was.
    bad = config_mismatches(with_added_fields(saved), model_cfg.to_dict())
    if bad:
      detail = "; ".join(f"model.{name}: checkpoint has {have!r}, expected {want!r}"
                         for name, have, want in bad)
      raise ValueError(f"checkpoint {path} holds another architecture: {detail}")
    shapes = jax.eval_shape(lambda k: init_params(model_cfg, k), jax.random.key(0))
    if mesh is not None:
      shardings = sharding.tree_shardings(param_logical_axes(model_cfg), shapes, mesh,
                                          rules or sharding.DEFAULT_RULES)
    else:
      dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      shardings = jax.tree.map(lambda _: dev, shapes)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)
    lora = mngr.read_config(step).get("lora")  # a LoRA run: restore base + adapters, merge
    target = {"params": abstract if lora is None else
              lora_state.checkpoint_target(model_cfg, lora, abstract)}
    try:
      out = mngr._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
              partial_restore=True)))
    except Exception as e:
      raise CheckpointCorruptError(
          f"cannot restore params from checkpoint {path}: {type(e).__name__}: {e}",
          step=step) from e
    mngr._verify(step, out.state, mngr._read_meta(step))
    if lora is not None:
      return lora_state.merged_checkpoint_params(
          model_cfg, lora, out.state["params"], shardings, path=path,
          load_base=lambda d, s: load_params(d, model_cfg, step=s, mesh=mesh, rules=rules))
    return out.state["params"]
  finally:
    mngr.close()
