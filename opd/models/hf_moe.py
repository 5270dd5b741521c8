"""Mixture-of-experts fields and tensors in HF interop (docs/DESIGN.md §2).

``opd.models.hf_config`` and ``opd.models.hf`` call here for the MoE parts of
``Qwen3MoeForCausalLM`` (``model_type="qwen3_moe"``) and of
``DeepseekV3ForCausalLM``'s MoE layers: the ``MoEConfig`` read from and
written to ``config.json`` and the MoE layer's rows of the tensor table.

On disk every routed expert is its own set of ``nn.Linear`` weights (as the
released checkpoints; ``transformers`` fuses them when it loads)::

  mlp.gate.weight [E, D]                    ↔ mlp/router [D, E]
  mlp.gate.e_score_correction_bias [E]      ↔ mlp/selection_bias [E]   (sigmoid)
  mlp.experts.{e}.gate_proj.weight [Fe, D]  ↔ mlp/gate[e] [D, Fe]      (up_proj alike)
  mlp.experts.{e}.down_proj.weight [D, Fe]  ↔ mlp/down[e] [Fe, D]
  mlp.shared_experts.gate_proj.weight [S·Fe, D] ↔ mlp/shared_gate [D, S·Fe] (up, down alike)

A row's 7th entry is the expert index ``e``: the HF tensor is slice ``e`` of
our stacked parameter along its leading axis.
"""
from __future__ import annotations

from typing import Any, Mapping

from opd.models.moe import MoEConfig

QWEN3_MOE = "qwen3_moe"
QWEN3_MOE_CLASS = "Qwen3MoeForCausalLM"
# MoEConfig fields that shape training only (not the checkpoint's function).
TRAINING_FIELDS = ("aux_loss_coef", "seq_aux_loss_coef", "bias_update_rate", "dispatch")


def _require(hf: Mapping[str, Any], arch: str, *names: str) -> None:
  for name in names:
    if hf.get(name) is None:
      raise ValueError(f"HF config model_type={arch!r} lacks required field {name!r}")


def _first_dense_qwen3(hf: Mapping[str, Any], n_layers: int) -> int:
  """Qwen3-MoE's dense layers as ``first_k_dense``; other patterns raise."""
  step = hf.get("decoder_sparse_step", 1)
  only = list(hf.get("mlp_only_layers") or [])
  dense = [i for i in range(n_layers) if i in only or (i + 1) % step]
  if dense != list(range(len(dense))):
    raise ValueError(f"HF config mlp_only_layers={only} with decoder_sparse_step={step} makes "
                     f"layers {dense} dense; only the first k layers can be dense")
  return len(dense)


def moe_from_hf(hf: Mapping[str, Any], arch: str, n_layers: int) -> MoEConfig:
  """The ``MoEConfig`` of a ``qwen3_moe`` or ``deepseek_v3`` ``config.json``.

  Raises:
    ValueError: naming the HF field for a missing size or anything the MoE
      block does not implement (a non-prefix dense-layer pattern, a scoring
      function or top-k method other than DeepSeek-V3's).
  """
  if arch == QWEN3_MOE:
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
      raise ValueError(f"HF config model_type={arch!r} lacks required field 'num_experts'")
    _require(hf, arch, "num_experts_per_tok", "moe_intermediate_size")
    return MoEConfig(n_routed_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                     moe_d_ff=hf["moe_intermediate_size"], router="softmax",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     first_k_dense=_first_dense_qwen3(hf, n_layers),
                     aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
  if arch == "deepseek_v3":
    _require(hf, arch, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
      if hf.get(name, want) != want:
        raise ValueError(f"HF config {name}={hf[name]!r} is not supported (only {want!r})")
    return MoEConfig(n_routed_experts=hf["n_routed_experts"],
                     experts_per_token=hf["num_experts_per_tok"],
                     moe_d_ff=hf["moe_intermediate_size"],
                     n_shared_experts=hf.get("n_shared_experts", 1) or 0, router="sigmoid",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                     n_group=hf.get("n_group", 1) or 1, topk_group=hf.get("topk_group", 1) or 1,
                     first_k_dense=min(hf.get("first_k_dense_replace", 3), n_layers))
  raise ValueError(f"model_type={arch!r} has no mixture-of-experts mapping")


def moe_to_hf(moe: MoEConfig, arch: str) -> dict[str, Any]:
  """The ``config.json`` fields that express ``moe`` for ``arch``.

  Raises:
    ValueError: naming the ``MoEConfig`` field ``arch`` cannot express.
  """
  if arch == QWEN3_MOE:
    for name, want in (("router", "softmax"), ("n_shared_experts", 0), ("n_group", 1),
                       ("routed_scaling_factor", 1.0)):
      if getattr(moe, name) != want:
        raise ValueError(f"arch={QWEN3_MOE!r} needs MoEConfig.{name}={want!r}, got "
                         f"{getattr(moe, name)!r}")
    return {"num_experts": moe.n_routed_experts, "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.moe_d_ff, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(moe.first_k_dense)),
            "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False}
  if arch == "deepseek_v3":
    if moe.router != "sigmoid":
      raise ValueError(f"arch='deepseek_v3' needs MoEConfig.router='sigmoid', got "
                       f"{moe.router!r}")
    return {"n_routed_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.moe_d_ff, "n_shared_experts": moe.n_shared_experts,
            "norm_topk_prob": moe.norm_topk_prob,
            "routed_scaling_factor": moe.routed_scaling_factor, "n_group": moe.n_group,
            "topk_group": moe.topk_group, "first_k_dense_replace": moe.first_k_dense,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
  raise ValueError(f"arch={arch!r} cannot express a mixture of experts")


def same_architecture(a: MoEConfig | None, b: MoEConfig | None) -> bool:
  """Whether two MoE configs compute the same function (training fields ignored)."""
  if a is None or b is None:
    return a is b
  return all(getattr(a, f) == getattr(b, f) for f in a.__dataclass_fields__
             if f not in TRAINING_FIELDS)


def mlp_rows(moe: MoEConfig, d_model: int) -> list[tuple]:
  """One MoE layer's tensor rows ``(hf_name, our_path, hf_shape, shape, transpose, fields,
  expert_index)``, relative to ``model.layers.{i}.`` / ``layers_{i}/``."""
  D, E, Fe = d_model, moe.n_routed_experts, moe.moe_d_ff
  fe = "moe.moe_d_ff, d_model"
  rows = [("mlp.gate.weight", "mlp/router", (E, D), (D, E), True,
           "moe.n_routed_experts, d_model", None)]
  if moe.router == "sigmoid":
    rows.append(("mlp.gate.e_score_correction_bias", "mlp/selection_bias", (E,), (E,), False,
                 "moe.n_routed_experts", None))
  for e in range(E):
    rows += [(f"mlp.experts.{e}.gate_proj.weight", "mlp/gate", (Fe, D), (D, Fe), True, fe, e),
             (f"mlp.experts.{e}.up_proj.weight", "mlp/up", (Fe, D), (D, Fe), True, fe, e),
             (f"mlp.experts.{e}.down_proj.weight", "mlp/down", (D, Fe), (Fe, D), True, fe, e)]
  if moe.n_shared_experts:
    Fs = moe.n_shared_experts * Fe
    fs = "moe.n_shared_experts, moe.moe_d_ff, d_model"
    rows += [("mlp.shared_experts.gate_proj.weight", "mlp/shared_gate", (Fs, D), (D, Fs), True,
              fs, None),
             ("mlp.shared_experts.up_proj.weight", "mlp/shared_up", (Fs, D), (D, Fs), True,
              fs, None),
             ("mlp.shared_experts.down_proj.weight", "mlp/shared_down", (D, Fs), (Fs, D), True,
              fs, None)]
  return rows
