"""Inference-time scaling by voting over k GRM samples: pure numpy (docs/DESIGN.md §6).

Inputs are one example's k samples, already mapped back to the original
response order (``grm.format.unshuffle``): ``scores [k, n]`` ints and
``valid [k]`` bools. An invalid sample's row is ignored, whatever it holds
(``grm.judge.score_arrays`` fills it with zeros); a valid sample's scores
must be integers in 1..10 (``grm.format.MIN_SCORE..MAX_SCORE``), and a NaN,
an infinity, a fraction or an out-of-range value there is refused with a
``ValueError`` naming ``scores``, the sample, the response and the value.

  vote           ``S*_i = sum_j S_ij`` over valid samples (range k..10k)
  meta_vote      the same over the k_meta valid samples with the highest
                 meta-RM score (ties in the meta score: lower sample index
                 first)
  weighted_vote  ``R_i = sum_j m_j S_ij / sum_j m_j`` over valid samples,
                 weights ``m_j >= 0`` (e.g. the meta-RM's probabilities)

**Tie rule.** The winner is the unique argmax of the totals; when two or
more responses share the top total (or no sample was valid) there is no
winner, ``winner == -1``, and the vote counts as incorrect, exactly as a
single judgement with a tie at the top does (``grm.correctness``). Picking
the lowest index instead would reward position bias.

The model-calling side (k shuffled samples per example in one sampler call)
is ``grm.judge``; these functions only add numbers, so tests compare them
with a plain numpy reference.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from grm.correctness import check_ratings
from grm.format import MAX_SCORE, MIN_SCORE

NO_WINNER = -1


@dataclasses.dataclass(frozen=True)
class Vote:
  """A voted decision for one example.

  Attributes:
    totals: ``[n]`` float64 summed (or weighted-mean) scores, original order.
    winner: unique argmax of ``totals``, or ``NO_WINNER`` (-1) on a tie.
    num_valid: valid samples that voted.
    num_invalid: invalid samples dropped.
    used: indices of the samples that voted (sorted).
    averaged: True when ``totals`` are already per-sample means
      (``weighted_vote``), False when they are sums.
  """
  totals: np.ndarray
  winner: int
  num_valid: int
  num_invalid: int
  used: tuple[int, ...]
  averaged: bool = False

  @property
  def mean_scores(self) -> np.ndarray:
    """``[n]`` mean score per response (NaN when nothing voted)."""
    if self.num_valid == 0:
      return np.full_like(self.totals, np.nan)
    return self.totals if self.averaged else self.totals / self.num_valid


def unique_argmax(totals: np.ndarray) -> int:
  """The index of the unique maximum, or ``NO_WINNER`` on a tie at the top."""
  totals = np.asarray(totals)
  top = totals.max()
  return int(np.argmax(totals)) if np.sum(totals == top) == 1 else NO_WINNER


def _check(scores, valid) -> tuple[np.ndarray, np.ndarray]:
  s = np.asarray(scores)
  v = np.asarray(valid)
  if s.ndim != 2 or s.shape[1] == 0:
    raise ValueError(f"scores must be [k, n] with n >= 1, got {s.shape=}")
  if v.dtype != bool or v.shape != (s.shape[0],):
    raise ValueError(f"valid must be a bool [k] array, got {v.dtype} {v.shape=} for {s.shape=}")
  if not (np.issubdtype(s.dtype, np.integer) or np.issubdtype(s.dtype, np.floating)):
    raise ValueError(f"scores must be numbers, got dtype {s.dtype}")
  s = s.astype(np.float64)
  rows = s[v]
  bad = ~(np.isfinite(rows) & (rows == np.round(rows)) & (rows >= MIN_SCORE)
          & (rows <= MAX_SCORE))
  if bad.any():
    j, i = np.argwhere(bad)[0]
    value = float(rows[j, i])
    raise ValueError(f"scores[{np.flatnonzero(v)[j]}, {i}]={value!r} of a valid sample must be "
                     f"an integer in [{MIN_SCORE}, {MAX_SCORE}]")
  return s, v


def _result(totals, used: np.ndarray, num_invalid: int, any_vote: bool,
            averaged: bool = False) -> Vote:
  totals = np.asarray(totals, np.float64)
  winner = unique_argmax(totals) if any_vote else NO_WINNER
  return Vote(totals=totals, winner=winner, num_valid=int(used.size), num_invalid=num_invalid,
              used=tuple(int(i) for i in used), averaged=averaged)


def vote(scores, valid) -> Vote:
  """Sum of the valid samples' scores per response.

  Args:
    scores: ``[k, n]`` scores in the original order.
    valid: ``[k]`` bool.
  """
  s, v = _check(scores, valid)
  used = np.flatnonzero(v)
  return _result(s[used].sum(0), used, int((~v).sum()), used.size > 0)


def select_top(meta, valid, k_meta: int) -> np.ndarray:
  """Indices (sorted) of the ``k_meta`` valid samples with the largest meta score.

  Ties in ``meta`` go to the lower sample index; fewer valid samples than
  ``k_meta`` means all of them.
  """
  m = np.asarray(meta, np.float64)
  v = np.asarray(valid)
  if m.shape != v.shape or m.ndim != 1:
    raise ValueError(f"meta {m.shape=} and valid {v.shape=} must both be [k]")
  if isinstance(k_meta, bool) or not isinstance(k_meta, (int, np.integer)) or k_meta < 1:
    raise ValueError(f"k_meta={k_meta!r} must be an int >= 1")
  if np.any(np.isnan(m[v])):
    raise ValueError("meta scores of valid samples must not be NaN")
  idx = np.flatnonzero(v)
  order = np.argsort(-m[idx], kind="stable")  # stable: equal scores keep index order
  return np.sort(idx[order[:k_meta]])


def meta_vote(scores, valid, meta, k_meta: int) -> Vote:
  """``vote`` over the top-``k_meta`` valid samples by meta-RM score.

  Args:
    scores: ``[k, n]``; valid: ``[k]`` bool; meta: ``[k]`` meta-RM scores
      (logits or probabilities: only their order matters); k_meta >= 1.
  """
  s, v = _check(scores, valid)
  used = select_top(meta, v, k_meta)
  return _result(s[used].sum(0), used, int((~v).sum()), used.size > 0)


def weighted_vote(scores, valid, weights) -> Vote:
  """Weighted mean ``sum_j m_j S_ij / sum_j m_j`` over valid samples.

  Args:
    scores: ``[k, n]``; valid: ``[k]`` bool; weights: ``[k]`` finite, >= 0.
      With zero total weight there is no winner.
  """
  s, v = _check(scores, valid)
  w = np.asarray(weights, np.float64)
  if w.shape != v.shape or not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"weights must be a finite, non-negative [k] array, got {w!r:.80}")
  used = np.flatnonzero(v)
  mass = w[used].sum()
  if mass <= 0:
    return _result(np.zeros(s.shape[1]), used, int((~v).sum()), False, averaged=True)
  totals = (w[used, None] * s[used]).sum(0) / mass
  return _result(totals, used, int((~v).sum()), True, averaged=True)


def vote_correct(result: Vote, ratings) -> bool:
  """Whether a vote picks the ground truth.

  n >= 2: the winner is the unique best (``NO_WINNER`` is wrong). n == 1:
  the mean voted score (``Vote.mean_scores``), rounded half to even,
  equals the rating.
  """
  r = check_ratings(ratings)
  if r.shape != result.totals.shape:
    raise ValueError(f"ratings={tuple(ratings)} do not match {result.totals.shape[0]} responses")
  if r.size >= 2:
    return result.winner == int(np.argmax(r))
  if result.num_valid == 0:
    return False
  return bool(np.rint(result.mean_scores[0]) == r[0])


def random_winners(ns, seed) -> np.ndarray:
  """The random baseline: a uniform pick among each example's n responses.

  Args:
    ns: ``[E]`` response counts (each >= 1).
    seed: ``np.random.default_rng`` seed.

  Returns:
    ``[E]`` int64 picks; expected accuracy ``mean(1 / n)``.
  """
  ns = np.asarray(ns)
  if ns.ndim != 1 or not np.issubdtype(ns.dtype, np.integer) or np.any(ns < 1):
    raise ValueError(f"ns must be a 1-D array of ints >= 1, got {ns!r:.80}")
  return np.random.default_rng(seed).integers(0, ns)
