"""Job ``v4``: the DeepSeek-V4 post-training pipeline at toy size — what ``make demo`` runs.

  python -m experiments.launch --config=experiments/configs/v4.py --workdir=workdirs/demo

Stages (docs/DESIGN.md §3, §11), each a run directory under the workdir,
resumable, skipped once finished and refused when written under another
config (``experiments.common.run_stage``):

  base → one specialist per domain (SFT, GRPO)        WORKDIR/base, WORKDIR/<domain>/{sft,grpo}
  → for each student seed s:
      cold start: SFT on the specialists' verified answers   WORKDIR/student/seed<s>/cold_start
      OPD: routing by domain, reverse KL to the specialists  WORKDIR/student/seed<s>/opd
      annealing: teacher weights → uniform, lr → 0           WORKDIR/student/seed<s>/anneal
  → baselines (``config.baselines.baselines``)                WORKDIR/baselines/<job>
  → evaluation of every model on every test set               WORKDIR/v4/

The specialists stage also writes its own report (``WORKDIR/results``).
The ``v4`` evaluation scores every row (base, specialists, each student
stage, each baseline) with one ``EvalConfig``: greedy ``reward@1`` and the
sampled ``mean@N``, bootstrap standard errors over test examples; student
rows with several seeds show the mean and the standard deviation across
seeds. ``experiments.v4_report`` renders the tables, the retention row and
the OPD-minus-baseline comparisons (markdown + JSON + heatmap).
"""
from __future__ import annotations

import pathlib

import jax
import ml_collections

from experiments import baselines as baselines_job
from experiments import common
from experiments import diagnostics_plot
from experiments import distill as distill_job
from experiments import specialists as specialists_job
from experiments import v4_report
from opd.config.fields import from_group, to_group
from opd.eval import evaluation as ev
from opd.models import to_model_config
from opd.training.checkpoints import load_params
from opd.training.optim import OptimConfig

STUDENT_STAGES = ("cold_start", "opd", "anneal")


def _copy(group) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(group.to_dict())


def _teachers(config, root: pathlib.Path) -> ml_collections.ConfigDict:
  model = config.specialists.model
  return ml_collections.ConfigDict({
      d: ml_collections.ConfigDict(dict(init=str(root / d / "grpo" / "checkpoints"), domain=d,
                                        model=_copy(model)))
      for d in config.specialists.domains})


def student_stage_config(config, stage: str, root: pathlib.Path, student_init: str,
                         seed: int) -> ml_collections.ConfigDict:
  """The ``experiments.distill`` config of one student stage."""
  if stage not in STUDENT_STAGES:
    raise ValueError(f"stage={stage!r}: expected one of {STUDENT_STAGES}")
  c = ml_collections.ConfigDict()
  c.job = "cold_start" if stage == "cold_start" else "opd"
  c.seed = seed
  c.mesh = config.specialists.mesh
  c.sharding_rules = config.specialists.sharding_rules
  c.student = ml_collections.ConfigDict(dict(init=student_init,
                                             model=_copy(config.specialists.model)))
  c.teachers = _teachers(config, root)
  c.data = _copy(config.data)
  c.cold_start = _copy(config.cold_start)
  # The teachers are the specialists: nothing is built (a fixed group, so no
  # stage depends on another stage's optimizer settings).
  c.build_teachers = ml_collections.ConfigDict(dict(sft_steps=0, num_train=0, batch_size=1,
                                                    optim=to_group(OptimConfig)))
  c.opd = _copy(config.opd)
  c.optim = _copy(config.cold_start_optim if stage == "cold_start" else
                  config.opd_optim if stage == "opd" else config.anneal_optim)
  c.train = _copy(config.opd_train)
  if stage == "opd":
    c.opd.anneal_steps = 0
  elif stage == "anneal":
    steps = config.anneal.steps
    c.opd.anneal_steps = steps
    c.train.update(steps=steps, save_every=steps, eval_every=max(1, steps // 2))
  return c


def _ckpt(directory: pathlib.Path) -> str:
  return str(directory / "checkpoints")


def run_students(config, root: pathlib.Path) -> dict[int, dict[str, pathlib.Path]]:
  """Cold start → OPD → annealing for every seed; ``{seed: {stage: run dir}}``."""
  out = {}
  for seed in config.student_seeds:
    dirs, init = {}, _ckpt(root / "base")
    for stage in STUDENT_STAGES:
      d = root / "student" / f"seed{seed}" / stage
      fn = distill_job.run_cold_start if stage == "cold_start" else distill_job.run_opd
      common.run_stage(f"student seed {seed}: {stage}", fn,
                                 student_stage_config(config, stage, root, init, seed), d)
      dirs[stage], init = d, _ckpt(d)
    out[seed] = dirs
  return out


def run_baselines(config, root: pathlib.Path, cold_start: pathlib.Path) -> dict[str, pathlib.Path]:
  """The baselines in ``config.baselines.baselines``; ``{job: run dir}``."""
  bl = config.baselines
  paths = {"base": _ckpt(root / "base"), "student": _ckpt(cold_start),
           "teachers": {d: _ckpt(root / d / "grpo") for d in config.specialists.domains}}
  out = {}
  for job in bl.baselines:
    if job not in baselines_job.RUNS:
      raise ValueError(f"config.baselines.baselines has {job!r}: expected some of "
                       f"{tuple(baselines_job.RUNS)}")
    d = root / "baselines" / job
    common.run_stage(f"baseline {job}", baselines_job.RUNS[job],
                               baselines_job.stage_config(bl, job, paths), d)
    out[job] = d
  return out


def _evaluate_all(config, models: dict[str, pathlib.Path]):
  """A stage function: every model on every test set, results saved as JSON."""

  def fn(cfg, workdir: str) -> dict:
    model_cfg = to_model_config(config.specialists.model)
    tok = common.tokenizer_for(model_cfg)
    mesh, rules = common.mesh_and_rules(config.specialists)
    eval_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval",
                          domains=tuple(config.specialists.domains))
    key = jax.random.key(config.seed + 1234)
    results = []
    print(f"[v4] evaluating {len(models)} models on {len(eval_cfg.domains)} test sets "
          f"({eval_cfg.n_per_domain} examples each, greedy + mean@{eval_cfg.num_samples})",
          flush=True)
    for name, run_dir in models.items():
      params = load_params(_ckpt(run_dir), model_cfg, mesh=mesh, rules=rules)
      results.append(ev.evaluate(model_cfg, params, tok, eval_cfg, rng=key, name=name, mesh=mesh,
                                 rules=rules))
      print(f"  {name}: " + ", ".join(
          f"{d} {results[-1].score(d, config.report_metric).value:.0f}" for d in eval_cfg.domains),
            flush=True)
    ev.save_results(results, workdir)
    return {"models": len(results)}

  return fn


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  root = pathlib.Path(workdir)
  specialists_job.run(config.specialists, str(root))
  students = run_students(config, root)
  first = students[config.student_seeds[0]]["cold_start"]
  base_rows = run_baselines(config, root, first)
  models = {"base": root / "base"}
  models.update({f"{d}-specialist": root / d / "grpo" for d in config.specialists.domains})
  for seed, dirs in students.items():
    for stage, d in dirs.items():
      models[f"{v4_report.STUDENT_ROWS[stage]}#{seed}"] = d
  models.update({v4_report.BASELINE_ROWS.get(job, job): d for job, d in base_rows.items()})
  eval_stage = ml_collections.ConfigDict(dict(
      job="v4_eval", eval=_copy(config.eval), models=sorted(str(v) for v in models.values())))
  out_dir = root / "v4"
  common.run_stage("v4 evaluation", _evaluate_all(config, models), eval_stage, out_dir)
  results = ev.load_results(str(out_dir / "results.json"))
  summary = v4_report.summarize(results, tuple(config.specialists.domains),
                                config.report_metric, f"mean@{config.eval.num_samples}")
  report = v4_report.render(summary, timer_s=timer.seconds)
  (out_dir / "report.md").write_text(report)
  common.write_json(out_dir / "summary.json", summary)
  heat = v4_report.heatmap(summary, out_dir / "heatmap.png", config.report_metric)
  # Per-teacher overlap and reverse KL by position over OPD then annealing (first seed).
  diag = diagnostics_plot.plot_diagnostics(
      [first.parent / "opd", first.parent / "anneal"], out_dir / "diagnostics.png",
      f"OPD then annealing (student seed {config.student_seeds[0]}): diagnostics per teacher")
  print(report, flush=True)
  print(f"[v4] heatmap: {heat}\n[v4] diagnostics: {diag}\n[v4] report: {out_dir / 'report.md'}",
        flush=True)
  flat = {f"{row}/{d}": v[0] for row, cols in summary["table"][config.report_metric].items()
          for d, v in cols.items()}
  return {"wall_s": timer.seconds, "heatmap": str(heat), "report": str(out_dir / "report.md"),
          "diagnostics": diag or "",
          **{f"retention/{d}": v for d, v in summary["retention"].items()},
          **{f"opd_minus/{k}": v[0] for k, v in summary["opd_minus"].items()}, **flat}

