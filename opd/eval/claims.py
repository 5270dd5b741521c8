"""Metrics the V4 claims are read with (docs/DESIGN.md §3, "Baselines and curve metrics").

* ``sampler_quality``: a model's sampled score over its greedy one on the
  same examples, ``mean@N`` at the evaluation's temperature / ``reward@1``
  (1: sampling loses nothing; OPD's reverse KL pulls a student towards its
  teacher's sampling distribution, so a teacher far below 1 caps OPD);
* ``retention``: a student's score over its teacher's on the same examples
  (greedy or sampled);
* ``steps_to_fraction``: the first evaluation step at which a curve reaches
  ``fraction · target`` (e.g. 90% of the teacher), linearly interpolated
  between the two evaluations around the crossing;
* ``domain_fluctuation``: the step-to-step noise of each domain's own loss
  curve relative to its level, averaged over domains, so the domain mix of
  consecutive batches (a math-heavy batch has another loss than a
  writing-heavy one) does not count as fluctuation.

Ratios come with the delta-method SE of ``opd.eval.stats.ratio_estimate``
(paired over examples).
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from opd.config.fields import check_float
from opd.eval.results import DomainResult
from opd.eval.stats import ratio_estimate

__all__ = ["domain_fluctuation", "retention", "sampler_quality", "steps_to_fraction"]

MODES = ("greedy", "sampled")


def _rewards(result: DomainResult, mode: str, who: str):
  """``[n]`` greedy or ``[n][N]`` sampled rewards of a domain result."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  values = result.greedy_rewards if mode == "greedy" else result.sampled_rewards
  if values is None:
    raise ValueError(f"{who} ({result.domain}) has no {mode} pass (EvalConfig."
                     f"{'greedy' if mode == 'greedy' else 'num_samples'})")
  return values


def sampler_quality(result: DomainResult) -> tuple[float, float]:
  """``(mean@N / reward@1, SE)`` of one model on one domain, paired over its examples.

  Raises:
    ValueError: the result lacks the greedy or the sampled pass, or its
      greedy score is 0.
  """
  return ratio_estimate(_rewards(result, "sampled", "result"),
                        _rewards(result, "greedy", "result"))


def retention(student: DomainResult, teacher: DomainResult,
              mode: str = "greedy") -> tuple[float, float]:
  """``(student score / teacher score, SE)`` on one domain, paired over examples.

  Args:
    student, teacher: results on the same examples (``example_ids`` equal).
    mode: ``"greedy"`` (reward@1) or ``"sampled"`` (mean@N, N equal in both).

  Raises:
    ValueError: different domains or examples, a missing pass, a teacher score of 0.
  """
  if student.domain != teacher.domain or list(student.example_ids) != list(teacher.example_ids):
    raise ValueError(f"retention needs both models on the same examples: student "
                     f"{student.domain} ({len(student.example_ids)} examples), teacher "
                     f"{teacher.domain} ({len(teacher.example_ids)}); ids differ")
  s, t = _rewards(student, mode, "student"), _rewards(teacher, mode, "teacher")
  if np.shape(s) != np.shape(t):
    raise ValueError(f"retention: student {mode} rewards have shape {np.shape(s)}, teacher's "
                     f"{np.shape(t)} (the same N samples per example are needed)")
  return ratio_estimate(s, t)


def steps_to_fraction(steps, scores, target: float, fraction: float = 0.9,
                      interpolate: bool = True) -> float | None:
  """The step at which an evaluation curve first reaches ``fraction · target``.

  With evaluations ``(s_i, y_i)`` and ``c = fraction · target``, let i be the
  first index with ``y_i >= c``. The answer is ``s_i`` when ``i = 0`` or
  ``interpolate`` is False; otherwise the crossing of the straight line
  between ``(s_{i-1}, y_{i-1})`` and ``(s_i, y_i)``:
  ``s_{i-1} + (c − y_{i-1}) / (y_i − y_{i-1}) · (s_i − s_{i-1})``.

  Args:
    steps: ``[n]`` strictly increasing evaluation steps.
    scores: ``[n]`` the scores there (e.g. the student's reward@1).
    target: e.g. the teacher's score, in the units of ``scores``.
    fraction: in (0, 1].

  Returns:
    That step (a float when interpolated), or None if no evaluation reaches ``c``.
  """
  s, y = np.asarray(steps, np.float64), np.asarray(scores, np.float64)
  if s.ndim != 1 or s.shape != y.shape or s.size == 0:
    raise ValueError(f"steps {s.shape} and scores {y.shape} must be equal non-empty 1-D curves")
  if not (np.all(np.isfinite(s)) and np.all(np.isfinite(y))):
    raise ValueError("steps and scores must be finite")
  if np.any(np.diff(s) <= 0):
    raise ValueError(f"steps must be strictly increasing, got {s.tolist()}")
  fraction = check_float("steps_to_fraction", "fraction", fraction, min_value=0,
                         min_exclusive=True, max_value=1)
  c = fraction * check_float("steps_to_fraction", "target", target)
  hit = np.flatnonzero(y >= c)
  if hit.size == 0:
    return None
  i = int(hit[0])
  if i == 0 or not interpolate:
    return float(s[i])
  return float(s[i - 1] + (c - y[i - 1]) / (y[i] - y[i - 1]) * (s[i] - s[i - 1]))


def domain_fluctuation(per_domain: Mapping[str, object],
                       from_fraction: float = 0.5) -> tuple[float, dict[str, float]]:
  """Step-to-step loss noise within each domain, in % of its level, and its mean.

  For a domain's curve ``x`` (its mean loss over its own rows at each step;
  NaN where a step held none of its rows), over the steps ``t >=
  floor(from_fraction · n)`` with a value, in step order, with consecutive
  differences ``d``: ``100 · std(d, ddof=1) / sqrt(2) / mean(|x|)``. For a
  level with independent noise of standard deviation σ per step this
  estimates ``100 · σ / level`` (a difference of two steps has variance
  2σ²); a steady trend adds a constant to every ``d`` and does not count.

  Args:
    per_domain: domain -> ``[n]`` per-step losses (NaN: absent that step).
    from_fraction: where the measured span starts (0.5: second half).

  Returns:
    ``(mean over domains, {domain: value})``.

  Raises:
    ValueError: no domain, a curve that is not 1-D, fewer than 3 values in
      a domain's span, or a domain whose mean |loss| is 0.
  """
  if not per_domain:
    raise ValueError("per_domain must name at least one domain")
  f = check_float("domain_fluctuation", "from_fraction", from_fraction, min_value=0,
                  max_value=1, max_exclusive=True)
  out = {}
  for domain, values in per_domain.items():
    x = np.asarray(values, np.float64)
    if x.ndim != 1 or np.any(np.isinf(x)):
      raise ValueError(f"domain {domain!r}: expected a 1-D curve of finite losses (NaN: "
                       f"absent), got shape {x.shape}")
    span = x[int(math.floor(f * x.shape[0])):]
    span = span[np.isfinite(span)]
    if span.shape[0] < 3:
      raise ValueError(f"domain {domain!r} has {span.shape[0]} losses from step "
                       f"{int(math.floor(f * x.shape[0]))} on; at least 3 are needed")
    level = float(np.mean(np.abs(span)))
    if level == 0:
      raise ValueError(f"domain {domain!r} has mean |loss| 0: a relative fluctuation is undefined")
    out[domain] = float(100.0 * np.std(np.diff(span), ddof=1) / math.sqrt(2.0) / level)
  return float(np.mean(list(out.values()))), out
