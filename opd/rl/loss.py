"""GRPO's objective (SPEC §5): config, episode scoring, group advantages, clipped loss.

Episodes become scores (``score_episodes``: the task verifiers' ``Reward``
or a plain ``reward_fn`` callable, failures isolated and counted), scores
become advantages, advantages and log-probs become the loss. The trainer
that drives this is ``opd.rl.grpo``.

For a prompt ``q`` the policy samples a group of G responses ``o_1..o_G``
with rewards ``r_i``. Each response's advantage is its reward relative to
the group (``group_advantages``)::

    A_i = (r_i - mean(r)) / (std(r) + eps)      scale_advantages_by_std=True (GRPO)
    A_i =  r_i - mean(r)                        scale_advantages_by_std=False (Dr. GRPO)

with the population std (ddof=0); a group whose rewards are all equal
gets exactly zero advantages. Every policy-sampled token ``t`` of ``o_i``
carries ``A_i`` and the per-token loss (``policy_loss``)::

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

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from opd.models import ModelConfig, forward, token_logprobs
from opd.rollout.episodes import Episode
from opd.tasks import Reward, RewardStats

Array = jax.Array
LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum_norm")
# exp() of a log-ratio beyond this overflows fp32 long before it means anything;
# clamping keeps a diverged token finite (its gradient is then zero).
_MAX_LOG_RATIO = 20.0
# The GRPOConfig fields grpo_loss reads: configs equal on these share a compiled step.
LOSS_FIELDS = ("clip_eps_low", "clip_eps_high", "kl_coef", "loss_aggregation", "temperature",
               "max_new_tokens")
BATCH_KEYS = ("tokens", "targets", "mask", "loss_mask", "old_logprobs", "advantages")


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
      and math.isfinite(float(v))


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Everything GRPO-specific; hashable (it keys the compiled train step).

  Attributes:
    group_size: G, samples per prompt (>= 2: a group of one has no baseline).
    prompts_per_step: P, prompts per rollout batch; the batch has B = P * G rows.
    clip_eps_low: ratio clipped below at ``1 - clip_eps_low`` (in [0, 1)).
    clip_eps_high: ratio clipped above at ``1 + clip_eps_high``; larger than
      ``clip_eps_low`` gives DAPO's asymmetric "clip-higher".
    kl_coef: weight of the k3 KL(pi || pi_ref) term in the loss (0 = none;
      then no reference model is needed).
    scale_advantages_by_std: divide by the group std (GRPO); False keeps the
      plain mean-centred reward (Dr. GRPO).
    advantage_eps: added to the group std before dividing.
    loss_aggregation: one of ``LOSS_AGGREGATIONS`` (module docstring).
    temperature: sampling temperature T > 0, also used for every log-prob.
    top_k, top_p: sampling truncation (log-probs stay untruncated).
    max_new_tokens: N, tokens per sampled turn; also the ``token_sum_norm``
      normaliser.
    updates_per_batch: mu, optimizer steps on one rollout batch (the ratio
      moves away from 1 from the second on).
    seq_len: L, the longest training row; a prompt must leave room for a full
      turn (``len(prompt) + N - 1 <= L``), longer agent episodes are cut.
    length_bucket: each step's arrays are padded only to its longest episode
      rounded up to a multiple of this (at most ``seq_len``), so short
      responses do not pay for ``seq_len`` and only a few shapes compile;
      0 always pads to ``seq_len``.
    max_error_fraction: a step whose share of verifier errors and malformed
      prompts exceeds this stops the run (``VerifierFailureError``).
    num_text_samples: rollouts written to TensorBoard as text (0 = none).
  """
  group_size: int = 8
  prompts_per_step: int = 8
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.04
  scale_advantages_by_std: bool = True
  advantage_eps: float = 1e-6
  loss_aggregation: str = "token_mean"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64
  updates_per_batch: int = 1
  seq_len: int = 256
  length_bucket: int = 32
  max_error_fraction: float = 0.1
  num_text_samples: int = 4

  def __post_init__(self):
    def bad(name, want):
      raise ValueError(f"GRPOConfig.{name} must be {want}, got {getattr(self, name)!r}")

    for name, lo in (("group_size", 2), ("prompts_per_step", 1), ("top_k", 0),
                     ("max_new_tokens", 1), ("updates_per_batch", 1), ("seq_len", 2),
                     ("length_bucket", 0), ("num_text_samples", 0)):
      if not _is_int(getattr(self, name)) or getattr(self, name) < lo:
        bad(name, f"an int >= {lo}")
    checks = {
        "clip_eps_low": (lambda v: 0.0 <= v < 1.0, "a number in [0, 1)"),
        "clip_eps_high": (lambda v: v >= 0.0, "a number >= 0"),
        "kl_coef": (lambda v: v >= 0.0, "a number >= 0"),
        "advantage_eps": (lambda v: v >= 0.0, "a number >= 0"),
        "temperature": (lambda v: v > 0.0, "a number > 0 (GRPO needs sampling, not greedy)"),
        "top_p": (lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
        "max_error_fraction": (lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    }
    for name, (ok, want) in checks.items():
      v = getattr(self, name)
      if not _is_num(v) or not ok(float(v)):
        bad(name, want)
    if not isinstance(self.scale_advantages_by_std, bool):
      bad("scale_advantages_by_std", "a bool")
    if self.loss_aggregation not in LOSS_AGGREGATIONS:
      bad("loss_aggregation", f"one of {LOSS_AGGREGATIONS}")
    if self.seq_len < self.max_new_tokens + 1:
      raise ValueError(f"GRPOConfig.seq_len={self.seq_len} must be >= max_new_tokens + 1 = "
                       f"{self.max_new_tokens + 1} (a prompt token plus a full turn)")

  @property
  def batch_size(self) -> int:
    """B = prompts_per_step * group_size."""
    return self.prompts_per_step * self.group_size

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "GRPOConfig":
    return dataclasses.replace(self, **changes)


def group_advantages(rewards, *, scale_by_std: bool = True, eps: float = 1e-6) -> np.ndarray:
  """Group-normalised advantages. ``[P, G] -> [P, G]`` float32 (host numpy).

  Population std (ddof=0). A group whose rewards are all equal has
  advantage exactly 0 (no NaN, even with ``eps=0``).

  Raises:
    ValueError: ``rewards`` is not a finite ``[P, G]`` array, or ``eps < 0``.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 2 or 0 in r.shape:
    raise ValueError(f"rewards must be a non-empty [P, G] array, got shape {r.shape}")
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards must be finite, got {int((~np.isfinite(r)).sum())} NaN/inf")
  if not _is_num(eps) or eps < 0:
    raise ValueError(f"eps must be a number >= 0, got {eps!r}")
  flat = r.max(axis=1) == r.min(axis=1)  # [P]
  adv = r - r.mean(axis=1, keepdims=True)
  if scale_by_std:
    std = np.where(flat, 1.0, r.std(axis=1))[:, None]
    adv = adv / (std + eps)
  adv[flat] = 0.0
  return adv.astype(np.float32)


# ---------------------------------------------------------------------------
# Rewards: episodes -> scores (advantages from them above).

RewardFn = Callable[[Sequence[Episode]], Any]


def count_reason(stats: RewardStats, reason: str) -> None:
  """Adds one score with ``reason`` to ``stats`` (as ``RewardStats.add`` does for a
  ``Reward``; custom scores need not be valid ``Reward``s)."""
  category = reason.split(":", 1)[0]
  stats.total += 1
  stats.reasons[category] += 1
  stats.errors += category in RewardStats.ERROR_CATEGORIES


@dataclasses.dataclass(frozen=True)
class Score:
  """One episode's reward as the trainer uses it.

  Attributes:
    reward: the scalar the advantages are computed from (any finite value;
      custom scorers need not stay in [0, 1]).
    components: named parts for logging (``format`` and the verifier's
      components, or a custom scorer's columns).
    reason: ``"ok"`` or ``category[:detail]`` as in ``opd.tasks.Reward``.
  """
  reward: float
  components: Mapping[str, float] = dataclasses.field(default_factory=dict)
  reason: str = "ok"


def _from_reward(r: Reward) -> Score:
  return Score(float(r.reward), {"format": float(r.format), **dict(r.components)}, r.reason)


def _parse_scores(out: Any, n: int, names: Sequence[str] | None) -> list[Score]:
  """A reward_fn's output for ``n`` episodes as Scores; ValueError if malformed."""
  if isinstance(out, Mapping):
    cols = {str(k): np.asarray(v, np.float64) for k, v in out.items()}
    for k, v in cols.items():
      if v.shape != (n,):
        raise ValueError(f"reward_fn component {k!r} has shape {v.shape}, expected ({n},)")
    table = np.stack(list(cols.values()), axis=1) if cols else np.zeros((n, 0))
    names, total = list(cols), table.sum(axis=1)
  elif isinstance(out, (list, tuple)) and out and all(isinstance(r, Reward) for r in out):
    if len(out) != n:
      raise ValueError(f"reward_fn returned {len(out)} Rewards for {n} episodes")
    return [_from_reward(r) for r in out]
  else:
    arr = np.asarray(out, np.float64)
    if arr.shape == (n,):
      table, names, total = np.zeros((n, 0)), [], arr
    elif arr.ndim == 2 and arr.shape[0] == n:
      names = list(names) if names is not None else [f"c{i}" for i in range(arr.shape[1])]
      if len(names) != arr.shape[1]:
        raise ValueError(f"reward_fn.component_names has {len(names)} names for "
                         f"{arr.shape[1]} columns")
      table, total = arr, arr.sum(axis=1)
    else:
      raise ValueError(f"reward_fn must return [B]={n} rewards, [B, C] components, a dict of "
                       f"[B] components or B Rewards; got shape {arr.shape}")
  scores = []
  for i in range(n):
    if not (np.isfinite(total[i]) and np.all(np.isfinite(table[i]))):
      scores.append(Score(0.0, {}, "verifier_error:non-finite reward"))
    else:
      scores.append(Score(float(total[i]), dict(zip(names, map(float, table[i])))))
  return scores


def score_episodes(episodes: Sequence[Episode], reward_fn: RewardFn | None = None, *,
                   stats: RewardStats | None = None) -> list[Score]:
  """Scores episodes; never raises for a bad sample.

  Args:
    episodes: from ``opd.rollout.episodes.rollout``.
    reward_fn: None takes ``Episode.reward`` (the task verifiers'; rollout
      already counted it in its stats). Otherwise ``reward_fn(episodes)``
      returns ``[B]`` rewards, ``[B, C]`` components (summed to the reward;
      named by ``reward_fn.component_names`` if it has one), a dict of named
      ``[B]`` components (summed), or ``B`` ``opd.tasks.Reward``s.
    stats: counts every score's reason (custom ``reward_fn`` only).

  A ``reward_fn`` that raises or returns a malformed batch is retried one
  episode at a time; episodes that still fail, and non-finite values, score
  0 with reason ``verifier_error:...``.
  """
  if reward_fn is None:
    missing = [i for i, ep in enumerate(episodes) if ep.reward is None]
    if missing:
      raise ValueError(f"episodes {missing[:8]} have no reward; roll out with verify=True or "
                       "pass a reward_fn")
    return [_from_reward(ep.reward) for ep in episodes]
  names = getattr(reward_fn, "component_names", None)
  try:
    scores = _parse_scores(reward_fn(list(episodes)), len(episodes), names)
  except Exception:  # noqa: BLE001 - isolate the failing episode(s)
    scores = []
    for ep in episodes:
      try:
        scores += _parse_scores(reward_fn([ep]), 1, names)
      except Exception as e:  # noqa: BLE001 - count it, score 0, never crash the trainer
        scores.append(Score(0.0, {}, f"verifier_error:{type(e).__name__}: {e}"[:300]))
  if stats is not None:
    for s in scores:
      count_reason(stats, s.reason)
  return scores


def reward_metrics(scores: Sequence[Score], episodes: Sequence[Episode],
                   group_size: int) -> dict[str, float]:
  """Reward and response statistics of one rollout batch (names in ``train_grpo``)."""
  r = np.asarray([s.reward for s in scores], np.float64)
  if r.size % group_size:
    raise ValueError(f"{r.size} scores do not split into groups of {group_size}")
  groups = r.reshape(-1, group_size)
  out = {"reward/mean": r.mean(), "reward/std": r.std(), "reward/min": r.min(),
         "reward/max": r.max(),
         "groups/zero_std_fraction": float(np.mean(groups.max(1) == groups.min(1)))}
  for name in sorted({k for s in scores for k in s.components}):
    vals = np.asarray([s.components[name] for s in scores if name in s.components])
    out[f"reward/components/{name}/mean"] = vals.mean()
    out[f"reward/components/{name}/std"] = vals.std()
  domains = [ep.example.domain for ep in episodes]
  for d in sorted(set(domains)):
    out[f"reward/domain/{d}/mean"] = float(np.mean([x for x, e in zip(r, domains) if e == d]))
  lengths = np.asarray([len(ep.response_ids) for ep in episodes])
  out.update({"response/length_mean": lengths.mean(), "response/length_max": lengths.max(),
              "response/truncation_rate": float(np.mean([ep.truncated for ep in episodes])),
              "response/policy_tokens": float(sum(ep.num_policy_tokens for ep in episodes))})
  return {k: float(v) for k, v in out.items()}


# ---------------------------------------------------------------------------
# The loss.


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
    if not _is_int(norm_tokens) or norm_tokens < 1:
      raise ValueError(f"token_sum_norm needs norm_tokens >= 1, got {norm_tokens!r}")
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
    advantages: ``[B]``, one per sequence.
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
  for name, x, shape in (("old_logp", old_logp, (B, T)), ("weights", weights, (B, T)),
                         ("advantages", advantages, (B,)),
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
  A = advantages.astype(jnp.float32)[:, None]
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


def grpo_loss(model_cfg: ModelConfig, cfg: GRPOConfig):
  """``loss_fn(params, batch, rng) -> (loss, metrics)`` for ``opd.training.train_step``.

  ``batch`` is ``opd.rollout.episodes.batch_episodes``' dict (``tokens``, ``targets``,
  ``mask``, ``loss_mask``, ``old_logprobs``, all ``[B, L]``) plus
  ``advantages [B]`` and, when ``cfg.kl_coef > 0``, ``ref_logprobs [B, L]``
  (the frozen reference's ``token_logprobs`` at ``cfg.temperature``; also
  accepted with ``kl_coef = 0``, to log the KL).

  Metrics: those of ``policy_loss`` plus ``entropy``, the mean over policy
  tokens of the full-vocabulary entropy at temperature T.
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
    logits = forward(model_cfg, params, batch["tokens"], None, batch["mask"]).logits
    logp = token_logprobs(logits, batch["targets"], T)
    weights = batch["loss_mask"].astype(jnp.float32) * batch["mask"].astype(jnp.float32)
    loss, metrics = policy_loss(
        logp, batch["old_logprobs"], batch["advantages"], weights, ref_logp=ref,
        clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high, kl_coef=cfg.kl_coef,
        aggregation=cfg.loss_aggregation, norm_tokens=cfg.max_new_tokens)
    entropy = jax.lax.stop_gradient(token_entropy(logits, T))
    metrics["entropy"] = _token_mean(entropy, weights > 0)
    return loss, metrics

  return loss_fn
