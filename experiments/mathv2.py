"""Job ``mathv2``: DeepSeekMath-V2 on the toy proof domain (docs/DESIGN.md §7).

Stages (each resumable, ``experiments.common.run_stage``; a stage directory
holds ``config.json`` and ``final_metrics.json``). Every role is one of our
decoders; every text a role is measured on is sampled from it.

  data              train / test proof problems; per problem its reference
                    proof and ``data.corruptions`` corrupted ones with the
                    rule checker's verdicts (``grm.verify.training``). ``data.json``.
  base              ``base.init`` (a checkpoint), or pre-training on
                    proof-domain chat text (a ``response_fraction`` share
                    with the reference proof).
  generator_sft     SFT from the base: problem → proof Y + honest
                    self-evaluation Z (rule-written), on its own pool of
                    ``generator.num_problems`` train problems for
                    ``generator.sft_steps`` steps (its own ``seq_len``,
                    ``batch_size`` and ``lr``), with refinement pairs
                    (previous corrupted proof + the checker's analysis →
                    the reference; share ``generator.refine_fraction``).
  verifier_sft      SFT from the base: problem + proof → the checker's analysis.
  meta_sft          SFT from the base: problem + proof + noisy analysis → the
                    rule meta-verification.
  verifier_rl       GRPO from verifier_sft, reward R_format · R_score.
  verifier_rl_meta  GRPO from verifier_sft, reward R_format · R_score · R_meta,
                    the meta_sft model sampled in the loop.
  generator_rl      GRPO from generator_sft, reward R_format(Y, Z) · (α R_Y +
                    β R_score(s', R_Y) · R_meta(Z)), R_Y from verifier_rl_meta,
                    R_meta from meta_sft (``rl.generator_steps`` 0 skips it:
                    the generator is then generator_sft).
  evaluate          on test problems: each verifier's score accuracy and issue
                    faithfulness on the test proofs (greedy); each generator's
                    proof correctness (checker) for a single pass and
                    refinement after 1/2/4 rounds (``grm.verify.refine``), the
                    final generator in search (``grm.verify.search``) with
                    the final verifier; auto-labelling agreement with the
                    checker as n and m vary (``grm.verify.labelling``).
                    ``report.md``, ``results.json``, ``mathv2.png``.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import ml_collections
import numpy as np

from experiments import common
from experiments import pretrain as pretrain_job
from experiments.grpo import grpo_config
from grm.verify import evaluation as eval_lib
from grm.verify import format as verify_format
from grm.verify import labelling as label_lib
from grm.verify import refine as refine_lib
from grm.verify import sampling as sampling_lib
from grm.verify import search as search_lib
from grm.verify import training as train_lib
from opd import tasks as tasks_lib
from opd.rollout.episodes import sampling_for_chat
from opd.tasks import Example
from opd.tasks.proof_task import check_proof
from opd.training import lm_trainer
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.checkpoints import load_params
from opd.training.files import read_json
from opd.training.metrics_writer import MetricWriter

VERIFIERS = ("verifier_sft", "verifier_rl", "verifier_rl_meta")
GENERATORS = ("generator_sft", "generator_rl")
# config.sample.constrained_roles: the roles whose samples (outside GRPO's own
# rollouts) are decoded under their whole grammar (opd.rollout.constraint), so every
# finished one parses valid: the verifier's analysis and the meta-verifier's verdicts.
ROLE_PATTERNS = {"verifier": verify_format.ANALYSIS_PATTERN,
                 "meta": verify_format.META_PATTERN}


_Ctx = common.JobContext


# ----------------------------------------------------------------------------- data
def _stage_data(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  out, counts = {}, {}
  for split, n, seed in (("train", c.data.num_train, c.seed), ("test", c.data.num_test,
                                                               c.seed + 1)):
    examples = train_lib.proof_problems(split, n, difficulties=tuple(c.data.difficulties),
                                        seed=seed)
    items = train_lib.proof_items(examples, corruptions=c.data.corruptions, seed=seed)
    out[split] = {"examples": [ex.to_json() for ex in examples],
                  "items": [{"example": it.example.id, "proof": it.proof, "source": it.source}
                            for it in items]}
    counts[f"{split}_problems"] = len(examples)
    counts[f"{split}_proofs"] = len(items)
    for s in (0.0, 0.5, 1.0):
      counts[f"{split}_label_{s:g}"] = sum(it.check.score == s for it in items)
  common.write_json(workdir / "data.json", out)
  return counts


def _example(text: str) -> Example:
  d = json.loads(text)
  return Example(**{**d, "reference": tuple(tuple(t) for t in d["reference"])})


def _load(ctx: _Ctx, split: str) -> tuple[list[Example], list[train_lib.ProofItem]]:
  raw = read_json(ctx.root / "data" / "data.json", expect=dict)[split]
  examples = [_example(t) for t in raw["examples"]]
  by_id = {ex.id: ex for ex in examples}
  items = [train_lib.ProofItem(by_id[r["example"]], r["proof"],
                               check_proof(by_id[r["example"]], r["proof"]),
                               r["source"]) for r in raw["items"]]
  return examples, items


# ----------------------------------------------------------------------------- models
def _params(ctx: _Ctx, stage: str):
  path = (ctx.config.base.init if stage == "base" and ctx.config.base.init
          else ctx.root / stage / "checkpoints")
  return load_params(path, ctx.model_cfg, mesh=ctx.mesh, rules=ctx.rules)


def _stage_base(ctx: _Ctx, workdir: pathlib.Path) -> dict:
  c = ctx.config
  if c.base.init:
    return {"init": str(c.base.init)}
  docs = []
  for responses, n, seed in ((True, round(c.base.num_docs * c.base.response_fraction), c.seed),
                             (False, c.base.num_docs - round(c.base.num_docs
                                                             * c.base.response_fraction),
                              c.seed + 1)):
    docs += tasks_lib.mixture_corpus(n, seed, domains=("proof",),
                                     difficulties=tuple(c.data.difficulties),
                                     responses=responses)
  batches = iter(pretrain_job.lm_batches(docs, ctx.tok, ctx.model_cfg, _base_group(c),
                                         seed=c.seed, num_epochs=None))
  loop = lm_trainer.LMTrainConfig(steps=c.base.steps, keep_checkpoints=1)
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=max(1, c.base.steps // 20))
    lm_trainer.train_lm(ctx.model_cfg, batches, common.optim_config(c.base_optim,
                                                                    "config.base_optim"),
                        loop, RunIO(checkpoint_dir=workdir / "checkpoints", on_metrics=logger,
                                    config={"model": ctx.model_cfg.to_dict()}),
                        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed))
  return _losses(logger, docs=len(docs))


def _base_group(c):
  """The ``train``/``data`` fields ``experiments.pretrain.lm_batches`` reads."""
  return ml_collections.ConfigDict({"train": {"seq_len": c.base.seq_len,
                                              "batch_size": c.base.batch_size},
                                    "data": {"mode": "pack"}})


def _losses(logger, **extra) -> dict:
  losses = [m["loss"] for _, m in logger.history if "loss" in m]
  return {**extra, "loss_first": losses[0], "loss_final": float(np.mean(losses[-5:]))}


def _sft(ctx: _Ctx, pairs, workdir: pathlib.Path, *, steps: int | None = None,
         seq_len: int | None = None, batch_size: int | None = None,
         lr: float | None = None) -> dict:
  """SFT of a role from the base; ``steps``, ``seq_len``, ``batch_size`` and ``lr``
  default to the shared ``sft`` / ``sft_optim`` groups."""
  c = ctx.config
  steps = steps or c.sft.steps
  loop = lm_trainer.LMTrainConfig(steps=steps, keep_checkpoints=1)
  with MetricWriter(workdir) as writer:
    logger = common.Logger(writer, every=max(1, steps // 20))
    optim = common.optim_config(c.sft_optim, "config.sft_optim")
    if steps != c.sft.steps and optim.schedule != "constant":  # the schedule spans the run
      optim = dataclasses.replace(optim, decay_steps=max(1, steps - optim.warmup_steps))
    if lr is not None:
      optim = dataclasses.replace(optim, lr=float(lr))
    train_lib.train_role_sft(
        ctx.model_cfg, _params(ctx, "base"), pairs, optim=optim, loop=loop,
        io=RunIO(checkpoint_dir=workdir / "checkpoints", on_metrics=logger),
        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed, tokenizer=ctx.tok),
        seq_len=seq_len or c.sft.seq_len, batch_size=batch_size or c.sft.batch_size)
  return _losses(logger, pairs=len(pairs))


def _stage_generator_sft(ctx, workdir):
  c = ctx.config
  problems = train_lib.proof_problems("train", c.generator.num_problems,
                                      difficulties=tuple(c.data.difficulties), seed=c.seed + 2)
  items = train_lib.proof_items(problems, corruptions=c.data.corruptions, seed=c.seed + 2)
  pairs = train_lib.generator_pairs(items, corrupt_fraction=c.data.generator_corrupt_fraction,
                                    seed=c.seed)
  g = c.generator
  refine = train_lib.refine_pairs(items, fraction=g.refine_fraction, seed=c.seed + 3)
  out = _sft(ctx, pairs + refine, workdir, steps=g.sft_steps, seq_len=g.seq_len,
             batch_size=g.batch_size, lr=g.lr)
  return {**out, "refine_pairs": len(refine)}


def _stage_verifier_sft(ctx, workdir):
  return _sft(ctx, train_lib.verifier_pairs(_load(ctx, "train")[1]), workdir)


def _stage_meta_sft(ctx, workdir):
  _, items = _load(ctx, "train")
  return _sft(ctx, train_lib.meta_pairs(items, noise=ctx.config.data.analysis_noise,
                                        seed=ctx.config.seed), workdir)


class _Counted:
  """A ``GenerateFn`` that counts the samples cut at the token budget."""

  def __init__(self, fn):
    self.fn, self.samples, self.truncated = fn, 0, 0

  def __call__(self, prompts):
    texts = self.fn(prompts)
    self.samples += len(texts)
    self.truncated += sum(t.endswith(sampling_lib.TRUNCATED) for t in texts)
    return texts


def _sampler(ctx: _Ctx, params, role: str, *, temperature: float | None = None,
             seed: int = 0) -> _Counted:
  """A role's ``GenerateFn``; every one has the same rows, prompt length and
  decode width, so a run compiles one sampler program."""
  s = ctx.config.sample
  n = s.proof_tokens if role == "generator" else s.analysis_tokens
  sampling = dataclasses.replace(
      sampling_for_chat(ctx.tok, max_new_tokens=n,
                        temperature=s.temperature if temperature is None else temperature),
      max_new_tokens_cap=max(s.proof_tokens, s.analysis_tokens))
  pattern = ROLE_PATTERNS[role] if role in constrained_roles(ctx.config) else False
  return _Counted(sampling_lib.sampler_fn(ctx.model_cfg, params, ctx.tok, sampling, seed=seed,
                                          batch_size=s.batch_size, prompt_bucket=s.prompt_len,
                                          mesh=ctx.mesh, rules=ctx.rules, constrained=pattern))


def constrained_roles(config) -> tuple[str, ...]:
  """``config.sample.constrained_roles`` (default none), each a key of ``ROLE_PATTERNS``;
  ValueError naming the field otherwise."""
  roles = config.sample.get("constrained_roles", ())
  if isinstance(roles, str) or not all(r in ROLE_PATTERNS for r in roles):
    raise ValueError(f"config.sample.constrained_roles={roles!r} must be a tuple of roles "
                     f"among {tuple(ROLE_PATTERNS)}")
  return tuple(roles)


def _rl(ctx: _Ctx, start: str, examples, reward_fn, steps: int, workdir: pathlib.Path,
        max_new_tokens: int | None = None) -> dict:
  c = ctx.config
  cfg = grpo_config(c.grpo)
  if max_new_tokens:
    cfg = dataclasses.replace(cfg, max_new_tokens=max_new_tokens)
  with MetricWriter(workdir) as writer:
    run = train_lib.train_role_rl(
        ctx.model_cfg, _params(ctx, start), examples, cfg,
        common.optim_config(c.grpo_optim, "config.grpo_optim"), reward_fn, LoopConfig(steps),
        RunIO(writer=writer, checkpoint_dir=workdir / "checkpoints"),
        runtime=Runtime(ctx.mesh, ctx.rules, seed=c.seed, tokenizer=ctx.tok))
  out = {"steps": len(run.history)}
  keys = sorted({k for m in run.history for k in m
                 if k == "reward/mean" or (k.startswith("reward/components/")
                                           and k.endswith("/mean"))})
  for k in keys:
    vals = [m[k] for m in run.history if k in m]
    name = k.removeprefix("reward/components/").removesuffix("/mean").replace("/", "_")
    out[f"{name}_first"], out[f"{name}_final"] = vals[0], float(np.mean(vals[-5:]))
  return out


def _stage_verifier_rl(ctx, workdir, with_meta: bool = False):
  c = ctx.config
  meta_fn = _sampler(ctx, _params(ctx, "meta_sft"), "meta", seed=c.seed + 5) if with_meta else None
  examples = train_lib.verifier_examples(_load(ctx, "train")[1])
  return _rl(ctx, "verifier_sft", examples, train_lib.VerifierRLReward(meta_fn),
             c.rl.verifier_steps, workdir)


def _stage_generator_rl(ctx, workdir):
  c = ctx.config
  if not c.rl.generator_steps:
    return {"skipped": 1}
  reward = train_lib.GeneratorRLReward(
      _sampler(ctx, _params(ctx, "verifier_rl_meta"), "verifier", seed=c.seed + 6),
      _sampler(ctx, _params(ctx, "meta_sft"), "meta", seed=c.seed + 7), alpha=c.rl.alpha,
      beta=c.rl.beta)
  examples = train_lib.generator_examples(_load(ctx, "train")[0])
  return _rl(ctx, "generator_sft", examples, reward, c.rl.generator_steps, workdir,
             max_new_tokens=c.rl.generator_max_new_tokens)


# ----------------------------------------------------------------------------- evaluation
def _stage_evaluate(ctx, workdir):
  c, e = ctx.config, ctx.config.eval
  examples, items = _load(ctx, "test")
  results = {"verifiers": {}, "generators": {}}
  problems = [it.problem for it in items]
  proofs = [it.proof for it in items]
  checks = [it.check for it in items]
  for stage in VERIFIERS:
    fn = _sampler(ctx, _params(ctx, stage), "verifier", temperature=0.0, seed=c.seed + 11)
    results["verifiers"][stage] = eval_lib.evaluate_verifier(fn, problems, proofs, checks)
    print(f"[mathv2] {stage}: {results['verifiers'][stage]}", flush=True)
  generators = [g for g in GENERATORS if g != "generator_rl" or c.rl.generator_steps]
  texts = [ex.prompt for ex in examples]
  for stage in generators:
    fn = _sampler(ctx, _params(ctx, stage), "generator", seed=c.seed + 12)
    run = refine_lib.refine(texts, fn, max_rounds=max(e.rounds), progress=True)
    row = {"single": eval_lib.correctness(eval_lib.checker_scores(
        examples, [run.proof_at(p, 0) for p in range(len(examples))]))}
    for r in e.rounds:
      row[f"refine@{r}"] = eval_lib.correctness(eval_lib.checker_scores(
          examples, [run.proof_at(p, r) for p in range(len(examples))]))
    row["converged"] = float(np.mean(run.converged))
    row["format"] = float(np.mean([g.valid for gens in run.generations for g in gens]))
    results["generators"][stage] = row
    print(f"[mathv2] {stage}: " + ", ".join(f"{k} {v['correct']:.2f}" for k, v in row.items()
                                            if isinstance(v, dict)), flush=True)
  final_gen, final_ver = generators[-1], VERIFIERS[-1]
  gen_fn = _sampler(ctx, _params(ctx, final_gen), "generator", seed=c.seed + 13)
  ver_fn = _sampler(ctx, _params(ctx, final_ver), "verifier", seed=c.seed + 14)
  meta_fn = _sampler(ctx, _params(ctx, "meta_sft"), "meta", seed=c.seed + 15)
  sub = examples[:e.search_problems]
  found = search_lib.search([ex.prompt for ex in sub], gen_fn, ver_fn, search_lib.SearchConfig(
      n_candidates=e.search_pool, n_analyses=e.search_analyses, n_keep=e.search_kept,
      n_rounds=e.search_rounds), progress=True)
  results["search"] = {
      "generator": final_gen, "verifier": final_ver, "problems": len(sub),
      **eval_lib.correctness(eval_lib.checker_scores(sub, [r.best.proof for r in found])),
      "candidates": float(np.mean([len(r.candidates) for r in found]))}
  results["search_baseline"] = results["generators"][final_gen]["single"]
  lab_items = items[:e.label_proofs]
  labelling = label_lib.label_proofs([it.problem for it in lab_items],
                                     [it.proof for it in lab_items], ver_fn, meta_fn,
                                     n=max(e.label_ns), m=max(e.label_ms), progress=True)
  results["labelling"] = label_lib.agreement_table(
      labelling, [it.check.score for it in lab_items], tuple(e.label_ns), tuple(e.label_ms))
  results["samples_truncated"] = {"generator": gen_fn.truncated, "verifier": ver_fn.truncated,
                                  "meta": meta_fn.truncated}
  common.write_json(workdir / "results.json", results)
  (workdir / "report.md").write_text(render_report(results, c))
  _plot(results, tuple(e.rounds), workdir / "mathv2.png")
  out = {}
  for stage, v in results["verifiers"].items():
    out[f"{stage}/accuracy"] = v["accuracy"]
    if np.isfinite(v["faithfulness"]):  # NaN when no issue was stated
      out[f"{stage}/faithfulness"] = v["faithfulness"]
  for stage, row in results["generators"].items():
    for k, v in row.items():
      if isinstance(v, dict):
        out[f"{stage}/{k}"] = v["correct"]
  out["search/correct"] = results["search"]["correct"]
  return out


def _pm(v: float, se: float, scale: float = 100.0) -> str:
  return f"{scale * v:.1f}" + ("" if np.isnan(se) else f" ± {scale * se:.1f}")


def render_report(results: dict, c) -> str:
  """Markdown: proof correctness, verifier accuracy / faithfulness, labelling agreement."""
  rounds = tuple(c.eval.rounds)
  cols = ["single"] + [f"refine@{r}" for r in rounds]
  lines = ["# DeepSeekMath-V2 on the toy proof domain (docs/DESIGN.md §7)", "",
           "Every number is measured with the rule step checker on test-split problems; every "
           "text is sampled from our models. ± is one standard error over problems/proofs.", "",
           "## Proof correctness (% of proofs the checker scores 1)", "",
           "| generator | " + " | ".join(cols) + " | self-score 1 reached | format |",
           "|---" * (len(cols) + 3) + "|"]
  for stage, row in results["generators"].items():
    cells = [_pm(row[k]["correct"], row[k]["correct_se"]) for k in cols]
    lines.append(f"| {stage} | " + " | ".join(cells) +
                 f" | {100 * row['converged']:.0f}% | {100 * row['format']:.0f}% |")
  s = results["search"]
  lines += ["", f"Search ({s['generator']} + {s['verifier']}; pool {c.eval.search_pool}, "
            f"{c.eval.search_analyses} analyses, keep {c.eval.search_kept}, "
            f"{c.eval.search_rounds} rounds; {s['problems']} problems, "
            f"{s['candidates']:.1f} candidates each): {_pm(s['correct'], s['correct_se'])}% "
            f"correct, mean checker score {s['mean_score']:.2f}.", "",
           "## Verifiers on the test proofs (reference and corrupted; greedy)", "",
           "| verifier | reward | score accuracy % | faithfulness % | issues stated | format % "
           "| mean R_score |", "|---|---|---|---|---|---|---|"]
  reward = {"verifier_sft": "SFT (rule-written)", "verifier_rl": "R_format·R_score",
            "verifier_rl_meta": "R_format·R_score·R_meta"}
  for stage, v in results["verifiers"].items():
    faith = "–" if np.isnan(v["faithfulness"]) else f"{100 * v['faithfulness']:.1f}"
    lines.append(f"| {stage} | {reward[stage]} | {_pm(v['accuracy'], v['accuracy_se'])} | "
                 f"{faith} | {v['stated_issues']} | {100 * v['format']:.0f} | "
                 f"{v['r_score']:.3f} |")
  lines += ["", "## Automatic labelling vs the checker", "",
            "| n analyses | m meta-checks | agreement % | mean abs error | mean label |",
            "|---|---|---|---|---|"]
  lines += [f"| {r['n']} | {r['m']} | {100 * r['agreement']:.1f} | {r['mae']:.3f} | "
            f"{r['mean_label']:.3f} |" for r in results["labelling"]]
  t = results["samples_truncated"]
  lines += ["", f"Samples cut at the token budget (counted invalid): generator {t['generator']}, "
            f"verifier {t['verifier']}, meta-verifier {t['meta']}."]
  return "\n".join(lines) + "\n"


def _plot(results: dict, rounds, path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.5))
  xs = [0, *rounds]
  for stage, row in results["generators"].items():
    keys = ["single"] + [f"refine@{r}" for r in rounds]
    v = np.array([100 * row[k]["correct"] for k in keys])
    se = np.nan_to_num(np.array([100 * row[k]["correct_se"] for k in keys]))
    ax.errorbar(xs, v, yerr=se, marker="o", capsize=3, label=stage)
  s = results["search"]
  ax.errorbar([max(xs) + 1], [100 * s["correct"]], yerr=[np.nan_to_num(100 * s["correct_se"])],
              marker="s", color="k", ls="", capsize=3, label="search")
  ax.set_xlabel("refinement rounds")
  ax.set_ylabel("proofs correct (%)")
  ax.legend(fontsize=7)
  names = list(results["verifiers"])
  acc = [100 * results["verifiers"][n]["accuracy"] for n in names]
  faith = [100 * np.nan_to_num(results["verifiers"][n]["faithfulness"]) for n in names]
  x = np.arange(len(names))
  bx.bar(x - 0.2, acc, 0.4, label="score accuracy")
  bx.bar(x + 0.2, faith, 0.4, label="faithfulness")
  bx.set_xticks(x, [n.replace("verifier_", "") for n in names])
  bx.set_ylabel("%")
  bx.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


STAGES = (("data", _stage_data, ("data",)),
          ("base", _stage_base, ("base", "base_optim", "data")),
          ("generator_sft", _stage_generator_sft, ("sft", "sft_optim", "generator", "data")),
          ("verifier_sft", _stage_verifier_sft, ("sft", "sft_optim")),
          ("meta_sft", _stage_meta_sft, ("sft", "sft_optim")),
          ("verifier_rl", _stage_verifier_rl, ("rl", "grpo", "grpo_optim")),
          ("verifier_rl_meta", lambda ctx, w: _stage_verifier_rl(ctx, w, with_meta=True),
           ("rl", "grpo", "grpo_optim", "sample")),
          ("generator_rl", _stage_generator_rl, ("rl", "grpo", "grpo_optim", "sample")),
          ("evaluate", _stage_evaluate, ("eval", "sample")))

# The stages each one reads (``common.Stages.run_all``: a rerun upstream makes it stale).
UPSTREAM = {"base": ("data",), "generator_sft": ("base",), "verifier_sft": ("data", "base"),
            "meta_sft": ("data", "base"), "verifier_rl": ("data", "verifier_sft"),
            "verifier_rl_meta": ("data", "verifier_sft", "meta_sft"),
            "generator_rl": ("data", "generator_sft", "verifier_rl_meta", "meta_sft"),
            "evaluate": ("data", *VERIFIERS, *GENERATORS, "meta_sft")}


def run(config, workdir: str) -> dict:
  constrained_roles(config)  # checked before any stage runs
  root = pathlib.Path(workdir)
  out = common.run_stage_table(config, root, "mathv2", STAGES, UPSTREAM,
                               _Ctx.for_run(config, root))
  return out
