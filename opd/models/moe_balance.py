"""Router statistics and load balancing for ``opd.models.moe`` (docs/DESIGN.md §2).

* ``RouterStats`` / ``router_stats`` (defined in ``opd.models.moe``, which
  returns them; re-exported here): one MoE layer's sums over its real
  (unmasked) tokens; the decoder stacks them over MoE layers (leading axis
  L, ``stack_stats``) into ``DecoderOutput.moe``.
* ``aux_loss``: ``aux_loss_coef`` x the Switch / Qwen3-MoE loss
  ``E Σ_e f_e P_e`` over all MoE layers' tokens together (as transformers'
  ``load_balancing_loss_func``) + ``seq_aux_loss_coef`` x DeepSeek-V3's
  sequence-wise loss summed over layers. Add it to the training loss.
* ``update_selection_bias``: DeepSeek-V3's auxiliary-loss-free balancing,
  ``b_e += γ sign(mean_load - load_e)`` per MoE layer, applied to the params
  after the optimizer update (never through the gradient); the same for
  DeepSeek-V4's sqrtsoftplus top-k layers (``ModelConfig.v4``).
* ``router_metrics``: per-expert load, its min / max, router entropy and the
  dropped (token, expert) pairs (0: the dispatch is dropless) as scalars.
* ``balance_terms`` / ``bias_update_hook``: what an objective adds to its
  loss and metrics, and the ``make_train_step(after_update=...)`` hook that
  applies the bias update after the optimizer's (``opd.training.objectives``
  and ``opd.training.lm_trainer`` wire both).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from opd.models.moe import (MoEConfig, RouterStats,  # noqa: F401 - re-exported
                             router_stats)

Array = jax.Array


def stack_stats(stats: list[RouterStats]) -> RouterStats:
  """Per-layer stats → one ``RouterStats`` with a leading layer axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *stats)


def aux_loss(moe: MoEConfig, stats: RouterStats) -> Array:
  """The balance terms to add to the training loss (0.0 when both coefficients are 0).

  Switch / Qwen3-MoE: ``E Σ_e f_e P_e`` with f_e = Σ_l counts_le / Σ_l N_l
  (fraction of tokens sent to e, summing to k) and P_e = Σ_l prob_sum_le /
  Σ_l N_l. DeepSeek-V3: Σ_l seq_aux_l.
  """
  loss = jnp.zeros((), jnp.float32)
  if moe.aux_loss_coef:
    n = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    f = jnp.sum(stats.counts, axis=0) / n
    P = jnp.sum(stats.prob_sum, axis=0) / n
    loss += moe.aux_loss_coef * moe.n_routed_experts * jnp.sum(f * P)
  if moe.seq_aux_loss_coef:
    loss += moe.seq_aux_loss_coef * jnp.sum(stats.seq_aux)
  return loss


def router_metrics(stats: RouterStats) -> dict[str, Array]:
  """Scalars for the metrics writer, over all MoE layers.

  ``moe/load/eN``: expert N's share of the routed pairs times E (1 = even).
  ``moe/load_min`` / ``moe/load_max``: their extremes. ``moe/entropy``:
  mean router entropy (nats). ``moe/dropped``: pairs not computed (0).
  """
  counts = jnp.sum(stats.counts, axis=0)
  E = counts.shape[0]
  load = counts * E / jnp.maximum(jnp.sum(counts), 1.0)
  out = {f"moe/load/e{e}": load[e] for e in range(E)}
  out.update({"moe/load_min": jnp.min(load), "moe/load_max": jnp.max(load),
              "moe/entropy": jnp.sum(stats.entropy_sum) / jnp.maximum(jnp.sum(stats.tokens), 1.0),
              "moe/dropped": jnp.sum(stats.dropped)})
  return out


def bias_update(bias: Array, counts: Array, rate: float) -> Array:
  """One layer's ``b + γ sign(mean(counts) - counts)``: overloaded experts lose γ."""
  err = jnp.mean(counts) - counts
  return (bias.astype(jnp.float32) + rate * jnp.sign(err)).astype(bias.dtype)


def _bias_layers(cfg: Any) -> tuple[list[int], list[int]]:
  """``(decoder layers with a selection_bias, their rows in DecoderOutput.moe)``.

  DeepSeek-V3 (``MoEMLP``, sigmoid router): the MoE layers ``>= first_k_dense``,
  stacked from row 0. DeepSeek-V4 (``ModelConfig.v4``): the stats stack every
  layer; the top-k ("moe") layers carry the bias, hash-routed layers have none.
  """
  moe = cfg.moe
  if getattr(cfg, "v4", None) is not None:
    rows = [i for i, t in enumerate(cfg.v4.mlp_layer_types) if t == "moe"]
    return rows, rows
  if moe is None or moe.router != "sigmoid":
    raise ValueError("update_selection_bias needs ModelConfig.moe with router='sigmoid' (or a "
                     f"ModelConfig.v4 model), got moe={moe}")
  layers = [i for i in range(cfg.n_layers) if moe.is_moe_layer(i)]
  return layers, list(range(len(layers)))


def update_selection_bias(cfg: Any, params, counts: Array):
  """Params with every MoE layer's ``selection_bias`` moved by ``bias_update``.

  Args:
    cfg: the ``ModelConfig``: ``moe.router == "sigmoid"`` (DeepSeek-V3), or ``v4``
      set (DeepSeek-V4's sqrtsoftplus top-k layers; hash-routed layers have no bias).
    params: the decoder's param tree (a new tree is returned; ``params`` is
      not modified).
    counts: ``[L, E]``, ``DecoderOutput.moe.counts`` of the step's forward
      (V3: row j is decoder layer ``first_k_dense + j``; V4: row i is layer i).

  Returns ``params`` itself when ``bias_update_rate`` is 0.
  """
  moe = cfg.moe
  if moe is None:
    raise ValueError("update_selection_bias needs ModelConfig.moe, got None")
  layers, rows = _bias_layers(cfg)
  if not moe.bias_update_rate:
    return params
  n_rows = cfg.n_layers if cfg.v4 is not None else len(layers)
  if counts.shape[0] != n_rows:
    raise ValueError(f"counts hold {counts.shape[0]} MoE layers, the config has {n_rows}")
  new = dict(params)
  for i, j in zip(layers, rows):
    name = f"layers_{i}"
    mlp = dict(new[name]["mlp"])
    mlp["selection_bias"] = bias_update(mlp["selection_bias"], counts[j], moe.bias_update_rate)
    new[name] = {**new[name], "mlp": mlp}
  return new


COUNTS_KEY = "moe/counts"  # [L, E] per-layer expert counts, for the bias update only


def balance_terms(moe: MoEConfig, stats: RouterStats) -> tuple[Array, dict[str, Array]]:
  """``(aux_loss, metrics)`` an objective adds to its loss and metrics.

  The metrics are ``router_metrics`` plus ``moe/aux_loss``; with
  ``bias_update_rate > 0`` also ``COUNTS_KEY`` (an array, which
  ``bias_update_hook`` consumes before the metrics are logged).
  """
  loss = aux_loss(moe, stats)
  metrics = {**router_metrics(stats), "moe/aux_loss": loss}
  if moe.bias_update_rate:
    metrics[COUNTS_KEY] = stats.counts
  return loss, metrics


def bias_update_hook(cfg: Any):
  """``after_update(params, metrics) -> (params, metrics)`` for ``make_train_step``.

  None unless ``cfg.moe.bias_update_rate > 0``. It pops ``COUNTS_KEY`` from
  the step's metrics and applies ``update_selection_bias`` to the updated
  params: the bias moves outside the gradient, after the optimizer.
  """
  if cfg.moe is None or not cfg.moe.bias_update_rate:
    return None

  def after_update(params, metrics):
    metrics = dict(metrics)
    return update_selection_bias(cfg, params, metrics.pop(COUNTS_KEY)), metrics

  return after_update
