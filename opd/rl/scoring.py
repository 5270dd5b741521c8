"""Host-side scoring of GRPO rollouts (docs/DESIGN.md §5, §7): episodes -> rewards -> metrics.

Episodes become ``Score``s (``score_episodes``: the task verifiers' ``Reward``
or a plain ``reward_fn`` callable, failures isolated and counted); the
trainer turns scores into advantages (``opd.rl.advantages``) and logs
``reward_metrics``. Nothing here is jitted.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from opd.rollout.episodes import Episode
from opd.tasks import Reward, RewardStats

__all__ = ["RewardFn", "Score", "count_reason", "reward_metrics", "score_episodes"]

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
