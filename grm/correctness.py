"""When a GRM judgement is correct, and the rule-based RL reward (docs/DESIGN.md §6).

With ground-truth ratings ``r`` (verifier rewards, a hidden rubric's score,
...) of n responses, and the judgement's scores ``S`` in the **original**
response order (``grm.format.unshuffle``):

  n >= 2: correct iff the best response ``j = argmax r`` scores strictly
          above every other, ``S_j > S_i`` for all ``i != j`` (a tie for the
          top is incorrect);
  n == 1: correct iff ``S_1 == r_1`` (``r_1`` an integer rating in 1..10).

An invalid sample (``scores is None``) is incorrect. The rule-RL reward is
+1 for a correct judgement and -1 otherwise; there is no format reward.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from grm.format import MAX_SCORE, MIN_SCORE


def check_ratings(ratings: Sequence[float]) -> np.ndarray:
  """``ratings`` as a float64 ``[n]`` array, validated as ground truth.

  Raises:
    ValueError: empty or non-finite; n >= 2 without a unique best; n == 1
      with a rating that is not an integer in 1..10.
  """
  r = np.asarray(ratings, np.float64)
  if r.ndim != 1 or r.size == 0 or not np.all(np.isfinite(r)):
    raise ValueError(f"ratings={ratings!r} must be a non-empty 1-D sequence of finite numbers")
  if r.size == 1:
    if r[0] != np.round(r[0]) or not MIN_SCORE <= r[0] <= MAX_SCORE:
      raise ValueError(f"ratings={ratings!r}: a single response needs an integer rating in "
                       f"[{MIN_SCORE}, {MAX_SCORE}]")
  elif np.sum(r == r.max()) != 1:
    raise ValueError(f"ratings={ratings!r} have no unique best response")
  return r


def best_index(ratings: Sequence[float]) -> int:
  """Index of the unique best response (n >= 2), or 0 for n == 1."""
  return int(np.argmax(check_ratings(ratings)))


def is_correct(scores: Sequence[int] | None, ratings: Sequence[float]) -> bool:
  """The correctness rule of the module docstring.

  Args:
    scores: the judgement's n scores in the original order, or None when
      the sample was invalid.
    ratings: the n ground-truth ratings (``check_ratings``).

  Raises:
    ValueError: invalid ``ratings``, or ``len(scores) != len(ratings)``.
  """
  r = check_ratings(ratings)
  if scores is None:
    return False
  s = np.asarray(scores, np.float64)
  if s.shape != r.shape:
    raise ValueError(f"scores={tuple(scores)} and ratings={tuple(ratings)} differ in length")
  if r.size == 1:
    return bool(s[0] == r[0])
  j = int(np.argmax(r))
  others = np.delete(s, j)
  return bool(np.all(s[j] > others))


def rule_reward(scores: Sequence[int] | None, ratings: Sequence[float]) -> float:
  """+1.0 for a correct judgement, -1.0 otherwise (invalid included)."""
  return 1.0 if is_correct(scores, ratings) else -1.0
