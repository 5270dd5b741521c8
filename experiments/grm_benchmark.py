"""The ``grm`` job's benchmark stage (docs/DESIGN.md §6; the job is ``experiments/grm.py``).

Per GRM stage (and the shared backbone): greedy, voting@k and meta-RM
voting@k (k_meta = ceil(k/2)) on the RewardBench-style test set, the first k
of ``max(ks)`` samples drawn in batched sampler calls; each model's results
are saved as they finish (``results_<model>.json``), so an interrupted stage
resumes. Baselines: the BT RM, the pairwise judge (n >= 2 groups only) and
random. Writes ``benchmark.json``, ``report.md`` and ``k_curve.png``.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from experiments import common
from experiments.grm_common import (GRM_STAGES, SHARED, _params, _response_ids, _sampler,
                                    _shared_cfg, _test_subsets)
from experiments.grm_report import PAPER, plot_k_curve, render_report
from grm import benchmark_set as bench_lib
from grm import judge as judge_lib
from grm import meta_rm as meta_lib
from grm import pairwise as pairwise_lib
from grm import scalar_rm as scalar_lib
from grm import training as training_lib
from grm.correctness import is_correct
from grm.voting import meta_vote, random_winners, vote, vote_correct
from opd.rollout.episodes import sampling_for_chat


def _rates(samples) -> dict[str, float]:
  counts = judge_lib.invalid_sample_counts(samples)
  n = max(1, len(samples))
  return {"invalid_rate": sum(counts.values()) / n,
          **{f"invalid/{k}": v / n for k, v in counts.items() if v}}


def _stage_ks(c, stage: str) -> tuple[int, ...]:
  """The k of voting@k for one GRM stage: ``benchmark.ks_by_stage[stage]``, else ``ks``."""
  ks = c.benchmark.get("ks_by_stage", {}).get(stage, c.benchmark.ks)
  ks = tuple(int(k) for k in ks)
  if not ks or min(ks) < 1:
    raise ValueError(f"config.benchmark ks for {stage!r}={ks} must be non-empty ints >= 1")
  return ks


def _grm_results(ctx, stage: str, subsets, meta, cfg=None) -> dict:
  """Greedy, voting@k and meta-RM voting@k correctness per subset for one GRM stage
  (``cfg``: its model config when not the plain GRM's, e.g. the shared backbone)."""
  c = ctx.config
  params = _params(ctx, stage, cfg)
  names = [s for s, gs in subsets.items() for _ in gs]
  groups = [g for gs in subsets.values() for g in gs]
  pairs = [(g.query, g.responses) for g in groups]
  greedy = _sampler(ctx, params, c.benchmark.max_new_tokens, 0.0, cfg,
                    progress=f"{stage} greedy")(pairs, 1, c.seed + 11, None)
  ks = _stage_ks(c, stage)
  k_max = max(ks)
  many = _sampler(ctx, params, c.benchmark.max_new_tokens, c.benchmark.temperature, cfg,
                  progress=f"{stage} k={k_max}")(pairs, k_max, c.seed + 13, None)
  meta_cfg, meta_params = meta
  flat = [s for row in many for s in row]
  m = meta_lib.meta_scores(meta_cfg, meta_params, ctx.tok, flat, seq_len=c.rm.seq_len,
                           batch_size=c.rm.score_batch_size,
                           length_bucket=c.rm.length_bucket).reshape(len(groups), k_max)
  correct = {"greedy": [is_correct(row[0].scores, g.ratings) for g, row in zip(groups, greedy)]}
  for k in ks:
    votes, metas = [], []
    for g, row, mrow in zip(groups, many, m):
      scores, valid = judge_lib.score_arrays(row[:k])
      votes.append(vote_correct(vote(scores, valid), g.ratings))
      metas.append(vote_correct(meta_vote(scores, valid, mrow[:k], math.ceil(k / 2)), g.ratings))
    correct[f"vote@{k}"], correct[f"meta@{k}"] = votes, metas
  out = {name: _by_subset(names, v) for name, v in correct.items()}
  return {"correct": out, "invalid": {"greedy": _rates([r[0] for r in greedy]),
                                      "sampled": _rates(flat)}}


def _by_subset(names, values) -> dict[str, list[bool]]:
  out: dict[str, list[bool]] = {}
  for s, v in zip(names, values):
    out.setdefault(s, []).append(bool(v))
  return out


def _baseline_results(ctx, subsets) -> dict:
  """BT RM and pairwise judge on n >= 2 groups; random on all."""
  c = ctx.config
  multi = {s: [g for g in gs if g.n >= 2] for s, gs in subsets.items()}
  bt_cfg = ctx.model_cfg.replace(scalar_head=True)
  bt = _params(ctx, "bt_rm", bt_cfg)
  pw = _params(ctx, "pairwise")
  sampling = sampling_for_chat(ctx.tok, max_new_tokens=c.pairwise.max_new_tokens,
                               temperature=0.0)
  correct = {"bt_rm": {}, "pairwise": {}, "random": {}}
  pw_invalid = []
  rng = np.random.default_rng(c.seed)
  for i, (s, gs) in enumerate(subsets.items()):
    picks = random_winners(np.asarray([g.n for g in gs], np.int64), (c.seed, i)) if gs else []
    correct["random"][s] = [bench_lib.decision_correct(
        g.ratings, pick=int(p), rating=int(rng.integers(1, 11))) for g, p in zip(gs, picks)]
  for s, gs in multi.items():
    if not gs:
      continue
    seqs = [_response_ids(ctx.tok, g.query, r)[:c.rm.bt_seq_len] for g in gs
            for r in g.responses]
    rewards = scalar_lib.score_sequences(bt_cfg, bt, seqs, seq_len=c.rm.bt_seq_len,
                                         pad_id=ctx.tok.pad_id,
                                         batch_size=c.rm.score_batch_size,
                                         length_bucket=c.rm.length_bucket)
    starts = np.cumsum([0] + [g.n for g in gs])
    correct["bt_rm"][s] = [bench_lib.decision_correct(
        g.ratings, pick=_unique_argmax(rewards[a:b])) for g, a, b in zip(gs, starts, starts[1:])]
    triples, owner = [], []
    for e, g in enumerate(gs):
      for i in range(g.n):
        for j in range(i + 1, g.n):
          triples.append((g.query, g.responses[i], g.responses[j]))
          owner.append((e, i, j))
    preferred, judgements = pairwise_lib.judge_pairs(
        ctx.model_cfg, pw, ctx.tok, triples, seed=c.seed + 17, sampling=sampling,
        batch_size=c.benchmark.batch_size, length_bucket=c.benchmark.length_bucket,
        mesh=ctx.mesh, rules=ctx.rules)
    pw_invalid += [not j.valid for j in judgements]
    wins = [np.zeros(g.n) for g in gs]
    for (e, i, j), p in zip(owner, preferred):
      if p >= 0:
        wins[e][(i, j)[p]] += 1
    correct["pairwise"][s] = [bench_lib.decision_correct(g.ratings, pick=_unique_argmax(w))
                              for g, w in zip(gs, wins)]
  return {"correct": correct,
          "invalid": {"pairwise": {"invalid_rate": float(np.mean(pw_invalid)) if pw_invalid
                                   else 0.0}}}


MULTI = "overall n>=2"  # the column of groups with two or more responses


def multi_only(correct: dict, subsets: dict, *, already: bool) -> list[bool]:
  """One method's per-group correctness pooled over the n >= 2 groups of every
  subset (``already``: its lists hold only those groups, as the BT RM's do)."""
  out = []
  for s, values in correct.items():
    if already:
      out += list(values)
    else:
      out += [v for v, g in zip(values, subsets[s]) if g.n >= 2]
  return out


def _unique_argmax(x) -> int:
  x = np.asarray(x)
  return int(np.argmax(x)) if np.sum(x == x.max()) == 1 else -1


def _stage_benchmark(ctx, workdir):
  c = ctx.config
  subsets = _test_subsets(ctx)
  meta_cfg = ctx.model_cfg.replace(scalar_head=True)
  meta = (meta_cfg, _params(ctx, "meta_rm", meta_cfg))
  parts = {stage: common.cached_json(workdir / f"results_{stage}.json",
                                     lambda stage=stage: _grm_results(ctx, stage, subsets, meta))
           for stage in GRM_STAGES}
  # The shared backbone judges with its own value head as the meta-RM.
  shared_cfg = _shared_cfg(ctx)
  parts[SHARED] = common.cached_json(workdir / f"results_{SHARED}.json", lambda: _grm_results(
      ctx, SHARED, subsets, (shared_cfg, _params(ctx, SHARED, shared_cfg)), cfg=shared_cfg))
  correct, invalid = {}, {}
  for stage, res in parts.items():
    correct.update({f"{stage}/{k}": v for k, v in res["correct"].items()})
    invalid.update({f"{stage}/{k}": v for k, v in res["invalid"].items()})
  base = common.cached_json(workdir / "results_baselines.json",
                            lambda: _baseline_results(ctx, subsets))
  correct.update(base["correct"])
  invalid.update(base["invalid"])
  table = {name: {s: dataclasses.asdict(e) for s, e in bench_lib.accuracy(
      v, num_resamples=c.benchmark.bootstrap_samples, seed=c.seed).items()}
           for name, v in correct.items() if any(v.values())}
  # The BT RM and the pairwise judge rank n >= 2 groups only; every method's
  # accuracy on those same groups is the like-for-like column.
  for name, row in table.items():
    pooled = multi_only(correct[name], subsets, already=name in ("bt_rm", "pairwise"))
    if pooled:
      row[MULTI] = dataclasses.asdict(bench_lib.accuracy(
          {MULTI: pooled}, num_resamples=c.benchmark.bootstrap_samples,
          seed=c.seed)[bench_lib.OVERALL])
  sizes = bench_lib.subset_sizes(subsets)
  sizes[MULTI] = {"groups": sum(g.n >= 2 for gs in subsets.values() for g in gs)}
  common.write_json(workdir / "benchmark.json", {"accuracy": table, "invalid": invalid,
                                                 "sizes": sizes, "paper": PAPER})
  rft = json.loads((ctx.root / "rft" / common.FINAL).read_text())
  extra = ["RFT counts: " + ", ".join(f"{k} {rft[k]}" for k in training_lib.RFT_COUNTS
                                      if k in rft)]
  (workdir / "report.md").write_text(render_report(table, invalid, sizes, extra))
  plot_k_curve(table, GRM_STAGES + (SHARED,), workdir / "k_curve.png")
  out = {}
  for stage in GRM_STAGES + (SHARED,):
    ks = _stage_ks(c, stage)
    for k in sorted({min(ks), max(ks)}):
      for kind in ("vote", "meta"):
        e = table.get(f"{stage}/{kind}@{k}", {}).get(bench_lib.OVERALL)
        if e:
          out[f"{stage}/{kind}@{k}"], out[f"{stage}/{kind}@{k}_se"] = e["value"], e["se"]
    e = table.get(f"{stage}/greedy", {}).get(bench_lib.OVERALL)
    if e:
      out[f"{stage}/greedy"], out[f"{stage}/greedy_se"] = e["value"], e["se"]
  return out
