"""Job ``opd_forms``: issue #32's experiments on the strong toy world.

  python -m experiments.launch --config=experiments/configs/opd_forms.py \\
      --workdir=workdirs/opd_forms --config.reuse_from=workdirs/v4_strong,workdirs/strong

Single-teacher OPD from the V4 student's first cold start towards one
specialist on its own domain, the setting of the positive control
(``experiments.positive_control``: its OPD stage config, its length and
checkpoints), in the arms of ``experiments/configs/opd_forms.py``: the exact
reverse KL, the advantage form, the advantage form plus α times GRPO's
outcome advantage, and the advantage form towards a specialist of the same
recipe trained with another tokenizer. Every arm gets the same updates and
samples the same number of prompts × samples per step.

Stages (``experiments.common.Stages``; the world's finished stages are
read from ``--config.reuse_from``):

  the world's specialists, cold start and their evaluations   (as ``experiments.v4``)
  WORKDIR/cross_tokenizer/...                  the other tokenizer's specialist (specialists job)
  WORKDIR/opd_forms/<d>/cross_teacher_eval     that specialist on <d>'s test set
  WORKDIR/opd_forms/<d>/alpha_sweep/alpha<α>   the α sweep (OPD only; chosen by train reward)
  WORKDIR/positive_control/<d>/opd             the exact arm's first seed (the control itself)
  WORKDIR/opd_forms/<d>/<arm>/seed<s>/opd      every other arm and seed
  WORKDIR/opd_forms/<d>/<arm>/seed<s>/eval     every checkpoint on <d>, the last on the others

The report (``WORKDIR/opd_forms/report.md``, ``summary.json``): per arm the
own-domain curve (greedy ``reward@1`` and ``mean@N``, mean over seeds), the
last step's score over the teacher's, the steps to 90% of the teacher, the
other domains against the cold start, the OPD wall time, and paired
differences over test examples between arms (per-example scores averaged
over the seeds both arms ran; bootstrap SE, ``opd.eval.stats``).
"""
from __future__ import annotations

import math
import pathlib

import jax
import ml_collections
import numpy as np

from experiments import common
from experiments import distill as distill_job
from experiments import positive_control
from experiments import specialists as specialists_job
from experiments import v4
from experiments import v4_report
from opd.config.fields import from_group
from opd.eval import claims
from opd.eval import evaluation as ev
from opd.eval import stats
from opd.models import to_model_config
from opd.training.checkpoints import CheckpointManager, load_params
from opd.training.metrics_writer import read_metrics

COLD = f"{v4_report.STUDENT_ROWS['cold_start']}#0"
ADVANTAGE_ARMS = ("advantage", "advantage_outcome", "advantage_g1", "cross_tokenizer",
                  "cross_tokenizer_g1")
CROSS_ARMS = ("cross_tokenizer", "cross_tokenizer_g1")
GAMMA1_ARMS = ("advantage_g1", "cross_tokenizer_g1")  # γ = 1 instead of config.advantage's
# (arm, baseline arm) paired on the own domain at the last step.
COMPARISONS = (("advantage", "exact"), ("advantage_outcome", "exact"),
               ("advantage_outcome", "advantage"), ("advantage_g1", "exact"),
               ("advantage_g1", "advantage"), ("cross_tokenizer", "advantage"),
               ("cross_tokenizer_g1", "advantage_g1"), ("cross_tokenizer_g1", "cross_tokenizer"),
               ("cross_tokenizer", "cold_start"), ("cross_tokenizer_g1", "cold_start"),
               ("exact", "cold_start"), ("advantage", "cold_start"),
               ("advantage_g1", "cold_start"))
# Differences of two comparisons, paired over examples: the cross-tokenizer
# deficit at γ = 1 (where a span's credit placement does not matter) minus
# the deficit at γ = 0.
INTERACTIONS = ((("cross_tokenizer_g1", "advantage_g1"), ("cross_tokenizer", "advantage")),)


def _copy(group) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(group.to_dict())


def cross_specialists_config(config) -> ml_collections.ConfigDict:
  """The world's specialists recipe with ``config.cross``'s tokenizer, for
  ``config.domains`` only, on a shared SFT of every world domain."""
  c = _copy(config.world.specialists)
  c.model.update(tokenizer=config.cross.tokenizer, vocab_size=config.cross.vocab_size)
  c.domains = tuple(config.domains)
  c.shared_sft.domains = tuple(config.world.specialists.domains)
  c.reuse_from = ""
  return c


def arm_stage_config(config, arm: str, domain: str, seed: int, teacher_dir: pathlib.Path,
                     cold_start: pathlib.Path, *, alpha: float = 0.0,
                     teacher_model=None, steps: int = 0) -> ml_collections.ConfigDict:
  """The OPD stage config of one arm and seed: the positive control's
  (``positive_control.stage_config``) with the arm's loss form, the OPD seed
  ``seed``, and for ``cross_tokenizer`` the teacher's own model group.
  ``GAMMA1_ARMS`` take γ = 1. ``steps`` > 0: that many steps, one checkpoint
  at the end (the α sweep)."""
  if arm not in ("exact", *ADVANTAGE_ARMS):
    raise ValueError(f"arm={arm!r}: expected one of {('exact', *ADVANTAGE_ARMS)}")
  world = config.world
  if steps:
    world = _copy(world)
    world.positive_control.update(steps=steps, eval_every=steps)
  c = positive_control.stage_config(world, domain, teacher_dir, cold_start,
                                    v4.student_stage_config)
  c.seed = seed
  if arm in ADVANTAGE_ARMS:
    c.opd.loss.update(form="advantage", **config.advantage.to_dict())
    c.opd.loss.adv_alpha = alpha if arm == "advantage_outcome" else 0.0
    if arm in GAMMA1_ARMS:
      c.opd.loss.adv_gamma = 1.0
  if arm in CROSS_ARMS:
    if teacher_model is None:
      raise ValueError(f"arm {arm!r} needs teacher_model (the other tokenizer's model)")
    c.teachers[domain].model = _copy(teacher_model)
  return c


def choose_alpha(rewards: dict[float, list[float]], last: int) -> float:
  """The α whose run has the highest mean train reward over its last ``last``
  steps (``rewards``: α -> the run's ``reward/mean`` by step; ties: smaller α)."""
  if not rewards:
    raise ValueError("choose_alpha: no sweep run")
  means = {}
  for a, r in rewards.items():
    if len(r) < last or last < 1:
      raise ValueError(f"choose_alpha: α={a} logged {len(r)} rewards, fewer than last={last}")
    means[a] = float(np.mean(r[-last:]))
  return min(means, key=lambda a: (-means[a], a))


def _evaluate(cfg, workdir: str) -> dict:
  """Stage function: ``cfg.models`` (name, checkpoint dir, step or -1 for the
  latest) on ``cfg.domain``, and the last of them on ``cfg.others`` too."""
  model_cfg = to_model_config(cfg.model)
  tok = common.tokenizer_for(model_cfg, workdir)
  mesh, rules = common.mesh_and_rules(cfg)
  key = jax.random.key(cfg.seed + 1234)
  results, models = [], [tuple(m) for m in cfg.models]
  for i, (name, directory, step) in enumerate(models):
    domains = (cfg.domain,) + (tuple(cfg.others) if i == len(models) - 1 else ())
    eval_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval", domains=domains)
    params = load_params(directory, model_cfg, step=None if step < 0 else step, mesh=mesh,
                         rules=rules)
    results.append(ev.evaluate(model_cfg, params, tok, eval_cfg, rng=key, name=name, mesh=mesh,
                               rules=rules))
  ev.save_results(results, workdir)
  return {f"{r.name}/{cfg.domain}/reward@1": r.score(cfg.domain, "reward@1").value
          for r in results}


def _eval_stage(config, stages, name: str, rel: str, model, models, domain: str, others,
                inputs) -> list:
  world = config.world
  cfg = ml_collections.ConfigDict(dict(
      job="opd_forms_eval", seed=config.seed, domain=domain, others=tuple(others),
      mesh=world.specialists.mesh, sharding_rules=world.specialists.sharding_rules,
      eval=_copy(world.eval), model=_copy(model), models=[list(m) for m in models]))
  _, d = stages.run(name, _evaluate, cfg, rel, inputs)
  return ev.load_results(str(d / "results.json"))


def _sweep(config, stages, domain, teacher, cold) -> tuple[float, dict]:
  sw = config.alpha_sweep
  rewards = {}
  for a in sw.alphas:
    cfg = arm_stage_config(config, "advantage_outcome", domain, sw.seed, teacher, cold,
                           alpha=float(a), steps=sw.steps)
    _, d = stages.run(f"α sweep {domain}: α={a}", distill_job.run_opd, cfg,
                      f"opd_forms/{domain}/alpha_sweep/alpha{a}", [cold, teacher])
    rewards[float(a)] = [r["reward/mean"] for r in sorted(read_metrics(d), key=lambda r: r["step"])
                         if "reward/mean" in r]
  return choose_alpha(rewards, sw.last), {str(a): float(np.mean(r[-sw.last:]))
                                           for a, r in rewards.items()}


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  world = config.world
  positive_control.check(world)
  unknown = set(config.arms) - {"exact", *ADVANTAGE_ARMS}
  if unknown or not config.arms:
    raise ValueError(f"config.arms={tuple(config.arms)}: expected some of "
                     f"{('exact', *ADVANTAGE_ARMS)}")
  root = pathlib.Path(workdir)
  reuse = [r.strip() for r in str(config.get("reuse_from", "") or "").split(",") if r.strip()]
  stages = common.Stages.of(root, reuse)
  spec = specialists_job.run(world.specialists, str(root), reuse=stages.reuse)
  base_dir = pathlib.Path(spec["dirs"]["base"])
  grpo_dirs = {d: pathlib.Path(spec["dirs"][f"{d}/grpo"]) for d in world.specialists.domains}
  seed0 = world.student_seeds[0]
  cold = v4.run_student_stage(world, stages, grpo_dirs, "cold_start",
                              v4.run_student_base(world, stages, base_dir), seed0)
  refs = v4.evaluate_models(world, stages, {COLD: cold, **{f"{d}-specialist": grpo_dirs[d]
                                                          for d in config.domains}}, {COLD})
  ref = {r.name: r for r in refs}
  xcfg = (cross_specialists_config(config) if set(CROSS_ARMS) & set(config.arms) else None)
  xreuse = [r / "cross_tokenizer" for r in stages.reuse if (r / "cross_tokenizer").is_dir()]
  xdirs = (specialists_job.run(xcfg, str(root / "cross_tokenizer"), reuse=xreuse)["dirs"]
           if xcfg is not None else {})
  all_domains = tuple(world.specialists.domains)
  summary = {"domains": {}, "alpha": None, "alpha_sweep": {}}
  for d in config.domains:
    teacher, others = grpo_dirs[d], [o for o in all_domains if o != d]
    runs: dict[str, dict[int, list]] = {}
    walls: dict[str, dict[int, float]] = {}
    xteacher = None
    if xcfg is not None:
      xteacher = pathlib.Path(xdirs[f"{d}/grpo"])
      ref[f"cross-{d}-specialist"] = _eval_stage(
          config, stages, f"{d}: cross-tokenizer teacher evaluation",
          f"opd_forms/{d}/cross_teacher_eval", xcfg.model,
          [("cross-teacher", str(xteacher / "checkpoints"), -1)], d, (), [xteacher])[0]
    for arm in config.arms:
      alpha = 0.0
      if arm == "advantage_outcome":
        if summary["alpha"] is None:
          summary["alpha"], summary["alpha_sweep"] = _sweep(config, stages, config.domains[0],
                                                            grpo_dirs[config.domains[0]], cold)
        alpha = summary["alpha"]
      seeds = config.cross.seeds if arm in CROSS_ARMS else config.seeds
      t_dir = xteacher if arm in CROSS_ARMS else teacher
      model = world.specialists.model
      for s in seeds:
        cfg = arm_stage_config(config, arm, d, s, t_dir, cold, alpha=alpha,
                               teacher_model=xcfg.model if xcfg is not None else None)
        control = arm == "exact" and s == seed0  # the positive control's own stage
        rel = f"positive_control/{d}/opd" if control else f"opd_forms/{d}/{arm}/seed{s}/opd"
        metrics, opd_dir = stages.run(f"{d} {arm} seed {s}: OPD", distill_job.run_opd, cfg, rel,
                                      [cold, t_dir])
        steps = sorted(CheckpointManager(opd_dir / "checkpoints").all_steps())
        ckpt = str(opd_dir / "checkpoints")
        runs.setdefault(arm, {})[s] = _eval_stage(
            config, stages, f"{d} {arm} seed {s}: evaluation",
            f"opd_forms/{d}/{arm}/seed{s}/eval", model,
            [(f"step{k}", ckpt, k) for k in steps], d, others, [opd_dir])
        walls.setdefault(arm, {})[s] = float(metrics.get("wall_s", math.nan))
    summary["domains"][d] = summarize(
        runs, walls, ref[COLD], ref[f"{d}-specialist"], ref.get(f"cross-{d}-specialist"), d,
        others, f"mean@{world.eval.num_samples}", world.eval.bootstrap_samples)
  out_dir = root / "opd_forms"
  out_dir.mkdir(parents=True, exist_ok=True)
  report = render(summary)
  (out_dir / "report.md").write_text(report)
  common.write_json(out_dir / "summary.json", summary)
  print(report, flush=True)
  flat = {"wall_s": timer.seconds, "report": str(out_dir / "report.md")}
  if summary["alpha"] is not None:
    flat["alpha"] = summary["alpha"]
  for d, s in summary["domains"].items():
    for arm, a in s["arms"].items():
      flat[f"{d}/{arm}/greedy_final"] = a["greedy"][-1]
  return flat


def _per_example(result, domain: str, mode: str) -> np.ndarray:
  """[n] per-example score in [0, 1]: greedy reward, or the mean of the N samples."""
  dr = result.domains[domain]
  x = dr.greedy_rewards if mode == "greedy" else dr.sampled_rewards
  if x is None:
    raise ValueError(f"{result.name!r} on {domain}: no per-example {mode} rewards")
  x = np.asarray(x, float)
  return x if x.ndim == 1 else x.mean(axis=1)


def _seed_mean(results, domain: str, mode: str) -> np.ndarray:
  """The per-example scores of several seeds' results, averaged over seeds."""
  ids = {tuple(r.domains[domain].example_ids) for r in results}
  if len(ids) != 1:
    raise ValueError(f"{domain}: the seeds were scored on different test examples")
  return np.mean([_per_example(r, domain, mode) for r in results], axis=0)


def _paired(x: np.ndarray, y: np.ndarray, num_resamples: int) -> dict:
  value, se = stats.paired_difference(x, y, num_resamples, 0)
  # Smallest effect the run detects with 80% power at a two-sided 5% level: 2.8 SE.
  return {"diff": 100 * value, "se": 100 * se, "ci95": 196 * se, "mde": 280 * se}


def summarize(runs, walls, cold, teacher, cross_teacher, domain: str, others, sampled: str,
              num_resamples: int) -> dict:
  """The report's numbers for one domain (module docstring).

  Args:
    runs: ``{arm: {seed: [EvalResult per checkpoint, in step order]}}``; the
      last result of each also holds ``others``.
    walls: ``{arm: {seed: OPD wall seconds}}``.
    cold, teacher: the cold start and the teacher (every domain / ``domain``).
    cross_teacher: the cross-tokenizer teacher on ``domain``, or None.
    sampled: the sampled metric's name (``mean@N``).
  """
  metric = {"greedy": "reward@1", "sampled": sampled}
  out = {"teacher": {m: teacher.score(domain, k).value for m, k in metric.items()},
         "cold_start": {m: cold.score(domain, k).value for m, k in metric.items()},
         "arms": {}, "comparisons": {}}
  if cross_teacher is not None:
    out["cross_teacher"] = {m: cross_teacher.score(domain, k).value for m, k in metric.items()}
  finals = {}
  for arm, by_seed in runs.items():
    seeds = sorted(by_seed)
    first = by_seed[seeds[0]]
    steps = [0] + [int(r.name.removeprefix("step")) for r in first]
    a = {"seeds": seeds, "steps": steps,
         "wall_s": [walls.get(arm, {}).get(s, math.nan) for s in seeds]}
    for mode, key in metric.items():
      curves = np.array([[cold.score(domain, key).value] +
                         [r.score(domain, key).value for r in by_seed[s]] for s in seeds])
      mean = curves.mean(axis=0)
      t = out["teacher"][mode]
      a[mode] = mean.tolist()
      a[f"{mode}_seed_sd"] = float(curves[:, -1].std(ddof=1)) if len(seeds) > 1 else math.nan
      a[f"{mode}_retention"] = float(mean[-1] / t) if t > 0 else math.nan
      a[f"{mode}_steps_to_90"] = (claims.steps_to_fraction(steps, mean.tolist(), t, 0.9)
                                  if t > 0 else None)
      a[f"{mode}_steps_to_90_by_seed"] = [
          claims.steps_to_fraction(steps, c.tolist(), t, 0.9) if t > 0 else None for c in curves]
    a["others"] = {}
    for o in others:
      last = [by_seed[s][-1] for s in seeds]
      a["others"][o] = {"score": float(np.mean([r.score(o, "reward@1").value for r in last])),
                        "cold_start": cold.score(o, "reward@1").value,
                        **_paired(_seed_mean(last, o, "greedy"), _per_example(cold, o, "greedy"),
                                  num_resamples)}
    out["arms"][arm] = a
    finals[arm] = {s: by_seed[s][-1] for s in seeds}
  for arm, base in COMPARISONS:
    if arm not in finals or (base != "cold_start" and base not in finals):
      continue
    seeds = sorted(set(finals[arm]) & set(finals[base])) if base != "cold_start" else \
        sorted(finals[arm])
    if not seeds:
      continue
    row = {"seeds": seeds}
    for mode in metric:
      x = _seed_mean([finals[arm][s] for s in seeds], domain, mode)
      y = (_per_example(cold, domain, mode) if base == "cold_start" else
           _seed_mean([finals[base][s] for s in seeds], domain, mode))
      row[mode] = _paired(x, y, num_resamples)
    out["comparisons"][f"{arm} − {base}"] = row
  for (a, b), (c, d) in INTERACTIONS:
    if not {a, b, c, d} <= set(finals):
      continue
    seeds = sorted(set.intersection(*(set(finals[k]) for k in (a, b, c, d))))
    if not seeds:
      continue
    row = {"seeds": seeds}
    for mode in metric:
      m = {k: _seed_mean([finals[k][s] for s in seeds], domain, mode) for k in (a, b, c, d)}
      row[mode] = _paired(m[a] - m[b], m[c] - m[d], num_resamples)
    out["comparisons"][f"({a} − {b}) − ({c} − {d})"] = row
  return out


def _f(x, spec=".1f") -> str:
  return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render(summary: dict) -> str:
  """The markdown report: per domain the arms' table, the other domains and
  the paired differences."""
  lines = ["# OPD forms and cross-tokenizer teachers (issue #32)", ""]
  if summary.get("alpha") is not None:
    sweep = ", ".join(f"α={a}: {r:.3f}" for a, r in summary["alpha_sweep"].items())
    lines += [f"α = {summary['alpha']} (mean train reward over the sweep's last steps: {sweep})",
              ""]
  for d, s in summary["domains"].items():
    t, c = s["teacher"], s["cold_start"]
    lines += [f"## {d}", "", f"Teacher {t['greedy']:.1f} greedy / {t['sampled']:.1f} sampled; "
              f"cold start {c['greedy']:.1f} / {c['sampled']:.1f}."
              + (f" Cross-tokenizer teacher {s['cross_teacher']['greedy']:.1f} / "
                 f"{s['cross_teacher']['sampled']:.1f}." if "cross_teacher" in s else ""), "",
              "| arm | seeds | greedy by step | greedy last ± seed sd | retention greedy | "
              "steps to 90% greedy (mean curve; by seed) | sampled by step | retention sampled | "
              "steps to 90% sampled | OPD wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
      curve = lambda m: " / ".join(f"{v:.1f}" for v in a[m])  # noqa: E731
      by_seed = ", ".join(_f(v, ".0f") for v in a["greedy_steps_to_90_by_seed"])
      lines.append(
          f"| {arm} | {len(a['seeds'])} | {curve('greedy')} | {a['greedy'][-1]:.1f} ± "
          f"{_f(a['greedy_seed_sd'])} | {_f(a['greedy_retention'], '.2f')} | "
          f"{_f(a['greedy_steps_to_90'], '.0f')}; {by_seed} | {curve('sampled')} | "
          f"{_f(a['sampled_retention'], '.2f')} | {_f(a['sampled_steps_to_90'], '.0f')} | "
          f"{' / '.join(_f(w, '.0f') for w in a['wall_s'])} |")
    others = list(next(iter(s["arms"].values()))["others"]) if s["arms"] else []
    lines += ["", "Other domains at the last step, greedy, minus the cold start (paired over "
              "examples, per-example scores averaged over seeds; ± SE):", "",
              "| arm | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
    for arm, a in s["arms"].items():
      lines.append(f"| {arm} | " + " | ".join(
          f"{a['others'][o]['diff']:+.1f} ± {a['others'][o]['se']:.1f}" for o in others) + " |")
    lines += ["", f"Paired differences on {d} at the last step (seeds both arms ran; 95% CI "
              "half-width; MDE = 2.8 SE, the smallest effect detected with 80% power):", "",
              "| difference | seeds | greedy | CI95 | MDE | sampled | CI95 |",
              "|---|---|---|---|---|---|---|"]
    for name, r in s["comparisons"].items():
      g, m = r["greedy"], r["sampled"]
      lines.append(f"| {name} | {len(r['seeds'])} | {g['diff']:+.1f} ± {g['se']:.1f} | "
                   f"{g['ci95']:.1f} | {g['mde']:.1f} | {m['diff']:+.1f} ± {m['se']:.1f} | "
                   f"{m['ci95']:.1f} |")
    lines.append("")
  return "\n".join(lines)
