"""The GRM benchmark's yardstick: per-sample records, fair metrics, baselines, a control
(docs/DESIGN.md §6 "Yardstick, controls and constrained decoding").

Pure numpy. A benchmark run keeps, per test group, the scores, validity and
meta score of every sample (``group_record``, one JSON-able dict per group in
``records_<model>.json``); ``recompute`` rebuilds the whole table from those
records without sampling again.

Per decision (a single judgement or a vote over the first k samples):

  strict   1 when the decision is the truth (``grm.voting.vote_correct``: a
           tie at the top or no valid sample is wrong)
  credit   chance credit: a tie at the top holding the best gets
           ``1 / |tied top|``, a tie without it 0, no valid sample ``1 / n``
           (n >= 2) or ``1 / 10`` (n == 1): what a uniform tie-break earns
  valid    the fraction of the k samples that are valid
  tie      n >= 2, some sample valid, and two or more responses share the top

n == 1 groups (a 10-way exact rating) and n >= 2 groups (pick the unique
best; the headline) are reported apart. Meta-RM voting keeps the top
``meta_k(v) = ceil(v / 2)`` of the v *valid* samples among the first k.

Baselines: ``chance`` (mean 1/n for n >= 2, computed, with the SE of a
uniform picker; 1/10 for n == 1) and ``most_common_rating`` (n == 1:
always predict the train split's most common rating).

Control (``content_blind``): the same groups, queries and ratings, every
response text swapped for one from another group, by a seeded derangement;
a GRM reading the responses falls to chance there.

Split judging (``singles_of`` / ``join_singles``): each n >= 2 group judged
as n single-response groups, one response at a time, and its judgement j
the n singles' judgements j side by side. A GRM that reads a response when
it sees it alone, but cannot bind n scores to n responses in one context,
agrees with the ratings here and not in the joint judgement.

``pair_agreement``: whether a valid judgement's scores order the responses as
the ratings do, over every pair of differently rated responses (1 agree,
1/2 equal scores, 0 reversed; 50 = scores independent of which response is
better). Each sample counts, not only the vote, so its SE is far smaller
than the accuracy's at the same groups.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from grm import judge as judge_lib
from grm.correctness import check_ratings
from grm.data import PreferenceGroup
from grm.evaluation import meta_k
from grm.format import MAX_SCORE, MIN_SCORE
from grm.voting import meta_vote, vote, vote_correct
from opd.eval.stats import Estimate, estimate

MULTI, SINGLE = "n>=2", "n=1"
RATINGS = MAX_SCORE - MIN_SCORE + 1  # a uniform n == 1 guess is right 1 time in 10


def decision(scores, valid, ratings) -> dict[str, float]:
  """``strict``, ``credit``, ``valid`` and ``tie`` of a vote over ``scores [k, n]``,
  ``valid [k]`` (module docstring) against the group's ``ratings``."""
  r = check_ratings(ratings)
  s, v = np.asarray(scores), np.asarray(valid, bool)
  result = vote(s, v)
  strict = float(vote_correct(result, r))
  out = {"valid": float(v.mean()), "tie": 0.0}
  if result.num_valid == 0:
    out.update(strict=strict, credit=1.0 / (RATINGS if r.size == 1 else r.size))
  elif r.size == 1:
    out.update(strict=strict, credit=strict)
  else:
    top = np.flatnonzero(result.totals == result.totals.max())
    out["tie"] = float(top.size > 1)
    out.update(strict=strict, credit=float(int(np.argmax(r)) in top) / top.size)
  return out


def group_record(subset: str, group: PreferenceGroup, greedy, many, meta) -> dict:
  """One group's JSON-able record: its truth and every sample's scores and validity.

  Args:
    subset: the group's benchmark subset.
    group: the preference group.
    greedy: its greedy ``SampledJudgement`` row (the first is used).
    many: its sampled ``SampledJudgement``s.
    meta: ``[len(many)]`` meta-RM scores of ``many``.
  """
  m = np.asarray(meta, np.float64)
  if m.shape != (len(many),):
    raise ValueError(f"meta {m.shape=} must be [{len(many)}] (one per sample)")
  gs, gv = judge_lib.score_arrays(greedy[:1])
  ss, sv = judge_lib.score_arrays(many)
  return {"subset": subset, "n": group.n, "ratings": [float(x) for x in group.ratings],
          "greedy": {"scores": gs.tolist(), "valid": gv.tolist(),
                     "reasons": [greedy[0].judgement.reason]},
          "samples": {"scores": ss.tolist(), "valid": sv.tolist(), "meta": m.tolist(),
                      "reasons": [s.judgement.reason for s in many]}}


def record_decisions(records: Sequence[Mapping], ks: Sequence[int]) -> dict[str, list[dict]]:
  """``{"greedy", "vote@k", "meta@k": [one ``decision`` per record]}`` from records alone."""
  ks = tuple(int(k) for k in ks)
  if not ks or min(ks) < 1:
    raise ValueError(f"ks={ks} must be non-empty ints >= 1")
  out = {"greedy": [decision(r["greedy"]["scores"], r["greedy"]["valid"], r["ratings"])
                    for r in records]}
  for k in ks:
    votes, metas = [], []
    for e, r in enumerate(records):
      s = np.asarray(r["samples"]["scores"], np.int64).reshape(-1, r["n"])
      v = np.asarray(r["samples"]["valid"], bool)
      m = np.asarray(r["samples"]["meta"], np.float64)
      if len(v) < k:
        raise ValueError(f"records[{e}] holds {len(v)} samples, fewer than k={k}")
      s, v, m = s[:k], v[:k], m[:k]
      votes.append(decision(s, v, r["ratings"]))
      used = np.zeros(k, bool)
      used[list(meta_vote(s, v, m, meta_k(int(v.sum()))).used)] = True
      metas.append({**decision(s, used, r["ratings"]), "valid": float(v.mean())})
    out[f"vote@{k}"], out[f"meta@{k}"] = votes, metas
  return out


def summarize(decisions: Sequence[Mapping], ns: Sequence[int], *, num_resamples: int,
              seed: int) -> dict[str, dict]:
  """``{"n>=2", "n=1": {"groups", "strict", "credit" (``Estimate`` dicts, 0-100),
  "valid_rate", "tie_rate"}}`` over the groups of each kind (absent when none)."""
  if len(decisions) != len(ns):
    raise ValueError(f"decisions ({len(decisions)}) and ns ({len(ns)}) differ in length")
  out = {}
  for i, (name, keep) in enumerate(((MULTI, lambda n: n >= 2), (SINGLE, lambda n: n == 1))):
    rows = [d for d, n in zip(decisions, ns) if keep(n)]
    if not rows:
      continue
    col = lambda key: np.asarray([d[key] for d in rows], np.float64)
    out[name] = {"groups": len(rows),
                 "strict": vars(estimate(col("strict"), num_resamples, (int(seed), i, 0))),
                 "credit": vars(estimate(col("credit"), num_resamples, (int(seed), i, 1))),
                 "valid_rate": float(col("valid").mean()), "tie_rate": float(col("tie").mean())}
  return out


def recompute(records: Sequence[Mapping], ks: Sequence[int], *, num_resamples: int = 1000,
              seed: int = 0) -> dict[str, dict]:
  """The yardstick table of one GRM from its records: ``{method: summarize(...)}``."""
  ns = [int(r["n"]) for r in records]
  return {name: summarize(d, ns, num_resamples=num_resamples, seed=seed)
          for name, d in record_decisions(records, ks).items()}


def pair_agreement(records: Sequence[Mapping], k: int, *, num_resamples: int = 1000,
                   seed: int = 0) -> dict:
  """Score-order agreement with the ratings (module docstring) of the valid samples
  among the first ``k`` of each n >= 2 record.

  Each group's value is the mean over its valid samples and its pairs of
  differently rated responses; groups with no valid sample (or all ratings
  equal) are left out; the estimate is over groups (0-100, bootstrap SE).

  Returns:
    ``{"value", "se", "groups"}``; value and se None when no group counts.
  """
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k={k!r} must be an int >= 1")
  per_group = []
  for r in records:
    n = int(r["n"])
    if n < 2:
      continue
    ratings = np.asarray(r["ratings"], np.float64)
    scores = np.asarray(r["samples"]["scores"], np.int64).reshape(-1, n)[:k]
    valid = np.asarray(r["samples"]["valid"], bool)[:k]
    hi, lo = np.nonzero(ratings[:, None] > ratings[None, :])  # every differently rated pair
    if not valid.any() or hi.size == 0:
      continue
    s = scores[valid]  # [v, n]
    agree = np.where(s[:, hi] > s[:, lo], 1.0, np.where(s[:, hi] == s[:, lo], 0.5, 0.0))
    per_group.append(float(agree.mean()))
  if not per_group:
    return {"value": None, "se": None, "groups": 0}
  est = estimate(np.asarray(per_group), num_resamples, (int(seed), 3))
  return {"value": est.value, "se": est.se, "groups": len(per_group)}


def chance(ns: Sequence[int]) -> dict[str, dict]:
  """Chance accuracy, computed: ``mean(1/n)`` over n >= 2 groups with the SE of a
  uniform picker ``sqrt(sum p(1-p)) / G``; ``1/10`` for n == 1 (0-100)."""
  out = {}
  for name, ps in ((MULTI, [1.0 / n for n in ns if n >= 2]),
                   (SINGLE, [1.0 / RATINGS for n in ns if n == 1])):
    if ps:
      p = np.asarray(ps)
      se = math.sqrt(float(np.sum(p * (1 - p)))) / p.size
      out[name] = {"groups": int(p.size), "value": 100.0 * float(p.mean()), "se": 100.0 * se}
  return out


def most_common_rating(groups: Sequence[PreferenceGroup]) -> int:
  """The most common rating of the n == 1 ``groups`` (ties: the lowest rating)."""
  counts = collections.Counter(int(g.ratings[0]) for g in groups if g.n == 1)
  if not counts:
    raise ValueError("groups hold no n == 1 group: no most common rating")
  top = max(counts.values())
  return min(r for r, c in counts.items() if c == top)


def most_common_accuracy(groups: Sequence[PreferenceGroup], rating: int, *,
                         num_resamples: int = 1000, seed: int = 0) -> Estimate:
  """Accuracy (0-100, bootstrap SE) of predicting ``rating`` for every n == 1 group."""
  hits = [float(int(g.ratings[0]) == int(rating)) for g in groups if g.n == 1]
  if not hits:
    raise ValueError("groups hold no n == 1 group")
  return estimate(np.asarray(hits), num_resamples, (int(seed), 2))


def content_blind(groups: Sequence[PreferenceGroup], seed: int) -> list[PreferenceGroup]:
  """The control: each response text replaced by one of another group (module docstring).

  The response slots are laid out group after group, the groups in an
  order seeded by ``seed`` and each group's slots shuffled; slot p then takes
  the text of slot ``p + m`` (mod the slot count), m the largest group size:
  a block of at most m slots never reaches itself, so every text comes from
  another group (a derangement of the groups). Queries, ratings and reasons
  stay the group's own.

  Raises:
    ValueError: fewer than ``2 m`` response slots (no such derangement by shift).
  """
  groups = list(groups)
  if not groups:
    return []
  rng = np.random.default_rng(seed)
  m = max(g.n for g in groups)
  slots = [(e, i) for e in rng.permutation(len(groups))
           for i in rng.permutation(groups[e].n)]
  if len(slots) < 2 * m:
    raise ValueError(f"{len(slots)} responses in {len(groups)} groups: the content-blind "
                     f"control needs at least 2 * max n = {2 * m}")
  texts = {(e, i): groups[e].responses[i] for e, i in slots}
  new = [list(g.responses) for g in groups]
  for p, (e, i) in enumerate(slots):
    new[e][i] = texts[slots[(p + m) % len(slots)]]
  return [dataclasses.replace(g, responses=tuple(r)) for g, r in zip(groups, new)]


def singles_of(groups: Sequence[PreferenceGroup]) -> list[PreferenceGroup]:
  """Each n >= 2 group of ``groups`` as n single-response groups, group after group
  (n == 1 groups are dropped); a single's rating is its reward as a 1..10 rating
  (``grm.data.rating_from_reward``), so it is a well-formed n = 1 group."""
  from grm.data import rating_from_reward  # noqa: PLC0415
  return [dataclasses.replace(g, responses=(g.responses[i],),
                              ratings=(float(rating_from_reward(g.ratings[i])),),
                              reasons=(g.reasons[i],))
          for g in groups if g.n >= 2 for i in range(g.n)]


def join_singles(groups: Sequence[PreferenceGroup], single_records: Sequence[Mapping],
                 subsets: Sequence[str] | None = None) -> list[dict]:
  """The records (``group_record``'s layout) of the n >= 2 ``groups`` from their
  singles' records (``singles_of``' order): judgement j of a group is its singles'
  judgements j side by side (scores ``[n]``), valid when every single's is; the
  meta score is the singles' mean. ``subsets``: each n >= 2 group's subset name
  (default its first single record's)."""
  multi = [g for g in groups if g.n >= 2]
  if len(single_records) != sum(g.n for g in multi):
    raise ValueError(f"{len(single_records)} single records for {len(multi)} groups holding "
                     f"{sum(g.n for g in multi)} responses")
  if subsets is not None and len(subsets) != len(multi):
    raise ValueError(f"{len(subsets)} subset names for {len(multi)} n >= 2 groups")
  out, pos = [], 0
  for e, g in enumerate(multi):
    parts = single_records[pos:pos + g.n]
    pos += g.n
    k = {len(r["samples"]["valid"]) for r in parts}
    if len(k) != 1:
      raise ValueError(f"group {g.example_id!r}: its singles hold {sorted(k)} samples")
    k = k.pop()

    def side(key, field, parts=parts):
      return np.asarray([np.asarray(r[key][field], np.float64).reshape(-1) for r in parts])

    gs, gv = side("greedy", "scores")[:, :1], side("greedy", "valid")[:, :1]
    ss, sv, sm = side("samples", "scores"), side("samples", "valid"), side("samples", "meta")
    out.append({"subset": subsets[e] if subsets is not None else parts[0]["subset"], "n": g.n,
                "ratings": [float(x) for x in g.ratings],
                "greedy": {"scores": gs.T.astype(np.int64).tolist(),
                           "valid": [bool(gv.all())]},
                "samples": {"scores": ss.T.astype(np.int64).reshape(k, g.n).tolist(),
                            "valid": sv.astype(bool).all(axis=0).tolist(),
                            "meta": sm.mean(axis=0).tolist()}})
  return out
