"""OPD's advantage form: the teacher inside the policy gradient (docs/DESIGN.md §3).

Beside the exact loss (``OPDLossConfig.form = "exact"``, the full-vocabulary
reverse KL of ``opd.distill.loss``), ``form = "advantage"`` puts the teachers
into GRPO's policy gradient (``opd.rl.loss.policy_loss``, docs/DESIGN.md §5).
On the student's sampled token ``y_t``, with renormalised teacher weights
``ŵ_{t,k}`` and every log-prob at the sampling temperature T (the teachers'
further divided by τ_T)::

    a_t     = Σ_k ŵ_{t,k} log π_k(y_t | y_<t) − log π_S(y_t | y_<t)   (stop-gradient)
    Â_OPD_t = Σ_{t' >= t} γ^(n(t') − n(t)) a_t'                       (discounted future sum)
    Â_t     = β Â_OPD_t + α Â_ORM             (Â_ORM: GRPO's group-normalised outcome)

``n(t)`` counts the trained tokens of the row up to t, so a gap (a tool
reply, padding) is not a step of the discount. γ = 0 is the immediate,
per-token advantage; its expected gradient is that of the per-token reverse
KL ``Σ_t KL(π_S ‖ π_T)(· | y_<t)`` with the prefixes held fixed (the exact
form's). γ = 1 is the sequence-level form: ``E_y[Σ_t Â_t ∇log π_S(y_t)]``
is ``−∇ KL(π_S(y) ‖ π_T(y))`` over whole responses, because
``E[∇log π_S(y_t) · a_t']`` vanishes for t' < t. α = 0 is pure OPD; β = 0
is exactly GRPO's update (``tests/opd/distill/test_distill_advantage.py``
checks all three against enumeration over every sequence, and GRPO's loss).

The per-token objective, aggregated like the exact form (``token_mean`` or
``sequence_mean``), with ``r_t = π_S(y_t) / π_b(y_t)`` against the behaviour
policy that sampled (the sampler's ``old_logprobs``)::

    is_cap = 0    −min(r_t Â_t, clip(r_t, 1 − ε_low, 1 + ε_high) Â_t)   (GRPO's surrogate)
    is_cap = c    −sg[min(r_t, c) / r_t] · r_t · Â_t           (truncated weight min(r_t, c))

The second is the truncated-IS policy gradient (value ``−min(r_t, c) Â_t``,
gradient ``−min(r_t, c) Â_t ∇log π_S(y_t)``; c >= 1 so that on-policy
samples, r = 1, are untouched); the share of tokens with ``r_t > c`` is
logged as ``is_truncated_frac``.

The teacher's sampled-token log-prob comes from the hidden-state cache:
``log π_k(y_t) = h_k,t · W_k[:, y_t] / T − lse_t``, one column of the
teacher's head per token, plus the teacher's log-normaliser
``lse_t = log Σ_v exp(h_k,t · W_k[:, v] / T)``. The normaliser still needs a
pass over the whole vocabulary: ``pallas_kernels.fused_cross_entropy`` takes
it tile by tile (the fused kernel's logsumexp path, no ``[B, T, V]`` array),
forward only (the teacher is never differentiated). Per update the form
thus replaces the fused reverse-KL training pass over the student's and the
teachers' vocabularies (docs/DESIGN.md §4) by the student's cross-entropy
at the sampled token (a logsumexp pass and its softmax backward) and one
forward logsumexp pass per teacher. That normaliser does not depend on the
student, so it could be taken once per rollout batch, when the teacher
runs, and kept as ``[B, T]`` floats; that is not built (the hidden-state
cache is what the pool, the fault layer and both forms share).
``experiments/benchmarks/opd_forms.py`` measures the step against the exact
form and against reading cached teacher logits.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

import pallas_kernels
from opd.config import fields
from opd.rl.loss import policy_loss
from pallas_kernels.inputs import normalized_weights

__all__ = ["FORMS", "FORM_DEFAULTS", "advantage_loss", "check_form_fields",
           "discounted_future_sum", "policy_gradient_loss", "teacher_token_logprobs"]

FORMS = ("exact", "advantage")
# The advantage form's fields and their defaults (OPDLossConfig carries them
# under these names; OPDConfig in its ``loss``).
FORM_DEFAULTS = {"adv_gamma": 0.0, "adv_beta": 1.0, "adv_alpha": 0.0, "is_cap": 0.0}


def check_form_fields(cfg: Any, owner: str, form_field: str) -> None:
  """Validates the loss form and the advantage form's fields of ``cfg``.

  ``cfg.<form_field>`` in :data:`FORMS`; ``adv_gamma`` in [0, 1];
  ``adv_beta``, ``adv_alpha`` >= 0; ``is_cap`` 0 (GRPO's clipped ratio) or
  >= 1. The exact form leaves every advantage field at its default, and the
  advantage form needs ``adv_beta + adv_alpha > 0`` and no ``grpo_coef`` /
  ``forward_kl_coef`` / other estimator (those belong to the exact form).

  Raises:
    ValueError: naming ``owner``, the field and its value.
  """
  fields.check_fields(cfg, owner, non_negative=("adv_beta", "adv_alpha", "is_cap"),
                      floats={"adv_gamma": dict(min_value=0, max_value=1)},
                      choices={form_field: FORMS})
  form = getattr(cfg, form_field)
  if 0 < cfg.is_cap < 1:
    raise ValueError(f"{owner}.is_cap={cfg.is_cap} must be 0 (GRPO's clipped ratio) or >= 1 "
                     "(min(r, c) with c < 1 would reweigh on-policy tokens)")
  if form == "exact":
    changed = {k: getattr(cfg, k) for k, v in FORM_DEFAULTS.items() if getattr(cfg, k) != v}
    if changed:
      raise ValueError(f"{owner}: {changed} only apply with {form_field}='advantage'; "
                       f"{form_field}={form!r}")
    return
  if cfg.adv_beta == 0 and cfg.adv_alpha == 0:
    raise ValueError(f"{owner}: {form_field}='advantage' with adv_beta=0 and adv_alpha=0 has "
                     "no advantage to train on")
  for name, off in (("grpo_coef", 0.0), ("forward_kl_coef", 0.0), ("estimator", "full")):
    if getattr(cfg, name) != off:
      raise ValueError(f"{owner}.{name}={getattr(cfg, name)!r} belongs to the exact form; "
                       f"{form_field}='advantage' takes the outcome reward through adv_alpha "
                       f"(set {name}={off!r})")


def discounted_future_sum(values: jax.Array, keep: jax.Array, gamma: float) -> jax.Array:
  """``A_t = Σ_{t' >= t, keep} γ^(n(t') − n(t)) values_t'`` per row; 0 off ``keep``.

  Args:
    values: [B, T] float per-token values.
    keep: [B, T] bool, the trained tokens (``n(t)`` counts them).
    gamma: γ in [0, 1]; 0 returns ``values`` on ``keep``.

  Returns:
    [B, T] float32.
  """
  x = jnp.where(keep, values.astype(jnp.float32), 0.0)
  if gamma == 0.0:
    return x
  # Right to left, S_t = x_t + d_t S_{t+1}: a kept token adds its value to
  # the future discounted once (d = γ); a token off keep passes the future on
  # undiscounted (d = 1, it is not a step).
  decay = jnp.where(keep, jnp.float32(gamma), 1.0)

  def step(future, col):
    v, d, k = col
    here = v + d * future
    return here, jnp.where(k, here, 0.0)

  _, out = jax.lax.scan(step, jnp.zeros(x.shape[0], jnp.float32), (x.T, decay.T, keep.T),
                        reverse=True)
  return out.T


def teacher_token_logprobs(teacher_hidden: Sequence[jax.Array], heads: Sequence[jax.Array],
                           w_hat: jax.Array, targets: jax.Array, *, temperature: float,
                           impl: str = "auto") -> jax.Array:
  """``Σ_k ŵ_k log π_k(y_t)`` [N] float32, never differentiated.

  Args:
    teacher_hidden: K arrays [N, D_k] (the cached hidden states, already
      divided by τ_T if any).
    heads: K arrays ``W_k`` [D_k, V].
    w_hat: [N, K] renormalised weights (0 where a teacher does not count).
    targets: [N] int sampled tokens ``y_t``.
    temperature: T > 0 dividing every teacher logit.
    impl: ``pallas_kernels`` implementation.

  Each teacher's ``−log π_k(y_t)`` is ``pallas_kernels.fused_cross_entropy``
  (its gathered logit and its vocabulary logsumexp; module docstring),
  computed on the tokens that teacher weighs.
  """
  out = jnp.zeros(targets.shape, jnp.float32)
  for k, (h, w) in enumerate(zip(teacher_hidden, heads)):
    on = w_hat[:, k] != 0
    nll = pallas_kernels.fused_cross_entropy(
        jax.lax.stop_gradient(h), jax.lax.stop_gradient(w), targets, mask=on,
        temperature=temperature, impl=impl)
    out = out + jnp.where(on, -w_hat[:, k] * nll, 0.0)
  return jax.lax.stop_gradient(out)


def advantage_loss(config: Any, h_s: jax.Array, w_s: jax.Array, teacher_hidden, heads,
                   batch, keep: jax.Array, coef: jax.Array, *,
                   temperature: float) -> tuple[jax.Array, dict]:
  """The advantage form's loss from hidden states (module docstring): ``(scalar, metrics)``.

  Args:
    config: the ``opd.distill.loss.OPDLossConfig`` (``adv_gamma``,
      ``adv_beta``, ``adv_alpha``, ``is_cap``, the clip range,
      ``aggregation``, ``impl``).
    h_s: [B·T, D] the student's last hidden states (differentiated).
    w_s: [D, V] the student's head.
    teacher_hidden: K arrays [B·T, D_k] (divided by τ_T already).
    heads: K arrays [D_k, V].
    batch: the loss batch (:func:`policy_gradient_loss`'s keys, plus
      ``targets`` and ``teacher_weights`` [B, T, K]).
    keep: [B, T] bool trained tokens.
    coef: [B, T] the aggregation's per-token coefficients
      (``opd.distill.loss.token_coefficients``).
    temperature: the sampling temperature T (every log-prob is taken at it).
  """
  b, t = keep.shape
  tau, impl = float(temperature), config.impl
  targets = batch["targets"].reshape(b * t)
  logp = -pallas_kernels.fused_cross_entropy(
      h_s, w_s, targets, mask=keep.reshape(b * t), temperature=tau, impl=impl).reshape(b, t)
  teacher_logp = None
  if config.adv_beta:
    w_hat = normalized_weights(batch["teacher_weights"].reshape(b * t, -1), keep.reshape(b * t))
    teacher_logp = teacher_token_logprobs(teacher_hidden, heads, w_hat, targets,
                                          temperature=tau, impl=impl).reshape(b, t)
  return policy_gradient_loss(config, logp, teacher_logp, batch, keep, coef)


def policy_gradient_loss(config: Any, logp: jax.Array, teacher_logp: jax.Array | None, batch,
                         keep: jax.Array, coef: jax.Array, *, signal: jax.Array | None = None
                         ) -> tuple[jax.Array, dict]:
  """``Â`` and the policy-gradient objective from sampled-token log-probs.

  Args:
    config: as :func:`advantage_loss`.
    logp: [B, T] ``log π_S(y_t)`` at T (differentiated).
    teacher_logp: [B, T] ``Σ_k ŵ_k log π_k(y_t)`` (None with ``adv_beta = 0`` or
      ``signal``).
    batch: ``old_logprobs`` [B, T] (the behaviour policy's, at T) and, with
      ``adv_alpha > 0``, ``advantages`` [B] (GRPO's outcome advantage).
    keep, coef: as :func:`advantage_loss` (``coef`` weighs the truncated-IS
      path's tokens; the clipped path aggregates as GRPO does).
    signal: [B, T] the log-ratio ``a_t`` itself, replacing
      ``teacher_logp − logp`` (teachers with another tokenizer:
      ``opd.distill.crosstok``, span log-ratios on each span's last token).

  Metrics: ``adv/opd_abs_mean`` (mean |Â_OPD| over trained tokens),
  ``adv/kl_estimate`` (mean of −a_t: the sampled reverse-KL estimate),
  ``adv/abs_mean`` (mean |Â|), ``ratio_mean``, and ``is_truncated_frac``
  (``is_cap > 0``) or ``clip_frac_low`` / ``clip_frac_high`` (``is_cap = 0``).
  """
  b, t = keep.shape
  keep_f = keep.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(keep_f), 1.0)
  adv = jnp.zeros((b, t), jnp.float32)
  metrics = {}
  if config.adv_beta:
    a = jnp.where(keep, jax.lax.stop_gradient(teacher_logp - logp if signal is None else signal),
                  0.0)
    opd_adv = discounted_future_sum(a, keep, config.adv_gamma)
    adv = adv + config.adv_beta * opd_adv
    metrics["adv/opd_abs_mean"] = jnp.sum(jnp.abs(opd_adv)) / n
    metrics["adv/kl_estimate"] = -jnp.sum(a) / n
  if config.adv_alpha:
    adv = adv + config.adv_alpha * batch["advantages"].astype(jnp.float32)[:, None]
  adv = jnp.where(keep, adv, 0.0)
  metrics["adv/abs_mean"] = jnp.sum(jnp.abs(adv)) / n
  old = batch["old_logprobs"].astype(jnp.float32)
  if not config.is_cap:
    loss, pg = policy_loss(logp, old, adv, keep_f, clip_eps_low=config.grpo_clip_eps_low,
                           clip_eps_high=config.grpo_clip_eps_high, kl_coef=0.0,
                           aggregation=config.aggregation)
    metrics.update({k: pg[k] for k in ("clip_frac_low", "clip_frac_high", "ratio_mean")})
  else:
    # GRPO's clamp of the log-ratio (a diverged token stays finite).
    ratio = jnp.exp(jnp.where(keep, jnp.clip(logp - old, -20.0, 20.0), 0.0))
    capped = jnp.minimum(ratio, config.is_cap)
    per_tok = -jax.lax.stop_gradient(capped / ratio) * ratio * adv
    loss = jnp.sum(coef * per_tok)
    metrics["is_truncated_frac"] = jnp.sum(jnp.where(keep, ratio > config.is_cap, False)) / n
    metrics["ratio_mean"] = jnp.sum(jnp.where(keep, ratio, 0.0)) / n
  return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
