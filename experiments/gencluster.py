"""Job ``gencluster``: test-time clustering for code (docs/DESIGN.md §7, ``grm.gencluster``).

Stages (each resumable, ``experiments.common.run_stage``; a stage directory
holds ``config.json``, ``final_metrics.json`` and its JSON outputs):

  policy     the code policy: the first directory of ``policy.checkpoints``
             whose run finished (e.g. the V4 run's code specialist), else
             SFT on the code domain from ``policy.base`` (pre-training one
             first when that is missing too); ``policy.random_init``: a random
             model (tiny variant). ``policy.json`` names what was used.
  problems   code-domain test examples as three-subtask problems (``problems.json``).
  samples    K candidates per subtask, and per subtask ``n_generators``
             input-generator and ``n_validators`` validator responses, all
             sampled from the policy (``samples.json``).
  inputs     generators run (or the seeded fallback), validators probed (or the
             rule-based one), the 75% rule (``inputs.json``).
  execute    candidates parsed; every parsed candidate run on its subtask's
             kept inputs and on the unfiltered ones, and on every subtask's
             hidden tests; clusters per variant (``clusters.json``); sandbox
             throughput.
  judge      ``judge.train_steps`` > 0: SFT of the policy into a pairwise code
             judge on rule-written train-split pairs (reference vs a near miss).
  rank       the pairwise tournament between cluster representatives, per
             variant, judged by ``judge.checkpoint``, the trained judge, or the
             policy (``rankings.json``); judge accuracy on the matches where
             exactly one representative passes the subtask's hidden tests.
  report     submissions per strategy under the budget; solve rate vs budget
             (``report.md``, ``results.json``, ``solve_rate.png``;
             ``experiments.gencluster_report``).
"""
from __future__ import annotations

import pathlib

import jax
import numpy as np
from tqdm.auto import tqdm

from experiments import common
from experiments import pretrain as pretrain_job
from experiments import sft as sft_job
from experiments.gencluster_report import LABELS, STRATEGIES, mean_se, plot, render_report  # noqa: F401
from grm import training as training_lib
from grm.gencluster import clustering, execution, pipeline
from grm.gencluster import inputs as inputs_lib
from grm.gencluster import tournament as tournament_lib
from grm.gencluster.problems import Problem, generator_prompt, make_problem
from grm.gencluster.problems import validator_prompt
from opd import tasks as tasks_lib
from opd.models import init_params
from opd.rollout.episodes import sampling_for_chat
from opd.rollout.policy import Policy
from opd.tasks.sandbox import Sandbox, SandboxLimits
from opd.training import lm_trainer
from opd.training.checkpoints import load_params
from opd.training.files import read_json
from opd.training.loop_config import RunIO, Runtime
from opd.training.metrics_writer import MetricWriter

VARIANTS = ("validated", "unfiltered")  # the inputs clusters are built on


_Ctx = common.JobContext


def _read(ctx: _Ctx, stage: str, name: str):
  return read_json(ctx.root / stage / name)


def _problems(ctx: _Ctx) -> list[Problem]:
  return [Problem.from_json(d) for d in _read(ctx, "problems", "problems.json")]


def _sandbox(c) -> Sandbox:
  limits = SandboxLimits(cpu_s=c.sandbox.cpu_s, wall_s=c.sandbox.wall_s,
                         memory_bytes=c.sandbox.memory_mb * 2**20)
  return Sandbox(limits, require=tasks_lib.get_task("code").required_isolation)


def _run_kwargs(c, stats=None) -> dict:
  return {"workers": c.sandbox.workers, "chunk": c.sandbox.chunk, "stats": stats}


# --- policy -----------------------------------------------------------------------------------

def _stage_policy(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  if c.policy.random_init:
    return {"policy": "random_init", "model_driven": 0}
  for path in c.policy.checkpoints:
    # Only a finished run's checkpoints (its final_metrics.json written): never one mid-training.
    if path and (pathlib.Path(path).parent / common.FINAL).is_file():
      load_params(path, ctx.model_cfg)  # fails here, loudly, on a mismatched model
      common.write_json(workdir / "policy.json", {"checkpoint": str(path)})
      return {"policy": str(path), "model_driven": 1}
  base = c.policy.base
  if not (base and (pathlib.Path(base).parent / common.FINAL).is_file()):
    base_dir = workdir / "base"
    common.run_stage("policy: base pre-training", pretrain_job.run, common.stage_config(
        c, "pretrain", **{k: c.policy.pretrain[k] for k in ("optim", "train", "data")}), base_dir)
    base = str(base_dir / "checkpoints")
  sft_dir = workdir / "sft"
  sft = c.policy.sft
  metrics = common.run_stage("policy: code SFT", sft_job.run, common.stage_config(
      c, "sft", init=base, optim=sft.optim, train=sft.train, data=sft.data), sft_dir,
      inputs=[pathlib.Path(base).parent])
  path = str(sft_dir / "checkpoints")
  common.write_json(workdir / "policy.json", {"checkpoint": path, "base": base})
  return {"policy": path, "model_driven": 1, "sft_eval_loss": metrics.get("eval_loss")}


def _policy_params(ctx: _Ctx):
  if ctx.config.policy.random_init:
    return init_params(ctx.model_cfg, jax.random.key(ctx.config.seed))
  path = _read(ctx, "policy", "policy.json")["checkpoint"]
  return load_params(path, ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules)


# --- problems and samples ---------------------------------------------------------------------

def planted(problem: Problem) -> list[str]:
  """Not model-driven (tiny variant): an off-by-one distractor, then the reference."""
  body = problem.reference.split("return", 1)
  return [f"{body[0]}return 1+({body[1].strip()})", problem.reference]


def _stage_problems(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  task = tasks_lib.get_task("code")
  problems, seen = [], set()
  for d in c.problems.difficulties:
    for ex in task.examples(c.problems.split, 4 * c.problems.per_difficulty, seed=c.seed,
                            difficulty=d):
      if ex.prompt not in seen and sum(p.difficulty == d for p in problems) < c.problems.per_difficulty:
        seen.add(ex.prompt)
        problems.append(make_problem(ex, n_hidden=c.problems.n_hidden, seed=c.seed))
  common.write_json(workdir / "problems.json", [p.to_json() for p in problems])
  return {"problems": len(problems), "subtasks": 3 * len(problems),
          "hidden_tests": sum(len(s.hidden) for p in problems for s in p.subtasks)}


def _stage_samples(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  problems = _problems(ctx)
  params = _policy_params(ctx)
  k, t = c.candidates.k, c.tests
  prompts = []
  for p in problems:
    for s in p.subtasks:
      prompts += [p.prompt] * k + [generator_prompt(p, s)] * t.n_generators
      prompts += [validator_prompt(p, s)] * t.n_validators
  per_sub = k + t.n_generators + t.n_validators
  cand_sampling = sampling_for_chat(ctx.tok, max_new_tokens=c.candidates.max_new_tokens,
                                    temperature=c.candidates.temperature)
  texts = pipeline.sample_texts(Policy(ctx.model_cfg, params, ctx.tok, ctx.mesh, ctx.rules),
                                prompts, seed=c.seed, sampling=cand_sampling,
                                batch_size=c.sample_batch, desc="policy samples")
  out = {}
  for i, p in enumerate(problems):
    rows = {"candidates": [], "generators": [], "validators": []}
    for j, s in enumerate(p.subtasks):
      row = texts[(i * 3 + j) * per_sub:(i * 3 + j + 1) * per_sub]
      cands = row[:k] + (planted(p) if c.candidates.plant_reference else [])
      rows["candidates"].append(cands)
      rows["generators"].append(row[k:k + t.n_generators])
      rows["validators"].append(row[k + t.n_generators:])
    out[p.id] = rows
  common.write_json(workdir / "samples.json", out)
  return {"samples": len(texts), "candidates": sum(len(c_) for r in out.values()
                                                   for c_ in r["candidates"]),
          "planted_candidates": 3 * len(planted(problems[0])) * len(problems)
          if c.candidates.plant_reference and problems else 0}


# --- inputs, execution, ranking ----------------------------------------------------------------

def _stage_inputs(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  sandbox = _sandbox(c)
  samples = _read(ctx, "samples", "samples.json")
  stats = execution.RunStats()
  out, totals = {}, {}
  for p in tqdm(_problems(ctx), desc="test inputs", unit="problem"):
    rows = []
    for j, s in enumerate(p.subtasks):
      built = inputs_lib.build_inputs(
          sandbox, p, s, samples[p.id]["generators"][j], samples[p.id]["validators"][j],
          per_generator=c.tests.per_generator, n_probe=c.tests.n_probe,
          seed=(c.seed, p.id, j), max_inputs=c.tests.max_inputs,
          run_kwargs=_run_kwargs(c, stats))
      rows.append({"generated": built.inputs, "kept_inputs": built.kept, **built.counts()})
      for key, v in built.counts().items():
        totals[key] = totals.get(key, 0) + v
      totals["subtasks_filtered"] = totals.get("subtasks_filtered", 0) + (built.counts()["removed"] > 0)
    out[p.id] = rows
  common.write_json(workdir / "inputs.json", out)
  return {**totals, "removal_rate": totals["removed"] / max(1, totals["inputs"]),
          "programs": stats.programs, "programs_per_s": stats.programs_per_s}


def _variant_inputs(row: dict, variant: str, max_inputs: int) -> list[tuple]:
  rows = row["kept_inputs"] if variant == "validated" else row["generated"][:max_inputs]
  return [tuple(a) for a in rows]


def _stage_execute(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  sandbox = _sandbox(c)
  problems = _problems(ctx)
  samples = _read(ctx, "samples", "samples.json")
  tests = _read(ctx, "inputs", "inputs.json")
  stats = execution.RunStats()
  counts = {"candidates": 0, "parsed": 0, "dropped_parse": 0, "dropped_compile": 0}
  sources, texts = [], []
  for p in problems:
    flat_src, flat_txt = [], []
    for cands in samples[p.id]["candidates"]:
      src, n = pipeline.parse_candidates(cands, p.n_args)
      flat_src += src
      flat_txt += cands
      for key, v in n.items():
        counts[key] += v
    counts["candidates"] += len(flat_txt)
    sources.append(flat_src)
    texts.append(flat_txt)
  # Every parsed candidate on its subtask's inputs, per variant (one run when they agree).
  jobs, keys = [], []
  for pi, p in enumerate(problems):
    n_per = len(samples[p.id]["candidates"][0])
    for j in range(3):
      variant_inputs = {v: _variant_inputs(tests[p.id][j], v, c.tests.max_inputs) for v in VARIANTS}
      same = repr(variant_inputs["validated"]) == repr(variant_inputs["unfiltered"])
      for ci in range(j * n_per, (j + 1) * n_per):
        if sources[pi][ci] is None:
          continue
        for v in (("validated",) if same else VARIANTS):
          jobs.append((sources[pi][ci], variant_inputs[v]))
          keys.append((pi, j, ci, v, same))
  outs = execution.run_functions(sandbox, [s for s, _ in jobs], [x for _, x in jobs],
                                 desc="candidates on test inputs", **_run_kwargs(c, stats))
  got = {}
  for (pi, j, ci, v, same), o in zip(keys, outs):
    got[pi, j, ci, v] = o
    if same:
      got[pi, j, ci, "unfiltered"] = o
  passes = pipeline.hidden_passes(sandbox, problems, sources, **_run_kwargs(c, stats))
  clusters_out, cl_counts = {}, {}
  for pi, p in enumerate(problems):
    n_per = len(samples[p.id]["candidates"][0])
    reasoning = [pipeline.reasoning_length(t) for t in texts[pi]]
    per_variant = {}
    for v in VARIANTS:
      subs = []
      for j in range(3):
        ids = list(range(j * n_per, (j + 1) * n_per))
        res = pipeline.cluster_subtask([got.get((pi, j, ci, v)) for ci in ids],
                                       [reasoning[ci] for ci in ids])
        subs.append({"clusters": [[ids[m] for m in cl.members] for cl in res.clusters],
                     "keys": [cl.key for cl in res.clusters], **res.counts})
        for key, val in res.counts.items():
          cl_counts[f"{v}/{key}"] = cl_counts.get(f"{v}/{key}", 0) + val
        cl_counts[f"{v}/clusters_kept"] = cl_counts.get(f"{v}/clusters_kept", 0) + len(res.clusters)
      per_variant[v] = subs
    clusters_out[p.id] = {"variants": per_variant, "parsed": [s is not None for s in sources[pi]],
                          "passes": [sorted(x) for x in passes[pi]], "texts": texts[pi]}
  common.write_json(workdir / "clusters.json", clusters_out)
  return {**counts, **cl_counts, "programs": stats.programs, "sandbox_wall_s": stats.wall_s,
          "programs_per_s": stats.programs_per_s,
          "upper_bound": pipeline.upper_bound(passes)}


def _stage_judge(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  """SFT of the policy into a pairwise code judge (``judge.train_steps`` > 0 and no
  ``judge.checkpoint``) on rule-written pairs of the code domain's train split:
  the reference against a near miss (``tournament.judge_sft_pairs``)."""
  c = ctx.config
  if c.judge.checkpoint or not c.judge.train_steps:
    return {"trained": 0}
  examples = [ex for d in c.problems.difficulties for ex in tasks_lib.get_task("code").examples(
      "train", c.judge.num_train // len(c.problems.difficulties), seed=c.seed + 5, difficulty=d,
      unique=False)]
  pairs = tournament_lib.judge_sft_pairs(examples, seed=c.seed)
  steps = c.judge.train_steps
  loop = lm_trainer.LMTrainConfig(steps=steps, keep_checkpoints=1, progress=True)
  history = []
  optim = common.optim_config(c.judge.optim, "config.judge.optim")
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=max(1, steps // 20))
    training_lib.train_judgement_sft(
        ctx.model_cfg, _policy_params(ctx), pairs, optim=optim, loop=loop,
        io=RunIO(checkpoint_dir=workdir / "checkpoints",
                 on_metrics=lambda s, m: (history.append(m), logger(s, m))),
        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed, tokenizer=ctx.tok),
        seq_len=c.judge.seq_len, batch_size=c.judge.batch_size)
  losses = [float(m["loss"]) for m in history if "loss" in m]
  return {"trained": 1, "pairs": len(pairs), "loss_first": losses[0],
          "loss_final": float(np.mean(losses[-5:]))}


def _judge(ctx: _Ctx):
  c = ctx.config
  if c.judge.checkpoint:
    params = load_params(c.judge.checkpoint, ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules)
  elif c.judge.train_steps:
    params = load_params(ctx.root / "judge" / "checkpoints", ctx.model_cfg, mesh=ctx.mesh,
                         rules=ctx.rules)
  else:
    params = _policy_params(ctx)
  sampling = sampling_for_chat(ctx.tok, max_new_tokens=c.judge.max_new_tokens,
                               temperature=c.judge.temperature)
  return pipeline.model_judge(Policy(ctx.model_cfg, params, ctx.tok, ctx.mesh, ctx.rules),
                              sampling, batch_size=c.sample_batch,
                              constrained=c.tournament.get("constrained", False))


def _stage_rank(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  """All matches of every subtask and variant go to the judge in one call."""
  c = ctx.config
  clusters = _read(ctx, "execute", "clusters.json")
  problems = _problems(ctx)
  all_matches, owner = [], []
  for pi, p in enumerate(problems):
    row = clusters[p.id]
    for vi, v in enumerate(VARIANTS):
      for j, sub in enumerate(row["variants"][v]):
        reps = [row["texts"][m[0]] for m in sub["clusters"][:c.tournament.max_clusters]]
        ms = tournament_lib.matches(p.prompt, reps, seed=c.seed, where=(pi, vi, j),
                                    games=c.tournament.games,
                                    both_orders=c.tournament.get("both_orders", False))
        all_matches += ms
        owner += [(p.id, v, j)] * len(ms)
  texts = list(_judge(ctx)([m.prompt.text for m in all_matches], c.seed)) if all_matches else []
  out: dict = {}
  judged = valid = 0
  informative = right = 0  # matches where exactly one representative passes the subtask
  for pi, p in enumerate(problems):
    out[p.id] = {}
    for v in VARIANTS:
      orders = []
      for j, sub in enumerate(clusters[p.id]["variants"][v]):
        idx = [i for i, o in enumerate(owner) if o == (p.id, v, j)]
        head = sub["clusters"][:c.tournament.max_clusters]
        games, said = [all_matches[i] for i in idx], [texts[i] for i in idx]
        r = tournament_lib.rank([len(m) for m in head], games, said)
        judged, valid = judged + r.judged, valid + r.valid
        n, k = tournament_lib.judge_accuracy(
            games, said, [j in clusters[p.id]["passes"][m[0]] for m in head])
        informative, right = informative + n, right + k
        orders.append({"order": list(r.order), "wins": list(r.wins)})
      out[p.id][v] = orders
  common.write_json(workdir / "rankings.json", out)
  common.write_json(workdir / "judge_samples.json", texts[:20])
  bias = tournament_lib.position_bias(all_matches, texts, owners=owner)
  return {"matches": judged, "valid_judgements": valid,
          **{f"judge_{k}": v for k, v in bias.items()},
          "judge_valid_rate": valid / judged if judged else float("nan"),
          "informative_matches": informative,
          "judge_accuracy": right / informative if informative else float("nan")}


# --- report -------------------------------------------------------------------------------------

def _strategies(c, problems, clusters, rankings) -> list[dict]:
  per_problem = []
  for pi, p in enumerate(problems):
    row = clusters[p.id]
    n_per = len(row["texts"]) // 3
    strategies = {}
    for name in STRATEGIES:
      v = "unfiltered" if name == "no_validators" else "validated"
      ranked = []
      for j in range(3):
        sub = row["variants"][v][j]
        cls = [clustering.Cluster(k, tuple(m)) for k, m in zip(sub["keys"], sub["clusters"])]
        order = None
        if name in ("gencluster", "no_validators"):
          r = rankings[p.id][v][j]
          order = pipeline.ranked_clusters(
              cls, tournament_lib.Ranking(tuple(r["order"]), tuple(r["wins"]), 0, 0),
              c.tournament.max_clusters)
        parsed = [ci for ci in range(j * n_per, (j + 1) * n_per) if row["parsed"][ci]]
        ranked.append(pipeline.strategy_rankings(name, candidates=parsed, clusters=cls,
                                                 tournament_order=order,
                                                 seed=(c.seed, pi, j)))
      strategies[name] = ranked
    per_problem.append(strategies)
  return per_problem


def _stage_report(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  problems = _problems(ctx)
  clusters = _read(ctx, "execute", "clusters.json")
  rankings = _read(ctx, "rank", "rankings.json")
  budget = c.submission.budget
  passes = [[frozenset(x) for x in clusters[p.id]["passes"]] for p in problems]
  curves = pipeline.solve_curves(_strategies(c, problems, clusters, rankings), passes,
                                 budget=budget)
  budgets = [b for b in c.submission.report_budgets if b <= budget]
  table = {name: {b: mean_se(curves[name][:, b - 1]) for b in budgets} for name in STRATEGIES}
  full = {name: float(np.mean(curves[name][:, -1] == 1.0)) for name in STRATEGIES}
  stage = {s: read_json(ctx.root / s / common.FINAL, expect=dict)
           for s in ("policy", "samples", "inputs", "execute", "rank")}
  results = {"solve_rate": {n: {str(b): v for b, v in row.items()} for n, row in table.items()},
             "all_subtasks_solved_at_budget": full, "upper_bound": stage["execute"]["upper_bound"],
             "curves": {n: np.mean(v, 0).tolist() for n, v in curves.items()},
             "stages": stage, "problems": len(problems)}
  common.write_json(workdir / "results.json", results)
  (workdir / "report.md").write_text(render_report(results, budgets))
  plot(curves, stage["execute"]["upper_bound"], workdir / "solve_rate.png")
  out = {f"{n}@{b}": table[n][b][0] for n in STRATEGIES for b in budgets}
  out.update({"upper_bound": stage["execute"]["upper_bound"],
              "programs_per_s": stage["execute"]["programs_per_s"],
              "removal_rate": stage["inputs"]["removal_rate"],
              "judge_valid_rate": stage["rank"]["judge_valid_rate"]})
  return out


STAGES = (("policy", _stage_policy, ("policy",)),
          ("problems", _stage_problems, ("problems",)),
          ("samples", _stage_samples, ("candidates", "tests", "sample_batch")),
          ("inputs", _stage_inputs, ("tests", "sandbox")),
          ("execute", _stage_execute, ("sandbox",)),
          ("judge", _stage_judge, ("judge", "problems")),
          ("rank", _stage_rank, ("judge", "tournament")),
          ("report", _stage_report, ("submission",)))

# The stages each one reads (``common.Stages.run_all``: a rerun upstream makes it stale).
UPSTREAM = {"samples": ("policy", "problems"), "inputs": ("problems", "samples"),
            "execute": ("problems", "samples", "inputs"), "judge": ("policy",),
            "rank": ("problems", "execute", "judge"),
            "report": ("policy", "problems", "samples", "inputs", "execute", "rank")}


def run(config, workdir: str) -> dict:
  root = pathlib.Path(workdir)
  out = common.run_stage_table(config, root, "gencluster", STAGES, UPSTREAM,
                               _Ctx.for_run(config, root))
  print((root / "report" / "report.md").read_text(), flush=True)
  return out
