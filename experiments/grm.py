"""Job ``grm``: train a pointwise GRM (SPCT) and benchmark it (docs/DESIGN.md §6).

Stages (each resumable, ``experiments.common.run_stage``; a stage
directory holds ``config.json`` and ``final_metrics.json``; ``config.skip_stages``
leaves some out, an error when a stage it does run reads one that has not finished):

  data        candidates from the source models (``config.models``; the tiny
              variant builds random ones) at each temperature, verified, then
              one preference group per example (``grm.data``, subsets redrawn
              up to ``data.max_draws`` times for a unique best); train and test
              examples by the tasks' prompt-hash split. ``groups.json``; its
              metrics hold the counts and the sampling / verifying seconds.
  grm_base    only with ``config.grm_width`` set to another width than the source
              models': that model pre-trained by ``config.base`` (the specialists'
              base recipe); the GRM, BT RM and pairwise judge start from it.
  cold_start  SFT of the base model on the rule-based judge's judgements of
              the train groups (``grm.training`` a).
  rft         rejective sampling from the cold-start GRM on ``rft.num_groups``
              train groups, SFT from it on the kept judgements (counts of each
              rejection in its metrics).
  rule_rl     GRPO from the RFT GRM, reward +1 correct / -1 otherwise, KL
              ``rl.kl_multiplier`` x the GRPO config's.
  shared      the shared-backbone variant (docs/DESIGN.md §6): the RFT GRM plus
              a fresh value head on the same trunk, trained by rule RL + ``rl.meta_weight``
              x meta BCE on its own judgements (``grm.shared``); its value
              head guides its own voting. Each of its networks is the size
              of one separate GRM or meta-RM (the separate pair holds twice
              the parameters; for a pair of half the size set
              ``config.grm_width``, and compare with ``experiments/grm_compare.py``).
  bt_rm       Bradley–Terry scalar RM from the base (pairs: best vs each other).
  pairwise    the "A or B" judge, SFT from the base on rule-written
              ``Better: A/B`` texts (not zero-shot from the GRM).
  meta_rm     scalar head on the final GRM's trunk, BCE on its own sampled
              judgements of ``rm.meta_groups`` train groups (label: correct);
              one meta-RM guides the voting of every GRM stage.
  benchmark   ``experiments/grm_benchmark.py``: per GRM stage (and ``shared``)
              greedy, voting@k and meta-RM voting@k (k_meta = ceil(k/2), k in
              ``benchmark.ks_by_stage`` or ``ks``) on the test set
              (``grm.benchmark_set``), the first k of ``max(ks)`` samples;
              BT RM, pairwise judge (n >= 2 groups only: neither gives an
              n = 1 rating) and random. ``report.md`` (``experiments/grm_report.py``),
              ``benchmark.json``, ``k_curve.png``.

Every stage's metrics add ``time/wall_s`` and ``time/cpu_s``. Shared helpers
are in ``experiments/grm_common.py``.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
import warnings

import jax
import ml_collections
import numpy as np

from experiments import common
from experiments import pretrain as pretrain_job
from experiments.grm_benchmark import stage_benchmark, stage_ks
from experiments.grm_common import (GRM_BASE, GRM_STAGES, SHARED, base_params,
                                    control_without_sources, grm_sampler, load_groups,
                                    source_cfg, source_models, stage_params)
from grm import benchmark_set as bench_lib
from grm import control_set
from grm import meta_rm as meta_lib
from grm import pairwise as pairwise_lib
from grm import scalar_rm as scalar_lib
from grm import shared as shared_lib
from grm import training as training_lib
from grm.correctness import best_index
from grm.data import (Candidate, build_groups, downsample_rating1, sample_candidates,
                      split_groups)
from grm.reward import bt_input_ids
from opd import tasks as tasks_lib
from opd.config.fields import from_group
from opd.models import to_model_config
from opd.rl.config import GRPOConfig
from opd.rollout.episodes import RolloutLog
from opd.training import lm_trainer
from opd.training.checkpoints import CheckpointManager
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.metrics_writer import MetricWriter
from opd.training.files import read_json

_PER_DOMAIN_KEYS = ("num_train", "num_test", "difficulties")
# config.data.source: "models" samples the source models' responses (grm.data);
# "control" builds the positive-control set (grm.control_set, cue config.data.cue).
DATA_SOURCES = ("models", "control")


def _examples(c, split: str, n: int, seed: int):
  """``n`` examples of ``split`` per domain (test ones distinct), unless
  ``config.data.per_domain[domain]`` sets ``num_<split>`` or ``difficulties``."""
  out = []
  for d in c.data.domains:
    over = dict(c.data.get("per_domain", {}).get(d, {}))
    bad = sorted(set(over) - set(_PER_DOMAIN_KEYS))
    if bad:
      raise ValueError(f"config.data.per_domain.{d} has unknown keys {bad}; known: "
                       f"{_PER_DOMAIN_KEYS}")
    out += tasks_lib.domain_examples((d,), split, int(over.get(f"num_{split}", n)), seed,
                                     tuple(over.get("difficulties", c.data.difficulties)),
                                     unique=split == "test")
  return out


def _control_data(c) -> tuple[list, list, dict]:
  """The positive-control set (``grm.control_set``): ``(examples, groups, counts)``."""
  examples, groups = [], []
  for split, n, seed in (("train", c.data.num_train, c.seed), ("test", c.data.num_test,
                                                               c.seed + 1)):
    ex, gs = control_set.control_groups(split, int(n), cue=c.data.cue, seed=seed,
                                        difficulties=tuple(c.data.difficulties))
    examples += ex
    groups += gs
  return examples, groups, {"kept": len(groups), "kept_n2": len(groups)}


def _stage_data(ctx: common.JobContext, workdir: pathlib.Path) -> dict:
  c = ctx.config
  source = c.data.get("source", "models")
  if source not in DATA_SOURCES:
    raise ValueError(f"config.data.source={source!r} must be one of {DATA_SOURCES}")
  if source == "control":
    examples, groups, counts = _control_data(c)
    return _write_groups(workdir, examples, groups, counts, {})
  examples = _examples(c, "train", c.data.num_train, c.seed) + _examples(
      c, "test", c.data.num_test, c.seed + 1)
  models = [(source_cfg(ctx), p) for p in source_models(ctx).values()]
  timings: dict[str, float] = {}
  cands = sample_candidates(models, ctx.tok, examples, temperatures=tuple(c.data.temperatures),
                            max_new_tokens=c.data.max_new_tokens, seed=c.seed, mesh=ctx.mesh,
                            rules=ctx.rules, log=RolloutLog(timings=timings))
  if c.data.include_reference:  # tiny: a verified correct candidate per single-turn example
    for ex, row in zip(examples, cands):
      if not tasks_lib.is_multi_turn(ex.domain):
        text = ex.reference[-1][1]
        row.append(Candidate(text, tasks_lib.get_task(ex.domain).verify(ex, text)))
  groups, counts = build_groups(examples, cands, seed=c.seed, sizes=tuple(c.data.sizes),
                                max_draws=c.data.max_draws)
  # keep_rating1_n1: the share of train single-response groups rated 1 kept (test: all).
  train = downsample_rating1([g for g in groups if g.split == "train"],
                             float(c.data.get("keep_rating1_n1", 1.0)), seed=c.seed + 11)
  counts["train_rating1_n1_dropped"] = sum(g.split == "train" for g in groups) - len(train)
  kept = {id(g) for g in train}
  groups = [g for g in groups if g.split != "train" or id(g) in kept]
  return {**_write_groups(workdir, examples, groups, counts, timings),
          "candidates": sum(len(r) for r in cands)}


def _write_groups(workdir: pathlib.Path, examples, groups, counts: dict, timings: dict) -> dict:
  """``groups.json``, ``test_examples.json`` and ``subsets.json``; the data stage's metrics."""
  splits = split_groups(groups)
  common.write_json(workdir / "groups.json",
                    {s: [dataclasses.asdict(g) for g in gs] for s, gs in splits.items()})
  test = bench_lib.benchmark_set(groups, examples)
  common.write_json(workdir / "test_examples.json", [ex.id for ex in examples])
  sizes = bench_lib.subset_sizes(test)
  common.write_json(workdir / "subsets.json",
                    {s: [g.example_id for g in gs] for s, gs in test.items()})
  return {**counts, **{f"{k}_s": v for k, v in timings.items()}, "examples": len(examples),
          "train_groups": len(splits.get("train", [])),
          "test_groups": len(splits.get("test", [])),
          **{f"test_{s}": v["groups"] for s, v in sizes.items()}}


def _sft(ctx, params, pairs, workdir: pathlib.Path, steps: int, seq_len: int | None = None
         ) -> dict:
  """SFT on ``(prompt, target)`` pairs (``sft_optim``; a decaying schedule
  decays over this stage's steps after warmup); metrics include the longest
  pair and how many exceed ``seq_len`` (default ``sft.seq_len``; those are
  cut, their scores line lost)."""
  c = ctx.config
  seq_len = seq_len or c.sft.seq_len
  lengths = [len(training_lib.judgement_pair(ctx.tok, p, t)[0]) for p, t in pairs]
  loop = lm_trainer.LMTrainConfig(steps=steps, keep_checkpoints=1, progress=False)
  decay = {} if c.sft_optim.get("schedule", "constant") == "constant" else {
      "decay_steps": max(1, steps - c.sft_optim.warmup_steps)}
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=max(1, steps // 20))
    training_lib.train_judgement_sft(
        ctx.model_cfg, params, pairs,
        optim=common.optim_config(c.sft_optim, "config.sft_optim", **decay), loop=loop,
        io=RunIO(checkpoint_dir=workdir / "checkpoints", on_metrics=logger),
        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed, tokenizer=ctx.tok), seq_len=seq_len,
        batch_size=c.sft.batch_size)
  losses = [m["loss"] for _, m in logger.history if "loss" in m]
  return {"pairs": len(pairs), "loss_first": losses[0], "loss_final": float(np.mean(losses[-5:])),
          "tokens_max": max(lengths), "tokens_mean": float(np.mean(lengths)),
          "over_seq_len": sum(n > seq_len for n in lengths)}


def _stage_cold_start(ctx, workdir):
  c = ctx.config
  # sft.copies judgements per group, each with its own response order and principles.
  train = load_groups(ctx)["train"]
  pairs = [p for r in range(c.sft.copies)
           for p in training_lib.cold_start_pairs(train, seed=c.seed + r, noise=c.data.noise,
                                                  **_judgement_size(c))]
  # A sampling budget below the longest judgement it was taught (and <|end|>)
  # cuts such samples, which then count as invalid (the tiny run does so on purpose).
  longest = max(len(ctx.tok.encode(t)) for _, t in pairs) + 1
  for field in ("benchmark", "rft", "grpo"):
    if c[field].max_new_tokens < longest:
      print(f"[grm] warning: config.{field}.max_new_tokens={c[field].max_new_tokens} < the "
            f"longest cold-start judgement ({longest} tokens with <|end|>)", flush=True)
  return {**_sft(ctx, base_params(ctx), pairs, workdir, c.sft.steps),
          "judgement_tokens_max": longest}


def _judgement_size(c) -> dict:
  """The cold-start judgements' size: ``sft.principles`` principles (default 2) and the
  verifier-reason critique unless ``sft.critique`` is off (``grm.data.rule_judgement``)."""
  return {"principles": int(c.sft.get("principles", 2)),
          "critique": bool(c.sft.get("critique", True))}


def _subset(groups, n: int, seed: int):
  """``n`` of ``groups`` drawn without replacement (seeded, original order kept); 0: all."""
  if not n or n >= len(groups):
    return list(groups)
  keep = np.sort(np.random.default_rng(seed).choice(len(groups), size=int(n), replace=False))
  return [groups[i] for i in keep]


def _stage_rft(ctx, workdir):
  c = ctx.config
  params = stage_params(ctx, "cold_start")
  kept, counts = training_lib.rejective_sample(
      _subset(load_groups(ctx)["train"], c.rft.num_groups, c.seed + 5),
      grm_sampler(ctx, params, c.rft.max_new_tokens, c.rft.temperature, progress="rft samples"),
      n_rft=c.rft.n_rft, seed=c.seed)
  print(f"[grm] RFT counts: {counts}", flush=True)
  out = dict(counts)
  if not kept:  # nothing survived: the RFT model is the cold-start model, saved as such
    kept = training_lib.cold_start_pairs(load_groups(ctx)["train"], seed=c.seed + 1,
                                         **_judgement_size(c))
    out["fallback_cold_start_pairs"] = len(kept)
  return {**out, **_sft(ctx, params, kept, workdir, c.rft.steps)}


def _grpo(c) -> GRPOConfig:
  return from_group(GRPOConfig, c.grpo, "config.grpo")


def _stage_rule_rl(ctx, workdir):
  c = ctx.config
  with MetricWriter(workdir) as writer:
    run = training_lib.train_rule_rl(
        ctx.model_cfg, stage_params(ctx, "rft"), load_groups(ctx)["train"], _grpo(c),
        common.optim_config(c.grpo_optim, "config.grpo_optim"),
        LoopConfig(c.rl.steps, progress=False),
        RunIO(writer=writer, checkpoint_dir=workdir / "checkpoints"),
        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed, tokenizer=ctx.tok),
        kl_multiplier=c.rl.kl_multiplier)
  rewards = [m["reward/mean"] for m in run.history if "reward/mean" in m]
  return {"steps": len(run.history), "reward_first": rewards[0] if rewards else float("nan"),
          "reward_final": float(np.mean(rewards[-5:])) if rewards else float("nan")}


def _stage_shared(ctx, workdir):
  c = ctx.config
  cfg, params = meta_lib.add_scalar_head(ctx.model_cfg, stage_params(ctx, "rft"),
                                         jax.random.key(c.seed + 17))
  with MetricWriter(workdir) as writer:
    run = shared_lib.train_shared_rule_rl(
        cfg, params, load_groups(ctx)["train"], _grpo(c),
        common.optim_config(c.grpo_optim, "config.grpo_optim"),
        LoopConfig(c.rl.steps, progress=False),
        RunIO(writer=writer, checkpoint_dir=workdir / "checkpoints"),
        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed, tokenizer=ctx.tok),
        meta_weight=c.rl.meta_weight, kl_multiplier=c.rl.kl_multiplier)
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
                                LoopConfig(c.rm.steps, progress=False),
                                RunIO(checkpoint_manager=manager,
                                      on_metrics=lambda s, m: history.append(m)),
                                runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed),
                                params=params)
  losses = [float(m["loss"]) for m in history if "loss" in m]
  return {"loss_first": losses[0], "loss_final": float(np.mean(losses[-5:]))}


def _cycle_batches(make, n: int, batch_size: int, seed: int):
  rng = np.random.default_rng(seed)
  while True:
    yield make(rng.integers(0, n, size=batch_size))


def _bt_pairs(groups):
  out = []
  for g in groups:
    if g.n >= 2:
      j = best_index(g.ratings)
      out += [(g.query, g.responses[j], g.responses[i]) for i in range(g.n) if i != j]
  return out


def _stage_bt_rm(ctx, workdir):
  c = ctx.config
  cfg, params = meta_lib.add_scalar_head(ctx.model_cfg, base_params(ctx),
                                         jax.random.key(c.seed + 7))
  pairs = _bt_pairs(load_groups(ctx)["train"])
  if not pairs:
    raise ValueError("no train group with n >= 2: the BT RM has no pairs (more examples?)")
  # Longer rows keep their first bt_seq_len tokens, as grm.reward.BTReward reads them.
  cut = c.rm.bt_seq_len
  enc = [(bt_input_ids(ctx.tok, q, a)[:cut], bt_input_ids(ctx.tok, q, b)[:cut])
         for q, a, b in pairs]

  def make(idx):
    return scalar_lib.pair_batch([enc[i][0] for i in idx], [enc[i][1] for i in idx],
                                 seq_len=c.rm.bt_seq_len, pad_id=ctx.tok.pad_id)

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
  pairs = _pairwise_pairs(load_groups(ctx)["train"], ctx.config.seed)
  if not pairs:
    raise ValueError("no train group with n >= 2: the pairwise judge has no pairs")
  return _sft(ctx, base_params(ctx), pairs, workdir, ctx.config.pairwise.steps,
              ctx.config.pairwise.seq_len)


def _stage_meta_rm(ctx, workdir):
  c = ctx.config
  final = GRM_STAGES[-1]
  params = stage_params(ctx, final)
  groups = _subset(load_groups(ctx)["train"], c.rm.meta_groups, c.seed + 6)
  samples = grm_sampler(ctx, params, c.benchmark.max_new_tokens, c.benchmark.temperature,
                     progress="meta-RM training judgements")(
      [(g.query, g.responses) for g in groups], c.rm.meta_k, c.seed + 3, None)
  flat = meta_lib.training_rows(groups, samples)  # valid judgements only
  dropped = sum(map(len, samples)) - len(flat)
  if not flat:  # e.g. the tiny variant's random GRM: every row, all labelled wrong
    warnings.warn(f"all {dropped} meta-RM training judgements are invalid; training on them "
                  "with label 0", stacklevel=1)
    flat, dropped = [(s, 0.0) for row in samples for s in row], 0
  cfg, mparams = meta_lib.add_scalar_head(ctx.model_cfg, params, jax.random.key(c.seed + 9))

  def make(idx):
    return meta_lib.meta_batch(ctx.tok, [flat[i][0].prompt for i in idx],
                               [flat[i][0].text for i in idx], [flat[i][1] for i in idx],
                               seq_len=c.rm.seq_len)

  out = _train_scalar(ctx, cfg, mparams, meta_lib.meta_loss_fn(cfg),
                      _cycle_batches(make, len(flat), c.rm.batch_size, c.seed), workdir)
  return {"samples": len(flat), "invalid_dropped": dropped,
          "positive_rate": float(np.mean([y for _, y in flat])), **out}


# Fields of the benchmark group only the benchmark stage reads (the voting k's and
# the bootstrap); RFT and the meta-RM read its sampling fields, so these are left
# out of their stage configs (a saved config that still holds them matches).
BENCHMARK_ONLY = ("benchmark.ks", "benchmark.ks_by_stage", "benchmark.bootstrap_samples",
                  "benchmark.constrained", "benchmark.content_blind",
                  "benchmark.pairwise_both_orders")

STAGES = (("data", _stage_data, ("data", "models", "tiny_models")),
          ("cold_start", _stage_cold_start, ("sft", "sft_optim")),
          ("rft", _stage_rft, ("rft", "sft", "sft_optim", "benchmark")),
          ("rule_rl", _stage_rule_rl, ("rl", "grpo", "grpo_optim")),
          (SHARED, _stage_shared, ("rl", "grpo", "grpo_optim")),
          ("bt_rm", _stage_bt_rm, ("rm", "rm_optim")),
          ("pairwise", _stage_pairwise, ("pairwise", "sft", "sft_optim")),
          ("meta_rm", _stage_meta_rm, ("rm", "rm_optim", "benchmark")),
          ("benchmark", stage_benchmark, ("benchmark", "rm", "rl", "pairwise")))


def _without(group, name: str, paths):
  """A copy of config group ``name`` without the ``paths`` fields under it (or the
  group itself when none are); RFT and the meta-RM sample with the benchmark's
  settings only."""
  drop = [p.split(".", 1)[1] for p in paths if p.split(".", 1)[0] == name]
  if not drop or not isinstance(group, ml_collections.ConfigDict):
    return group
  return ml_collections.ConfigDict({k: v for k, v in group.to_dict().items() if k not in drop})


def _timed(fn, ctx, workdir: pathlib.Path) -> dict:
  """A stage's metrics plus its wall and CPU seconds (``time/wall_s``, ``time/cpu_s``;
  CPU over every thread of this process, so cpu/wall is the cores it kept busy)."""
  wall, cpu = time.perf_counter(), time.process_time()
  out = fn(ctx, workdir)
  return {**out, "time/wall_s": time.perf_counter() - wall, "time/cpu_s": time.process_time() - cpu}


# What each stage reads (besides the GRM's own base): a stage that runs while one
# of these is skipped (config.skip_stages) and unfinished is an error.
NEEDS = {"data": (), "cold_start": ("data",), "rft": ("cold_start",), "rule_rl": ("rft",),
         SHARED: ("rft",), "bt_rm": ("data",), "pairwise": ("data",), "meta_rm": ("rule_rl",),
         "benchmark": ("cold_start", "rft", "rule_rl", SHARED, "bt_rm", "pairwise", "meta_rm")}


# The stages that start from the GRM's base (its own one with config.grm_width).
READS_BASE = ("cold_start", "bt_rm", "pairwise")


def check_benchmark(cfg) -> None:
  """The benchmark stage's voting k's, checked at job start rather than after
  hours of the stages before it: ``ks`` (and every ``ks_by_stage`` entry, each
  naming a GRM stage) non-empty ints >= 1."""
  known = GRM_STAGES + (SHARED,)
  bad = sorted(set(cfg.benchmark.get("ks_by_stage", {})) - set(known))
  if bad:
    raise ValueError(f"config.benchmark.ks_by_stage names {bad}, which are not GRM stages "
                     f"{known}")
  for stage in known:
    stage_ks(cfg, stage)


def grm_model(config) -> ml_collections.ConfigDict:
  """The GRM's model group: ``config.model`` (the source models') or, with
  ``config.grm_width``, that model at another width (``common.model_at_width``)."""
  return common.model_at_width(config.model, config.get("grm_width", 0), "config.grm_width")


def saved_run_context(run_dir: pathlib.Path, ks: tuple[int, ...], *,
                      content_blind: bool | None = None,
                      constrained: bool | None = None) -> common.JobContext:
  """A finished grm run's saved config (voting at ``ks`` for every stage;
  ``benchmark.content_blind`` and ``benchmark.constrained`` set when not None)
  and its job context (GRM model), for the tools that rescore a run (``experiments.grm_compare``,
  ``experiments.grm_yardstick``)."""
  path = pathlib.Path(run_dir) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} is missing: {run_dir} is not a grm run directory")
  config = ml_collections.ConfigDict(read_json(path, expect=dict))
  if config.get("job") != "grm":
    raise ValueError(f"{path}: job={config.get('job')!r}, expected 'grm'")
  config.benchmark.ks = tuple(ks)
  config.benchmark.ks_by_stage = ml_collections.ConfigDict()
  if content_blind is not None:
    config.benchmark.content_blind = content_blind
  if constrained is not None:
    config.benchmark.constrained = constrained
  ctx = common.JobContext.for_run(config, run_dir)
  return dataclasses.replace(ctx, model_cfg=to_model_config(grm_model(config)))


def has_own_base(config) -> bool:
  """Whether the GRM pre-trains its own base (stage ``grm_base``): at another width
  than the source models', or on the positive-control set (``data.source``
  "control", no source models to start from)."""
  return (grm_model(config).to_dict() != config.model.to_dict()
          or control_without_sources(config))


def _skipped(config, root: pathlib.Path) -> set[str]:
  skip = tuple(config.get("skip_stages", ()) or ())
  names = [n for n, _, _ in STAGES]
  bad = sorted(set(skip) - set(names))
  if bad:
    raise ValueError(f"config.skip_stages={tuple(skip)}: unknown stages {bad}; stages: {names}")
  for name in names:
    if name in skip:
      continue
    missing = [d for d in NEEDS[name] if d in skip and not (root / d / common.FINAL).exists()]
    if missing:
      raise ValueError(f"config.skip_stages={tuple(skip)}: stage {name!r} reads {missing}, "
                       f"which {'is' if len(missing) == 1 else 'are'} skipped and not finished "
                       f"in {root}; skip {name!r} too or run them")
  return set(skip)


def _grm_base_stage(config, model) -> ml_collections.ConfigDict:
  cfg = common.stage_config(config, "pretrain", optim=config.base.optim,
                            train=config.base.train, data=config.base.data)
  cfg.model = ml_collections.ConfigDict(model.to_dict())
  return cfg


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  model = grm_model(config)
  own_base = has_own_base(config)
  if not config.tiny_models and not own_base and "base" not in config.models:
    raise ValueError(f"config.models={dict(config.models)} needs a 'base' entry (the GRM, "
                     "BT RM and pairwise judge start from it), or set config.tiny_models > 0")
  root = pathlib.Path(workdir)
  skip = _skipped(config, root)
  ctx = common.JobContext.for_run(config, root)
  ctx = dataclasses.replace(ctx, model_cfg=to_model_config(model))
  stages = [common.Stage(GRM_BASE, pretrain_job.run, _grm_base_stage(config, model))] \
      if own_base else []
  for name, fn, groups in STAGES:
    unread = () if name == "benchmark" else BENCHMARK_ONLY
    held = {g: _without(config[g], g, unread) for g in groups}
    if name != "data":  # the data stage samples the source models (config.model)
      held["model"] = model
    upstream = NEEDS[name] + ((GRM_BASE,) if own_base and name in READS_BASE else ())
    stages.append(common.Stage(name, lambda _c, w, fn=fn: _timed(fn, ctx, pathlib.Path(w)),
                               common.stage_config(config, f"grm_{name}", **held), upstream,
                               check_benchmark if name == "benchmark" else None))
  for name in skip:
    print(f"[grm] {name}: skipped (config.skip_stages)", flush=True)
  out = common.Stages.of(root).run_all(stages, skip)
  out["wall_s"] = timer.seconds
  return out
