"""Job ``specialists``: the first stage of the V4 pipeline (docs/DESIGN.md §3, §5, §9).

  tiny base (pre-training on the task suite's text)
    → optionally one shared SFT on every domain at once (``shared_sft.steps``
      > 0; V4's specialists share one SFT'd base): the "base" of every later
      stage, row and student, with the pre-trained model kept as ``pretrained``
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

import logging
import pathlib

import jax
import ml_collections

from experiments import common
from experiments import grpo as grpo_job
from experiments import pretrain as pretrain_job
from experiments import sft as sft_job
from opd.eval import claims
from opd.eval import evaluation as ev
from opd.training.checkpoints import load_params
from opd.config.fields import from_group
from opd.models import to_model_config
from opd.tasks import ALL_DOMAINS

log = logging.getLogger(__name__)

def _copy(group, **changes) -> ml_collections.ConfigDict:
  out = ml_collections.ConfigDict(group.to_dict())
  out.update(changes)
  return out


def _steps(train, optim, config, domain: str, field: str):
  """``train`` (and a cosine ``optim``) with the step count of
  ``config.per_domain.<domain>.<field>`` when that is set."""
  steps = config.per_domain.get(domain, {}).get(field) if "per_domain" in config else None
  if not steps:
    return train, optim
  train = _copy(train, steps=steps, save_every=steps)
  if optim is not None and optim.schedule != "constant":
    optim = _copy(optim, decay_steps=max(1, steps - optim.warmup_steps))
  return train, optim


def _sft_data(config, domain: str):
  """``config.sft.data`` for one domain; with ``sft.replay_fraction`` > 0 the
  other domains are replayed in that share of the train examples."""
  f = config.sft.get("replay_fraction", 0.0)
  if not f:
    return _copy(config.sft.data, domains=(domain,))
  others = tuple(o for o in config.domains if o != domain)
  return _copy(config.sft.data, domains=(domain,), replay_domains=others, replay_fraction=f)


PER_DOMAIN_FIELDS = ("sft_steps", "grpo_steps", "grpo_lr")  # 0 means the shared value


def check_per_domain(config) -> None:
  """``config.per_domain``: known domains and fields, values >= 0 (ml-collections
  already refuses a float for the int step counts)."""
  for d, group in config.get("per_domain", {}).items():
    if d not in ALL_DOMAINS:
      raise ValueError(f"per_domain.{d}: unknown domain {d!r}; domains are {ALL_DOMAINS}")
    for name, value in group.items():
      if name not in PER_DOMAIN_FIELDS or value < 0:
        raise ValueError(f"per_domain.{d}.{name}={value!r}: expected one of "
                         f"{PER_DOMAIN_FIELDS}, >= 0 (0 means the shared value)")


def run(config, workdir: str, reuse=()) -> dict:
  """Runs (or resumes) every stage; ``reuse``: finished workdirs whose
  matching stages are read instead of rerun (``experiments.common.Stages``)."""
  timer = common.Timer()
  if not reuse:  # launched alone: the config's own reuse roots
    reuse = [r.strip() for r in str(config.get("reuse_from", "") or "").split(",") if r.strip()]
  stages = common.Stages.of(workdir, reuse)
  domains = tuple(config.domains)
  check_per_domain(config)
  stage_metrics: dict[str, dict] = {}

  stage_metrics["base"], base_dir = stages.run(
      "base pre-training", pretrain_job.run,
      common.stage_config(config, "pretrain", optim=config.base.optim, train=config.base.train,
                          data=config.base.data), "base")

  pretrained_dir = base_dir
  shared = config.get("shared_sft")
  if shared is not None and shared.steps > 0:
    # V4's specialists start from one SFT'd base: every domain's SFT data at once.
    train = _copy(config.sft.train, steps=shared.steps, save_every=shared.steps)
    optim = config.sft.optim
    if optim.schedule != "constant":
      optim = _copy(optim, decay_steps=max(1, shared.steps - optim.warmup_steps))
    # shared_sft.domains (optional; empty: config.domains): a specialist of
    # one domain built on the same every-domain base as the others.
    shared_domains = tuple(shared.get("domains") or domains)
    stage_metrics["shared_sft"], base_dir = stages.run(
        "shared SFT (every domain)", sft_job.run,
        common.stage_config(config, "sft", init=str(pretrained_dir / "checkpoints"), optim=optim,
                            train=train, data=_copy(config.sft.data, domains=shared_domains,
                                                    num_train=shared.num_train)),
        "shared_sft", [pretrained_dir])

  dirs = {}
  for d in domains:
    sft_train, sft_optim = _steps(config.sft.train, config.sft.optim, config, d, "sft_steps")
    stage_metrics[f"sft_{d}"], sft_dir = stages.run(
        f"{d}: SFT", sft_job.run,
        common.stage_config(config, "sft", init=str(base_dir / "checkpoints"), optim=sft_optim,
                            train=sft_train, data=_sft_data(config, d)),
        f"{d}/sft",
        [base_dir])
    grpo_train, _ = _steps(config.grpo_train, None, config, d, "grpo_steps")
    grpo_lr = config.get("per_domain", {}).get(d, {}).get("grpo_lr")
    grpo_optim = _copy(config.grpo_optim, lr=grpo_lr) if grpo_lr else config.grpo_optim
    stage_metrics[f"grpo_{d}"], grpo_dir = stages.run(
        f"{d}: GRPO", grpo_job.run,
        common.stage_config(config, "grpo", init=str(sft_dir / "checkpoints"),
                            grpo=config.grpo, optim=grpo_optim, train=grpo_train,
                            data=_copy(config.grpo_data, domains=(d,)),
                            agent_reward=config.agent_reward), f"{d}/grpo", [sft_dir])
    dirs[d] = {"sft": sft_dir, "grpo": grpo_dir}

  eval_cfg = ml_collections.ConfigDict(dict(
      job="specialists_eval", seed=config.seed, model=_copy(config.model), mesh=config.mesh,
      sharding_rules=config.sharding_rules,
      eval=_copy(config.eval), report_metric=config.report_metric, base=str(base_dir),
      models={d: {k: str(v) for k, v in dirs[d].items()} for d in domains}))
  metrics, out_dir = stages.run("specialists evaluation", _evaluate, eval_cfg, "results",
                                [base_dir, *(p for d in domains for p in dirs[d].values())])
  print((out_dir / "report.md").read_text(), flush=True)
  print(f"[specialists] heatmap: {out_dir / 'heatmap.png'}\n"
        f"[specialists] tables: {out_dir / 'results.md'}", flush=True)
  return {**metrics, "wall_s": timer.seconds, "heatmap": str(out_dir / "heatmap.png"),
          "report": str(out_dir / "report.md"), "dirs": {
              "base": str(base_dir), "pretrained": str(pretrained_dir), **{f"{d}/{k}": str(v) for d in domains
                                        for k, v in dirs[d].items()}}}


def _evaluate(cfg, workdir: str) -> dict:
  """The evaluation stage. The heatmap: base and specialists on every test
  set, greedy. The GRPO-vs-SFT comparison: each domain's SFT model and
  specialist on their own test set, greedy and sampled (mean@N is what
  GRPO optimises)."""
  domains = tuple(cfg.models)
  model_cfg = to_model_config(cfg.model)
  tok = common.tokenizer_for(model_cfg, workdir)
  mesh, rules = common.mesh_and_rules(cfg)
  cross_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval", domains=domains,
                         num_samples=0)
  results, own = [], {}
  models = [("base", pathlib.Path(cfg.base))] + [
      (f"{d}-specialist", pathlib.Path(cfg.models[d]["grpo"])) for d in domains]
  print(f"[specialists] evaluating {len(models)} models on {len(domains)} test sets "
        f"({cross_cfg.n_per_domain} examples each)", flush=True)
  key = jax.random.key(cfg.seed + 1234)
  for name, run_dir in models:
    params = load_params(run_dir / "checkpoints", model_cfg, mesh=mesh, rules=rules)
    results.append(ev.evaluate(model_cfg, params, tok, cross_cfg, rng=key, name=name, mesh=mesh,
                               rules=rules))
    print(f"  {name}: " + ", ".join(f"{d} {results[-1].score(d, cfg.report_metric).value:.0f}"
                                    for d in domains), flush=True)
  for d in domains:
    own_cfg = from_group(ev.EvalConfig, cfg.eval, "config.eval", domains=(d,))
    for stage in ("sft", "grpo"):
      params = load_params(pathlib.Path(cfg.models[d][stage]) / "checkpoints", model_cfg,
                           mesh=mesh, rules=rules)
      own[d, stage] = ev.evaluate(model_cfg, params, tok, own_cfg, rng=key,
                                  name=f"{d}-{stage}", mesh=mesh, rules=rules)

  out_dir = pathlib.Path(workdir)
  ev.save_results(results + list(own.values()), out_dir)
  ev.heatmap(results, out_dir / "heatmap.png", metric=cfg.report_metric)
  sampled = f"mean@{cfg.eval.num_samples}"
  summary = summarize(results, own, domains, cfg.report_metric, sampled)
  table = ev.results_table(results, metric=cfg.report_metric)
  (out_dir / "report.md").write_text(render_report(table, summary, cfg.report_metric, sampled))
  return {**{k: v for k, v in summary.items() if not isinstance(v, (list, dict))},
          **{f"{k}/{d}": v for k, row in summary.items() if isinstance(row, dict)
             for d, v in row.items()}}


def summarize(results, own, domains, metric: str, sampled: str) -> dict:
  """Own-domain scores and the two comparisons the issue asks for.

  ``specialist_minus_base`` uses ``metric`` from the cross-domain table;
  GRPO vs SFT is reported on both the greedy ``metric`` and the sampled
  ``sampled`` (mean@N) score of the own-domain evaluation.
  """
  by_name = {r.name: r for r in results}
  base = {d: by_name["base"].score(d, metric).value for d in domains}
  spec = {d: by_name[f"{d}-specialist"].score(d, metric).value for d in domains}
  out = {"base": base, "specialist": spec,
         "specialist_minus_base": {d: spec[d] - base[d] for d in domains}}
  for m, tag in ((metric, "greedy"), (sampled, "sampled")):
    sft = {d: own[d, "sft"].score(d, m) for d in domains}
    grpo = {d: own[d, "grpo"].score(d, m) for d in domains}
    out[f"sft_{tag}"] = {d: sft[d].value for d in domains}
    out[f"grpo_{tag}"] = {d: grpo[d].value for d in domains}
    out[f"grpo_minus_sft_{tag}"] = {d: grpo[d].value - sft[d].value for d in domains}
    out[f"grpo_minus_sft_{tag}_se"] = {d: (sft[d].se ** 2 + grpo[d].se ** 2) ** 0.5
                                       for d in domains}
  # The sampler-quality bar (docs/RESULTS.md, "A stronger toy world"): on
  # its own domain a specialist's mean@N over its greedy score, paired over
  # examples; off its domain, its greedy total over the base's.
  out["sampler_quality"], out["sampler_quality_se"] = {}, {}
  for d in domains:
    try:
      q, se = claims.sampler_quality(own[d, "grpo"].domains[d])
    except ValueError:  # a greedy score of 0: no ratio
      q, se = float("nan"), float("nan")
    out["sampler_quality"][d], out["sampler_quality_se"][d] = q, se
  out["off_domain_retention"] = {}
  for d in domains:
    others = [o for o in domains if o != d]
    base_total = sum(by_name["base"].score(o, metric).value for o in others)
    spec_total = sum(by_name[f"{d}-specialist"].score(o, metric).value for o in others)
    out["off_domain_retention"][d] = spec_total / base_total if base_total > 0 else float("nan")
  gain = out["specialist_minus_base"]
  out["domains_specialist_beats_base_by_20"] = sum(g >= 20 for g in gain.values())
  out["domains_grpo_improves_on_sft_sampled"] = sum(
      g > 0 for g in out["grpo_minus_sft_sampled"].values())
  out["domains_grpo_improves_on_sft_greedy"] = sum(
      g > 0 for g in out["grpo_minus_sft_greedy"].values())
  return out


def render_report(table: str, summary: dict, metric: str, sampled: str) -> str:
  domains = list(summary["base"])
  n = len(domains)
  lines = [f"## Specialists pipeline — greedy {metric} (0–100) on each test set", "", table, "",
           "## Own domain: base, SFT, SFT+GRPO (the specialist)", "",
           f"| domain | base {metric} | SFT {metric} | specialist {metric} | specialist − base "
           f"| SFT {sampled} | specialist {sampled} | GRPO − SFT ({sampled}) | GRPO − SFT ({metric}) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for d in domains:
    lines.append(
        f"| {d} | {summary['base'][d]:.1f} | {summary['sft_greedy'][d]:.1f} | "
        f"{summary['specialist'][d]:.1f} | {summary['specialist_minus_base'][d]:+.1f} | "
        f"{summary['sft_sampled'][d]:.1f} | {summary['grpo_sampled'][d]:.1f} | "
        f"{summary['grpo_minus_sft_sampled'][d]:+.1f} ± {summary['grpo_minus_sft_sampled_se'][d]:.1f} | "
        f"{summary['grpo_minus_sft_greedy'][d]:+.1f} ± {summary['grpo_minus_sft_greedy_se'][d]:.1f} |")
  lines += ["", f"## Sampler quality: {sampled} / greedy {metric} on the own domain (bar: ≥ 0.8), "
            "and off-domain greedy total / the base's (bar: ≥ 0.8)", "",
            "| domain | sampler quality | off-domain retention |", "|---|---|---|"]
  for d in domains:
    lines.append(f"| {d} | {summary['sampler_quality'][d]:.2f} ± "
                 f"{summary['sampler_quality_se'][d]:.2f} | "
                 f"{summary['off_domain_retention'][d]:.2f} |")
  lines += ["", f"Specialist beats base by ≥ 20 points on "
            f"{summary['domains_specialist_beats_base_by_20']}/{n} domains. GRPO improves on SFT "
            f"on {summary['domains_grpo_improves_on_sft_sampled']}/{n} domains by {sampled} "
            f"(the sampled reward GRPO optimises) and on "
            f"{summary['domains_grpo_improves_on_sft_greedy']}/{n} by greedy {metric}. "
            "± is one bootstrap standard error over test examples.", ""]
  return "\n".join(lines)
