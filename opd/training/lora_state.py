"""A LoRA student's train state: a frozen base and trainable adapters (docs/DESIGN.md §2, LoRA).

``init_lora_train_state`` builds the ``TrainState`` whose params are
``{"base": params, "lora": adapters}``: the base in ``base_dtype`` (bf16 by
default, not the fp32 master copy a full fine-tune keeps), the adapters in
fp32, the optimizer wrapped by ``opd.models.lora.lora_optimizer`` so only
the adapters have moments. Any ``loss_fn(params, batch, rng)`` of the model
trains it through ``opd.models.lora.lora_loss`` with ``make_train_step``
unchanged; ``export_params`` merges the adapters for ``save_hf``.
"""
from __future__ import annotations

from typing import Any

import jax

from opd.models.config import ModelConfig
from opd.models.decoder import init_params
from opd.models.lora import LoRAConfig, lora_init, lora_merge, lora_optimizer
from opd.parallel import sharding as sharding_lib
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


__all__ = ["export_params", "init_lora_train_state"]
