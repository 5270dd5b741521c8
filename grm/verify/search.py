"""High-compute search: a verified, refined candidate pool (docs/DESIGN.md §7).

Per problem, with ``SearchConfig`` sizes (the paper: 64 / 64 / 8 / 16):

  round 0    ``n_candidates`` generations (``generator_prompt``); their proofs
             form the pool.
  each round every candidate not yet verified gets ``n_analyses`` verifier
             analyses; its score is the mean analysis score (an invalid
             analysis counts 0). The ``n_keep`` best (ties: older, i.e.
             lower id, first) are kept.
  stop       after ``n_rounds`` refinement rounds, or once the best mean is 1,
             or when no kept candidate has an analysis that reports issues.
  refine     each kept candidate is paired with up to ``n_pairs`` of its
             issue-reporting analyses (first ones first); each pair gives one
             ``refine_prompt`` generation, a new candidate whose parent is
             that candidate. The next pool is the kept candidates plus these.

A candidate is verified once; its scores stay with it. All model calls are
batched over problems: one ``generate_fn`` and one ``verify_fn`` call per
round. The returned bookkeeping says which candidate came from which and
what each round kept.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import tqdm

from grm.verify.format import (Analysis, generator_prompt, parse_analysis, refine_prompt,
                               split_generation, verifier_prompt)
from opd.config.fields import check_fields, check_int, set_field

GenerateFn = Callable[[Sequence[str]], Sequence[str]]


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """Pool size, analyses per candidate, candidates kept, refinement rounds and
  refinements per kept candidate (None: ``n_candidates // n_keep``)."""
  n_candidates: int = 8
  n_analyses: int = 4
  n_keep: int = 2
  n_rounds: int = 2
  n_pairs: int | None = None

  def __post_init__(self):
    check_fields(self, "SearchConfig",
                 ints={"n_candidates": 1, "n_analyses": 1, "n_keep": 1, "n_rounds": 0})
    set_field(self, "n_pairs", check_int("SearchConfig", "n_pairs", self.n_pairs, min_value=1,
                                         allow_none=True))
    if self.n_keep > self.n_candidates:
      raise ValueError(f"SearchConfig.n_keep={self.n_keep} must be <= n_candidates="
                       f"{self.n_candidates}")

  @property
  def pairs(self) -> int:
    return self.n_pairs if self.n_pairs is not None else max(1, self.n_candidates // self.n_keep)


@dataclasses.dataclass
class Candidate:
  """One proof in a problem's pool: ``id`` in creation order, ``parent`` the
  candidate it refines (None in round 0), ``round`` of creation, its
  analyses (texts and parses) and ``mean`` score once verified."""
  id: int
  parent: int | None
  round: int
  proof: str
  analysis_texts: list[str] = dataclasses.field(default_factory=list)
  analyses: list[Analysis] = dataclasses.field(default_factory=list)
  mean: float | None = None


@dataclasses.dataclass(frozen=True)
class RoundRecord:
  """One round of one problem: the pool verified, the ids kept (best first)
  and the best mean score."""
  round: int
  pool: tuple[int, ...]
  kept: tuple[int, ...]
  best_mean: float


@dataclasses.dataclass
class SearchResult:
  """Per problem: every candidate, the rounds it ran and its final best."""
  candidates: list[Candidate]
  rounds: list[RoundRecord]

  @property
  def best(self) -> Candidate:
    return self.candidates[self.rounds[-1].kept[0]]

  def lineage(self, cid: int) -> list[int]:
    """Ids from the round-0 ancestor down to ``cid``."""
    out = [cid]
    while self.candidates[out[-1]].parent is not None:
      out.append(self.candidates[out[-1]].parent)
    return out[::-1]


def _call(fn: GenerateFn, name: str, prompts: list[str]) -> list[str]:
  texts = list(fn(prompts)) if prompts else []
  if len(texts) != len(prompts):
    raise ValueError(f"{name} returned {len(texts)} texts for {len(prompts)} prompts")
  return texts


def search(problems: Sequence[str], generate_fn: GenerateFn, verify_fn: GenerateFn,
           config: SearchConfig = SearchConfig(), *, progress: bool = False
           ) -> list[SearchResult]:
  """Runs the search (module docstring) for every problem; returns ``[P]`` results."""
  P = len(problems)
  results = [SearchResult([], []) for _ in range(P)]
  prompts = [generator_prompt(problems[p]) for p in range(P) for _ in range(config.n_candidates)]
  texts = _call(generate_fn, "generate_fn", prompts)
  for k, text in enumerate(texts):
    res = results[k // config.n_candidates]
    res.candidates.append(Candidate(len(res.candidates), None, 0, split_generation(text)[0]))
  pools = [list(range(config.n_candidates)) for _ in range(P)]
  active = list(range(P))
  for r in tqdm.trange(config.n_rounds + 1, desc="search", disable=not progress):
    todo = [(p, c) for p in active for c in pools[p] if results[p].candidates[c].mean is None]
    prompts = [verifier_prompt(problems[p], results[p].candidates[c].proof)
               for p, c in todo for _ in range(config.n_analyses)]
    texts = _call(verify_fn, "verify_fn", prompts)
    for t, (p, c) in enumerate(todo):
      cand = results[p].candidates[c]
      cand.analysis_texts = texts[t * config.n_analyses:(t + 1) * config.n_analyses]
      cand.analyses = [parse_analysis(x) for x in cand.analysis_texts]
      cand.mean = float(np.mean([a.score if a.valid else 0.0 for a in cand.analyses]))
    refine_jobs, still = [], []
    for p in active:
      res = results[p]
      ranked = sorted(pools[p], key=lambda c: (-res.candidates[c].mean, c))
      kept = tuple(ranked[:config.n_keep])
      best = res.candidates[kept[0]].mean
      res.rounds.append(RoundRecord(r, tuple(pools[p]), kept, best))
      pools[p] = list(kept)
      if r == config.n_rounds or best == 1.0:
        continue
      jobs = []
      for c in kept:
        cand = res.candidates[c]
        critiques = [x for a, x in zip(cand.analyses, cand.analysis_texts) if a.reports_issues]
        jobs += [(p, c, x) for x in critiques[:config.pairs]]
      if jobs:
        refine_jobs += jobs
        still.append(p)
    prompts = [refine_prompt(problems[p], results[p].candidates[c].proof, text)
               for p, c, text in refine_jobs]
    texts = _call(generate_fn, "generate_fn", prompts)
    for (p, c, _), text in zip(refine_jobs, texts):
      res = results[p]
      child = Candidate(len(res.candidates), c, r + 1, split_generation(text)[0])
      res.candidates.append(child)
      pools[p].append(child.id)
    active = still
    if not active:
      break
  return results
