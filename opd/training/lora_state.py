"""A LoRA student's train state: a frozen base and trainable adapters (docs/DESIGN.md §2, LoRA).

``init_lora_train_state`` builds the ``TrainState`` whose params are
``{"base": params, "lora": adapters}``: the base in ``base_dtype`` (bf16 by
default, not the fp32 master copy a full fine-tune keeps), the adapters in
fp32, the optimizer wrapped by ``opd.models.lora.lora_optimizer`` so only
the adapters have moments. Any ``loss_fn(params, batch, rng)`` of the model
trains it through ``opd.models.lora.lora_loss`` with ``make_train_step``
unchanged; ``export_params`` merges the adapters for ``save_hf``.

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
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax

from opd.models.config import ModelConfig
from opd.models.decoder import init_params
from opd.models.lora import (LoRAConfig, lora_apply, lora_init, lora_loss, lora_merge,
                             lora_optimizer)
from opd.parallel import sharding as sharding_lib
from opd.training.loop_config import Runtime
from opd.training.optim import OptimConfig, make_optimizer
from opd.training.train_step import TrainState, init_train_state

PyTree = Any


def init_lora_train_state(model_cfg: ModelConfig, lora: LoRAConfig, optimizer, mesh,
                          rules=sharding_lib.DEFAULT_RULES, *, base_params: PyTree,
                          rng: int = 0, base_dtype: str = "bfloat16",
                          check_min_size: int | None = 2 ** 14):
  """``(state, shardings, optimizer)`` for a LoRA student.

  Args:
    model_cfg: the student's architecture.
    lora: which projections get adapters (``LoRAConfig``).
    optimizer: the adapters' optimizer (e.g. ``make_optimizer(OptimConfig(...))``);
      the returned one wraps it and is the one to pass to ``make_train_step``.
    mesh, rules: as ``init_train_state``; the base is sharded like a full model.
    base_params: the pretrained weights (unboxed), frozen.
    rng: seed of the adapters' ``a`` draw (``b`` starts at zero).
    base_dtype: storage dtype of the frozen base ("bfloat16", "float32", ...).
    check_min_size: as ``init_train_state``.

  Raises:
    ValueError: ``base_params`` not matching ``model_cfg`` (missing or extra
      weights, a wrong shape), or an unknown ``base_dtype``.
  """
  base_cfg = model_cfg.replace(param_dtype=base_dtype)  # validates base_dtype
  wrapped = lora_optimizer(optimizer)
  key = jax.random.key(rng)
  start = {"base": base_params, "lora": lora_init(model_cfg, lora, key)}

  def init_fn(r):
    return {"base": init_params(base_cfg, r, boxed=True),
            "lora": lora_init(model_cfg, lora, r, boxed=True)}

  state, shardings = init_train_state(init_fn, wrapped, mesh, rules, rng=rng, params=start,
                                      master_dtype=None, check_min_size=check_min_size)
  return state, shardings, wrapped


def export_params(state: TrainState, lora: LoRAConfig) -> PyTree:
  """The base with the adapters merged, on the host, in the base's dtype (for ``save_hf``)."""
  return lora_merge(state.params["base"], state.params["lora"], lora)


def _check_base_dtype(value, name: str) -> None:
  if value not in ("bfloat16", "float32", "float16"):
    raise ValueError(f"{name}={value!r}: expected 'bfloat16', 'float32' or 'float16'")


@dataclasses.dataclass(frozen=True)
class LoRAStudent:
  """A trainer's ``params`` for a LoRA run: adapters trained on a frozen base.

  Attributes:
    base: the pretrained weights (unboxed), never updated.
    config: rank, alpha and target projections (``LoRAConfig``).
    base_dtype: the base's storage dtype in the train state ("bfloat16"
      halves it; "float32" keeps it as given).
  """
  base: PyTree
  config: LoRAConfig = LoRAConfig()
  base_dtype: str = "bfloat16"

  def __post_init__(self):
    if not isinstance(self.config, LoRAConfig):
      raise ValueError(f"LoRAStudent.config must be a LoRAConfig, got "
                       f"{type(self.config).__name__}")
    if self.base is None:
      raise ValueError("LoRAStudent.base is None: LoRA adapts pretrained weights (give them)")
    _check_base_dtype(self.base_dtype, "LoRAStudent.base_dtype")

  def to_dict(self) -> dict:
    """The run-config entry ``lora`` (rank, alpha, targets, base dtype)."""
    return {**dataclasses.asdict(self.config), "targets": list(self.config.targets),
            "base_dtype": self.base_dtype}


@dataclasses.dataclass(frozen=True)
class Student:
  """A trainer's student: its train state and how the rest of the run sees it.

  Attributes:
    model_cfg: the architecture.
    state, shardings: the ``TrainState`` and its shardings; a LoRA state's
      params are ``{"base", "lora"}``.
    optimizer: the one to step with (adapter-only moments under LoRA).
    runtime: mesh and rules.
    lora: the ``LoRAStudent`` (None: full fine-tuning).
  """
  model_cfg: ModelConfig
  state: TrainState
  shardings: TrainState
  optimizer: Any
  runtime: Runtime
  lora: LoRAStudent | None = None

  @property
  def param_shardings(self) -> PyTree:
    """Shardings of the model's params tree (the base's under LoRA)."""
    return self.shardings.params["base"] if self.lora is not None else self.shardings.params

  @property
  def config_entries(self) -> dict:
    """``{"lora": ...}`` for the run config under LoRA (a resume must match it), else {}."""
    return {"lora": self.lora.to_dict()} if self.lora is not None else {}

  def loss(self, loss_fn: Callable) -> Callable:
    """``loss_fn(params, batch, rng)`` over the state's params (adapters only under LoRA)."""
    if self.lora is None:
      return loss_fn
    return lora_loss(loss_fn, self.lora.config, dtype=self.model_cfg.compute_dtype)

  @functools.cached_property
  def view(self) -> Callable[[PyTree], PyTree]:
    """``fn(state.params) -> params`` of the model: the identity, or under LoRA
    the base with the adapters applied in the compute dtype (what the loss
    sees), sharded like the base, for rollouts and evaluation."""
    if self.lora is None:
      return lambda p: p
    return jax.jit(lambda p: lora_apply(p["base"], p["lora"], self.lora.config,
                                        dtype=self.model_cfg.compute_dtype),
                   out_shardings=self.param_shardings)

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
  """``(config, base_dtype)`` of a run config's ``lora`` entry (``LoRAStudent.to_dict``)."""
  base_dtype = entry.get("base_dtype", "bfloat16")
  _check_base_dtype(base_dtype, "checkpoint config lora.base_dtype")
  return LoRAConfig(**{k: v for k, v in entry.items() if k != "base_dtype"}), base_dtype


def checkpoint_target(model_cfg: ModelConfig, entry: Mapping[str, Any],
                      abstract: PyTree) -> PyTree:
  """The ``{"base", "lora"}`` params a LoRA run's checkpoint holds, as the
  restore target: ``abstract`` (the model's params, with shardings) in the
  base's dtype, and the adapters replicated on the same devices."""
  lora, base_dtype = _from_entry(entry)
  base = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, base_dtype, sharding=a.sharding),
                      abstract)
  one = jax.tree.leaves(abstract)[0].sharding
  rep = (jax.sharding.NamedSharding(one.mesh, jax.sharding.PartitionSpec())
         if isinstance(one, jax.sharding.NamedSharding) else one)
  shapes = jax.eval_shape(lambda k: lora_init(model_cfg, lora, k), jax.random.key(0))
  lora = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), shapes)
  return {"base": base, "lora": lora}


def merged_checkpoint_params(model_cfg: ModelConfig, entry: Mapping[str, Any],
                             params: PyTree, shardings: PyTree) -> PyTree:
  """A restored ``{"base", "lora"}`` as the model's params: the adapters merged
  in the model's storage dtype, placed on ``shardings``."""
  lora, _ = _from_entry(entry)
  return jax.jit(lambda p: lora_apply(p["base"], p["lora"], lora, dtype=model_cfg.storage_dtype),
                 out_shardings=shardings)(params)


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
  state, shardings, wrapped = init_lora_train_state(
      model_cfg, params.config, optimizer, mesh, rules, base_params=nn.meta.unbox(params.base),
      rng=runtime.seed, base_dtype=params.base_dtype)
  return Student(model_cfg, state, shardings, wrapped, runtime, params)


__all__ = ["LoRAStudent", "Student", "checkpoint_target", "export_params",
           "init_lora_train_state", "init_student", "merged_checkpoint_params"]
