"""Job ``compat``: teacher compatibility, OPD from a same-base vs an other-base teacher (docs/DESIGN.md §3).

  python -m experiments.launch --config=experiments/configs/compat.py --workdir=workdirs/compat

"Rethinking On-Policy Distillation" (arXiv 2604.13016) reports that OPD works
when student and teacher share a thinking pattern (a high initial top-k
overlap), that a teacher grown from another base with an equal score
distils worse, and that the teacher's signal is strong early in a response
and weak late. This job tests that at toy size on one domain. Stages, each a
resumable run directory (``experiments.common.run_stage``):

  base_a/, base_b/                pre-training with config.base_seeds[0] / [1]
  teacher_a/{sft,grpo}            the specialists' recipe from base A
  teacher_b/{sft,grpo}            the same recipe (same seed) from base B
  student/                        a short SFT of base A: the student of both arms
  opd_a/, opd_b/                  OPD of the student from teacher A / teacher B
  compat/                         evaluation of the five models on the domain's
                                  test set → results.json, report.md,
                                  summary.json, compat.png

``summarize`` turns the evaluation and the OPD runs' logged diagnostics
(``experiments.diagnostics_plot``) into the report's numbers.
"""
from __future__ import annotations

import math
import pathlib
from typing import Mapping

import jax
import ml_collections

from experiments import common
from experiments import diagnostics_plot
from experiments import distill as distill_job
from experiments import grpo as grpo_job
from experiments import pretrain as pretrain_job
from experiments import sft as sft_job
from opd.config.fields import from_group
from opd.eval import evaluation as ev
from opd.eval import stats as stats_lib
from opd.models import to_model_config
from opd.training.checkpoints import load_params
from opd.training.metrics_writer import read_metrics

ARMS = ("A", "B")
TEACHER = {"A": "same_base", "B": "other_base"}  # the teacher's name in each OPD run
ROWS = {"teacher_A": "teacher A (student's base)", "teacher_B": "teacher B (other base)",
        "student": "student (before OPD)", "opd_A": "student after OPD from A",
        "opd_B": "student after OPD from B"}
BUCKETS = ("first", "middle", "last")
TAIL = 3  # "final" diagnostics: the mean of the last TAIL logged points


def _ckpt(run_dir: pathlib.Path) -> str:
  return str(run_dir / "checkpoints")


def _copy(group) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(group.to_dict())


def _stage(config, job: str, seed: int, **groups) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.job, c.seed = job, seed
  c.model, c.mesh, c.sharding_rules = _copy(config.model), config.mesh, config.sharding_rules
  for name, value in groups.items():
    setattr(c, name, _copy(value) if isinstance(value, ml_collections.ConfigDict) else value)
  return c


def run_teachers(config, root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Base A/B, then SFT and GRPO from each; ``{arm: teacher run dir}``."""
  if len(config.base_seeds) != 2 or config.base_seeds[0] == config.base_seeds[1]:
    raise ValueError(f"config.base_seeds={tuple(config.base_seeds)}: expected two different seeds")
  out = {}
  for arm, seed in zip(ARMS, config.base_seeds):
    base, sft, grpo = (root / f"base_{arm.lower()}", root / f"teacher_{arm.lower()}" / "sft",
                       root / f"teacher_{arm.lower()}" / "grpo")
    common.run_stage(f"base {arm} (seed {seed})", pretrain_job.run,
                     _stage(config, "pretrain", seed, optim=config.base.optim,
                            train=config.base.train, data=config.base.data), base)
    common.run_stage(f"teacher {arm}: SFT", sft_job.run,
                     _stage(config, "sft", config.seed, init=_ckpt(base), optim=config.sft.optim,
                            train=config.sft.train, data=config.sft.data), sft, [base])
    common.run_stage(f"teacher {arm}: GRPO", grpo_job.run,
                     _stage(config, "grpo", config.seed, init=_ckpt(sft), grpo=config.grpo,
                            optim=config.grpo_optim, train=config.grpo_train,
                            data=config.grpo_data, agent_reward=config.agent_reward), grpo,
                     [sft])
    out[arm] = grpo
  return out


def student_config(config, root: pathlib.Path) -> ml_collections.ConfigDict:
  """The student's SFT of base A (its own data seed, ``seed + 1``)."""
  data = _copy(config.student_sft.data)
  data.domains = (config.domain,)
  return _stage(config, "sft", config.seed + 1, init=_ckpt(root / "base_a"),
                optim=config.student_sft.optim, train=config.student_sft.train, data=data)


def opd_config(config, root: pathlib.Path, arm: str) -> ml_collections.ConfigDict:
  """The ``experiments.distill.run_opd`` config of one arm: only the teacher differs."""
  if arm not in ARMS:
    raise ValueError(f"arm={arm!r}: expected one of {ARMS}")
  teacher = ml_collections.ConfigDict(dict(
      init=_ckpt(root / f"teacher_{arm.lower()}" / "grpo"), domain=config.domain,
      model=_copy(config.model)))
  return _stage(config, "opd", config.seed,
                student=ml_collections.ConfigDict(dict(init=_ckpt(root / "student"),
                                                       model=_copy(config.model))),
                teachers=ml_collections.ConfigDict({TEACHER[arm]: teacher}), data=config.data,
                opd=config.opd, optim=config.opd_optim, train=config.opd_train)


def _evaluate(config, models: Mapping[str, pathlib.Path]):
  """A stage function: every model on the domain's test set, saved as results.json."""

  def fn(cfg, workdir: str) -> dict:
    model_cfg = to_model_config(config.model)
    tok = common.tokenizer_for(model_cfg, workdir)
    mesh, rules = common.mesh_and_rules(config)
    eval_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval", domains=(config.domain,))
    key = jax.random.key(config.seed + 1234)
    results = []
    for name, run_dir in models.items():
      params = load_params(_ckpt(run_dir), model_cfg, mesh=mesh, rules=rules)
      results.append(ev.evaluate(model_cfg, params, tok, eval_cfg, rng=key, name=name,
                                 mesh=mesh, rules=rules))
      print(f"  {name}: {config.report_metric} "
            f"{results[-1].score(config.domain, config.report_metric).value:.1f}", flush=True)
    ev.save_results(results, workdir)
    return {"models": len(results)}

  return fn


def _cell(estimate) -> tuple[float, float]:
  return float(estimate.value), float(estimate.se)


def _diff(a, b) -> tuple[float, float]:
  """``a − b`` of two ``(value, se)``, the SEs in quadrature."""
  return a[0] - b[0], math.hypot(a[1], b[1])


def paired_diff(a, b, domain: str, metric: str, num_resamples: int,
                seed: int) -> tuple[float, float]:
  """``a − b`` of two models' ``metric`` on the same test examples, with the
  bootstrap SE of the per-example differences (``opd.eval.stats.paired_difference``),
  on the 0-100 scale. ``metric``: ``reward@1`` (greedy) or ``mean@N`` (sampled)."""
  if a.domains[domain].example_ids != b.domains[domain].example_ids:
    raise ValueError(f"paired_diff: {a.name!r} and {b.name!r} were evaluated on different "
                     f"{domain} examples")
  x, y = example_rewards(a, domain, metric), example_rewards(b, domain, metric)
  value, se = stats_lib.paired_difference(x, y, num_resamples, seed)
  return 100.0 * value, 100.0 * se


def example_rewards(result, domain: str, metric: str):
  """One model's per-example rewards of ``metric`` on ``domain``: greedy ``[n]``
  (``reward@1``) or sampled ``[n, N]`` (``mean@N``)."""
  d = result.domains[domain]
  if metric == "reward@1":
    x = d.greedy_rewards
  elif metric.startswith("mean@"):
    x = d.sampled_rewards
  else:
    raise ValueError(f"paired_diff: metric={metric!r}, expected 'reward@1' or 'mean@N'")
  if x is None:
    raise ValueError(f"paired_diff: {metric} has no per-example rewards in {result.name!r}")
  return x


def _heldout_rkl(run_dir: pathlib.Path, teacher: str) -> dict[str, float]:
  """The held-out reverse KL at step 0 (before OPD) and at the last step, from
  ``metrics.jsonl`` (an OPD stage that was resumed keeps its step-0 row there)."""
  key = f"eval/rkl/{teacher}"
  pts = sorted((r["step"], r[key]) for r in read_metrics(run_dir) if key in r)
  first = pts[0][1] if pts and pts[0][0] == 0 else float("nan")
  return {"initial": first, "final": pts[-1][1] if pts else float("nan")}


def summarize(scores: Mapping[str, Mapping[str, tuple[float, float]]],
              series: Mapping[str, diagnostics_plot.Series],
              heldout: Mapping[str, Mapping[str, float]], metrics: tuple[str, str],
              after_gap: Mapping[str, tuple[float, float]] | None = None) -> dict:
  """The report's numbers.

  Args:
    scores: ``{row key of ROWS: {metric: (value, se)}}`` on the 0-100 scale.
    series: ``{arm: diagnostics series of that arm's OPD run}`` (one teacher).
    heldout: ``{arm: {"initial", "final"}}`` held-out reverse KL of the OPD run.
    metrics: the greedy and the sampled metric names.
    after_gap: ``{metric: (value, se)}`` of student-after-A − student-after-B,
      paired over test examples (``paired_diff``); kept as ``after_gap``.

  Returns:
    A JSON-ready dict: each teacher's scores and their gap (A − B); per arm
    the initial top-8 / top-1 overlap and reverse KL (the first logged
    diagnostics: the untrained student on its first rollout batch), the
    held-out reverse KL before and after, the score before and after OPD and
    the gain, and the reverse KL per position bucket, first point and mean of
    the last ``TAIL``, with the change in %.
  """
  out = {"metrics": list(metrics), "teachers": {}, "teacher_gap": {}, "arms": {},
         "after_gap": {m: tuple(v) for m, v in (after_gap or {}).items()}}
  for m in metrics:
    out["teacher_gap"][m] = _diff(scores["teacher_A"][m], scores["teacher_B"][m])
  for arm in ARMS:
    out["teachers"][arm] = {m: tuple(scores[f"teacher_{arm}"][m]) for m in metrics}
    if len(series[arm]) != 1:
      raise ValueError(f"series[{arm!r}] has teachers {sorted(series[arm])}: expected one")
    ends = diagnostics_plot.endpoints(series[arm], tail=TAIL)
    (diag,) = ends.values()
    position = {}
    for b in BUCKETS:
      e = diag[f"rkl_{b}"]
      position[b] = {"initial": e["first"], "final": e["last"],
                     "change_pct": 100.0 * (e["last"] / e["first"] - 1.0) if e["first"] > 0
                     else float("nan")}
    out["arms"][arm] = {
        "overlap@8_initial": diag["overlap@8"]["first"],
        "overlap@8_final": diag["overlap@8"]["last"],
        "overlap@1_initial": diag["overlap@1"]["first"],
        "rkl_initial": diag["rkl"]["first"],
        "heldout_rkl": dict(heldout[arm]),
        "before": {m: tuple(scores["student"][m]) for m in metrics},
        "after": {m: tuple(scores[f"opd_{arm}"][m]) for m in metrics},
        "gain": {m: _diff(scores[f"opd_{arm}"][m], scores["student"][m]) for m in metrics},
        "rkl_by_position": position,
        "diag_points": diag["overlap@8"]["n"]}
  return out


def _pm(cell) -> str:
  return f"{cell[0]:.1f} ± {cell[1]:.1f}"


def render(summary: Mapping, domain: str, timer_s: float | None = None) -> str:
  """The markdown report."""
  greedy, sampled = summary["metrics"]
  arms = summary["arms"]
  lines = [f"## Teacher compatibility on {domain} (0–100 scores, held-out test set)", "",
           f"| arm | teacher {greedy} | teacher {sampled} | initial top-8 overlap | "
           f"initial top-1 overlap | initial reverse KL | held-out reverse KL before → after | "
           f"student {greedy} before → after | OPD gain {greedy} | OPD gain {sampled} |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for arm in ARMS:
    a, t = arms[arm], summary["teachers"][arm]
    lines.append(
        f"| {arm}: {'same base' if arm == 'A' else 'other base'} | {_pm(t[greedy])} | "
        f"{_pm(t[sampled])} | {a['overlap@8_initial']:.3f} | {a['overlap@1_initial']:.3f} | "
        f"{a['rkl_initial']:.3f} | {a['heldout_rkl']['initial']:.3f} → "
        f"{a['heldout_rkl']['final']:.3f} | {a['before'][greedy][0]:.1f} → "
        f"{a['after'][greedy][0]:.1f} | {_pm(a['gain'][greedy])} | {_pm(a['gain'][sampled])} |")
  gap = summary["teacher_gap"]
  lines += ["", f"Teacher A − teacher B: {greedy} {_pm(gap[greedy])}, {sampled} "
            f"{_pm(gap[sampled])}."]
  if summary.get("after_gap"):
    ag = summary["after_gap"]
    lines.append("Student after OPD from A − after OPD from B (paired over test examples): "
                 + ", ".join(f"{m} {_pm(ag[m])}" for m in (greedy, sampled) if m in ag) + ".")
  lines += ["",
            f"## Reverse KL by trajectory position (first logged point → mean of the last {TAIL})",
            "", "| arm | first 25% | middle 50% | last 25% |", "|---|---|---|---|"]
  for arm in ARMS:
    pos = arms[arm]["rkl_by_position"]
    lines.append(f"| {arm} | " + " | ".join(
        f"{pos[b]['initial']:.3f} → {pos[b]['final']:.3f} ({pos[b]['change_pct']:+.0f}%)"
        for b in BUCKETS) + " |")
  lines += ["", "± is one bootstrap standard error over test examples; gains and gaps add the "
            "two SEs in quadrature (conservative: the test examples are shared). Overlap and "
            "the per-position reverse KL are measured on sampled response tokens of the OPD "
            "rollouts (training prompts), the held-out reverse KL on test prompts."]
  if timer_s is not None:
    lines.append(f"Wall time of this invocation: {timer_s / 60:.1f} min.")
  return "\n".join(lines) + "\n"


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  root = pathlib.Path(workdir)
  teachers = run_teachers(config, root)
  common.run_stage("student: short SFT of base A", sft_job.run, student_config(config, root),
                   root / "student", [root / "base_a"])
  for arm in ARMS:
    common.run_stage(f"OPD from teacher {arm}", distill_job.run_opd, opd_config(config, root, arm),
                     root / f"opd_{arm.lower()}", [root / "student", teachers[arm]])
  models = {ROWS["teacher_A"]: teachers["A"], ROWS["teacher_B"]: teachers["B"],
            ROWS["student"]: root / "student", ROWS["opd_A"]: root / "opd_a",
            ROWS["opd_B"]: root / "opd_b"}
  out_dir = root / "compat"
  # The whole job config is part of the stage's: a changed upstream stage (say
  # more OPD steps) must not reuse an evaluation of the old checkpoints.
  eval_stage = ml_collections.ConfigDict(dict(job="compat_eval", eval=_copy(config.eval),
                                              models=[str(v) for v in models.values()],
                                              pipeline=_copy(config)))
  common.run_stage("compat evaluation", _evaluate(config, models), eval_stage, out_dir,
                   list(models.values()))
  results = {r.name: r for r in ev.load_results(str(out_dir / "results.json"))}
  metrics = (config.report_metric, f"mean@{config.eval.num_samples}")
  scores = {key: {m: _cell(results[row].score(config.domain, m)) for m in metrics}
            for key, row in ROWS.items()}
  series = {arm: diagnostics_plot.read_diagnostics(root / f"opd_{arm.lower()}") for arm in ARMS}
  heldout = {arm: _heldout_rkl(root / f"opd_{arm.lower()}", TEACHER[arm]) for arm in ARMS}
  after_gap = {m: paired_diff(results[ROWS["opd_A"]], results[ROWS["opd_B"]], config.domain, m,
                             config.eval.bootstrap_samples, config.seed) for m in metrics}
  summary = summarize(scores, series, heldout, metrics, after_gap)
  report = render(summary, config.domain, timer_s=timer.seconds)
  (out_dir / "report.md").write_text(report)
  common.write_json(out_dir / "summary.json", summary)
  plot = diagnostics_plot.save_figure(
      diagnostics_plot.relabel({f"{arm} ({'same' if arm == 'A' else 'other'} base)": series[arm]
                                for arm in ARMS}),
      out_dir / "compat.png", f"OPD on {config.domain}: student vs teacher A / teacher B")
  print(report, flush=True)
  print(f"[compat] report: {out_dir / 'report.md'}\n[compat] plot: {plot}", flush=True)
  flat = {"wall_s": timer.seconds, "report": str(out_dir / "report.md"), "plot": plot}
  for m in metrics:
    flat[f"teacher_gap/{m}"] = summary["teacher_gap"][m][0]
    flat[f"after_gap/{m}"] = summary["after_gap"][m][0]
  for arm, a in summary["arms"].items():
    flat[f"{arm}/overlap@8_initial"] = a["overlap@8_initial"]
    flat.update({f"{arm}/gain/{m}": a["gain"][m][0] for m in metrics})
    flat.update({f"{arm}/rkl_{b}_initial": a["rkl_by_position"][b]["initial"] for b in BUCKETS})
  return flat
