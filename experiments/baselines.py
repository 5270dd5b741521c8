"""Jobs ``merge``, ``task_arithmetic``, ``offpolicy_kd``, ``mixed_rl``, ``sequential_rl``
and ``baselines`` (all five): what OPD is compared against (docs/DESIGN.md §3).

Config: ``experiments/configs/baselines.py`` (its docstring has the commands
and the compute budget). Each job writes the model it produces to
``WORKDIR/checkpoints`` (``load_params`` reads it) and returns its final metrics:

* ``merge``: the parameter average of the specialists (``config.teachers``),
  ``opd.distill.merging.average_params``;
* ``task_arithmetic``: ``θ_base + λ Σ_i (θ_i − θ_base)``
  (``config.task_arithmetic.scale``), with the task vectors' norms and mean
  pairwise cosine (how much they can interfere);
* ``offpolicy_kd``: ``opd.distill.offpolicy``: the specialists answer their
  domains' train prompts once, the student (``config.kd.init``, default the
  base) learns their full next-token distributions on that text by forward
  KL; the held-out forward KL per teacher is the eval;
* ``mixed_rl``: ``opd.rl.train_grpo`` from the cold-start student
  (``config.student.init``) on every domain's prompts with their verifiers;
* ``sequential_rl``: ``opd.rl.sequential.train_sequential_grpo``, one domain
  after another (``config.sequential.order``), ``config.rl_train.steps``
  split evenly over the stages.

``baselines`` runs the ones in ``config.baselines`` as stages of one workdir
(``WORKDIR/<job>/``), each a run directory reused only under the same config
(a stage directory written under another config is refused, fields named),
resumable, skipped once finished (``experiments.common.run_stage``).
Where ``config.base.init`` or a teacher's ``init`` is "" (the ``tiny``
variant) the inputs are built first: a random base saved as a checkpoint in
``WORKDIR/base`` and each teacher SFT'd from it on its domain in
``WORKDIR/teachers/<name>`` (reused if there); ``config.student.init`` ""
means the base.

Importing this module registers the jobs (``--jobs_module=experiments.baselines``).
"""
from __future__ import annotations

import logging
import pathlib

import jax
import ml_collections
import numpy as np

from experiments import common, jobs
from experiments import grpo as grpo_job
from opd.config.fields import from_group
from opd.config.overrides import config_to_dict
from opd.distill import Teacher, TeacherPool
from opd.distill.merging import average_params, task_arithmetic, task_vectors
from opd.distill.offpolicy import (OffPolicyConfig, make_heldout_forward_kl, teacher_rollouts,
                                   train_offpolicy_kd)
from opd.models import init_params, to_model_config
from opd.rl import GRPOExtras, train_grpo
from opd.rl.sequential import stage_name, train_sequential_grpo
from opd.tasks import domain_examples
from opd.training import lm_trainer
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.checkpoints import CheckpointManager, load_params
from opd.training.metrics_writer import MetricWriter, read_metrics
from opd.training.sft import SFTData, train_sft

log = logging.getLogger(__name__)

# The config groups each job reads, besides these shared ones.
COMMON = ("seed", "mesh", "sharding_rules", "model", "domains", "data")
USES = {
    "merge": ("teachers",),
    "task_arithmetic": ("teachers", "base", "task_arithmetic"),
    "offpolicy_kd": ("teachers", "base", "offpolicy", "kd", "kd_optim"),
    "mixed_rl": ("base", "student", "grpo", "rl_optim", "rl_train", "agent_reward"),
    "sequential_rl": ("base", "student", "grpo", "rl_optim", "rl_train", "agent_reward",
                      "sequential"),
}


def _ckpt(root: pathlib.Path) -> pathlib.Path:
  return root / "checkpoints"


def _has_checkpoint(directory: pathlib.Path) -> bool:
  return directory.is_dir() and CheckpointManager(directory).latest_step() is not None


def save_model(directory: pathlib.Path, model_cfg, params, config) -> str:
  """Writes ``params`` as checkpoint 0 of ``directory`` (``load_params`` reads it)."""
  mngr = CheckpointManager(directory, max_to_keep=1)
  try:
    mngr.save(0, {"params": params}, config={"model": model_cfg.to_dict(),
                                             "experiment": config_to_dict(config)})
    mngr.wait()
  finally:
    mngr.close()
  return str(directory)


def _base(config, root: pathlib.Path) -> str:
  """``config.base.init``, or a random base (seed ``config.seed``) saved in ``root/base``."""
  if config.base.init:
    return config.base.init
  ckpt = _ckpt(root / "base")
  if not _has_checkpoint(ckpt):
    cfg = to_model_config(config.model)
    print(f"[baselines] base.init is empty: saving a random init to {ckpt}", flush=True)
    save_model(ckpt, cfg, init_params(cfg, jax.random.key(config.seed)), config)
  return str(ckpt)


def _teacher(config, name: str, group, root: pathlib.Path, mesh, rules) -> str:
  """``group.init``, or a specialist SFT'd from the base in ``root/teachers/<name>``."""
  if group.init:
    return group.init
  build = config.get("build")
  if build is None or not build.sft_steps:
    raise ValueError(f"config.teachers.{name}.init is empty: name the specialist's checkpoint "
                     "directory (or set config.build.sft_steps to build one)")
  workdir = root / "teachers" / name
  if not _has_checkpoint(_ckpt(workdir)):
    cfg = to_model_config(group.model)
    print(f"[baselines] building teacher {name} ({group.domain}): {build.sft_steps} SFT steps "
          "from the base", flush=True)
    data = SFTData(domains=(group.domain,), num_train=build.num_train, num_eval=8,
                   difficulties=tuple(config.data.difficulties), seq_len=build.seq_len,
                   batch_size=build.batch_size)
    train_sft(cfg, load_params(_base(config, root), cfg, mesh=mesh, rules=rules), data, workdir,
              optim=common.optim_config(build.optim, "config.build.optim"),
              loop=lm_trainer.LMTrainConfig(steps=build.sft_steps, save_every=build.sft_steps,
                                            progress=False),
              runtime=Runtime(mesh, rules, seed=config.seed + 1,
                              tokenizer=common.tokenizer_for(cfg, workdir)))
  return str(_ckpt(workdir))


def resolve_inputs(config, root: pathlib.Path, mesh, rules, *, teachers: bool = True) -> dict:
  """``{"base", "student", "teachers": {name: dir}}`` checkpoint directories,
  building what is empty (module docstring)."""
  out = {"base": _base(config, root)} if "base" in config else {}
  if "student" in config:
    out["student"] = config.student.init or out["base"]
  if teachers and "teachers" in config:
    if not config.teachers:
      raise ValueError("config.teachers is empty: the baselines need the specialists")
    out["teachers"] = {n: _teacher(config, n, g, root, mesh, rules)
                       for n, g in config.teachers.items()}
  return out


def _specialists(config, paths, model_cfg) -> tuple[list[str], list]:
  for name, group in config.teachers.items():
    if to_model_config(group.model) != model_cfg:
      raise ValueError(f"config.teachers.{name}.model differs from config.model: merging "
                       "needs every specialist in the merged model's architecture")
  names = list(config.teachers)
  return names, [load_params(paths[n], model_cfg) for n in names]


def _write_merged(config, root, fn) -> dict:
  """Shared body of the two merging jobs: ``fn(names, params, paths, cfg) ->
  (merged params, metrics)``, saved unless a checkpoint is already there."""
  timer, root = common.Timer(), pathlib.Path(root)
  mesh, rules = common.mesh_and_rules(config)
  paths = resolve_inputs(config, root, mesh, rules)
  cfg = to_model_config(config.model)
  names, params = _specialists(config, paths["teachers"], cfg)
  merged, metrics = fn(names, params, paths, cfg)
  if _has_checkpoint(_ckpt(root)):
    print(f"[baselines] {_ckpt(root)} exists: kept", flush=True)
  else:
    save_model(_ckpt(root), cfg, merged, config)
  return {"models": len(names), "checkpoint": str(_ckpt(root)), "updates": 0,
          "sampled_tokens": 0, **metrics, "wall_s": timer.seconds}


def run_merge(config, workdir: str) -> dict:
  return _write_merged(config, workdir,
                       lambda names, params, paths, cfg: (average_params(params, names=names), {}))


def run_task_arithmetic(config, workdir: str) -> dict:
  scale = config.task_arithmetic.scale

  def merge(names, params, paths, cfg):
    base = load_params(paths["base"], cfg)
    vecs = [np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(v)])
            for v in task_vectors(base, params, names=names)]
    norms = [float(np.linalg.norm(v)) for v in vecs]
    cos = [float(vecs[i] @ vecs[j] / max(norms[i] * norms[j], 1e-30))
           for i in range(len(vecs)) for j in range(i + 1, len(vecs))]
    metrics = {f"task_vector_norm/{n}": v for n, v in zip(names, norms)}
    metrics.update(scale=float(scale), task_vector_cos_mean=float(np.mean(cos)) if cos else 1.0)
    return task_arithmetic(base, params, scale, names=names), metrics

  return _write_merged(config, workdir, merge)


def _prompts(config, domains, split: str, n: int, seed: int, unique: bool = False):
  return domain_examples(tuple(domains), split, n, seed, tuple(config.data.difficulties),
                         unique=unique)


def run_offpolicy_kd(config, workdir: str) -> dict:
  timer, root = common.Timer(), pathlib.Path(workdir)
  mesh, rules = common.mesh_and_rules(config)
  paths = resolve_inputs(config, root, mesh, rules)
  cfg = to_model_config(config.model)
  tok = common.tokenizer_for(cfg, workdir)
  teachers = [Teacher.from_checkpoint(n, paths["teachers"][n], to_model_config(g.model),
                                      domain=g.domain or None, mesh=mesh, rules=rules)
              for n, g in config.teachers.items()]
  ocfg = from_group(OffPolicyConfig, config.offpolicy, "config.offpolicy")
  train = teacher_rollouts(teachers, _prompts(config, config.domains, "train",
                                              config.kd.num_prompts, config.seed),
                           ocfg, tokenizer=tok, seed=config.seed, mesh=mesh, rules=rules)
  held = teacher_rollouts(teachers, _prompts(config, config.domains, "test",
                                             config.data.num_heldout, config.seed + 1, True),
                          ocfg, tokenizer=tok, seed=config.seed + 1, mesh=mesh, rules=rules)
  print(f"[offpolicy_kd] teacher text: {len(train.episodes)} train, {len(held.episodes)} "
        f"held-out sequences kept", flush=True)
  if not train.episodes:
    raise ValueError(f"offpolicy_kd: no teacher answer was kept (config.offpolicy.min_reward="
                     f"{ocfg.min_reward}): {train.metrics}")
  pool = TeacherPool(teachers, cfg.vocab_size, mesh, rules=rules)
  evaluate = (make_heldout_forward_kl(cfg, pool, held, ocfg, pad_id=tok.pad_id, mesh=mesh,
                                      rules=rules) if held.episodes else None)
  params = load_params(config.kd.init or paths["base"], cfg, mesh=mesh, rules=rules)
  with MetricWriter(root) as writer:
    resuming = _has_checkpoint(_ckpt(root))
    first = {} if resuming or evaluate is None else {f"eval/{k}": v
                                                     for k, v in evaluate(params).items()}
    if not resuming:
      writer.write_scalars(0, {**first, **train.metrics})
    out = train_offpolicy_kd(
        cfg, params, pool, train, ocfg, common.optim_config(config.kd_optim, "config.kd_optim"),
        LoopConfig(config.kd.steps, save_every=config.kd.save_every,
                   eval_every=config.kd.eval_every, keep_checkpoints=config.kd.keep_checkpoints),
        RunIO(writer=writer, checkpoint_dir=_ckpt(root),
              config={"experiment": config_to_dict(config)}, eval_fn=evaluate),
        runtime=Runtime(mesh, rules, seed=config.seed), pad_id=tok.pad_id)
  rows = read_metrics(root)
  last = out.history[-1] if out.history else {}
  metrics = {"steps": config.kd.steps, "updates": int(out.state.step),
             "sequences": len(train.episodes),
             "sampled_tokens": sum(len(ep.response_ids) for ep in train.episodes),
             "trained_tokens": _total(rows, "kd/response_tokens"),
             "checkpoint": str(_ckpt(root)), "wall_s": timer.seconds,
             **{k.split("/", 1)[1]: v for k, v in train.metrics.items()}}
  for key in [k for k in last if k.startswith("eval/fkl")]:
    name = key.removeprefix("eval/")
    metrics[f"{name}_final"] = last[key]
    if first:
      metrics[f"{name}_initial"] = first[key]
  common.plot_curves(root, keys=("train/loss", "eval/fkl"), filename="curves.png",
                     title="off-policy KD: forward KL")
  return metrics


def _total(rows, key: str) -> float:
  """Sum over steps of ``key`` in ``metrics.jsonl`` rows (a re-run step counted once)."""
  return float(sum({r["step"]: r[key] for r in rows if key in r}.values()))


def _rl_metrics(run_dir: pathlib.Path, domains, k: int = 5) -> dict:
  """Budget and rewards of a GRPO run from its ``metrics.jsonl``."""
  rows = read_metrics(run_dir)
  by_step = {r["step"]: r for r in rows if "reward/mean" in r}
  rewards = [by_step[s]["reward/mean"] for s in sorted(by_step)]
  out = {"sampled_tokens": _total(rows, "response/policy_tokens"),
         "reward_first": float(np.mean(rewards[:k])) if rewards else float("nan"),
         "reward_last": float(np.mean(rewards[-k:])) if rewards else float("nan")}
  for d in domains:
    vals = [by_step[s][f"reward/domain/{d}/mean"] for s in sorted(by_step)
            if f"reward/domain/{d}/mean" in by_step[s]]
    out[f"reward_last/{d}"] = float(np.mean(vals[-k:])) if vals else float("nan")
  return out


def _rl_setup(config, workdir):
  root = pathlib.Path(workdir)
  mesh, rules = common.mesh_and_rules(config)
  paths = resolve_inputs(config, root, mesh, rules, teachers=False)
  cfg = to_model_config(config.model)
  params = load_params(paths["student"], cfg, mesh=mesh, rules=rules)
  return root, mesh, rules, cfg, params, grpo_job.grpo_config(config.grpo)


def run_mixed_rl(config, workdir: str) -> dict:
  timer = common.Timer()
  root, mesh, rules, cfg, params, gcfg = _rl_setup(config, workdir)
  prompts = _prompts(config, config.domains, "train", config.data.num_prompts, config.seed)
  with MetricWriter(root) as writer:
    out = train_grpo(
        cfg, params, params if gcfg.kl_coef > 0 else None, prompts, gcfg,
        common.optim_config(config.rl_optim, "config.rl_optim"),
        LoopConfig(config.rl_train.steps, save_every=config.rl_train.save_every,
                   keep_checkpoints=config.rl_train.keep_checkpoints),
        RunIO(writer=writer, checkpoint_dir=_ckpt(root),
              config={"experiment": config_to_dict(config)}),
        runtime=Runtime(mesh, rules, seed=config.seed,
                        tokenizer=common.tokenizer_for(cfg, workdir)),
        extras=GRPOExtras(agent_config=grpo_job.agent_reward_config(config.agent_reward)))
  common.plot_curves(root, keys=["reward/mean"] + [f"reward/domain/{d}/mean"
                                                   for d in config.domains],
                     filename="reward.png", title="mixed RL reward")
  return {"steps": config.rl_train.steps, "updates": int(out.state.step),
          "checkpoint": str(_ckpt(root)), **_rl_metrics(root, config.domains),
          "wall_s": timer.seconds}


def run_sequential_rl(config, workdir: str) -> dict:
  timer = common.Timer()
  order = tuple(config.sequential.order)
  unknown = [d for d in order if d not in config.domains]
  if not order or unknown or len(set(order)) != len(order):
    raise ValueError(f"config.sequential.order={order!r} must list distinct domains of "
                     f"config.domains={tuple(config.domains)!r}")
  total = config.rl_train.steps
  steps = [total // len(order) + (i < total % len(order)) for i in range(len(order))]
  if min(steps) < 1:
    raise ValueError(f"config.rl_train.steps={total} is fewer than the {len(order)} stages of "
                     "config.sequential.order")
  root, mesh, rules, cfg, params, gcfg = _rl_setup(config, workdir)
  stages = [(d, _prompts(config, (d,), "train", config.data.num_prompts, config.seed))
            for d in order]
  out = train_sequential_grpo(
      cfg, params, stages, gcfg, common.optim_config(config.rl_optim, "config.rl_optim"),
      [LoopConfig(s, keep_checkpoints=1) for s in steps],
      RunIO(workdir=root / "stages", config={"experiment": config_to_dict(config)}),
      runtime=Runtime(mesh, rules, seed=config.seed,
                        tokenizer=common.tokenizer_for(cfg, workdir)),
      extras=GRPOExtras(agent_config=grpo_job.agent_reward_config(config.agent_reward)))
  if not _has_checkpoint(_ckpt(root)):
    save_model(_ckpt(root), cfg, out.state.params, config)
  metrics = {"steps": total, "updates": 0, "sampled_tokens": 0.0,
             "checkpoint": str(_ckpt(root)), "order": ",".join(order)}
  for i, d in enumerate(order):
    stage = _rl_metrics(root / "stages" / stage_name(i, d), (d,))
    metrics["sampled_tokens"] += stage["sampled_tokens"]
    metrics[f"reward_first/{d}"] = stage["reward_first"]
    metrics[f"reward_last/{d}"] = stage["reward_last"]
  metrics["updates"] = sum(s * gcfg.updates_per_batch for s in steps)
  metrics["wall_s"] = timer.seconds
  return metrics


RUNS = {"merge": run_merge, "task_arithmetic": run_task_arithmetic,
        "offpolicy_kd": run_offpolicy_kd, "mixed_rl": run_mixed_rl,
        "sequential_rl": run_sequential_rl}


def stage_config(config, job: str, paths: dict) -> ml_collections.ConfigDict:
  """The config of ``job`` as a stage of ``baselines``: the groups it reads,
  with the resolved input checkpoints filled in."""
  c = ml_collections.ConfigDict({"job": job})
  for name in COMMON + USES[job]:
    value = config[name]
    c[name] = (ml_collections.ConfigDict(value.to_dict())
               if isinstance(value, ml_collections.ConfigDict) else value)
  if "base" in c:
    c.base.init = paths["base"]
  if "student" in c:
    c.student.init = paths["student"]
  if "teachers" in c:
    for n in c.teachers:
      c.teachers[n].init = paths["teachers"][n]
  return c


def run_baselines(config, workdir: str) -> dict:
  timer, root = common.Timer(), pathlib.Path(workdir)
  chosen = tuple(config.baselines)
  bad = [b for b in chosen if b not in RUNS]
  if not chosen or bad:
    raise ValueError(f"config.baselines={chosen!r}: expected some of {tuple(RUNS)}")
  mesh, rules = common.mesh_and_rules(config)
  needs_teachers = any("teachers" in USES[b] for b in chosen)
  paths = resolve_inputs(config, root, mesh, rules, teachers=needs_teachers)
  out = {}
  for job in chosen:
    ckpts = [paths.get("base"), paths.get("student"), *paths.get("teachers", {}).values()]
    metrics = common.run_stage(job, RUNS[job], stage_config(config, job, paths), root / job,
                               [pathlib.Path(p).parent for p in ckpts if p])
    out.update({f"{job}/{k}": v for k, v in metrics.items()})
  out["wall_s"] = timer.seconds
  return out


for _name, _fn in [("baselines", "run_baselines")] + [(n, f"run_{n}") for n in RUNS]:
  jobs.register(_name, f"experiments.baselines:{_fn}")
