"""What the GRM benchmark computes from judges' outputs: per-group correctness (docs/DESIGN.md §6).

Pure numpy over already-sampled outputs (the model calls are ``grm.judge``,
``grm.pairwise``, ``grm.scalar_rm``, ``grm.meta_rm``); the ``grm`` job's
benchmark stage (``experiments/grm_benchmark.py``) wires them together.

  voting_correctness  greedy, voting@k and meta-RM voting@k of one GRM: the
                      first k of each group's samples, meta-RM voting over
                      the top ``k_meta = ceil(v / 2)`` of the v valid ones
                      among them, by meta score
  round_robin         every unordered pair (i < j) of each group's responses,
                      for the pairwise judge; ``round_robin_picks`` counts
                      each response's wins and picks the unique most-winning
                      one (a tie at the top is no pick)
  group_picks         the unique argmax of each group's slice of a flat
                      reward vector (the Bradley–Terry RM)
  random_correctness  the random baseline: a uniform pick (n >= 2), a
                      uniform rating in 1..10 (n == 1)

Correctness per group follows ``grm.benchmark_set.decision_correct`` and
``grm.voting.vote_correct``; every tie rule is ``grm.voting.unique_argmax``'s.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from grm import benchmark_set as bench_lib
from grm import judge as judge_lib
from grm.correctness import is_correct
from grm.data import PreferenceGroup
from grm.voting import meta_vote, random_winners, unique_argmax, vote, vote_correct

MULTI = "overall n>=2"  # the column of groups with two or more responses


def meta_k(num_valid: int) -> int:
  """Samples meta-RM voting keeps of the ``num_valid`` valid ones among the first k:
  ``ceil(v / 2)``, at least 1. Counting invalid samples too (``ceil(k / 2)``)
  let meta@k keep nearly every valid sample when half were invalid, so it
  equalled vote@k (docs/DESIGN.md §6)."""
  return max(1, math.ceil(num_valid / 2))


def invalid_rates(samples: Sequence[judge_lib.SampledJudgement]) -> dict[str, float]:
  """``invalid_rate`` and ``invalid/<reason>`` (reasons that occur) as fractions of the samples."""
  counts = judge_lib.invalid_sample_counts(samples)
  n = max(1, len(samples))
  return {"invalid_rate": sum(counts.values()) / n,
          **{f"invalid/{k}": v / n for k, v in counts.items() if v}}


def by_subset(names: Sequence[str], values: Sequence) -> dict[str, list[bool]]:
  """``values`` grouped by their subset ``names`` (same length), order kept."""
  if len(names) != len(values):
    raise ValueError(f"names ({len(names)}) and values ({len(values)}) differ in length")
  out: dict[str, list[bool]] = {}
  for s, v in zip(names, values):
    out.setdefault(s, []).append(bool(v))
  return out


def multi_only(correct: Mapping[str, Sequence[bool]],
               subsets: Mapping[str, Sequence[PreferenceGroup]], *, already: bool) -> list[bool]:
  """One method's per-group correctness pooled over the n >= 2 groups of every
  subset (``already``: its lists hold only those groups, as the BT RM's do)."""
  out = []
  for s, values in correct.items():
    if already:
      out += list(values)
    else:
      out += [v for v, g in zip(values, subsets[s]) if g.n >= 2]
  return out


def voting_correctness(groups: Sequence[PreferenceGroup], greedy, many, meta,
                       ks: Sequence[int]) -> dict[str, list[bool]]:
  """Greedy, voting@k and meta-RM voting@k correctness of one GRM, per group.

  Args:
    groups: ``[E]`` preference groups (their ``ratings`` are the truth).
    greedy: ``[E]`` rows of ``SampledJudgement``; the first of each row is
      the greedy judgement.
    many: ``[E]`` rows of at least ``max(ks)`` sampled judgements; voting@k
      uses the first k.
    meta: ``[E, >= max(ks)]`` meta-RM scores of ``many``'s samples.
    ks: the k of voting@k, each >= 1.

  Returns:
    ``{"greedy", "vote@k", "meta@k" for k in ks: [E] bools}``.
  """
  ks = tuple(ks)
  if not ks or any(isinstance(k, bool) or int(k) != k or k < 1 for k in ks):
    raise ValueError(f"ks={ks}: expected non-empty ints >= 1")
  k_max = max(ks)
  m = np.asarray(meta)
  if len(greedy) != len(groups) or len(many) != len(groups):
    raise ValueError(f"greedy ({len(greedy)}) and many ({len(many)}) must hold one row per "
                     f"group ({len(groups)})")
  if m.ndim != 2 or m.shape[0] != len(groups) or m.shape[1] < k_max:
    raise ValueError(f"meta {m.shape=} must be [{len(groups)}, >= {k_max}]")
  short = [e for e, row in enumerate(many) if len(row) < k_max]
  if short:
    raise ValueError(f"many: rows {short[:5]} hold fewer than max(ks)={k_max} samples")
  correct = {"greedy": [is_correct(row[0].scores, g.ratings) for g, row in zip(groups, greedy)]}
  for k in ks:
    votes, metas = [], []
    for g, row, mrow in zip(groups, many, m):
      scores, valid = judge_lib.score_arrays(row[:k])
      votes.append(vote_correct(vote(scores, valid), g.ratings))
      metas.append(vote_correct(meta_vote(scores, valid, mrow[:k], meta_k(int(valid.sum()))),
                                g.ratings))
    correct[f"vote@{k}"], correct[f"meta@{k}"] = votes, metas
  return correct


def random_correctness(subsets: Mapping[str, Sequence[PreferenceGroup]],
                       seed: int) -> dict[str, list[bool]]:
  """The random baseline's correctness per subset.

  Subset i's picks are ``random_winners(ns, (seed, i))``; one
  ``np.random.default_rng(seed)`` draws a rating in 1..10 for every group in
  order (the n == 1 decision; n >= 2 groups draw one too, unused).
  """
  out = {}
  rng = np.random.default_rng(seed)
  for i, (s, gs) in enumerate(subsets.items()):
    picks = random_winners(np.asarray([g.n for g in gs], np.int64), (seed, i)) if gs else []
    out[s] = [bench_lib.decision_correct(g.ratings, pick=int(p), rating=int(rng.integers(1, 11)))
              for g, p in zip(gs, picks)]
  return out


def group_picks(rewards, ns: Sequence[int]) -> list[int]:
  """The unique argmax of each group's consecutive slice of ``rewards``, or -1 on a tie.

  Args:
    rewards: ``[sum(ns)]`` scores, group after group.
    ns: each group's response count.
  """
  r = np.asarray(rewards)
  if r.shape != (sum(ns),):
    raise ValueError(f"rewards {r.shape=} must be [sum(ns)] = [{sum(ns)}]")
  starts = np.cumsum([0] + list(ns))
  return [unique_argmax(r[a:b]) for a, b in zip(starts, starts[1:])]


def round_robin(groups: Sequence[PreferenceGroup]):
  """Every pair ``i < j`` of each group's responses.

  Returns:
    ``(triples, owner)``: ``(query, response_i, response_j)`` per pair and
    its ``(group index, i, j)``, groups in order, pairs in lexicographic order.
  """
  triples, owner = [], []
  for e, g in enumerate(groups):
    for i in range(g.n):
      for j in range(i + 1, g.n):
        triples.append((g.query, g.responses[i], g.responses[j]))
        owner.append((e, i, j))
  return triples, owner


def round_robin_picks(groups: Sequence[PreferenceGroup], owner, preferred) -> list[int]:
  """Each group's response with the unique most wins, or -1 on a tie at the top.

  Args:
    groups: the groups ``round_robin`` paired.
    owner: its ``(group index, i, j)`` per pair.
    preferred: ``[P]`` the judge's preferred index within each pair (0: i,
      1: j, -1: invalid output, no win for either), or a swap-averaged
      credit of j in [0, 1] (``grm.pairwise.swap_average``; NaN: no verdict),
      which gives j ``q`` wins and i ``1 - q``.
  """
  p = np.asarray(preferred, np.float64)
  if p.shape != (len(owner),) or np.any((p != -1) & ~np.isnan(p) & ((p < 0) | (p > 1))):
    raise ValueError(f"preferred {p.shape=} must be [{len(owner)}] values in {{-1}} | [0, 1] "
                     "or NaN")
  wins = [np.zeros(g.n) for g in groups]
  for (e, i, j), q in zip(owner, p):
    if q >= 0:  # -1 and NaN: no verdict
      wins[e][i] += 1.0 - q
      wins[e][j] += q
  return [unique_argmax(w) for w in wins]
