"""Job ``specialists``: the first stage of the V4 pipeline (SPEC §3, §5, §9).

  tiny base (pre-training on the task suite's text)
    → for each domain: SFT on the domain, then GRPO with its verifier
    → evaluation of the base, every SFT model and every specialist on all
      five test sets: a markdown/JSON table and a heatmap.

Every stage is its own run directory under the workdir (``base/``,
``<domain>/sft/``, ``<domain>/grpo/``) with checkpoints, TensorBoard events
and curves, built by the same jobs one would launch alone (``pretrain``,
``sft``, ``grpo``). A stage whose ``final_metrics.json`` exists is not run
again, and an interrupted stage resumes from its last checkpoint, so
re-running the command continues where it stopped.
"""
from __future__ import annotations

import json
import logging
import pathlib

import jax
import ml_collections

from experiments import common
from experiments import grpo as grpo_job
from experiments import pretrain as pretrain_job
from experiments import sft as sft_job
from opd import evaluation as ev
from opd.checkpoints import load_params
from opd.config_utils import config_to_dict

log = logging.getLogger(__name__)

FINAL = "final_metrics.json"


def _stage_config(config, job: str, **groups) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.job = job
  c.seed = config.seed
  c.model = config.model
  c.mesh = config.mesh
  c.sharding_rules = config.sharding_rules
  for name, value in groups.items():
    setattr(c, name, value)
  return c


def _run_stage(name: str, fn, cfg, workdir: pathlib.Path) -> dict:
  """Runs one stage unless it already finished; returns its final metrics."""
  done = workdir / FINAL
  if done.exists():
    print(f"[specialists] {name}: done earlier ({done})", flush=True)
    return json.loads(done.read_text())
  print(f"[specialists] {name} → {workdir}", flush=True)
  workdir.mkdir(parents=True, exist_ok=True)
  common.write_json(workdir / "config.json", config_to_dict(cfg))
  metrics = fn(cfg, str(workdir))
  common.write_json(done, metrics)
  return metrics


def run(config, workdir: str) -> dict:
  timer = common.Timer()
  root = pathlib.Path(workdir)
  domains = tuple(config.domains)
  model_cfg = common.model_config(config.model)
  tok = common.tokenizer_for(model_cfg)
  mesh, rules = common.mesh_and_rules(config)
  stage_metrics: dict[str, dict] = {}

  base_dir = root / "base"
  stage_metrics["base"] = _run_stage(
      "base pre-training", pretrain_job.run,
      _stage_config(config, "pretrain", optim=config.base.optim, train=config.base.train,
                    data=config.base.data), base_dir)

  for d in domains:
    sft_dir, grpo_dir = root / d / "sft", root / d / "grpo"
    sft_data = ml_collections.ConfigDict(config.sft.data.to_dict())
    sft_data.domains = (d,)
    stage_metrics[f"sft_{d}"] = _run_stage(
        f"{d}: SFT", sft_job.run,
        _stage_config(config, "sft", init=str(base_dir / "checkpoints"), optim=config.sft.optim,
                      train=config.sft.train, data=sft_data), sft_dir)
    grpo_data = ml_collections.ConfigDict(config.grpo_data.to_dict())
    grpo_data.domains = (d,)
    stage_metrics[f"grpo_{d}"] = _run_stage(
        f"{d}: GRPO", grpo_job.run,
        _stage_config(config, "grpo", init=str(sft_dir / "checkpoints"), grpo=config.grpo,
                      optim=config.grpo_optim, train=config.grpo_train, data=grpo_data,
                      agent_reward=config.agent_reward), grpo_dir)

  # Evaluation: base and specialists on every domain; SFT models on their own.
  eval_cfg = ev.EvalConfig(**config.eval.to_dict(), domains=domains)
  results, sft_results = [], {}
  models = [("base", base_dir)] + [(f"{d}-specialist", root / d / "grpo") for d in domains]
  print(f"[specialists] evaluating {len(models)} models on {len(domains)} test sets "
        f"({eval_cfg.n_per_domain} examples each)", flush=True)
  key = jax.random.key(config.seed + 1234)
  for name, run_dir in models:
    params = load_params(run_dir / "checkpoints", model_cfg, mesh=mesh, rules=rules)
    results.append(ev.evaluate(model_cfg, params, tok, eval_cfg, rng=key, name=name, mesh=mesh,
                               rules=rules))
    print(f"  {name}: " + ", ".join(f"{d} {results[-1].score(d, 'pass@1').value:.0f}"
                                    for d in domains), flush=True)
  for d in domains:
    params = load_params(root / d / "sft" / "checkpoints", model_cfg, mesh=mesh, rules=rules)
    cfg_d = ev.EvalConfig(**{**config.eval.to_dict(), "domains": (d,)})
    sft_results[d] = ev.evaluate(model_cfg, params, tok, cfg_d, rng=key, name=f"{d}-sft",
                                 mesh=mesh, rules=rules)

  out_dir = root / "results"
  paths = ev.save_results(results + list(sft_results.values()), out_dir)
  heat = ev.heatmap(results, out_dir / "heatmap.png", metric=config.report_metric)
  summary = summarize(results, sft_results, domains, config.report_metric)
  table = ev.results_table(results, metric=config.report_metric)
  report = render_report(table, summary, config.report_metric)
  (out_dir / "report.md").write_text(report)
  print(report, flush=True)
  print(f"[specialists] heatmap: {heat}\n[specialists] tables: {paths['markdown']}", flush=True)
  return {"wall_s": timer.seconds, "heatmap": str(heat), "report": str(out_dir / "report.md"),
          **{k: v for k, v in summary.items() if not isinstance(v, (list, dict))},
          **{f"{k}/{d}": v for k, row in summary.items() if isinstance(row, dict)
             for d, v in row.items()}}


def summarize(results, sft_results, domains, metric: str) -> dict:
  """Own-domain scores and the two comparisons the issue asks for."""
  by_name = {r.name: r for r in results}
  base = by_name["base"]
  spec = {d: by_name[f"{d}-specialist"].score(d, metric).value for d in domains}
  base_own = {d: base.score(d, metric).value for d in domains}
  sft = {d: sft_results[d].score(d, metric).value for d in domains}
  gain = {d: spec[d] - base_own[d] for d in domains}
  grpo_gain = {d: spec[d] - sft[d] for d in domains}
  return {"base": base_own, "sft": sft, "specialist": spec, "specialist_minus_base": gain,
          "grpo_minus_sft": grpo_gain,
          "domains_specialist_beats_base_by_20": sum(g >= 20 for g in gain.values()),
          "domains_grpo_improves_on_sft": sum(g > 0 for g in grpo_gain.values())}


def render_report(table: str, summary: dict, metric: str) -> str:
  domains = list(summary["base"])
  lines = [f"## Specialists pipeline — {metric} (0–100) on each test set", "", table, "",
           "## Own-domain scores", "",
           "| domain | base | SFT | SFT+GRPO (specialist) | specialist − base | GRPO − SFT |",
           "|---|---|---|---|---|---|"]
  for d in domains:
    lines.append(f"| {d} | {summary['base'][d]:.1f} | {summary['sft'][d]:.1f} | "
                 f"{summary['specialist'][d]:.1f} | {summary['specialist_minus_base'][d]:+.1f} | "
                 f"{summary['grpo_minus_sft'][d]:+.1f} |")
  lines += ["", f"Specialist beats base by ≥ 20 points on "
            f"{summary['domains_specialist_beats_base_by_20']}/{len(domains)} domains; GRPO "
            f"improves on SFT on {summary['domains_grpo_improves_on_sft']}/{len(domains)}.", ""]
  return "\n".join(lines)
