"""The on-policy distillation loss over a batch (docs/DESIGN.md §3, kernel §4).

Per response token ``t`` with renormalised teacher weights ``ŵ_{t,k}``::

    full    L_t = Σ_k ŵ_{t,k} KL(p_s,t ‖ q_k,t)          pallas_kernels.fused_reverse_kl_train
    top_k   the same KL on each teacher's top-k tokens,    pallas_kernels.fused_topk_kl
            student and teacher renormalised there
    token   a_t = log p_s(y_t) − Σ_k ŵ_{t,k} log q_k(y_t)  pallas_kernels.fused_token_level_kl
            used as a per-token advantage (stop-gradient) in the policy-gradient
            loss a_t · log p_s(y_t): its gradient a_t ∇log p_s(y_t) is an
            unbiased sample of the reverse-KL gradient on the student's own
            samples; the reported value is a_t itself.

plus ``forward_kl_coef · Σ_k ŵ_{t,k} KL(q_k,t ‖ p_s,t)`` (default 0). All logits
are divided by ``temperature`` and rebuilt inside the kernels from hidden
states and heads; ``[B, T, V]`` is never materialised. ``teacher_temperature``
τ_T (default 1) sharpens (τ_T < 1) or flattens the targets only: teacher k's
logits become ``x_k / (τ τ_T)``, applied exactly by scaling its hidden states
(``x_k = h_k W_k``), so the kernels are unchanged; the reported ``kl/<name>``
is then to the sharpened teacher (docs/DESIGN.md §3).

``form = "advantage"`` replaces all of the above by the advantage form
(``opd.distill.advantage``): the teachers' sampled-token log-ratio as a
per-token advantage, plus ``adv_alpha`` times GRPO's outcome advantage, in
GRPO's policy gradient; ``form = "exact"`` (default) is everything else here.
A teacher with another tokenizer (``make_opd_loss(cross_tokenizer=...)``)
feeds the advantage form span log-ratios on its own rows
(``opd.distill.crosstok``); the exact form refuses it, naming it.

With ``grpo_coef > 0`` the GRPO verifier-reward term (docs/DESIGN.md §5) is
added to the aggregated loss: ``grpo_coef · opd.rl.loss.policy_loss(log p_s(y),
old_logprobs, advantages, ...)`` with the clipped ratio on the same tokens
and aggregation, ``log p_s(y)`` at the sampling temperature
(``make_opd_loss(sampling_temperature=...)``, the rollout's: OPD passes
``OPDConfig.rollout.temperature``; ``pallas_kernels.fused_cross_entropy``,
logits never materialised). With
``grpo_coef == 0`` the term is not even built.

Aggregation over the response tokens (``loss_mask * mask``, minus rows that
no teacher answered): ``token_mean`` (every token counts equally) or
``sequence_mean`` (mean over rows of each row's token mean). Either is a sum
``Σ_t c_t L_t`` with per-token coefficients ``c`` (:func:`token_coefficients`),
which is what lets the ``full`` estimator train through
``pallas_kernels.fused_reverse_kl_train`` (loss and gradients in one pass,
docs/DESIGN.md §4). ``OPDLossConfig.gradient_in_forward=False`` takes the
per-token path ``fused_reverse_kl`` under autodiff instead (same value and
gradient; for analysis).

The batch (teacher hidden states from :class:`opd.distill.cache.HiddenStateCache`)::

    tokens, targets           [B, T] int   prompt + response, next tokens
    mask                      [B, T] bool  real tokens
    loss_mask                 [B, T] float response (student-sampled) targets
    teacher_hidden            K arrays [B, T, D_k], aligned with ``tokens``
    teacher_weights           [B, T, K] >= 0 (opd.distill.teacher_weighting)
    positions (optional)      [B, T] int
    old_logprobs, advantages  [B, T] float, [B] float   (only with grpo_coef > 0; the
                              advantage form needs old_logprobs, and advantages
                              when adv_alpha > 0)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.api import IMPLS
from opd.config import fields
from opd.distill import advantage as advantage_lib
from opd.distill import crosstok
from opd.models import ModelConfig, forward, head_matrix, moe_balance
from opd.rl.config import GRPOConfig
from opd.rl.loss import policy_loss

ESTIMATORS = ("full", "top_k", "token")
AGGREGATIONS = ("token_mean", "sequence_mean")
BATCH_KEYS = ("tokens", "targets", "mask", "loss_mask", "teacher_hidden", "teacher_weights")
GRPO_KEYS = ("old_logprobs", "advantages")


@dataclasses.dataclass(frozen=True)
class OPDLossConfig:
  """Options of :func:`make_opd_loss`.

  Attributes:
    estimator: ``"full"``, ``"top_k"`` or ``"token"`` (module docstring).
    top_k: k of the ``top_k`` estimator, in [1, V].
    temperature: τ > 0, divides every logit.
    teacher_temperature: τ_T > 0, further divides the teachers' logits only
      (the targets; module docstring).
    aggregation: ``"token_mean"`` or ``"sequence_mean"``.
    forward_kl_coef: weight of the forward-KL term (>= 0, default 0).
    grpo_coef: weight of the GRPO policy-gradient term (>= 0, default 0).
    grpo_clip_eps_low, grpo_clip_eps_high: the ratio's clip range, as
      ``GRPOConfig.clip_eps_low`` / ``clip_eps_high`` (their defaults).
    impl: fused-kernel implementation (``"auto"``, ``"pallas"``,
      ``"chunked"``, ``"reference"``).
    gradient_in_forward: ``full`` estimator only: train through
      ``pallas_kernels.fused_reverse_kl_train`` (default) rather than the
      per-token ``fused_reverse_kl`` (module docstring).
    form: ``"exact"`` (this module's losses) or ``"advantage"``
      (``opd.distill.advantage``; its log-probs at the sampling temperature
      ``make_opd_loss`` is given, with the clip range above).
    adv_gamma: γ in [0, 1] of the advantage's discounted future sum (0: the
      immediate per-token advantage; 1: the sequence-level form).
    adv_beta, adv_alpha: ``Â = β Â_OPD + α Â_ORM`` (>= 0, not both 0).
    is_cap: 0 uses GRPO's clipped ratio; c >= 1 the truncated importance
      weight ``min(π_S / π_behaviour, c)``.
  """
  estimator: str = "full"
  top_k: int = 8
  temperature: float = 1.0
  teacher_temperature: float = 1.0
  aggregation: str = "token_mean"
  forward_kl_coef: float = 0.0
  grpo_coef: float = 0.0
  grpo_clip_eps_low: float = GRPOConfig.clip_eps_low
  grpo_clip_eps_high: float = GRPOConfig.clip_eps_high
  impl: str = "auto"
  gradient_in_forward: bool = True
  form: str = "exact"
  adv_gamma: float = advantage_lib.FORM_DEFAULTS["adv_gamma"]
  adv_beta: float = advantage_lib.FORM_DEFAULTS["adv_beta"]
  adv_alpha: float = advantage_lib.FORM_DEFAULTS["adv_alpha"]
  is_cap: float = advantage_lib.FORM_DEFAULTS["is_cap"]

  def __post_init__(self):
    fields.check_fields(
        self, "OPDLossConfig", ints={"top_k": 1},
        positive=("temperature", "teacher_temperature"),
        non_negative=("forward_kl_coef", "grpo_coef", "grpo_clip_eps_high"),
        floats={"grpo_clip_eps_low": dict(min_value=0, max_value=1, max_exclusive=True)},
        bools=("gradient_in_forward",),
        choices={"estimator": ESTIMATORS, "aggregation": AGGREGATIONS, "impl": IMPLS})
    advantage_lib.check_form_fields(self, "OPDLossConfig", "form")

  @property
  def outcome_advantages(self) -> bool:
    """The loss reads GRPO's outcome advantages (the GRPO term, or the
    advantage form with ``adv_alpha > 0``)."""
    return self.grpo_coef > 0 or (self.form == "advantage" and self.adv_alpha > 0)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @property
  def batch_extra_keys(self) -> tuple[str, ...]:
    """The batch keys beyond ``BATCH_KEYS`` this loss reads."""
    if self.form == "advantage":
      return ("old_logprobs",) + (("advantages",) if self.adv_alpha else ())
    return GRPO_KEYS if self.grpo_coef > 0 else ()


def _check_batch(batch, k: int, widths: Sequence[int], extra: tuple[str, ...],
                 cross: Sequence[int] = ()):
  missing = [key for key in BATCH_KEYS + extra if key not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
  bt = tuple(batch["tokens"].shape)
  for key in ("targets", "mask", "loss_mask") + tuple(x for x in extra if x == "old_logprobs"):
    if tuple(batch[key].shape) != bt or len(bt) != 2:
      raise ValueError(f"batch[{key!r}].shape={tuple(batch[key].shape)}: expected [B, T]={bt}")
  hidden = batch["teacher_hidden"]
  if len(hidden) != k:
    raise ValueError(f"batch['teacher_hidden'] has {len(hidden)} arrays for K={k} teacher heads")
  for i, (h, d) in enumerate(zip(hidden, widths)):
    if i not in cross and tuple(h.shape) != bt + (d,):
      raise ValueError(f"batch['teacher_hidden'][{i}].shape={tuple(h.shape)}: expected "
                       f"[B, T, D_k]={bt + (d,)}")
  crosstok.check_batch(batch, cross, widths)
  if "advantages" in extra and tuple(batch["advantages"].shape) != bt[:1]:
    raise ValueError(f"batch['advantages'].shape={tuple(batch['advantages'].shape)}: expected "
                     f"[B]={bt[:1]}")
  if tuple(batch["teacher_weights"].shape) != bt + (k,):
    raise ValueError(f"batch['teacher_weights'].shape={tuple(batch['teacher_weights'].shape)}: "
                     f"expected [B, T, K]={bt + (k,)}")


def token_coefficients(keep, aggregation: str):
  """[B, T] float32 ``c`` with ``Σ_t c_t L_t`` the aggregated loss over ``keep``.

  ``token_mean``: ``keep / n``; ``sequence_mean``: ``keep / (n_b · rows)``
  (n_b the kept tokens of row b, rows the rows with any). 0 off ``keep``.
  """
  keep = keep.astype(jnp.float32)
  if aggregation == "token_mean":
    return keep / jnp.maximum(jnp.sum(keep), 1.0)
  n = jnp.sum(keep, axis=1, keepdims=True)
  rows = jnp.sum((n > 0).astype(jnp.float32))
  return keep / jnp.maximum(n, 1.0) / jnp.maximum(rows, 1.0)


def _grpo_term(config: OPDLossConfig, h_s, w_s, batch, keep, impl: str, temperature: float):
  """``opd.rl.loss.policy_loss`` on the student's sampled tokens at the
  sampling ``temperature``: (scalar, metrics)."""
  b, t = keep.shape
  logp = -pallas_kernels.fused_cross_entropy(
      h_s, w_s, batch["targets"].reshape(b * t), mask=keep.reshape(b * t),
      temperature=temperature, impl=impl).reshape(b, t)
  return policy_loss(logp, batch["old_logprobs"].astype(jnp.float32), batch["advantages"],
                     keep.astype(jnp.float32), clip_eps_low=config.grpo_clip_eps_low,
                     clip_eps_high=config.grpo_clip_eps_high, kl_coef=0.0,
                     aggregation=config.aggregation)


def _exact_loss(config: OPDLossConfig, args, batch, keep, coef, names, shared: bool,
                sampling_temperature: float):
  """The exact form (module docstring): ``(scalar, metrics)``; ``args`` are
  ``(h_s, w_s, h_k, heads, w_flat)`` as the fused kernels take them."""
  b, t = keep.shape
  h_s, w_s, _, _, w_flat = args
  m_flat = keep.reshape(b * t)
  tau, impl = float(config.temperature), config.impl
  metrics = {}
  per_tok, loss = jnp.zeros((b * t,), jnp.float32), jnp.float32(0.0)
  if config.estimator == "full" and config.gradient_in_forward:
    loss, aux = pallas_kernels.fused_reverse_kl_train(*args, coef, temperature=tau, impl=impl,
                                                      shared_head=shared, return_aux=True)
  elif config.estimator == "full":
    per_tok, aux = pallas_kernels.fused_reverse_kl(*args, mask=m_flat, temperature=tau,
                                                   impl=impl, return_aux=True)
  if config.estimator == "full":
    uses = (w_flat > 0) & m_flat[:, None]  # [BT, K]
    kl_k = jnp.sum(aux["kl"] * uses, axis=0) / jnp.maximum(jnp.sum(uses, axis=0), 1)
    metrics.update({f"kl/{n}": kl_k[i] for i, n in enumerate(names)})
    metrics["student_entropy"] = jnp.sum(aux["entropy"]) / jnp.maximum(jnp.sum(m_flat), 1)
  elif config.estimator == "top_k":
    per_tok = pallas_kernels.fused_topk_kl(*args, mask=m_flat, temperature=tau,
                                           top_k=config.top_k,
                                           impl="reference" if impl == "reference" else "auto")
  else:
    est = pallas_kernels.fused_token_level_kl(*args, batch["targets"].reshape(b * t),
                                              mask=m_flat, temperature=tau, impl=impl)
    pg = jax.lax.stop_gradient(est) * est  # gradient a_t ∇log p_s(y_t)
    per_tok = pg + jax.lax.stop_gradient(est - pg)  # value a_t
  if config.forward_kl_coef:
    fkl = pallas_kernels.fused_forward_kl(*args, mask=m_flat, temperature=tau,
                                          impl="reference" if impl == "reference" else "auto")
    per_tok = per_tok + config.forward_kl_coef * fkl
  # Per-teacher (with routing: per-domain) mean of the per-token loss, for
  # every estimator: a fluctuation measure the domain mix does not dominate.
  uses = ((w_flat > 0) & m_flat[:, None]).astype(jnp.float32)  # [BT, K]
  per_k = aux["kl"] if config.estimator == "full" else per_tok  # full: teacher k's own KL
  per_k = per_k[:, None] if per_k.ndim == 1 else per_k
  loss_k = jnp.sum(per_k * uses, axis=0) / jnp.maximum(jnp.sum(uses, axis=0), 1)
  metrics.update({f"loss/{n}": loss_k[i] for i, n in enumerate(names)})
  loss = loss + jnp.sum(coef * per_tok)
  if config.grpo_coef > 0:
    pg, pg_metrics = _grpo_term(config, h_s, w_s, batch, keep, impl, sampling_temperature)
    metrics.update(kl_loss=loss, grpo_loss=pg)
    metrics.update({f"grpo_{k}": pg_metrics[k]
                    for k in ("clip_frac_low", "clip_frac_high", "ratio_mean")})
    loss = loss + config.grpo_coef * pg
  return loss, metrics


def make_opd_loss(student_cfg: ModelConfig, teacher_heads: Sequence[jax.Array],
                  config: OPDLossConfig = OPDLossConfig(),
                  teacher_names: Sequence[str] | None = None,
                  cross_tokenizer: Sequence[bool] | None = None, *,
                  sampling_temperature: float = 1.0):
  """``loss_fn(params, batch, rng) -> (loss, metrics)`` for ``make_train_step``.

  Args:
    student_cfg: the student's ``ModelConfig``.
    teacher_heads: K arrays ``W_k`` [D_k, V] (``TeacherPool.heads``); held by
      the closure, never differentiated.
    config: :class:`OPDLossConfig`.
    teacher_names: K names for the per-teacher metrics (default ``t0..``).
    cross_tokenizer: K flags, True for a teacher whose tokenizer is not the
      student's (``opd.distill.crosstok``: its head ``[D_k, V_k]`` has its
      own vocabulary, and the batch holds its own rows and span keys); only
      the advantage form takes one.
    sampling_temperature: T > 0, the temperature the batch's responses (and
      their ``old_logprobs``) were sampled at; the GRPO term and the
      advantage form take the student's log-probs at it (OPD: its
      ``rollout.temperature``).

  Returns:
    ``loss_fn``. Metrics: ``opd_tokens`` (trained tokens), ``opd_rows``
    (rows with a teacher), ``kl/<name>`` (mean reverse KL over the tokens
    teacher k weighs; ``full`` only), ``loss/<name>`` (mean per-token loss
    over the tokens teacher k weighs, every estimator, ``full``: teacher k's
    own reverse KL; with routing by domain a per-domain curve) and
    ``student_entropy`` (``full``);
    with ``grpo_coef > 0`` also ``kl_loss`` (the distillation part),
    ``grpo_loss`` (the policy term before ``grpo_coef``) and
    ``grpo_clip_frac_low`` / ``grpo_clip_frac_high`` / ``grpo_ratio_mean``.
    An MoE student (``student_cfg.moe``) adds its balance losses and router
    metrics (``opd.models.moe_balance.balance_terms``).
  """
  heads = tuple(teacher_heads)
  if not heads:
    raise ValueError("teacher_heads=(): distillation needs at least one teacher")
  names = tuple(teacher_names) if teacher_names is not None else tuple(
      f"t{i}" for i in range(len(heads)))
  if len(names) != len(heads):
    raise ValueError(f"teacher_names has {len(names)} names for {len(heads)} teacher_heads")
  flags = tuple(cross_tokenizer) if cross_tokenizer is not None else (False,) * len(heads)
  if len(flags) != len(heads) or not all(isinstance(f, bool) for f in flags):
    raise ValueError(f"cross_tokenizer={cross_tokenizer!r}: expected {len(heads)} bools, one "
                     "per teacher")
  cross = tuple(i for i, f in enumerate(flags) if f)
  if cross and config.form != "advantage":
    raise ValueError(f"teacher {names[cross[0]]!r} has another tokenizer than the student: "
                     f"form={config.form!r} needs the student's vocabulary (a full-vocabulary "
                     "KL); use form='advantage' (span log-ratios, opd.distill.crosstok)")
  v = student_cfg.vocab_size
  for i, w in enumerate(heads):
    if w.ndim != 2 or (w.shape[1] != v and i not in cross):
      raise ValueError(f"teacher_heads[{i}].shape={w.shape}: expected [D_k, V={v}] (the student's "
                       "vocabulary)")
  if config.estimator == "top_k" and config.top_k > v:
    raise ValueError(f"OPDLossConfig.top_k={config.top_k} exceeds the vocabulary V={v}")
  widths = [w.shape[0] for w in heads]
  # One head array for every teacher (e.g. specialists keeping the base's
  # head): the training loss loads each head tile once for all K.
  shared = len(heads) > 1 and all(w is heads[0] for w in heads)
  tau_sample = fields.check_float("make_opd_loss", "sampling_temperature", sampling_temperature,
                                 min_value=0, min_exclusive=True)
  inv_teacher_tau = 1.0 / float(config.teacher_temperature)
  extra = config.batch_extra_keys

  def loss_fn(params, batch, rng):
    del rng
    _check_batch(batch, len(heads), widths, extra, cross)
    b, t = batch["tokens"].shape
    out = forward(student_cfg, params, batch["tokens"], batch.get("positions"), batch["mask"],
                  return_logits=False, return_hidden=True)
    h_s = out.hidden.reshape(b * t, -1)
    w_s = head_matrix(student_cfg, params)
    h_k = [h.reshape(-1, h.shape[-1]) for h in batch["teacher_hidden"]]
    if inv_teacher_tau != 1.0:  # x_k / τ_T = (h_k / τ_T) W_k
      h_k = [h.astype(jnp.float32) * inv_teacher_tau for h in h_k]
    weights = batch["teacher_weights"].astype(jnp.float32)
    keep = ((batch["loss_mask"] > 0) & batch["mask"].astype(bool)
            & (jnp.sum(weights, axis=-1) > 0))  # [B, T]
    w_flat = weights.reshape(b * t, -1)
    coef = token_coefficients(keep, config.aggregation).reshape(b * t)
    if cross:
      loss, metrics = crosstok.advantage_loss(config, h_s, w_s, h_k, heads, batch, keep,
                                              coef.reshape(b, t), cross, temperature=tau_sample)
    elif config.form == "advantage":
      loss, metrics = advantage_lib.advantage_loss(config, h_s, w_s, h_k, heads, batch, keep,
                                                   coef.reshape(b, t), temperature=tau_sample)
    else:
      loss, metrics = _exact_loss(config, (h_s, w_s, h_k, heads, w_flat), batch, keep, coef,
                                  names, shared, tau_sample)
    metrics["opd_tokens"] = jnp.sum(keep.astype(jnp.float32))
    metrics["opd_rows"] = jnp.sum(jnp.any(keep, axis=1).astype(jnp.float32))
    if student_cfg.moe is not None:
      balance, router = moe_balance.balance_terms(student_cfg.moe, out.moe)
      loss = loss + balance
      metrics.update(router)
    return loss, metrics

  return loss_fn
