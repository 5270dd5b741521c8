"""DeepSeekMath-V2 rewards, vectorised over a batch, and issue faithfulness (docs/DESIGN.md §7).

For B samples (arrays ``[B]``; scores in {0, 0.5, 1}):

  R_score(s', s) = 1 − |s' − s|
  verifier       R = R_format · R_score(s', s)              (s the proof's label)
  with meta      R = R_format · R_score(s', s) · R_meta     (R_meta the meta-verifier's
                                                             score of the analysis)
  generator      R = R_format(Y, Z) · (α R_Y + β R_Z),  R_Z = R_score(s', s) · R_meta(Z)

with R_Y the verifier's score of proof Y, s' the self-score in Z, s the
score Z is compared with (the label of Y; by default R_Y itself) and
α = 0.76, β = 0.24. A sample whose format is 0 gets reward 0 whatever its
(possibly undefined, NaN) scores. ``*_from_parsed`` build the arrays from
``grm.verify.format`` parses.

Faithfulness: of all issues the analyses state, the share the rule checker
confirms (same line and kind, ``grm.verify.format.confirmed``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from grm.verify.format import Analysis, Generation, confirmed
from opd.config.fields import check_fields
from opd.tasks.proof_task import ProofCheck

ALPHA, BETA = 0.76, 0.24


def _arr(name: str, x, n: int | None = None) -> np.ndarray:
  a = np.asarray(x, np.float64)
  if a.ndim != 1 or (n is not None and a.shape[0] != n):
    raise ValueError(f"{name} must be a [B] array{f' with B={n}' if n is not None else ''}, "
                     f"got shape {a.shape}")
  return a


def r_score(pred, label) -> np.ndarray:
  """``[B]`` 1 − |s' − s| (NaN where a score is NaN)."""
  pred = _arr("pred", pred)
  return 1.0 - np.abs(pred - _arr("label", label, pred.shape[0]))


def _gate(fmt: np.ndarray, value: np.ndarray) -> np.ndarray:
  """``fmt · value``, 0 (not NaN) where the format is 0."""
  return np.where(fmt > 0, fmt * np.nan_to_num(value, nan=0.0), 0.0)


def verifier_reward(fmt, pred, label, meta=None) -> np.ndarray:
  """``[B]`` R_format · R_score(s', s) [· R_meta]."""
  fmt = _arr("fmt", fmt)
  value = r_score(pred, label)
  if meta is not None:
    value = value * _arr("meta", meta, fmt.shape[0])
  return _gate(fmt, value)


@dataclasses.dataclass(frozen=True)
class GeneratorReward:
  """The generator's reward weights (α on the proof, β on the self-evaluation)."""
  alpha: float = ALPHA
  beta: float = BETA

  def __post_init__(self):
    check_fields(self, "GeneratorReward", non_negative=("alpha", "beta"))

  def __call__(self, fmt, r_y, self_score, meta_z, label=None) -> np.ndarray:
    """``[B]`` R_format(Y, Z) · (α R_Y + β R_score(s', s) · R_meta(Z)); ``label`` s
    defaults to ``r_y``."""
    fmt, r_y = _arr("fmt", fmt), _arr("r_y", r_y)
    label = r_y if label is None else label
    r_z = r_score(self_score, label) * _arr("meta_z", meta_z, fmt.shape[0])
    return _gate(fmt, self.alpha * r_y + self.beta * r_z)


def generator_reward(fmt, r_y, self_score, meta_z, label=None, *, alpha: float = ALPHA,
                     beta: float = BETA) -> np.ndarray:
  """``GeneratorReward(alpha, beta)(fmt, r_y, self_score, meta_z, label)``."""
  return GeneratorReward(alpha, beta)(fmt, r_y, self_score, meta_z, label)


def analysis_arrays(analyses: Sequence[Analysis]) -> tuple[np.ndarray, np.ndarray]:
  """``(fmt [B], score [B])``: 1/0 validity and the stated score (NaN when invalid)."""
  fmt = np.asarray([a.valid for a in analyses], np.float64)
  score = np.asarray([a.score if a.valid else np.nan for a in analyses], np.float64)
  return fmt, score


def verifier_reward_from_parsed(analyses: Sequence[Analysis], labels, meta=None) -> np.ndarray:
  """``verifier_reward`` of parsed analyses against ``labels [B]``."""
  fmt, score = analysis_arrays(analyses)
  return verifier_reward(fmt, score, labels, meta)


def generator_reward_from_parsed(generations: Sequence[Generation], r_y, meta_z, label=None, *,
                                 reward: GeneratorReward = GeneratorReward()) -> np.ndarray:
  """``reward`` of parsed generations: R_format(Y, Z) = ``Generation.valid``,
  s' = the self-evaluation's score; ``r_y``, ``meta_z`` (and ``label``) ``[B]``."""
  fmt = np.asarray([g.valid for g in generations], np.float64)
  s_self = np.asarray([g.analysis.score if g.valid else np.nan for g in generations], np.float64)
  return reward(fmt, r_y, s_self, meta_z, label)


def faithfulness(analyses: Sequence[Analysis], checks: Sequence[ProofCheck]
                 ) -> tuple[float, int]:
  """``(share, stated)``: the share of issues stated by the valid analyses that
  the checker confirms, over all ``stated`` issues (NaN share when none)."""
  if len(analyses) != len(checks):
    raise ValueError(f"got {len(analyses)} analyses for {len(checks)} checks")
  stated = hits = 0
  for a, c in zip(analyses, checks):
    if a.valid:
      stated += len(a.issues)
      hits += sum(confirmed(i, c) for i in a.issues)
  return (hits / stated if stated else float("nan")), stated
