"""Job ``grm``: train a pointwise GRM (SPCT) and benchmark it (docs/DESIGN.md §6).

Stages (each resumable, ``experiments.common.run_stage``; a stage
directory holds ``config.json`` and ``final_metrics.json``):

  data        candidates from the source models (``config.models``; the tiny
              variant builds random ones) at each temperature, verified, then
              one preference group per example (``grm.data``); train and test
              examples by the tasks' prompt-hash split. ``groups.json``.
  cold_start  SFT of the base model on the rule-based judge's judgements of
              the train groups (``grm.training`` a).
  rft         rejective sampling from the cold-start GRM, SFT from it on the
              kept judgements (counts of each rejection in its metrics).
  rule_rl     GRPO from the RFT GRM, reward +1 correct / -1 otherwise, KL
              ``rl.kl_multiplier`` x the GRPO config's.
  shared      the shared-backbone variant (docs/DESIGN.md §6): the RFT GRM plus
              a fresh value head on the same trunk, trained by rule RL + ``rl.meta_weight``
              x meta BCE on its own judgements (``grm.shared``); its value
              head guides its own voting. Each of its networks is the size
              of one separate GRM or meta-RM (the separate pair holds twice
              the parameters).
  bt_rm       Bradley–Terry scalar RM from the base (pairs: best vs each other).
  pairwise    the "A or B" judge, SFT from the base on rule-written
              ``Better: A/B`` texts (not zero-shot from the GRM).
  meta_rm     scalar head on the final GRM's trunk, BCE on its own sampled
              judgements of the train groups (label: correct); one meta-RM
              guides the voting of every GRM stage.
  benchmark   per GRM stage (and ``shared``): greedy, voting@k and meta-RM voting@k
              (k_meta = ceil(k/2)) on the test set (``grm.benchmark_set``),
              the first k of ``max(ks)`` samples drawn in one sampler call;
              BT RM, pairwise judge (n >= 2 groups only: neither gives an
              n = 1 rating) and random. ``report.md``, ``benchmark.json``,
              ``k_curve.png``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import jax
import numpy as np

from experiments import common
from experiments.grpo import grpo_config
from experiments.sft import domain_examples
from experiments.specialists import _stage_config
from grm import benchmark_set as bench_lib
from grm import judge as judge_lib
from grm import meta_rm as meta_lib
from grm import pairwise as pairwise_lib
from grm import scalar_rm as scalar_lib
from grm import shared as shared_lib
from grm import training as training_lib
from grm.correctness import best_index, is_correct
from grm.format import user_prompt_ids
from grm.data import Candidate, PreferenceGroup, build_groups, sample_candidates, split_groups
from grm.voting import meta_vote, random_winners, vote, vote_correct
from opd import tasks as tasks_lib
from opd.models import init_params, to_model_config
from opd.rollout.episodes import sampling_for_chat
from opd.training import lm_trainer
from opd.training.checkpoints import CheckpointManager, load_params
from opd.training.metrics_writer import MetricWriter

PAPER = {1: 85.6, 32: 89.6}  # DeepSeek-GRM-27B on RewardBench, meta-RM voting (docs/DESIGN.md §6)
GRM_STAGES = ("cold_start", "rft", "rule_rl")


@dataclasses.dataclass
class _Ctx:
  config: object
  root: pathlib.Path
  model_cfg: object
  tok: object
  mesh: object
  rules: tuple


def _source_models(ctx: _Ctx) -> dict:
  c = ctx.config
  if c.tiny_models:
    return {f"tiny{i}": init_params(ctx.model_cfg, jax.random.key(c.seed + i))
            for i in range(c.tiny_models)}
  return {name: load_params(path, ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules)
          for name, path in c.models.items()}


def _base_params(ctx: _Ctx):
  return next(iter(_source_models(ctx).values())) if ctx.config.tiny_models else load_params(
      ctx.config.models.base, ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules)


def _examples(c, split: str, n: int, seed: int):
  return domain_examples(tuple(c.data.domains), split, n, seed, tuple(c.data.difficulties),
                         unique=split == "test")


def _load_groups(ctx: _Ctx) -> dict[str, list[PreferenceGroup]]:
  raw = json.loads((ctx.root / "data" / "groups.json").read_text())
  return {s: [PreferenceGroup(**{**g, "responses": tuple(g["responses"]),
                                 "ratings": tuple(g["ratings"]), "reasons": tuple(g["reasons"])})
              for g in gs] for s, gs in raw.items()}


def _stage_data(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  examples = _examples(c, "train", c.data.num_train, c.seed) + _examples(
      c, "test", c.data.num_test, c.seed + 1)
  models = [(ctx.model_cfg, p) for p in _source_models(ctx).values()]
  cands = sample_candidates(models, ctx.tok, examples, temperatures=tuple(c.data.temperatures),
                            max_new_tokens=c.data.max_new_tokens, seed=c.seed, mesh=ctx.mesh,
                            rules=ctx.rules)
  if c.data.include_reference:  # tiny: a verified correct candidate per single-turn example
    for ex, row in zip(examples, cands):
      if not tasks_lib.is_multi_turn(ex.domain):
        text = ex.reference[-1][1]
        row.append(Candidate(text, tasks_lib.get_task(ex.domain).verify(ex, text)))
  groups, counts = build_groups(examples, cands, seed=c.seed, sizes=tuple(c.data.sizes))
  splits = split_groups(groups)
  common.write_json(workdir / "groups.json",
                    {s: [dataclasses.asdict(g) for g in gs] for s, gs in splits.items()})
  test = bench_lib.benchmark_set(groups, examples)
  common.write_json(workdir / "test_examples.json", [ex.id for ex in examples])
  sizes = bench_lib.subset_sizes(test)
  common.write_json(workdir / "subsets.json",
                    {s: [g.example_id for g in gs] for s, gs in test.items()})
  return {**counts, "train_groups": len(splits.get("train", [])),
          "test_groups": len(splits.get("test", [])),
          **{f"test_{s}": v["groups"] for s, v in sizes.items()}}


def _test_subsets(ctx: _Ctx) -> dict[str, list[PreferenceGroup]]:
  ids = json.loads((ctx.root / "data" / "subsets.json").read_text())
  by_id = {g.example_id: g for g in _load_groups(ctx).get("test", [])}
  return {s: [by_id[i] for i in v] for s, v in ids.items()}


def _sft(ctx, params, pairs, workdir: pathlib.Path, steps: int) -> dict:
  c = ctx.config
  loop = lm_trainer.LMTrainConfig(steps=steps, keep_checkpoints=1, progress=False)
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=max(1, steps // 20))
    training_lib.train_judgement_sft(
        ctx.model_cfg, params, ctx.tok, pairs, optim=common.optim_config(c.sft_optim,
                                                                         "config.sft_optim"),
        loop=loop, mesh=ctx.mesh, rules=ctx.rules, seed=c.seed, seq_len=c.sft.seq_len,
        batch_size=c.sft.batch_size, checkpoint_dir=workdir / "checkpoints", on_metrics=logger)
  losses = [m["loss"] for _, m in logger.history if "loss" in m]
  return {"pairs": len(pairs), "loss_first": losses[0], "loss_final": float(np.mean(losses[-5:]))}


def _params(ctx: _Ctx, stage: str, cfg=None):
  return load_params(ctx.root / stage / "checkpoints", cfg or ctx.model_cfg, mesh=ctx.mesh,
                     rules=ctx.rules)


def _stage_cold_start(ctx, workdir):
  c = ctx.config
  pairs = training_lib.cold_start_pairs(_load_groups(ctx)["train"], seed=c.seed,
                                        noise=c.data.noise)
  return _sft(ctx, _base_params(ctx), pairs, workdir, c.sft.steps)


def _sampler(ctx, params, max_new_tokens, temperature, cfg=None):
  sampling = sampling_for_chat(ctx.tok, max_new_tokens=max_new_tokens, temperature=temperature)
  return training_lib.model_sampler(cfg or ctx.model_cfg, params, ctx.tok, sampling,
                                    batch_size=ctx.config.benchmark.batch_size, mesh=ctx.mesh,
                                    rules=ctx.rules)


def _stage_rft(ctx, workdir):
  c = ctx.config
  params = _params(ctx, "cold_start")
  kept, counts = training_lib.rejective_sample(
      _load_groups(ctx)["train"], _sampler(ctx, params, c.rft.max_new_tokens, c.rft.temperature),
      n_rft=c.rft.n_rft, seed=c.seed)
  print(f"[grm] RFT counts: {counts}", flush=True)
  out = dict(counts)
  if not kept:  # nothing survived: the RFT model is the cold-start model, saved as such
    kept = training_lib.cold_start_pairs(_load_groups(ctx)["train"], seed=c.seed + 1)
    out["fallback_cold_start_pairs"] = len(kept)
  return {**out, **_sft(ctx, params, kept, workdir, c.rft.steps)}


def _stage_rule_rl(ctx, workdir):
  c = ctx.config
  with MetricWriter(workdir) as writer:
    run = training_lib.train_rule_rl(
        ctx.model_cfg, _params(ctx, "rft"), _load_groups(ctx)["train"], grpo_config(c.grpo),
        common.optim_config(c.grpo_optim, "config.grpo_optim"), tokenizer=ctx.tok,
        steps=c.rl.steps, mesh=ctx.mesh, rules=ctx.rules, seed=c.seed,
        kl_multiplier=c.rl.kl_multiplier, writer=writer, checkpoint_dir=workdir / "checkpoints",
        progress=False)
  rewards = [m["reward/mean"] for m in run.history if "reward/mean" in m]
  return {"steps": len(run.history), "reward_first": rewards[0] if rewards else float("nan"),
          "reward_final": float(np.mean(rewards[-5:])) if rewards else float("nan")}


SHARED = "shared"


def _shared_cfg(ctx):
  return ctx.model_cfg.replace(scalar_head=True)


def _stage_shared(ctx, workdir):
  c = ctx.config
  cfg, params = meta_lib.add_scalar_head(ctx.model_cfg, _params(ctx, "rft"),
                                         jax.random.key(c.seed + 17))
  with MetricWriter(workdir) as writer:
    run = shared_lib.train_shared_rule_rl(
        cfg, params, _load_groups(ctx)["train"], grpo_config(c.grpo),
        common.optim_config(c.grpo_optim, "config.grpo_optim"), meta_weight=c.rl.meta_weight,
        tokenizer=ctx.tok, steps=c.rl.steps, mesh=ctx.mesh, rules=ctx.rules, seed=c.seed,
        kl_multiplier=c.rl.kl_multiplier, writer=writer, checkpoint_dir=workdir / "checkpoints",
        progress=False)
  hist = [m for m in run.history if "reward/mean" in m]
  last = hist[-5:]
  return {"steps": len(run.history),
          "reward_first": hist[0]["reward/mean"] if hist else float("nan"),
          "reward_final": float(np.mean([m["reward/mean"] for m in last])) if last else float("nan"),
          "meta_accuracy_final": float(np.mean([m["train/meta_accuracy"] for m in last]))
          if last else float("nan")}


def _train_scalar(ctx, cfg, params, loss_fn, batches, workdir) -> dict:
  c = ctx.config
  manager = CheckpointManager(workdir / "checkpoints", max_to_keep=1)
  history = []
  scalar_lib.train_reward_model(cfg, loss_fn, batches, common.optim_config(c.rm_optim,
                                                                           "config.rm_optim"),
                                steps=c.rm.steps, mesh=ctx.mesh, rules=ctx.rules, seed=c.seed,
                                params=params, checkpoint_manager=manager,
                                on_metrics=lambda s, m: history.append(m))
  losses = [float(m["loss"]) for m in history if "loss" in m]
  return {"loss_first": losses[0], "loss_final": float(np.mean(losses[-5:]))}


def _cycle_batches(make, n: int, batch_size: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    yield make(rng.integers(0, n, size=batch_size))


def _response_ids(tok, query: str, response: str) -> np.ndarray:
  """What the BT RM reads: the query's chat prompt, then the response."""
  return np.concatenate([user_prompt_ids(tok, query), np.asarray(tok.encode(response), np.int32)])


def _bt_pairs(groups):
  out = []
  for g in groups:
    if g.n >= 2:
      j = best_index(g.ratings)
      out += [(g.query, g.responses[j], g.responses[i]) for i in range(g.n) if i != j]
  return out


def _stage_bt_rm(ctx, workdir):
  c = ctx.config
  cfg, params = meta_lib.add_scalar_head(ctx.model_cfg, _base_params(ctx),
                                         jax.random.key(c.seed + 7))
  pairs = _bt_pairs(_load_groups(ctx)["train"])
  if not pairs:
    raise ValueError("no train group with n >= 2: the BT RM has no pairs (more examples?)")
  enc = [(_response_ids(ctx.tok, q, a), _response_ids(ctx.tok, q, b)) for q, a, b in pairs]

  def make(idx):
    return scalar_lib.pair_batch([enc[i][0] for i in idx], [enc[i][1] for i in idx],
                                 seq_len=c.rm.seq_len, pad_id=ctx.tok.pad_id)

  out = _train_scalar(ctx, cfg, params, scalar_lib.bt_loss_fn(cfg),
                      _cycle_batches(make, len(enc), c.rm.batch_size, c.seed), workdir)
  return {"pairs": len(pairs), **out}


def _pairwise_pairs(groups, seed):
  """Rule-written pairwise SFT pairs: (prompt text, target) per (best, other)."""
  out = []
  for e, g in enumerate(groups):
    if g.n < 2:
      continue
    j = best_index(g.ratings)
    for i in range(g.n):
      if i == j:
        continue
      p = pairwise_lib.build_pairwise_prompt(g.query, g.responses[j], g.responses[i],
                                             seed=(seed, e, i))
      a, b = (g.reasons[i], g.reasons[j]) if p.swapped else (g.reasons[j], g.reasons[i])
      critique = f"Response A: {a}. Response B: {b}."
      out.append((p.text, pairwise_lib.format_pairwise(critique, "B" if p.swapped else "A")))
  return out


def _stage_pairwise(ctx, workdir):
  pairs = _pairwise_pairs(_load_groups(ctx)["train"], ctx.config.seed)
  if not pairs:
    raise ValueError("no train group with n >= 2: the pairwise judge has no pairs")
  return _sft(ctx, _base_params(ctx), pairs, workdir, ctx.config.sft.steps)


def _stage_meta_rm(ctx, workdir):
  c = ctx.config
  final = GRM_STAGES[-1]
  params = _params(ctx, final)
  groups = _load_groups(ctx)["train"]
  samples = _sampler(ctx, params, c.benchmark.max_new_tokens, c.benchmark.temperature)(
      [(g.query, g.responses) for g in groups], c.rm.meta_k, c.seed + 3, None)
  flat = [(s, float(is_correct(s.scores, g.ratings))) for g, row in zip(groups, samples)
          for s in row]
  cfg, mparams = meta_lib.add_scalar_head(ctx.model_cfg, params, jax.random.key(c.seed + 9))

  def make(idx):
    return meta_lib.meta_batch(ctx.tok, [flat[i][0].prompt for i in idx],
                               [flat[i][0].text for i in idx], [flat[i][1] for i in idx],
                               seq_len=c.rm.seq_len)

  out = _train_scalar(ctx, cfg, mparams, meta_lib.meta_loss_fn(cfg),
                      _cycle_batches(make, len(flat), c.rm.batch_size, c.seed), workdir)
  return {"samples": len(flat), "positive_rate": float(np.mean([y for _, y in flat])), **out}


def _rates(samples) -> dict[str, float]:
  counts = judge_lib.invalid_sample_counts(samples)
  n = max(1, len(samples))
  return {"invalid_rate": sum(counts.values()) / n,
          **{f"invalid/{k}": v / n for k, v in counts.items() if v}}


def _grm_results(ctx, stage: str, subsets, meta, cfg=None) -> dict:
  """Greedy, voting@k and meta-RM voting@k correctness per subset for one GRM stage
  (``cfg``: its model config when not the plain GRM's, e.g. the shared backbone)."""
  c = ctx.config
  params = _params(ctx, stage, cfg)
  names = [s for s, gs in subsets.items() for _ in gs]
  groups = [g for gs in subsets.values() for g in gs]
  pairs = [(g.query, g.responses) for g in groups]
  greedy = _sampler(ctx, params, c.benchmark.max_new_tokens, 0.0, cfg)(pairs, 1, c.seed + 11,
                                                                        None)
  k_max = max(c.benchmark.ks)
  many = _sampler(ctx, params, c.benchmark.max_new_tokens, c.benchmark.temperature, cfg)(
      pairs, k_max, c.seed + 13, None)
  meta_cfg, meta_params = meta
  flat = [s for row in many for s in row]
  m = meta_lib.meta_scores(meta_cfg, meta_params, ctx.tok, flat, seq_len=c.rm.seq_len,
                           batch_size=c.rm.batch_size).reshape(len(groups), k_max)
  correct = {"greedy": [is_correct(row[0].scores, g.ratings) for g, row in zip(groups, greedy)]}
  for k in c.benchmark.ks:
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
  sampling = sampling_for_chat(ctx.tok, max_new_tokens=c.benchmark.max_new_tokens,
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
    seqs = [_response_ids(ctx.tok, g.query, r) for g in gs for r in g.responses]
    rewards = scalar_lib.score_sequences(bt_cfg, bt, seqs, seq_len=c.rm.seq_len,
                                         pad_id=ctx.tok.pad_id, batch_size=c.rm.batch_size)
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


def _unique_argmax(x) -> int:
  x = np.asarray(x)
  return int(np.argmax(x)) if np.sum(x == x.max()) == 1 else -1


def _stage_benchmark(ctx, workdir):
  c = ctx.config
  subsets = _test_subsets(ctx)
  meta_cfg = ctx.model_cfg.replace(scalar_head=True)
  meta = (meta_cfg, _params(ctx, "meta_rm", meta_cfg))
  correct, invalid = {}, {}
  for stage in GRM_STAGES:
    res = _grm_results(ctx, stage, subsets, meta)
    correct.update({f"{stage}/{k}": v for k, v in res["correct"].items()})
    invalid.update({f"{stage}/{k}": v for k, v in res["invalid"].items()})
  # The shared backbone judges with its own value head as the meta-RM.
  shared = (_shared_cfg(ctx), _params(ctx, SHARED, _shared_cfg(ctx)))
  res = _grm_results(ctx, SHARED, subsets, shared, cfg=shared[0])
  correct.update({f"{SHARED}/{k}": v for k, v in res["correct"].items()})
  invalid.update({f"{SHARED}/{k}": v for k, v in res["invalid"].items()})
  base = _baseline_results(ctx, subsets)
  correct.update(base["correct"])
  invalid.update(base["invalid"])
  table = {name: {s: dataclasses.asdict(e) for s, e in bench_lib.accuracy(
      v, num_resamples=c.benchmark.bootstrap_samples, seed=c.seed).items()}
           for name, v in correct.items() if any(v.values())}
  sizes = bench_lib.subset_sizes(subsets)
  common.write_json(workdir / "benchmark.json", {"accuracy": table, "invalid": invalid,
                                                 "sizes": sizes, "paper": PAPER})
  (workdir / "report.md").write_text(render_report(table, invalid, sizes, c.benchmark.ks))
  _plot_k_curve(table, c.benchmark.ks, workdir / "k_curve.png")
  out = {}
  for stage in GRM_STAGES + (SHARED,):
    for k in (min(c.benchmark.ks), max(c.benchmark.ks)):
      for kind in ("vote", "meta"):
        e = table.get(f"{stage}/{kind}@{k}", {}).get(bench_lib.OVERALL)
        if e:
          out[f"{stage}/{kind}@{k}"], out[f"{stage}/{kind}@{k}_se"] = e["value"], e["se"]
  return out


def render_report(table, invalid, sizes, ks) -> str:
  """Markdown: accuracy (± bootstrap SE) per subset and overall, sizes, invalid rates."""
  cols = [s for s in bench_lib.SUBSETS if sizes.get(s, {}).get("groups")] + [bench_lib.OVERALL]
  lines = ["# GRM benchmark (RewardBench-style test set, docs/DESIGN.md §6)", "",
           "Accuracy in % ± bootstrap SE. BT RM and pairwise judge: n >= 2 groups only. "
           f"Paper (DeepSeek-GRM-27B, RewardBench): {PAPER[1]} at k=1, {PAPER[32]} with "
           "meta-RM voting at k=32.", "",
           "| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for name, row in table.items():
    cells = [f"{row[s]['value']:.1f} ± {row[s]['se']:.1f}" if s in row else "–" for s in cols]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += ["", "Groups per subset: " + ", ".join(
      f"{s} {v['groups']}" for s, v in sizes.items()), "", "| model | invalid rate |",
            "|---|---|"]
  lines += [f"| {name} | {v['invalid_rate']:.3f} |" for name, v in invalid.items()]
  return "\n".join(lines) + "\n"


def _plot_k_curve(table, ks, path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 4))
  for stage in GRM_STAGES + (SHARED,):
    for kind, style in (("vote", "-"), ("meta", "--")):
      rows = [table.get(f"{stage}/{kind}@{k}", {}).get(bench_lib.OVERALL) for k in ks]
      if not all(rows):
        continue
      v = np.array([r["value"] for r in rows])
      se = np.array([r["se"] for r in rows])
      ax.plot(ks, v, style, marker="o", label=f"{stage} {kind}")
      ax.fill_between(ks, v - se, v + se, alpha=0.15)
  ax.plot(sorted(PAPER), [PAPER[k] for k in sorted(PAPER)], "k:", marker="s",
          label="paper (RewardBench, meta@k)")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("k (samples)")
  ax.set_ylabel("accuracy (%)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


STAGES = (("data", _stage_data, ("data", "models", "tiny_models")),
          ("cold_start", _stage_cold_start, ("sft", "sft_optim")),
          ("rft", _stage_rft, ("rft", "sft", "sft_optim", "benchmark")),
          ("rule_rl", _stage_rule_rl, ("rl", "grpo", "grpo_optim")),
          (SHARED, _stage_shared, ("rl", "grpo", "grpo_optim")),
          ("bt_rm", _stage_bt_rm, ("rm", "rm_optim")),
          ("pairwise", _stage_pairwise, ("sft", "sft_optim")),
          ("meta_rm", _stage_meta_rm, ("rm", "rm_optim", "benchmark")),
          ("benchmark", _stage_benchmark, ("benchmark", "rm", "rl")))


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  if not config.tiny_models and "base" not in config.models:
    raise ValueError(f"config.models={dict(config.models)} needs a 'base' entry (the GRM, "
                     "BT RM and pairwise judge start from it), or set config.tiny_models > 0")
  root = pathlib.Path(workdir)
  model_cfg = to_model_config(config.model)
  mesh, rules = common.mesh_and_rules(config)
  ctx = _Ctx(config, root, model_cfg, common.tokenizer_for(model_cfg), mesh, rules)
  out = {}
  for name, fn, groups in STAGES:
    cfg = _stage_config(config, f"grm_{name}", **{g: config[g] for g in groups})
    metrics = common.run_stage(name, lambda _c, w, fn=fn: fn(ctx, pathlib.Path(w)), cfg, root / name)
    out.update({f"{name}/{k}": v for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)})
  out["wall_s"] = timer.seconds
  return out
