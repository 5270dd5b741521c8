"""The positive control of the V4 pipeline: single-teacher OPD per domain.

Before five teachers are distilled at once, each one alone must be
distillable: from the cold-start student, OPD towards one specialist on its
own domain's prompts, checkpointed every ``eval_every`` steps; every
checkpoint and the teacher are scored on the same test examples of that
domain (greedy ``reward@1`` and sampled ``mean@N``). The stage reports, per
domain, the student's score over the teacher's with a paired SE
(``opd.eval.claims.retention``) at every checkpoint and the step at which the
student first reaches 90% of the teacher (``claims.steps_to_fraction``). The
largest of those steps sets the V4 run's OPD budget (docs/RESULTS.md, "A
stronger toy world").

Stages (``experiments.common.Stages``, resumable, reused by config):

  WORKDIR/positive_control/<domain>/opd    OPD, one teacher, one domain
  WORKDIR/positive_control/<domain>/eval   every checkpoint and the teacher

``config.positive_control``: ``steps`` (0: no control), ``eval_every``,
``domains`` (empty: every specialist's), ``prompts_per_step`` (0: the OPD
stage's).
"""
from __future__ import annotations

import math
import pathlib

import jax
import ml_collections

from experiments import common
from experiments import distill as distill_job
from opd.config.fields import from_group
from opd.eval import claims
from opd.eval import evaluation as ev
from opd.models import to_model_config
from opd.training.checkpoints import CheckpointManager, load_params

FRACTION = 0.9


def _copy(group) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(group.to_dict())


def stage_config(config, domain: str, teacher_dir: pathlib.Path, cold_start: pathlib.Path,
                 stage_config_fn) -> ml_collections.ConfigDict:
  """The OPD stage config of ``domain``'s control: the V4 student's OPD stage
  (``stage_config_fn``, ``experiments.v4.student_stage_config``) with one
  teacher, ``positive_control.steps`` steps and a checkpoint every
  ``eval_every`` (all kept), the cosine schedule stretched to the length."""
  pc = config.positive_control
  c = stage_config_fn(config, "opd", {domain: teacher_dir}, str(cold_start / "checkpoints"),
                      config.student_seeds[0])
  c.train.update(steps=pc.steps, save_every=pc.eval_every, eval_every=pc.eval_every,
                 keep_checkpoints=pc.steps // pc.eval_every + 1)
  # One domain: no balancing; its own batch size when set (0: the OPD stage's).
  c.opd.rollout.domain_balance = False
  if pc.get("prompts_per_step"):
    c.opd.rollout.prompts_per_step = pc.prompts_per_step
  if c.optim.schedule != "constant":
    c.optim.decay_steps = max(1, pc.steps - c.optim.warmup_steps)
  return c


def check(config) -> None:
  """``config.positive_control`` fields (job start)."""
  pc = config.get("positive_control")
  if pc is None:
    return
  for name in ("steps", "eval_every"):
    value = pc.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ValueError(f"config.positive_control.{name}={value!r}: expected an int >= 0")
  unknown = set(pc.get("domains") or ()) - set(config.specialists.domains)
  if unknown:
    raise ValueError(f"config.positive_control.domains names {sorted(unknown)}, not among the "
                     f"specialists' domains {tuple(config.specialists.domains)}")
  if pc.get("only") and not pc.steps:
    raise ValueError("config.positive_control.only=True stops after the control, but "
                     "config.positive_control.steps=0 runs none")
  if pc.steps and (pc.eval_every < 1 or pc.steps % pc.eval_every):
    raise ValueError(f"config.positive_control.eval_every={pc.eval_every}: must be >= 1 and "
                     f"divide steps={pc.steps}")


def _evaluate(cfg, workdir: str) -> dict:
  """Stage function: the teacher and every checkpoint of the OPD run on
  ``cfg.domain``'s test set, the same examples for all (``results.json``)."""
  model_cfg = to_model_config(cfg.model)
  tok = common.tokenizer_for(model_cfg, workdir)
  mesh, rules = common.mesh_and_rules(cfg)
  eval_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval", domains=(cfg.domain,))
  key = jax.random.key(cfg.seed + 1234)
  ckpt = pathlib.Path(cfg.run_dir) / "checkpoints"
  steps = sorted(CheckpointManager(ckpt).all_steps())
  models = [("teacher", pathlib.Path(cfg.teacher), None)]
  models += [("cold_start", pathlib.Path(cfg.cold_start), None)]
  models += [(f"step{s}", ckpt, s) for s in steps]
  results = []
  for name, directory, step in models:
    params = load_params(directory, model_cfg, step=step, mesh=mesh, rules=rules)
    results.append(ev.evaluate(model_cfg, params, tok, eval_cfg, rng=key, name=name,
                               mesh=mesh, rules=rules))
  ev.save_results(results, workdir)
  return summarize(results, cfg.domain, [0] + steps, cfg.sampled)


def summarize(results, domain: str, steps, sampled: str) -> dict:
  """Retention (student / teacher, paired SE) at each step and steps to 90%.

  ``results``: the teacher, the cold start (step 0), then one per step in
  ``steps[1:]``, all on ``domain``'s same examples.
  """
  teacher, students = results[0], results[1:]
  out: dict = {"domain": domain, "steps": list(steps)}
  for mode, metric in (("greedy", "reward@1"), ("sampled", sampled)):
    t = teacher.score(domain, metric).value
    curve = [r.score(domain, metric).value for r in students]
    out[f"teacher_{mode}"], out[f"student_{mode}"] = t, curve
    ratios = []
    for r in students:
      try:
        ratios.append(claims.retention(r.domains[domain], teacher.domains[domain], mode))
      except ValueError:  # a teacher score of 0
        ratios.append((math.nan, math.nan))
    out[f"retention_{mode}"] = [q for q, _ in ratios]
    out[f"retention_{mode}_se"] = [se for _, se in ratios]
    reached = claims.steps_to_fraction(steps, curve, t, FRACTION) if t > 0 else None
    out[f"steps_to_90_{mode}"] = reached
  return out


def run(config, stages: common.Stages, grpo_dirs, cold_start: pathlib.Path,
        stage_config_fn) -> dict[str, dict]:
  """Every domain's control (module docstring); ``{domain: summary}``."""
  pc = config.get("positive_control")
  if pc is None or not pc.steps:
    return {}
  out = {}
  for d in tuple(pc.get("domains") or ()) or tuple(config.specialists.domains):
    teacher = pathlib.Path(grpo_dirs[d])
    _, opd_dir = stages.run(f"positive control {d}: OPD", distill_job.run_opd,
                            stage_config(config, d, teacher, cold_start, stage_config_fn),
                            f"positive_control/{d}/opd", [cold_start, teacher])
    cfg = ml_collections.ConfigDict(dict(
        job="v4_positive_control_eval", seed=config.seed, domain=d,
        mesh=config.specialists.mesh, sharding_rules=config.specialists.sharding_rules,
        eval=_copy(config.eval), model=_copy(config.specialists.model),
        sampled=f"mean@{config.eval.num_samples}", run_dir=str(opd_dir),
        teacher=str(teacher / "checkpoints"), cold_start=str(cold_start / "checkpoints")))
    out[d], _ = stages.run(f"positive control {d}: evaluation", _evaluate, cfg,
                           f"positive_control/{d}/eval", [opd_dir, teacher, cold_start])
  return out


def render(summaries: dict[str, dict]) -> str:
  """The markdown table of every domain's control."""
  if not summaries:
    return ""
  lines = ["## Positive control: one teacher, its own domain (OPD from the cold start)", "",
           "| domain | teacher reward@1 | teacher mean@N | student reward@1 by step | "
           "student mean@N by step | final retention greedy | final retention sampled | "
           "steps to 90% (greedy / sampled) |", "|---|---|---|---|---|---|---|---|"]
  for d, s in summaries.items():
    def curve(key):
      return ", ".join(f"{step}: {v:.1f}" for step, v in zip(s["steps"], s[key]))

    def last(mode):
      return f"{s[f'retention_{mode}'][-1]:.2f} ± {s[f'retention_{mode}_se'][-1]:.2f}"

    reach = " / ".join("not reached" if s[f"steps_to_90_{m}"] is None
                       else f"{s[f'steps_to_90_{m}']:.0f}" for m in ("greedy", "sampled"))
    lines.append(f"| {d} | {s['teacher_greedy']:.1f} | {s['teacher_sampled']:.1f} | "
                 f"{curve('student_greedy')} | {curve('student_sampled')} | {last('greedy')} | "
                 f"{last('sampled')} | {reach} |")
  lines += ["", "Retention: the student's score over the teacher's on the same test examples, "
            "± one paired (delta-method) SE. Step 0 is the cold start.", ""]
  return "\n".join(lines)
