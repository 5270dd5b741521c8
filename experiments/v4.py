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
  → positive control (``config.positive_control.steps`` > 0): OPD from the
    first seed's cold start to one specialist on its own domain, per domain,
    scored at every checkpoint (``experiments.positive_control``)
                                                         WORKDIR/positive_control/<domain>
  → baselines (``config.baselines.baselines``)                WORKDIR/baselines/<job>
  → evaluation of each model on every test set               WORKDIR/eval/<model>
  → the report (tables, heatmap, diagnostics; rewritten on every run)  WORKDIR/v4/

The specialists stage also writes its own report (``WORKDIR/results``).
``--config.reuse_from=DIR[,DIR2]`` reads every stage a finished run in DIR
holds under the same stage config instead of rerunning it (nothing is
written there; ``experiments.common.Stages``): a lever on OPD
(``--config.opd.loss.aggregation=sequence_mean``) in a new workdir reruns only
OPD, annealing and their evaluations; ``:seeds=3`` only the new seeds.
The evaluation scores every row (base, specialists, each student
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
from experiments import positive_control
from experiments import pretrain as pretrain_job
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


def _teachers(config, grpo_dirs, shift: int = 0) -> ml_collections.ConfigDict:
  """Domain ``d_i``'s teacher: the specialist of ``d_{(i + shift) mod K}``
  (``shift`` 0: its own; ≠ 0: the negative control, ``config.teacher_shift``)."""
  model = config.specialists.model
  domains = [d for d in config.specialists.domains if d in grpo_dirs]
  return ml_collections.ConfigDict({
      d: ml_collections.ConfigDict(dict(
          init=str(pathlib.Path(grpo_dirs[domains[(i + shift) % len(domains)]]) / "checkpoints"),
          domain=d, model=_copy(model)))
      for i, d in enumerate(domains)})


def student_stage_config(config, stage: str, grpo_dirs, student_init: str,
                         seed: int) -> ml_collections.ConfigDict:
  """The ``experiments.distill`` config of one student stage.

  ``grpo_dirs``: ``{domain: specialist run dir}``, the teachers. Each stage's config
  holds only the groups it reads: the cold start has no ``opd`` group, OPD
  and annealing no ``cold_start`` group, so an OPD lever reuses the cold
  start (``experiments.common.Stages``).
  """
  if stage not in STUDENT_STAGES:
    raise ValueError(f"stage={stage!r}: expected one of {STUDENT_STAGES}")
  c = ml_collections.ConfigDict()
  c.job = "cold_start" if stage == "cold_start" else "opd"
  c.seed = seed
  c.mesh = config.specialists.mesh
  c.sharding_rules = config.specialists.sharding_rules
  c.student = ml_collections.ConfigDict(dict(init=student_init,
                                             model=_copy(student_model(config))))
  # The cold start always learns from the right specialists; the negative
  # control (teacher_shift ≠ 0) misroutes OPD and annealing only.
  c.teachers = _teachers(config, grpo_dirs,
                         0 if stage == "cold_start" else config.get("teacher_shift", 0))
  c.data = _copy(config.data)
  # The teachers are the specialists: nothing is built (a fixed group, so no
  # stage depends on another stage's optimizer settings).
  c.build_teachers = ml_collections.ConfigDict(dict(sft_steps=0, num_train=0, batch_size=1,
                                                    optim=to_group(OptimConfig)))
  c.optim = _copy(config.cold_start_optim if stage == "cold_start" else
                  config.opd_optim if stage == "opd" else config.anneal_optim)
  if stage == "cold_start":
    c.cold_start = _copy(config.cold_start)
    return c
  c.opd = _copy(config.opd)
  c.train = _copy(config.opd_train)
  if stage == "opd":
    # No annealing: an anneal_to lever reuses the OPD stage.
    c.opd.weighting.update(anneal_steps=0, anneal_to="uniform")
  else:
    steps = config.anneal.steps
    c.opd.weighting.anneal_steps = steps
    c.train.update(steps=steps, save_every=steps, eval_every=max(1, steps // 2))
  return c


def _ckpt(directory: pathlib.Path) -> str:
  return str(directory / "checkpoints")


def student_model(config) -> ml_collections.ConfigDict:
  """The student's model group: the specialists', or with ``config.student_width``
  > 0 the same model at that width D (``experiments.common.model_at_width``: F
  scaled by the same factor, heads kept, so the head dimension grows with D)."""
  return common.model_at_width(config.specialists.model, config.get("student_width", 0),
                               "config.student_width")


def student_has_own_base(config) -> bool:
  """A student of another architecture than the specialists' (e.g. wider)
  starts from its own base, pre-trained by the specialists' base recipe."""
  return student_model(config).to_dict() != config.specialists.model.to_dict()


def run_student_base(config, stages: common.Stages, base_dir: pathlib.Path) -> pathlib.Path:
  """The base the student's cold start starts from (module docstring)."""
  if not student_has_own_base(config):
    return base_dir
  spec = config.specialists
  cfg = common.stage_config(spec, "pretrain", optim=spec.base.optim, train=spec.base.train,
                            data=spec.base.data)
  cfg.model = _copy(student_model(config))
  _, d = stages.run("student base pre-training", pretrain_job.run, cfg, "student_base")
  return d


def _stages(config, workdir) -> common.Stages:
  reuse = [r.strip() for r in str(config.get("reuse_from", "") or "").split(",") if r.strip()]
  return common.Stages.of(workdir, reuse)


def run_students(config, stages: common.Stages, grpo_dirs,
                 base_dir: pathlib.Path) -> dict[int, dict[str, pathlib.Path]]:
  """Cold start → OPD → annealing for every seed; ``{seed: {stage: run dir}}``."""
  out = {}
  for seed in config.student_seeds:
    dirs, read = {}, base_dir
    for stage in STUDENT_STAGES:
      dirs[stage] = read = run_student_stage(config, stages, grpo_dirs, stage, read, seed)
    out[seed] = dirs
  return out


def run_student_stage(config, stages: common.Stages, grpo_dirs, stage: str,
                      start: pathlib.Path, seed: int) -> pathlib.Path:
  """One student stage of ``seed`` from the run directory ``start``; its run dir."""
  fn = distill_job.run_cold_start if stage == "cold_start" else distill_job.run_opd
  _, d = stages.run(f"student seed {seed}: {stage}", fn,
                    student_stage_config(config, stage, grpo_dirs, _ckpt(start), seed),
                    f"student/seed{seed}/{stage}", [start, *grpo_dirs.values()])
  return d


# Baselines that train the student's own network (from the cold start, or
# from the student's base for off-policy KD); merging works on the specialists.
STUDENT_BASELINES = ("mixed_rl", "sequential_rl", "offpolicy_kd")


def run_baselines(config, stages: common.Stages, grpo_dirs, base_dir: pathlib.Path,
                  cold_start: pathlib.Path,
                  student_base: pathlib.Path | None = None) -> dict[str, pathlib.Path]:
  """The baselines in ``config.baselines.baselines``; ``{job: run dir}``.

  With a student of its own architecture (``student_has_own_base``) the
  student-side baselines train that network: its model, its base for
  off-policy KD's start, the cold start for the RL baselines.
  """
  bl = config.baselines
  teachers = {d: _ckpt(grpo_dirs[d]) for d in config.specialists.domains}
  own = student_has_own_base(config)
  out = {}
  for job in bl.baselines:
    if job not in baselines_job.RUNS:
      raise ValueError(f"config.baselines.baselines has {job!r}: expected some of "
                       f"{tuple(baselines_job.RUNS)}")
    student_side = own and job in STUDENT_BASELINES
    base = student_base if student_side and job == "offpolicy_kd" else base_dir
    paths = {"base": _ckpt(base), "student": _ckpt(cold_start), "teachers": teachers}
    cfg = baselines_job.stage_config(bl, job, paths)
    if student_side:
      cfg.model = _copy(student_model(config))
    _, out[job] = stages.run(f"baseline {job}", baselines_job.RUNS[job], cfg, f"baselines/{job}",
                             [p for p in (base, cold_start, *grpo_dirs.values()) if p])
  return out


def _slug(name: str) -> str:
  return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_").lower()


def _evaluate_one(config):
  """A stage function: one model on every test set (``results.json``)."""

  def fn(cfg, workdir: str) -> dict:
    model_cfg = to_model_config(cfg.model)
    tok = common.tokenizer_for(model_cfg, workdir)
    mesh, rules = common.mesh_and_rules(config.specialists)
    eval_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval", domains=tuple(cfg.domains))
    params = load_params(_ckpt(pathlib.Path(cfg.model_dir)), model_cfg, mesh=mesh, rules=rules)
    result = ev.evaluate(model_cfg, params, tok, eval_cfg, rng=jax.random.key(cfg.seed + 1234),
                         name=cfg.name, mesh=mesh, rules=rules)
    ev.save_results([result], workdir)
    print(f"  {cfg.name}: " + ", ".join(
        f"{d} {result.score(d, config.report_metric).value:.0f}" for d in eval_cfg.domains),
          flush=True)
    return {f"{d}/{config.report_metric}": result.score(d, config.report_metric).value
            for d in eval_cfg.domains}

  return fn


def evaluate_models(config, stages: common.Stages, models: dict[str, pathlib.Path],
                    student_rows=()) -> list:
  """Every model on every test set, one reusable stage per model
  (``eval/<name>``); the ``EvalResult`` list in ``models``' order. Rows in
  ``student_rows`` have the student's model, the others the specialists'."""
  print(f"[v4] evaluating {len(models)} models on {len(config.specialists.domains)} test sets "
        f"({config.eval.n_per_domain} examples each, greedy + mean@{config.eval.num_samples})",
        flush=True)
  results = []
  for name, run_dir in models.items():
    cfg = ml_collections.ConfigDict(dict(
        job="v4_eval", seed=config.seed, eval=_copy(config.eval),
        domains=tuple(config.specialists.domains),
        model=_copy(student_model(config) if name in student_rows else config.specialists.model),
        model_dir=str(run_dir), name=name))
    _, d = stages.run(f"evaluation: {name}", _evaluate_one(config), cfg, f"eval/{_slug(name)}",
                      [run_dir])
    results += ev.load_results(str(d / "results.json"))
  return results


def _control_only(root: pathlib.Path, control: dict, timer) -> dict:
  """``positive_control.only``: the control's report, nothing after it."""
  out_dir = root / "v4"
  out_dir.mkdir(parents=True, exist_ok=True)
  common.write_json(out_dir / "positive_control.json", control)
  report = positive_control.render(control)
  (out_dir / "report.md").write_text(report)
  print(report, flush=True)
  return {"wall_s": timer.seconds, "report": str(out_dir / "report.md"),
          **{f"steps_to_90_{m}/{d}": -1 if s[f"steps_to_90_{m}"] is None else s[f"steps_to_90_{m}"]
             for d, s in control.items() for m in ("greedy", "sampled")}}


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  positive_control.check(config)  # before any work (the other checks: experiments.job_checks)
  root = pathlib.Path(workdir)
  stages = _stages(config, root)
  spec = specialists_job.run(config.specialists, str(root), reuse=stages.reuse)
  base_dir = pathlib.Path(spec["dirs"]["base"])
  grpo_dirs = {d: pathlib.Path(spec["dirs"][f"{d}/grpo"]) for d in config.specialists.domains}
  student_base = run_student_base(config, stages, base_dir)
  # The positive control first (it needs only the first seed's cold start,
  # which run_students then finds finished): it sizes OPD's budget.
  cold0 = run_student_stage(config, stages, grpo_dirs, "cold_start", student_base,
                            config.student_seeds[0])
  control = positive_control.run(config, stages, grpo_dirs, cold0, student_stage_config)
  if config.positive_control.get("only"):
    return _control_only(root, control, timer)
  students = run_students(config, stages, grpo_dirs, student_base)
  first = students[config.student_seeds[0]]
  base_rows = run_baselines(config, stages, grpo_dirs, base_dir, first["cold_start"],
                            student_base)
  models = {"base": base_dir}
  models.update({f"{d}-specialist": grpo_dirs[d] for d in config.specialists.domains})
  for seed, dirs in students.items():
    for stage, d in dirs.items():
      models[f"{v4_report.STUDENT_ROWS[stage]}#{seed}"] = d
  models.update({v4_report.BASELINE_ROWS.get(job, job): d for job, d in base_rows.items()})
  student_rows = {n for n in models if n.startswith("student")}
  if student_has_own_base(config):
    student_rows |= {v4_report.BASELINE_ROWS.get(j, j) for j in base_rows
                     if j in STUDENT_BASELINES}
  results = evaluate_models(config, stages, models, student_rows)
  out_dir = root / "v4"
  out_dir.mkdir(parents=True, exist_ok=True)
  ev.save_results(results, str(out_dir))
  common.write_json(out_dir / "models.json", {k: str(v) for k, v in models.items()})
  summary = v4_report.summarize(results, tuple(config.specialists.domains),
                                config.report_metric, f"mean@{config.eval.num_samples}")
  report = v4_report.render(summary, timer_s=timer.seconds) + positive_control.render(control)
  common.write_json(out_dir / "positive_control.json", control)
  (out_dir / "report.md").write_text(report)
  common.write_json(out_dir / "summary.json", summary)
  heat = v4_report.heatmap(summary, out_dir / "heatmap.png", config.report_metric)
  # Per-teacher overlap and reverse KL by position over OPD then annealing (first seed).
  diag = diagnostics_plot.plot_diagnostics(
      [first["opd"], first["anneal"]], out_dir / "diagnostics.png",
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

