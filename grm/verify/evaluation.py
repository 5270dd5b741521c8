"""Measuring the DeepSeekMath-V2 roles against the rule checker (docs/DESIGN.md §7).

``verifier_metrics``: a verifier's analyses of proofs with known verdicts —
format rate, score accuracy (s' = s, an invalid analysis counts as wrong),
mean R_score, and issue faithfulness (the share of stated issues the checker
confirms, ``grm.verify.rewards.faithfulness``) with the number stated.
``correctness``: the checker's scores of proofs, as the mean score and the
share scoring 1, each with its standard error over proofs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from grm.verify import rewards as rewards_lib
from grm.verify.format import parse_analysis, verifier_prompt
from opd.tasks import Example
from opd.tasks.proof_task import ProofCheck, check_proof

GenerateFn = Callable[[Sequence[str]], Sequence[str]]


def _se(x: np.ndarray) -> float:
  return float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")


def verifier_metrics(texts: Sequence[str], checks: Sequence[ProofCheck]) -> dict[str, float]:
  """Metrics of analysis ``texts`` of proofs whose checker verdicts are ``checks``."""
  if len(texts) != len(checks) or not texts:
    raise ValueError(f"need as many analyses as checks (> 0), got {len(texts)} and {len(checks)}")
  analyses = [parse_analysis(t) for t in texts]
  fmt, pred = rewards_lib.analysis_arrays(analyses)
  labels = np.asarray([c.score for c in checks], np.float64)
  accurate = np.asarray([a.valid and a.score == c.score for a, c in zip(analyses, checks)], float)
  r = rewards_lib.verifier_reward(fmt, pred, labels)
  faithful, stated = rewards_lib.faithfulness(analyses, checks)
  return {"n": len(texts), "format": float(fmt.mean()), "accuracy": float(accurate.mean()),
          "accuracy_se": _se(accurate), "r_score": float(r.mean()), "faithfulness": faithful,
          "stated_issues": stated}


def evaluate_verifier(verify_fn: GenerateFn, problems: Sequence[str], proofs: Sequence[str],
                      checks: Sequence[ProofCheck]) -> dict[str, float]:
  """One batched ``verify_fn`` call over the proofs, then ``verifier_metrics``."""
  texts = list(verify_fn([verifier_prompt(q, y) for q, y in zip(problems, proofs)]))
  if len(texts) != len(proofs):
    raise ValueError(f"verify_fn returned {len(texts)} texts for {len(proofs)} prompts")
  return verifier_metrics(texts, checks)


def checker_scores(examples: Sequence[Example], proofs: Sequence[str]) -> np.ndarray:
  """``[P]`` the rule checker's score of each proof."""
  if len(examples) != len(proofs):
    raise ValueError(f"got {len(examples)} examples for {len(proofs)} proofs")
  return np.asarray([check_proof(ex, y).score for ex, y in zip(examples, proofs)], np.float64)


def correctness(scores) -> dict[str, float]:
  """Mean checker score and share of fully correct proofs (score 1), with SEs."""
  s = np.asarray(scores, np.float64)
  if s.ndim != 1 or not s.size:
    raise ValueError(f"scores must be a non-empty [P] array, got shape {s.shape}")
  ok = (s == 1.0).astype(float)
  return {"n": int(s.size), "mean_score": float(s.mean()), "mean_score_se": _se(s),
          "correct": float(ok.mean()), "correct_se": _se(ok)}
