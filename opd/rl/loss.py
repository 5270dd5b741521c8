"""GRPO's jitted objective (docs/DESIGN.md §5): the clipped policy loss and its wrapper.

Every policy-sampled token ``t`` of response ``o_i`` carries the response's
group-relative advantage ``A_i`` (``opd.rl.advantages``) and the per-token
loss (``policy_loss``)::

    ratio_t = exp(logp_t - logp_old_t)
    pg_t    = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)
    kl_t    = exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1     (k3, >= 0)
    loss_t  = pg_t + kl_coef * kl_t

The KL term is the k3 estimator of KL(pi || pi_ref) on tokens sampled from
the policy; it is added to the loss, never folded into the reward. All three
log-probs are ``opd.models.token_logprobs(logits, targets, T)`` at the
sampling temperature T, which is what the sampler reports, so the ratio is 1
before the first update (up to fp32 rounding).

Token losses become one scalar by ``loss_aggregation`` (w = policy-token mask):

  ``token_mean``      sum(loss w) / sum(w): every token of the batch counts
                      equally (DAPO).
  ``sequence_mean``   mean over sequences of each sequence's token mean: the
                      original GRPO ``1/G sum_i 1/|o_i| sum_t``.
  ``token_sum_norm``  sum(loss w) / (B * max_new_tokens): a constant
                      normaliser, no length bias (Dr. GRPO).

With ``grad_accum_steps > 1`` the train step averages microbatch losses:
exact for ``token_sum_norm`` and (equal microbatches, no empty rows) for
``sequence_mean``; ``token_mean`` becomes a mean of microbatch token means.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from opd.config.fields import check_int
from opd.models import ModelConfig, forward, moe_balance, token_logprobs
from opd.rl.config import LOSS_AGGREGATIONS, GRPOConfig

__all__ = ["BATCH_KEYS", "check_batch", "make_grpo_loss", "policy_loss", "token_entropy"]

Array = jax.Array
# exp() of a log-ratio beyond this overflows fp32 long before it means anything;
# clamping keeps a diverged token finite (its gradient is then zero).
_MAX_LOG_RATIO = 20.0
BATCH_KEYS = ("tokens", "targets", "mask", "loss_mask", "old_logprobs", "advantages")


def _aggregate(per_token: Array, w: Array, aggregation: str, norm_tokens: int | None) -> Array:
  """One scalar from ``[B, T]`` token values weighted by ``w`` (module docstring)."""
  if aggregation == "token_mean":
    total = jnp.sum(w)
    return jnp.where(total > 0, jnp.sum(per_token * w) / jnp.where(total > 0, total, 1.0), 0.0)
  if aggregation == "sequence_mean":
    n = jnp.sum(w, axis=1)  # [B]
    rows = n > 0
    seq = jnp.sum(per_token * w, axis=1) / jnp.where(rows, n, 1.0)
    count = jnp.sum(rows)
    return jnp.where(count > 0, jnp.sum(jnp.where(rows, seq, 0.0)) / jnp.maximum(count, 1), 0.0)
  if aggregation == "token_sum_norm":
    check_int("token_sum_norm", "norm_tokens", norm_tokens, min_value=1)
    return jnp.sum(per_token * w) / (per_token.shape[0] * norm_tokens)
  raise ValueError(f"aggregation must be one of {LOSS_AGGREGATIONS}, got {aggregation!r}")


def _token_mean(x: Array, on: Array) -> Array:
  n = jnp.sum(on)
  return jnp.sum(jnp.where(on, x, 0.0)) / jnp.maximum(n, 1)


def policy_loss(logp: Array, old_logp: Array, advantages: Array, weights: Array, *,
                ref_logp: Array | None = None, clip_eps_low: float, clip_eps_high: float,
                kl_coef: float, aggregation: str, norm_tokens: int | None = None
                ) -> tuple[Array, dict[str, Array]]:
  """The GRPO loss from per-token log-probs (module docstring).

  Args:
    logp: ``[B, T]`` log-probs of the targets under the current policy
      (differentiated).
    old_logp: ``[B, T]`` log-probs under the sampling policy.
    advantages: ``[B]``, one per sequence, or ``[B, T]``, one per token (the
      OPD advantage form, ``opd.distill.advantage``).
    weights: ``[B, T]`` policy-token mask (0 on prompt, tool and pad tokens).
    ref_logp: ``[B, T]`` log-probs under the frozen reference; required when
      ``kl_coef > 0``, and when given the ``kl`` metric is reported.
    clip_eps_low, clip_eps_high, kl_coef, aggregation: as ``GRPOConfig``.
    norm_tokens: the ``token_sum_norm`` constant (``max_new_tokens``).

  Log-ratios are clamped to +-20 before ``exp`` and masked positions get 0,
  so padding or a diverged token never turns the gradient into NaN.

  Returns:
    ``(loss, metrics)``; metrics (scalars): ``policy_loss`` (the clipped term,
    aggregated like the loss), ``kl`` (token mean of k3; only with
    ``ref_logp``), ``clip_frac_low`` / ``clip_frac_high`` (share of policy
    tokens whose ratio was clipped below with A < 0 / above with A > 0, the
    cases where clipping zeroes the gradient), ``ratio_mean``, ``ratio_max``,
    ``policy_tokens``.
  """
  B, T = logp.shape
  adv_shape = (B, T) if advantages.ndim == 2 else (B,)
  for name, x, shape in (("old_logp", old_logp, (B, T)), ("weights", weights, (B, T)),
                         ("advantages", advantages, adv_shape),
                         ("ref_logp", ref_logp, (B, T))):
    if x is not None and tuple(x.shape) != shape:
      raise ValueError(f"{name} must have shape {shape} to match logp {logp.shape}, "
                       f"got {tuple(x.shape)}")
  if ref_logp is None and kl_coef:
    raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logp (the reference model's log-probs)")
  w = weights.astype(jnp.float32)
  on = w > 0
  # Masked positions get log-ratio 0 so no inf/NaN can leak into the gradient.
  log_ratio = jnp.where(on, jnp.clip(logp - old_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
  ratio = jnp.exp(log_ratio)
  A = advantages.astype(jnp.float32)
  A = A if A.ndim == 2 else A[:, None]
  clipped = jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
  pg = -jnp.minimum(ratio * A, clipped * A)
  per_token = pg
  metrics = {}
  if ref_logp is not None:
    d = jnp.where(on, jnp.clip(ref_logp - logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO), 0.0)
    kl = jnp.exp(d) - d - 1.0
    per_token = pg + kl_coef * kl
    metrics["kl"] = _token_mean(kl, on)
  loss = _aggregate(per_token, w, aggregation, norm_tokens)
  metrics["policy_loss"] = _aggregate(pg, w, aggregation, norm_tokens)
  metrics["clip_frac_low"] = _token_mean(((ratio < 1.0 - clip_eps_low) & (A < 0)).astype(
      jnp.float32), on)
  metrics["clip_frac_high"] = _token_mean(((ratio > 1.0 + clip_eps_high) & (A > 0)).astype(
      jnp.float32), on)
  metrics["ratio_mean"] = _token_mean(ratio, on)
  metrics["ratio_max"] = jnp.max(jnp.where(on, ratio, 0.0))
  metrics["policy_tokens"] = jnp.sum(on).astype(jnp.float32)
  metrics = {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
  return loss, metrics


def token_entropy(logits: Array, temperature: float = 1.0) -> Array:
  """Entropy of ``softmax(logits / T)`` over the vocabulary. ``[B, T, V] -> [B, T]`` fp32 (nats)."""
  logq = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  return -jnp.sum(jnp.exp(logq) * logq, axis=-1)


def check_batch(batch) -> None:
  """Raises ValueError unless ``batch`` has the GRPO keys with consistent shapes."""
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise ValueError(f"GRPO batch is missing {missing}; it has {sorted(batch)}")
  shape = tuple(batch["tokens"].shape)
  if len(shape) != 2:
    raise ValueError(f"batch['tokens'] must be [B, T], got {shape}")
  for k in ("targets", "mask", "loss_mask", "old_logprobs", "ref_logprobs"):
    if k in batch and tuple(batch[k].shape) != shape:
      raise ValueError(f"batch[{k!r}] has shape {tuple(batch[k].shape)}, tokens have {shape}")
  if tuple(batch["advantages"].shape) != shape[:1]:
    raise ValueError(f"batch['advantages'] must be [B]={shape[:1]}, got "
                     f"{tuple(batch['advantages'].shape)}")


def make_grpo_loss(model_cfg: ModelConfig, cfg: GRPOConfig):
  """``loss_fn(params, batch, rng) -> (loss, metrics)`` for ``opd.training.train_step``.

  ``batch`` is ``opd.rollout.episodes.batch_episodes``' dict (``tokens``, ``targets``,
  ``mask``, ``loss_mask``, ``old_logprobs``, all ``[B, L]``) plus
  ``advantages [B]`` and, when ``cfg.kl_coef > 0``, ``ref_logprobs [B, L]``
  (the frozen reference's ``token_logprobs`` at ``cfg.temperature``; also
  accepted with ``kl_coef = 0``, to log the KL).

  Metrics: those of ``policy_loss`` plus ``entropy``, the mean over policy
  tokens of the full-vocabulary entropy at temperature T. An MoE policy
  (``model_cfg.moe``) adds its balance losses and router metrics
  (``opd.models.moe_balance.balance_terms``).
  """
  if not isinstance(cfg, GRPOConfig):
    raise ValueError(f"cfg must be a GRPOConfig, got {type(cfg).__name__}")
  T = cfg.temperature

  def loss_fn(params, batch, rng):
    del rng  # the objective is deterministic given the batch
    check_batch(batch)
    ref = batch.get("ref_logprobs")
    if ref is None and cfg.kl_coef > 0:
      raise ValueError(f"GRPOConfig.kl_coef={cfg.kl_coef} > 0 but the batch has no "
                       "'ref_logprobs'")
    out = forward(model_cfg, params, batch["tokens"], None, batch["mask"])
    logits = out.logits
    logp = token_logprobs(logits, batch["targets"], T)
    weights = batch["loss_mask"].astype(jnp.float32) * batch["mask"].astype(jnp.float32)
    loss, metrics = policy_loss(
        logp, batch["old_logprobs"], batch["advantages"], weights, ref_logp=ref,
        clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef,
        aggregation=cfg.loss_aggregation, norm_tokens=cfg.max_new_tokens)
    entropy = jax.lax.stop_gradient(token_entropy(logits, T))
    metrics["entropy"] = _token_mean(entropy, weights > 0)
    if model_cfg.moe is not None:
      balance, router = moe_balance.balance_terms(model_cfg.moe, out.moe)
      loss = loss + balance
      metrics.update(router)
    return loss, metrics

  return loss_fn
