"""A LoRA student's train state: a frozen base and trainable adapters (docs/DESIGN.md §2, LoRA).

``init_lora_train_state`` builds the ``TrainState`` whose params are the
adapters alone (fp32; the optimizer's moments, the gradient and the
checkpoints hold only them) and places the frozen base beside it, in
``base_dtype`` (bf16 by default, not the fp32 master copy a full fine-tune
keeps), sharded like a full model's params. Any ``loss_fn(params, batch,
rng)`` of the model trains it as ``LossWithFrozen(lora_loss(loss_fn), base)``
with ``make_train_step``: the base is an argument of the compiled step,
never differentiated. ``export_params`` merges the adapters for ``save_hf``.

A LoRA run's checkpoint holds the adapters, their optimizer state and, in its
config's ``lora`` entry, a reference to the base: ``base = {"path", "step",
"checksum"}`` (the base checkpoint it was loaded from, when
``LoRAStudent.base_checkpoint`` says so, and ``base_checksum`` of the base as
trained). A resume compares the checksum with the base it is given (the
config check names both); ``opd.training.checkpoints.load_params`` restores
the base from the path and refuses (``LoRABaseError``) a missing or changed
one.

The trainers (``train_lm`` / ``train_sft``, ``train_grpo``, ``train_opd``)
take a ``LoRAStudent(base, config)`` as their ``params`` and build through
``init_student``: a ``Student`` holds the state, the optimizer to step with
and the seams where the rest of a run sees the model: ``view`` (the merged
params for rollouts and evaluation), ``loss`` (the adapter-only loss for
``make_train_step``), ``source`` (a rollout source that samples from the
merged params), ``eval_fn`` and ``config_entries`` (``lora`` in the run
config, compared on resume).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import numpy as np

from opd.models.config import ModelConfig
from opd.models.decoder import init_params, param_logical_axes
from opd.models.lora import LoRAConfig, lora_apply, lora_init, lora_loss, lora_merge
from opd.parallel import sharding as sharding_lib
from opd.training.integrity import tree_checksums
from opd.training.loop_config import Runtime
from opd.training.optim import OptimConfig, make_optimizer
from opd.training.train_step import (LossWithFrozen, TrainState, check_same_tree,
                                     init_train_state)

PyTree = Any


class LoRABaseError(ValueError):
  """A LoRA checkpoint's base cannot be restored: no path was recorded, the
  path or step is gone, or the base there is not the one the adapters were
  trained on (the message names the path and both checksums)."""


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x,
                      tree)


def place_base(model_cfg: ModelConfig, base_params: PyTree, mesh,
               rules=sharding_lib.DEFAULT_RULES, *, base_dtype: str = "bfloat16",
               check_min_size: int | None = 2 ** 14) -> PyTree:
  """The frozen base in ``base_dtype``, sharded like the model's params on ``mesh``.

  Raises:
    ValueError: ``base_params`` not matching ``model_cfg`` (names the weight as
      ``params['base'][...]``), or an unknown ``base_dtype``.
  """
  base_cfg = model_cfg.replace(param_dtype=base_dtype)  # validates base_dtype
  abstract = jax.eval_shape(lambda k: init_params(base_cfg, k), jax.random.key(0))
  check_same_tree({"base": base_params}, {"base": abstract})
  shardings = sharding_lib.tree_shardings(param_logical_axes(base_cfg), abstract, mesh, rules)
  base = jax.jit(lambda p: _cast(p, base_cfg.storage_dtype), out_shardings=shardings)(base_params)
  if check_min_size is not None:
    sharding_lib.check_sharded(base, min_size=check_min_size, what="LoRA base")
  return base


def base_checksum(base: PyTree) -> str:
  """16 hex digits identifying the base's values: a hash of every array's
  ``opd.training.integrity`` checksum (the same on any mesh)."""
  lines = "\n".join(f"{k}={v}" for k, v in sorted(tree_checksums(base).items()))
  return hashlib.sha256(lines.encode()).hexdigest()[:16]


def init_lora_train_state(model_cfg: ModelConfig, lora: LoRAConfig, optimizer, mesh,
                          rules=sharding_lib.DEFAULT_RULES, *, base_params: PyTree,
                          rng: int = 0, base_dtype: str = "bfloat16",
                          check_min_size: int | None = 2 ** 14):
  """``(state, shardings, base)`` for a LoRA student.

  The state's params are the adapters (fp32) and its optimizer state theirs
  alone; ``base`` is ``place_base``'s frozen base, to pass to the step as
  ``LossWithFrozen(lora_loss(loss_fn, lora), base)``.

  Args:
    model_cfg: the student's architecture.
    lora: which projections get adapters (``LoRAConfig``).
    optimizer: the adapters' optimizer (e.g. ``make_optimizer(OptimConfig(...))``).
    mesh, rules: as ``init_train_state``; the base is sharded like a full model.
    base_params: the pretrained weights (unboxed), frozen.
    rng: seed of the adapters' ``a`` draw (``b`` starts at zero).
    base_dtype: storage dtype of the frozen base ("bfloat16", "float32", ...).
    check_min_size: as ``init_train_state``.

  Raises:
    ValueError: ``base_params`` not matching ``model_cfg`` (missing or extra
      weights, a wrong shape), or an unknown ``base_dtype``.
  """
  base = place_base(model_cfg, base_params, mesh, rules, base_dtype=base_dtype,
                    check_min_size=check_min_size)
  state, shardings = init_train_state(
      lambda r: lora_init(model_cfg, lora, r, boxed=True), optimizer, mesh, rules, rng=rng,
      params=lora_init(model_cfg, lora, jax.random.key(rng)), master_dtype=None,
      check_min_size=check_min_size)
  return state, shardings, base


def export_params(student: "LoRAStudent", adapters: PyTree) -> PyTree:
  """``student``'s base (in its ``base_dtype``) with ``adapters`` (a LoRA
  state's params) merged, on the host, for ``save_hf``."""
  base = _cast(nn.meta.unbox(student.base), np.dtype(student.base_dtype))
  return lora_merge(base, adapters, student.config)


def _checkpoint_step(path: str, step: int | None) -> int:
  """``step`` (None: the latest) of the checkpoint root ``path``, which must hold it
  (committed steps are the root's ``<step>/`` directories, opd.training.checkpoints)."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"LoRA base checkpoint {path} does not exist")
  steps = sorted(int(n) for n in os.listdir(path)
                 if n.isdigit() and os.path.isdir(os.path.join(path, n)))
  if not steps or (step is not None and step not in steps):
    raise FileNotFoundError(f"LoRA base checkpoint {path} has no step {step}; it holds "
                            f"{steps}")
  return steps[-1] if step is None else step


def _check_base_dtype(value, name: str) -> None:
  if value not in ("bfloat16", "float32", "float16"):
    raise ValueError(f"{name}={value!r}: expected 'bfloat16', 'float32' or 'float16'")


@dataclasses.dataclass(frozen=True)
class LoRAStudent:
  """A trainer's ``params`` for a LoRA run: adapters trained on a frozen base.

  Attributes:
    base: the pretrained weights (unboxed), never updated.
    config: rank, alpha and target projections (``LoRAConfig``).
    base_dtype: the base's storage dtype while training ("bfloat16" halves
      it; "float32" keeps it as given).
    base_checkpoint: the ``CheckpointManager`` root ``base`` was loaded from
      (``load_params``), recorded in the run's checkpoints so that
      ``load_params`` can restore the base; None: a base from elsewhere (the
      run still trains and resumes; its checkpoints cannot be loaded alone).
    base_step: that checkpoint's step (None: its latest, resolved now).
  """
  base: PyTree
  config: LoRAConfig = LoRAConfig()
  base_dtype: str = "bfloat16"
  base_checkpoint: str | os.PathLike | None = None
  base_step: int | None = None

  def __post_init__(self):
    if not isinstance(self.config, LoRAConfig):
      raise ValueError(f"LoRAStudent.config must be a LoRAConfig, got "
                       f"{type(self.config).__name__}")
    if self.base is None:
      raise ValueError("LoRAStudent.base is None: LoRA adapts pretrained weights (give them)")
    _check_base_dtype(self.base_dtype, "LoRAStudent.base_dtype")
    if self.base_step is not None and self.base_checkpoint is None:
      raise ValueError(f"LoRAStudent.base_step={self.base_step} without base_checkpoint")
    if self.base_checkpoint is not None:
      path = os.path.abspath(os.fspath(self.base_checkpoint))
      object.__setattr__(self, "base_checkpoint", path)
      object.__setattr__(self, "base_step", _checkpoint_step(path, self.base_step))

  def to_dict(self) -> dict:
    """The run-config entry ``lora`` (rank, alpha, targets, base dtype) without
    the base reference (``Student.config_entries`` adds it)."""
    return {**dataclasses.asdict(self.config), "targets": list(self.config.targets),
            "base_dtype": self.base_dtype}


@dataclasses.dataclass(frozen=True)
class Student:
  """A trainer's student: its train state and how the rest of the run sees it.

  Attributes:
    model_cfg: the architecture.
    state, shardings: the ``TrainState`` and its shardings; a LoRA state's
      params are the adapters.
    optimizer: the one to step with.
    runtime: mesh and rules.
    lora: the ``LoRAStudent`` (None: full fine-tuning).
    base: under LoRA the frozen base, placed (``place_base``); else None.
    base_ref: under LoRA the ``lora.base`` entry of the run config
      (``{"path", "step", "checksum"}``); else None.
  """
  model_cfg: ModelConfig
  state: TrainState
  shardings: TrainState
  optimizer: Any
  runtime: Runtime
  lora: LoRAStudent | None = None
  base: PyTree = None
  base_ref: dict | None = None

  @property
  def param_shardings(self) -> PyTree:
    """Shardings of the model's params tree (the base's under LoRA)."""
    if self.lora is None:
      return self.shardings.params
    return jax.tree.map(lambda x: x.sharding, self.base)

  @property
  def config_entries(self) -> dict:
    """``{"lora": ...}`` for the run config under LoRA, with the base
    reference (a resume must match it: another base is refused), else {}."""
    if self.lora is None:
      return {}
    return {"lora": {**self.lora.to_dict(), "base": dict(self.base_ref)}}

  def loss(self, loss_fn: Callable) -> Callable:
    """``loss_fn(params, batch, rng)`` over the state's params: under LoRA a
    ``LossWithFrozen`` of the adapters, the base its frozen argument."""
    if self.lora is None:
      return loss_fn
    return LossWithFrozen(lora_loss(loss_fn, self.lora.config,
                                    dtype=self.model_cfg.compute_dtype), self.base)

  @functools.cached_property
  def view(self) -> Callable[[PyTree], PyTree]:
    """``fn(state.params) -> params`` of the model: the identity, or under LoRA
    the base with the adapters applied in the compute dtype (what the loss
    sees), sharded like the base, for rollouts and evaluation."""
    if self.lora is None:
      return lambda p: p
    merge = jax.jit(lambda base, adapters: lora_apply(base, adapters, self.lora.config,
                                                      dtype=self.model_cfg.compute_dtype),
                    out_shardings=self.param_shardings)
    return lambda adapters: merge(self.base, adapters)

  def after_update(self, hook: Callable | None) -> Callable | None:
    """``make_train_step``'s ``after_update`` hook for this student.

    Raises:
      ValueError: a hook (an MoE's selection-bias update) under LoRA, which
        freezes the base the hook would change.
    """
    if self.lora is not None and hook is not None:
      raise ValueError("LoRA freezes the base, but ModelConfig.moe.bias_update_rate="
                       f"{self.model_cfg.moe.bias_update_rate} updates its selection bias; "
                       "set it to 0 for a LoRA student")
    return hook

  def source(self, source):
    """A rollout source that builds its batches from ``view(state.params)``."""
    return source if self.lora is None else _ViewedSource(source, self.view)

  def eval_fn(self, fn: Callable | None) -> Callable | None:
    """``fn(params)`` of the model as a hook over the state's params."""
    if fn is None or self.lora is None:
      return fn
    view = self.view
    return lambda p: fn(view(p))


class _ViewedSource:
  """``source`` with ``next_batch`` given the state whose params are ``view(params)``."""

  def __init__(self, source, view):
    self._source, self._view = source, view
    self.updates_per_batch = source.updates_per_batch

  def next_batch(self, state: TrainState, step: int):
    return self._source.next_batch(state.replace(params=self._view(state.params)), step)

  def step_metrics(self, host_metrics, train_metrics, *, batch_time_s, train_time_s):
    return self._source.step_metrics(host_metrics, train_metrics, batch_time_s=batch_time_s,
                                     train_time_s=train_time_s)

  def texts(self, step: int) -> Mapping[str, str]:
    return self._source.texts(step)

  def get_state(self) -> Mapping[str, Any]:
    return self._source.get_state()

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._source.set_state(state)


def _from_entry(entry: Mapping[str, Any]) -> tuple[LoRAConfig, str]:
  """``(config, base_dtype)`` of a run config's ``lora`` entry (``Student.config_entries``)."""
  base_dtype = entry.get("base_dtype", "bfloat16")
  _check_base_dtype(base_dtype, "checkpoint config lora.base_dtype")
  return LoRAConfig(**{k: v for k, v in entry.items()
                       if k not in ("base_dtype", "base")}), base_dtype


def checkpoint_target(model_cfg: ModelConfig, entry: Mapping[str, Any],
                      abstract: PyTree) -> PyTree:
  """The adapters a LoRA run's checkpoint holds as its params, as the restore
  target: replicated on the devices of ``abstract`` (the model's params, with
  shardings)."""
  lora, _ = _from_entry(entry)
  one = jax.tree.leaves(abstract)[0].sharding
  rep = (jax.sharding.NamedSharding(one.mesh, jax.sharding.PartitionSpec())
         if isinstance(one, jax.sharding.NamedSharding) else one)
  shapes = jax.eval_shape(lambda k: lora_init(model_cfg, lora, k), jax.random.key(0))
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), shapes)


def merged_checkpoint_params(model_cfg: ModelConfig, entry: Mapping[str, Any], adapters: PyTree,
                             shardings: PyTree, *, path: str, load_base: Callable) -> PyTree:
  """A LoRA checkpoint's model params: its base, restored from the reference
  in ``entry`` with ``load_base(directory, step)`` (``load_params``) and
  checked against the recorded checksum, with ``adapters`` merged in the
  model's storage dtype, placed on ``shardings``. ``path`` (the LoRA
  checkpoint) is for the errors.

  Raises:
    LoRABaseError: the checkpoint records no base path, the base checkpoint
      or its step is gone, or its params' checksum differs from the one the
      adapters were trained on (naming the paths and both checksums).
  """
  lora, base_dtype = _from_entry(entry)
  ref = entry.get("base")
  if not isinstance(ref, Mapping) or "checksum" not in ref:
    raise LoRABaseError(f"LoRA checkpoint {path} has no base reference (config lora.base); "
                        "it was written before LoRA checkpoints stored only the adapters")
  if ref.get("path") is None:
    raise LoRABaseError(
        f"LoRA checkpoint {path} holds only adapters, and its base (checksum "
        f"{ref['checksum']}) was not loaded from a checkpoint (LoRAStudent.base_checkpoint was "
        "None), so it cannot be restored from here")
  try:
    base = load_base(ref["path"], ref.get("step"))
  except (FileNotFoundError, ValueError) as e:
    raise LoRABaseError(
        f"LoRA checkpoint {path}: its base {ref['path']} (step {ref.get('step')}, checksum "
        f"{ref['checksum']}) cannot be restored: {e}") from e
  base = jax.jit(lambda p: _cast(p, np.dtype(base_dtype)), out_shardings=shardings)(base)
  got = base_checksum(base)
  if got != ref["checksum"]:
    raise LoRABaseError(
        f"LoRA checkpoint {path} was trained on the base {ref['path']} (step {ref.get('step')}) "
        f"with checksum {ref['checksum']}, but the base there now has checksum {got}: it "
        "changed since; refusing to merge the adapters into another base")
  return jax.jit(lambda b, a: lora_apply(b, a, lora, dtype=model_cfg.storage_dtype),
                 out_shardings=shardings)(base, adapters)


def init_student(model_cfg: ModelConfig, optim: OptimConfig, runtime: Runtime,
                 params: PyTree | LoRAStudent | None) -> Student:
  """The trainers' student: a full state from ``params`` (None: random init
  from ``runtime.seed``), or a LoRA state when ``params`` is a ``LoRAStudent``.

  Raises:
    ValueError: a ``LoRAStudent`` whose base does not match ``model_cfg``
      (naming the weight), or whose targets the model lacks (MLA attention).
  """
  optimizer = make_optimizer(optim)
  mesh, rules = runtime.mesh, runtime.rules
  if not isinstance(params, LoRAStudent):
    state, shardings = init_train_state(model_cfg, optimizer, mesh, rules, rng=runtime.seed,
                                        params=params)
    return Student(model_cfg, state, shardings, optimizer, runtime)
  state, shardings, base = init_lora_train_state(
      model_cfg, params.config, optimizer, mesh, rules, base_params=nn.meta.unbox(params.base),
      rng=runtime.seed, base_dtype=params.base_dtype)
  ref = {"path": params.base_checkpoint, "step": params.base_step,
         "checksum": base_checksum(base)}
  return Student(model_cfg, state, shardings, optimizer, runtime, params, base, ref)


__all__ = ["LoRABaseError", "LoRAStudent", "Student", "base_checksum", "checkpoint_target",
           "export_params", "init_lora_train_state", "init_student", "merged_checkpoint_params",
           "place_base"]
