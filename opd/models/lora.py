"""LoRA adapters as a transform of the params dict (docs/DESIGN.md §2, LoRA).

The decoder stays ``forward(cfg, params, ...)``; an adapter tree holds, per
targeted projection ``W`` of a block, ``a [in..., r]`` and ``b [r, out...]``,
and ``lora_apply`` returns the effective params ``W + (alpha / r) · a b``
(the product contracts the rank axis, so ``q [D, H, Dh]`` gets ``a [D, r]``,
``b [r, H, Dh]`` and ``o [H, Dh, D]`` gets ``a [H, Dh, r]``, ``b [r, D]``).
``b`` starts at zero, so a fresh adapter leaves the model unchanged.

Training keeps the base frozen and out of the train state: the state's
params are the adapters alone (so are the optimizer's moments and the
gradient), and ``lora_loss`` is a loss over the adapters that takes the base
as a separate, never differentiated argument
(``opd.training.train_step.LossWithFrozen`` passes it to the jitted step).
``lora_merge`` folds the adapters in for export (``opd.models.hf.save_hf``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from opd.config.fields import check_fields, set_field
from opd.models.config import ModelConfig

PyTree = Any

# Target name -> (module, number of leading input axes, logical axes of the weight).
TARGETS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "q": ("attn", 1, ("embed", "q_heads", "head_dim")),
    "k": ("attn", 1, ("embed", "kv_heads", "head_dim")),
    "v": ("attn", 1, ("embed", "kv_heads", "head_dim")),
    "o": ("attn", 2, ("q_heads", "head_dim", "embed")),
    "gate": ("mlp", 1, ("embed", "mlp")),
    "up": ("mlp", 1, ("embed", "mlp")),
    "down": ("mlp", 1, ("mlp", "embed")),
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """Which projections get adapters, and their rank and scale.

  Attributes:
    rank: r, the adapters' inner width.
    alpha: the update is scaled by ``alpha / rank``.
    targets: names among ``TARGETS`` (attention q/k/v/o, MLP gate/up/down).
  """
  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

  def __post_init__(self):
    check_fields(self, "LoRAConfig", ints={"rank": 1}, positive=("alpha",))
    if isinstance(self.targets, str):
      raise ValueError(f"LoRAConfig.targets={self.targets!r} must be a sequence of names")
    set_field(self, "targets", tuple(self.targets))
    unknown = sorted(set(self.targets) - set(TARGETS))
    if unknown or not self.targets:
      raise ValueError(f"LoRAConfig.targets={self.targets!r}: unknown {unknown}; choose from "
                       f"{tuple(TARGETS)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _sites(cfg: ModelConfig, lora: LoRAConfig):
  """``(layer name, module, weight name)`` of every adapted weight."""
  if cfg.mla is not None and any(TARGETS[t][0] == "attn" for t in lora.targets):
    raise ValueError("LoRAConfig.targets name attention projections, but the model uses MLA "
                     "(its projections are kv_a / kv_b / q_a / q_b); target the MLP only")
  for i in range(cfg.n_layers):
    for t in lora.targets:
      module = TARGETS[t][0]
      if module == "mlp" and cfg.moe is not None and cfg.moe.is_moe_layer(i):
        continue  # routed experts are stacked [E, ...]; not adapted
      yield f"layers_{i}", module, t


def _weight_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
  D, H, K, Dh, F = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.d_ff)
  return {"q": (D, H, Dh), "k": (D, K, Dh), "v": (D, K, Dh), "o": (H, Dh, D),
          "gate": (D, F), "up": (D, F), "down": (F, D)}[name]


def lora_init(cfg: ModelConfig, lora: LoRAConfig, rng, *, boxed: bool = False,
              dtype=jnp.float32) -> PyTree:
  """Adapters ``{layer: {module: {name: {"a", "b"}}}}``: ``a`` ~ N(0, 1/in), ``b`` = 0.

  ``boxed=True`` wraps each array in ``nn.LogicallyPartitioned`` (the rank
  axis replicated), as ``opd.training.train_step.init_train_state`` needs.
  """
  tree: dict = {}
  for n, (layer, module, name) in enumerate(_sites(cfg, lora)):
    shape, n_in = _weight_shape(cfg, name), TARGETS[name][1]
    axes = TARGETS[name][2]
    fan_in = math.prod(shape[:n_in])
    a = jax.random.normal(jax.random.fold_in(rng, n), shape[:n_in] + (lora.rank,),
                          jnp.float32) / math.sqrt(fan_in)
    b = jnp.zeros((lora.rank,) + shape[n_in:], jnp.float32)
    a, b = a.astype(dtype), b.astype(dtype)
    if boxed:
      a = nn.LogicallyPartitioned(a, axes[:n_in] + (None,))
      b = nn.LogicallyPartitioned(b, (None,) + axes[n_in:])
    tree.setdefault(layer, {}).setdefault(module, {})[name] = {"a": a, "b": b}
  return tree


def lora_delta(a, b, scale: float):
  """``scale · a b`` over the rank axis: ``[in..., r] × [r, out...] -> [in..., out...]``."""
  return scale * jnp.tensordot(a, b, axes=1)


def lora_apply(params: PyTree, adapters: PyTree, lora: LoRAConfig, *, dtype=None) -> PyTree:
  """The effective params: each adapted ``W`` replaced by ``W + scale · a b``.

  ``dtype``: the adapted weights' dtype (None: each base weight's own). The
  trainers pass the model's compute dtype: the forward casts every weight to
  it anyway, so the sum is rounded once, where a bf16 base's dtype would
  round a small early ``a b`` away before an fp32 forward sees it.
  """
  out = jax.tree.map(lambda x: x, params)  # a fresh container tree
  for layer, modules in adapters.items():
    for module, weights in modules.items():
      for name, ab in weights.items():
        try:
          w = params[layer][module][name]
        except KeyError as e:
          raise ValueError(f"adapter {layer}/{module}/{name} has no base weight") from e
        delta = lora_delta(ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32), lora.scale)
        if delta.shape != w.shape:
          raise ValueError(f"adapter {layer}/{module}/{name} gives shape {delta.shape}, the "
                           f"base weight is {w.shape}")
        out[layer][module][name] = (w.astype(jnp.float32) + delta).astype(
            w.dtype if dtype is None else dtype)
  return out


def lora_merge(params: PyTree, adapters: PyTree, lora: LoRAConfig) -> PyTree:
  """The adapters folded into the base, for export (``save_hf``): ``lora_apply``'s
  result as concrete arrays."""
  return jax.device_get(jax.jit(lambda p, a: lora_apply(p, a, lora))(params, adapters))


def lora_loss(loss_fn: Callable, lora: LoRAConfig, *, dtype=None) -> Callable:
  """``loss_fn(params, batch, rng)`` as ``fn(adapters, batch, rng, base)``: a loss
  of the adapters alone, the base an input it is not differentiated for (its
  gradient is never formed: no base-sized buffer), ``dtype`` as in ``lora_apply``."""
  def wrapped(adapters, batch, rng, base):
    return loss_fn(lora_apply(base, adapters, lora, dtype=dtype), batch, rng)
  return wrapped


def lora_param_count(cfg: ModelConfig, lora: LoRAConfig) -> int:
  """Trainable parameters: ``r · (in + out)`` per adapted weight."""
  total = 0
  for _, _, name in _sites(cfg, lora):
    shape, n_in = _weight_shape(cfg, name), TARGETS[name][1]
    total += lora.rank * (math.prod(shape[:n_in]) + math.prod(shape[n_in:]))
  return total


def lora_adapted_count(cfg: ModelConfig, lora: LoRAConfig) -> int:
  """Parameters of the adapted base weights (``lora_apply`` materialises each
  ``W + s·a b``: the forward reads, and the backward keeps, that many)."""
  return sum(math.prod(_weight_shape(cfg, name)) for _, _, name in _sites(cfg, lora))


__all__ = ["LoRAConfig", "TARGETS", "lora_adapted_count", "lora_apply", "lora_delta",
           "lora_init", "lora_loss", "lora_merge", "lora_param_count"]
