"""The ``grm`` job's benchmark stage (docs/DESIGN.md §6; the job is ``experiments/grm.py``).

Per GRM stage (and the shared backbone): greedy, voting@k and meta-RM
voting@k (k_meta = ceil(k/2)) on the RewardBench-style test set, the first k
of ``max(ks)`` samples drawn in batched sampler calls; each model's results
are saved as they finish (``results_<model>.json``), so an interrupted stage
resumes. Baselines: the BT RM, the pairwise judge (n >= 2 groups only) and
random. Writes ``benchmark.json``, ``report.md`` and ``k_curve.png``.

The yardstick (``grm.yardstick``, docs/DESIGN.md §6): every GRM's
``results_<model>.json`` keeps each group's sample records (scores,
validity, meta score; ``records``), and with ``benchmark.content_blind`` the
same for the content-blind control (``control_records``); ``yardstick_table``
recomputes strict / chance-credit accuracy, valid and tie rates, n >= 2 and
n = 1 apart, beside chance, the most-common-rating baseline and the control,
from those files alone. ``benchmark.constrained`` decodes the GRM's and the
pairwise judge's last line under its grammar; ``benchmark.pairwise_both_orders``
adds the swap-averaged pairwise row and its "A" rates.
"""
from __future__ import annotations

import dataclasses
import pathlib
import types

import numpy as np

from experiments import common
from experiments.grm_common import (GRM_STAGES, SHARED, benchmark_chunking, grm_sampler,
                                    load_groups,
                                    load_test_subsets, shared_cfg, stage_params)
from experiments.grm_report import PAPER, plot_k_curve, render_report, render_yardstick
from grm import benchmark_set as bench_lib
from grm import evaluation as eval_lib
from grm import meta_rm as meta_lib
from grm import pairwise as pairwise_lib
from grm import scalar_rm as scalar_lib
from grm import training as training_lib
from grm import yardstick as ys
from grm.data import PreferenceGroup
from grm.evaluation import MULTI
from grm.reward import bt_input_ids
from opd.rollout.episodes import sampling_for_chat
from opd.rollout.policy import Policy
from opd.training.files import atomic_write_text, read_json


def stage_ks(c, stage: str) -> tuple[int, ...]:
  """The k of voting@k for one GRM stage: ``benchmark.ks_by_stage[stage]``, else ``ks``."""
  ks = c.benchmark.get("ks_by_stage", {}).get(stage, c.benchmark.ks)
  ks = tuple(int(k) for k in ks)
  if not ks or min(ks) < 1:
    raise ValueError(f"config.benchmark ks for {stage!r}={ks} must be non-empty ints >= 1")
  return ks


def grm_results(ctx, stage: str, subsets, meta, cfg=None) -> dict:
  """Greedy, voting@k and meta-RM voting@k correctness per subset for one GRM stage
  (``meta``: the meta-RM's ``(model config, params)``, or None without one: every
  meta score 0, so only greedy and voting@k are meaningful; ``cfg``: the GRM's
  model config when not the plain GRM's, e.g. the shared backbone)."""
  c = ctx.config
  params = stage_params(ctx, stage, cfg)
  names = [s for s, gs in subsets.items() for _ in gs]
  groups = [g for gs in subsets.values() for g in gs]
  ks = stage_ks(c, stage)
  k_max = max(ks)
  constrained = bool(c.benchmark.get("constrained", False))

  def judge(gs, label):
    """Greedy and k_max samples of ``gs``, with the meta scores of the samples."""
    pairs = [(g.query, g.responses) for g in gs]
    greedy = grm_sampler(ctx, params, c.benchmark.max_new_tokens, 0.0, cfg,
                         progress=f"{stage} {label}greedy", constrained=constrained)(
                             pairs, 1, c.seed + 11, None)
    many = grm_sampler(ctx, params, c.benchmark.max_new_tokens, c.benchmark.temperature, cfg,
                       progress=f"{stage} {label}k={k_max}", constrained=constrained)(
                           pairs, k_max, c.seed + 13, None)
    flat = [s for row in many for s in row]
    if meta is None:
      m = np.zeros((len(gs), k_max))
    else:
      m = meta_lib.meta_scores(*meta, ctx.tok, flat, seq_len=c.rm.seq_len,
                               batch_size=c.rm.score_batch_size,
                               length_bucket=c.rm.length_bucket).reshape(len(gs), k_max)
    records = [ys.group_record(s, g, gr, mn, mm)
               for s, g, gr, mn, mm in zip(names, gs, greedy, many, m)]
    return greedy, many, flat, m, records

  greedy, many, flat, m, records = judge(groups, "")
  correct = eval_lib.voting_correctness(groups, greedy, many, m, ks)
  out = {name: eval_lib.by_subset(names, v) for name, v in correct.items()}
  res = {"correct": out, "invalid": {"greedy": eval_lib.invalid_rates([r[0] for r in greedy]),
                                     "sampled": eval_lib.invalid_rates(flat)},
         "records": records}
  if c.benchmark.get("content_blind", False):
    try:
      control = ys.content_blind(groups, c.seed + 19)
    except ValueError as e:  # too few responses (a tiny run): said in the report
      res["control_error"] = str(e)
    else:
      res["control_records"] = judge(control, "control ")[-1]
  return res


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
  both = bool(c.benchmark.get("pairwise_both_orders", False))
  if both:
    correct["pairwise_swap"] = {}
  pairwise_judge = Policy(ctx.model_cfg, pw, ctx.tok, ctx.mesh, ctx.rules)
  judge_kw = dict(seed=c.seed + 17, sampling=sampling, chunking=benchmark_chunking(c),
                  constrained=bool(c.benchmark.get("constrained", False)))
  pw_invalid, position = [], {"judgements": [], "swapped": [], "share": []}
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
    if both:  # the seeded order alone is the single-order row, as before
      v = pairwise_lib.judge_pairs_both_orders(pairwise_judge, triples, **judge_kw)
      preferred, judgements = v.first, v.judgements[:len(triples)]
      picks = eval_lib.round_robin_picks(gs, owner, v.share)
      correct["pairwise_swap"][s] = [bench_lib.decision_correct(g.ratings, pick=p)
                                     for g, p in zip(gs, picks)]
      position["judgements"] += v.judgements
      position["swapped"] += v.swapped.tolist()
      position["share"] += v.share.tolist()
    else:
      preferred, judgements = pairwise_lib.judge_pairs(pairwise_judge, triples, **judge_kw)
    pw_invalid += [not j.valid for j in judgements]
    picks = eval_lib.round_robin_picks(gs, owner, preferred)
    correct["pairwise"][s] = [bench_lib.decision_correct(g.ratings, pick=p)
                              for g, p in zip(gs, picks)]
  out = {"correct": correct,
         "invalid": {"pairwise": {"invalid_rate": float(np.mean(pw_invalid)) if pw_invalid
                                  else 0.0}}}
  if both and position["share"]:
    out["position"] = pairwise_lib.position_stats(position["judgements"], position["swapped"],
                                                  position["share"])
  return out


def yardstick_table(parts, train_groups, c) -> dict:
  """The yardstick (module docstring) from the saved results alone.

  Args:
    parts: ``{model: results_<model>.json contents}``; a model whose results
      predate the records is left out.
    train_groups: the train split (the most common n = 1 rating's source).
    c: the job config (``benchmark.ks`` / ``ks_by_stage``, bootstrap).
  """
  boot = dict(num_resamples=c.benchmark.bootstrap_samples, seed=c.seed)
  out: dict = {}
  for stage, res in parts.items():
    if "records" not in res:
      continue
    records = res["records"]
    if "chance" not in out:  # the same test groups for every model
      out["chance"] = ys.chance([r["n"] for r in records])
      singles = [PreferenceGroup("", "", "test", "", ("",), tuple(r["ratings"]), ("",))
                 for r in records if r["n"] == 1]
      if singles and any(g.n == 1 for g in train_groups):
        rating = ys.most_common_rating(train_groups)
        out["most_common_rating"] = {"rating": rating, ys.SINGLE: dataclasses.asdict(
            ys.most_common_accuracy(singles, rating, **boot))}
    ks = stage_ks(c, stage)
    control = ys.recompute(res["control_records"], ks, **boot) \
        if "control_records" in res else {}
    for name, row in ys.recompute(records, ks, **boot).items():
      out[f"{stage}/{name}"] = {**row, "control": control.get(name, {}),
                                **({"control_error": res["control_error"]}
                                   if "control_error" in res else {})}
  return out


def recompute_yardstick(root, config) -> dict:
  """``yardstick_table`` of a ``grm`` run directory from its files alone (the
  benchmark's ``results_<model>.json`` and the data stage's groups): any
  metric of the records, recomputed without sampling again."""
  root = pathlib.Path(root)
  parts = {}
  for stage in GRM_STAGES + (SHARED,):
    path = root / "benchmark" / f"results_{stage}.json"
    if path.is_file():
      parts[stage] = read_json(path)
  # load_groups reads only the run directory (ctx.root/data/groups.json).
  train = load_groups(types.SimpleNamespace(root=root)).get("train", [])
  return yardstick_table(parts, train, config)


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
  yard = yardstick_table(parts, load_groups(ctx).get("train", []), c)
  common.write_json(workdir / "benchmark.json", {"accuracy": table, "invalid": invalid,
                                                 "sizes": sizes, "paper": PAPER,
                                                 "yardstick": yard,
                                                 "position": base.get("position")})
  rft = read_json(ctx.root / "rft" / common.FINAL, expect=dict)
  extra = ["RFT counts: " + ", ".join(f"{k} {rft[k]}" for k in training_lib.RFT_COUNTS
                                      if k in rft)]
  extra += render_yardstick(yard, base.get("position"))
  atomic_write_text(workdir / "report.md", render_report(table, invalid, sizes, extra))
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
