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

import numpy as np

from experiments import common
from experiments.grm_common import (GRM_STAGES, SHARED, grm_sampler, load_test_subsets,
                                    shared_cfg, stage_params)
from experiments.grm_report import PAPER, plot_k_curve, render_report
from grm import benchmark_set as bench_lib
from grm import evaluation as eval_lib
from grm import meta_rm as meta_lib
from grm import pairwise as pairwise_lib
from grm import scalar_rm as scalar_lib
from grm import training as training_lib
from grm.evaluation import MULTI
from grm.reward import bt_input_ids
from opd.rollout.episodes import sampling_for_chat


def stage_ks(c, stage: str) -> tuple[int, ...]:
  """The k of voting@k for one GRM stage: ``benchmark.ks_by_stage[stage]``, else ``ks``."""
  ks = c.benchmark.get("ks_by_stage", {}).get(stage, c.benchmark.ks)
  ks = tuple(int(k) for k in ks)
  if not ks or min(ks) < 1:
    raise ValueError(f"config.benchmark ks for {stage!r}={ks} must be non-empty ints >= 1")
  return ks


def grm_results(ctx, stage: str, subsets, meta, cfg=None) -> dict:
  """Greedy, voting@k and meta-RM voting@k correctness per subset for one GRM stage
  (``meta``: the meta-RM's ``(model config, params)``; ``cfg``: the GRM's model
  config when not the plain GRM's, e.g. the shared backbone)."""
  c = ctx.config
  params = stage_params(ctx, stage, cfg)
  names = [s for s, gs in subsets.items() for _ in gs]
  groups = [g for gs in subsets.values() for g in gs]
  pairs = [(g.query, g.responses) for g in groups]
  greedy = grm_sampler(ctx, params, c.benchmark.max_new_tokens, 0.0, cfg,
                       progress=f"{stage} greedy")(pairs, 1, c.seed + 11, None)
  ks = stage_ks(c, stage)
  k_max = max(ks)
  many = grm_sampler(ctx, params, c.benchmark.max_new_tokens, c.benchmark.temperature, cfg,
                     progress=f"{stage} k={k_max}")(pairs, k_max, c.seed + 13, None)
  meta_cfg, meta_params = meta
  flat = [s for row in many for s in row]
  m = meta_lib.meta_scores(meta_cfg, meta_params, ctx.tok, flat, seq_len=c.rm.seq_len,
                           batch_size=c.rm.score_batch_size,
                           length_bucket=c.rm.length_bucket).reshape(len(groups), k_max)
  correct = eval_lib.voting_correctness(groups, greedy, many, m, ks)
  out = {name: eval_lib.by_subset(names, v) for name, v in correct.items()}
  return {"correct": out, "invalid": {"greedy": eval_lib.invalid_rates([r[0] for r in greedy]),
                                      "sampled": eval_lib.invalid_rates(flat)}}


def _baseline_results(ctx, subsets) -> dict:
  """BT RM and pairwise judge on n >= 2 groups; random on all."""
  c = ctx.config
  multi = {s: [g for g in gs if g.n >= 2] for s, gs in subsets.items()}
  bt_cfg = ctx.model_cfg.replace(scalar_head=True)
  bt = stage_params(ctx, "bt_rm", bt_cfg)
  pw = stage_params(ctx, "pairwise")
  sampling = sampling_for_chat(ctx.tok, max_new_tokens=c.pairwise.max_new_tokens,
                               temperature=0.0)
  correct = {"bt_rm": {}, "pairwise": {}, "random": eval_lib.random_correctness(subsets, c.seed)}
  pw_invalid = []
  for s, gs in multi.items():
    if not gs:
      continue
    seqs = [bt_input_ids(ctx.tok, g.query, r)[:c.rm.bt_seq_len] for g in gs
            for r in g.responses]
    rewards = scalar_lib.score_sequences(bt_cfg, bt, seqs, seq_len=c.rm.bt_seq_len,
                                         pad_id=ctx.tok.pad_id,
                                         batch_size=c.rm.score_batch_size,
                                         length_bucket=c.rm.length_bucket)
    picks = eval_lib.group_picks(rewards, [g.n for g in gs])
    correct["bt_rm"][s] = [bench_lib.decision_correct(g.ratings, pick=p)
                           for g, p in zip(gs, picks)]
    triples, owner = eval_lib.round_robin(gs)
    preferred, judgements = pairwise_lib.judge_pairs(
        ctx.model_cfg, pw, ctx.tok, triples, seed=c.seed + 17, sampling=sampling,
        batch_size=c.benchmark.batch_size, length_bucket=c.benchmark.length_bucket,
        mesh=ctx.mesh, rules=ctx.rules)
    pw_invalid += [not j.valid for j in judgements]
    picks = eval_lib.round_robin_picks(gs, owner, preferred)
    correct["pairwise"][s] = [bench_lib.decision_correct(g.ratings, pick=p)
                              for g, p in zip(gs, picks)]
  return {"correct": correct,
          "invalid": {"pairwise": {"invalid_rate": float(np.mean(pw_invalid)) if pw_invalid
                                   else 0.0}}}


def stage_benchmark(ctx, workdir) -> dict:
  """The benchmark stage (module docstring); returns its headline metrics."""
  c = ctx.config
  subsets = load_test_subsets(ctx)
  meta_cfg = ctx.model_cfg.replace(scalar_head=True)
  meta = (meta_cfg, stage_params(ctx, "meta_rm", meta_cfg))
  parts = {stage: common.cached_json(workdir / f"results_{stage}.json",
                                     lambda stage=stage: grm_results(ctx, stage, subsets, meta))
           for stage in GRM_STAGES}
  # The shared backbone judges with its own value head as the meta-RM.
  head_cfg = shared_cfg(ctx)
  parts[SHARED] = common.cached_json(workdir / f"results_{SHARED}.json", lambda: grm_results(
      ctx, SHARED, subsets, (head_cfg, stage_params(ctx, SHARED, head_cfg)), cfg=head_cfg))
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
    pooled = eval_lib.multi_only(correct[name], subsets, already=name in ("bt_rm", "pairwise"))
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
    ks = stage_ks(c, stage)
    for k in sorted({min(ks), max(ks)}):
      for kind in ("vote", "meta"):
        e = table.get(f"{stage}/{kind}@{k}", {}).get(bench_lib.OVERALL)
        if e:
          out[f"{stage}/{kind}@{k}"], out[f"{stage}/{kind}@{k}_se"] = e["value"], e["se"]
    e = table.get(f"{stage}/greedy", {}).get(bench_lib.OVERALL)
    if e:
      out[f"{stage}/greedy"], out[f"{stage}/greedy_se"] = e["value"], e["se"]
  return out
