"""Automatic proof labelling by verifier analyses and meta-checks (docs/DESIGN.md §7).

For each proof: n verifier analyses; each analysis that reports issues
(valid, at least one issue) gets m meta-checks and is *valid* when a strict
majority of them confirm it (``MetaJudgement.confirms``: parsed, every stated
issue judged real; an unparsable meta-check does not confirm). The label is
the lowest score among the valid issue-reporting analyses, or 1 when there is
none. ``auto_labels`` is that rule on arrays; ``label_proofs`` samples the
analyses and meta-checks through batched callables; ``agreement_table``
measures the labels against the rule checker as n and m vary, reusing the
first n analyses and first m meta-checks of one sampled run.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import tqdm

from grm.verify.format import (Analysis, MetaJudgement, meta_prompt, parse_analysis, parse_meta,
                               verifier_prompt)

GenerateFn = Callable[[Sequence[str]], Sequence[str]]


def auto_labels(scores, reports, confirms) -> np.ndarray:
  """The labelling rule, vectorised over P proofs.

  Args:
    scores: ``[P, n]`` each analysis's score (any value where it reports nothing).
    reports: ``[P, n]`` bool, the analysis is valid and states at least one issue.
    confirms: ``[P, n, m]`` bool, meta-check j confirms analysis i.

  Returns:
    ``[P]`` labels: min score over analyses with ``reports`` and a strict
    majority of confirming meta-checks, else 1.
  """
  scores = np.asarray(scores, np.float64)
  reports, confirms = np.asarray(reports, bool), np.asarray(confirms, bool)
  if scores.ndim != 2 or reports.shape != scores.shape or confirms.ndim != 3 or \
      confirms.shape[:2] != scores.shape:
    raise ValueError(f"need scores [P, n], reports [P, n], confirms [P, n, m]; got "
                     f"{scores.shape=}, {reports.shape=}, {confirms.shape=}")
  m = confirms.shape[2]
  valid = reports & (2 * confirms.sum(-1) > m)
  return np.where(valid, scores, 1.0).min(-1, initial=1.0)


@dataclasses.dataclass(frozen=True)
class Labelling:
  """One sampled labelling run over P proofs.

  Attributes:
    analyses: ``[P][n]`` parsed analyses.
    metas: ``[P][n][m]`` parsed meta-checks (empty list for an analysis that
      reports no issue: it is not meta-checked).
  """
  analyses: list[list[Analysis]]
  metas: list[list[list[MetaJudgement]]]

  def arrays(self, n: int | None = None, m: int | None = None):
    """``(scores [P, n], reports [P, n], confirms [P, n, m])`` of the first n
    analyses and first m meta-checks (all by default)."""
    n = (len(self.analyses[0]) if self.analyses else 0) if n is None else n
    m = max((len(x) for row in self.metas for x in row), default=0) if m is None else m
    P = len(self.analyses)
    scores, reports = np.ones((P, n)), np.zeros((P, n), bool)
    confirms = np.zeros((P, n, m), bool)
    for p in range(P):
      for i, a in enumerate(self.analyses[p][:n]):
        scores[p, i] = a.score if a.valid else 1.0
        reports[p, i] = a.reports_issues
        for j, meta in enumerate(self.metas[p][i][:m]):
          confirms[p, i, j] = meta.confirms
    return scores, reports, confirms

  def labels(self, n: int | None = None, m: int | None = None) -> np.ndarray:
    """``[P]`` labels from the first n analyses and m meta-checks."""
    return auto_labels(*self.arrays(n, m))


def label_proofs(problems: Sequence[str], proofs: Sequence[str], verify_fn: GenerateFn,
                 meta_fn: GenerateFn, *, n: int, m: int, progress: bool = False) -> Labelling:
  """Samples n analyses per proof and m meta-checks per issue-reporting analysis.

  Args:
    problems, proofs: ``[P]`` texts.
    verify_fn: batched verifier, ``verifier_prompt`` texts -> analysis texts.
    meta_fn: batched meta-verifier, ``meta_prompt`` texts -> meta texts.
    n, m: analyses per proof (>= 1), meta-checks per analysis (>= 1).

  Returns:
    A ``Labelling``; ``.labels()`` applies the rule. Two callable calls in all.
  """
  if len(problems) != len(proofs):
    raise ValueError(f"got {len(problems)} problems for {len(proofs)} proofs")
  for name, v in (("n", n), ("m", m)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}={v!r} must be an int >= 1")
  steps = tqdm.tqdm(total=2, desc="labelling", disable=not progress)
  prompts = [verifier_prompt(q, y) for q, y in zip(problems, proofs) for _ in range(n)]
  texts = list(verify_fn(prompts))
  _check_outputs("verify_fn", prompts, texts)
  steps.update()
  analyses = [[parse_analysis(texts[p * n + i]) for i in range(n)] for p in range(len(proofs))]
  todo = [(p, i) for p in range(len(proofs)) for i in range(n) if analyses[p][i].reports_issues]
  meta_prompts = [meta_prompt(problems[p], proofs[p], texts[p * n + i])
                  for p, i in todo for _ in range(m)]
  meta_texts = list(meta_fn(meta_prompts)) if meta_prompts else []
  _check_outputs("meta_fn", meta_prompts, meta_texts)
  steps.update()
  steps.close()
  metas = [[[] for _ in range(n)] for _ in proofs]
  for t, (p, i) in enumerate(todo):
    k = len(analyses[p][i].issues)
    metas[p][i] = [parse_meta(meta_texts[t * m + j], k) for j in range(m)]
  return Labelling(analyses, metas)


def _check_outputs(name: str, prompts, texts):
  if len(texts) != len(prompts):
    raise ValueError(f"{name} returned {len(texts)} texts for {len(prompts)} prompts")


def agreement_table(labelling: Labelling, truth, ns: Sequence[int], ms: Sequence[int]
                    ) -> list[dict[str, float]]:
  """Agreement of the labels with ``truth [P]`` (the checker's scores) for each (n, m).

  Returns:
    One row per (n, m): ``{"n", "m", "agreement"`` (share of exactly equal
    labels), ``"mae"`` (mean |label − truth|), ``"mean_label"}``.
  """
  truth = np.asarray(truth, np.float64)
  n_max = len(labelling.analyses[0]) if labelling.analyses else 0
  m_max = max((len(x) for row in labelling.metas for x in row), default=0)
  rows = []
  for n in ns:
    for m in ms:
      # m_max 0: no analysis reported an issue, nothing was meta-checked, any m
      # gives the same labels (all 1).
      if not (1 <= n <= n_max and 1 <= m <= (m_max or m)):
        raise ValueError(f"(n, m)=({n}, {m}) outside the sampled run (n <= {n_max}, "
                         f"m <= {m_max})")
      labels = labelling.labels(n, m)
      rows.append({"n": n, "m": m, "agreement": float(np.mean(labels == truth)),
                   "mae": float(np.mean(np.abs(labels - truth))),
                   "mean_label": float(labels.mean())})
  return rows
