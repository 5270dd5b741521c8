"""Jobs ``cold_start`` and ``opd``: multi-teacher on-policy distillation (docs/DESIGN.md §3).

Both take ``config.teachers.<name>`` groups (``init``: a checkpoint
directory, ``domain``: the task domain it specialises in or "" for none,
``model``: its model group) and ``config.student`` (``model``, ``init``: a
checkpoint directory, or "" for a random init).

* ``cold_start``: each teacher answers its domain's train prompts; only
  verified answers (reward >= ``config.cold_start.min_reward``) are kept
  (``opd.distill.cold_start``) and the student is fine-tuned on them with the
  SFT objective (``opd.training.sft.sft_batches`` + ``train_lm``).
* ``opd``: ``opd.distill.train_opd`` on the teachers' domains' train prompts,
  with the reverse KL of each teacher on held-out test prompts as the eval
  (``eval/rkl/<teacher>``, also before the first step); curves of the
  reverse KL, the top-8 overlap and the skip counts are plotted.

``config.build_teachers.sft_steps > 0`` (the ``tiny`` variant) first builds
each teacher whose ``init`` is empty itself: a short SFT of a random init on
its domain, checkpointed under ``WORKDIR/teachers/<name>`` (reused if there).
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib

import jax
import numpy as np

from experiments import common
from opd.config.fields import from_group
from opd.config.overrides import config_to_dict
from opd.distill import OPDConfig, Teacher, TeacherPool, make_heldout_eval, train_opd
from opd.distill.cold_start import AnswerSampling, teacher_sft_pairs
from opd.models import init_params, to_model_config
from opd.parallel import distributed
from opd.tasks import domain_examples
from opd.training import lm_trainer
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.checkpoints import CheckpointManager, load_params
from opd.training.metrics_writer import MetricWriter
from opd.training.sft import SFTData, sft_batches, train_sft

log = logging.getLogger(__name__)


def _build_teacher(config, name: str, group, root: pathlib.Path, mesh, rules) -> str:
  """Checkpoint directory of a tiny specialist trained here (SFT of a random init)."""
  workdir = root / "teachers" / name
  ckpt = workdir / "checkpoints"
  if not ckpt.is_dir() or CheckpointManager(ckpt).latest_step() is None:
    steps = config.build_teachers.sft_steps
    print(f"[distill] building teacher {name} ({group.domain}): {steps} SFT steps", flush=True)
    cfg = to_model_config(group.model)
    data = SFTData(domains=(group.domain,), num_train=config.build_teachers.num_train,
                   num_eval=8, difficulties=tuple(config.data.difficulties),
                   seq_len=config.opd.rollout.seq_len, batch_size=config.build_teachers.batch_size,
                   mode=common.sft_mode(cfg))
    train_sft(cfg, None, data, workdir,
              optim=common.optim_config(config.build_teachers.optim),
              loop=lm_trainer.LMTrainConfig(steps=steps, save_every=steps, progress=False),
              runtime=Runtime(mesh, rules, seed=config.seed + 1,
                              tokenizer=common.tokenizer_for(cfg, workdir)))
  return str(ckpt)


def load_teachers(config, workdir, mesh, rules) -> list[Teacher]:
  """The ``config.teachers`` (built first where ``init`` is empty and building is on)."""
  if not config.teachers:
    raise ValueError("config.teachers is empty: distillation needs at least one teacher")
  out = []
  for name, group in config.teachers.items():
    init = group.init
    if not init and config.build_teachers.sft_steps:
      init = _build_teacher(config, name, group, pathlib.Path(workdir), mesh, rules)
    if not init:
      raise ValueError(f"config.teachers.{name}.init is empty: name the teacher's checkpoint "
                       "directory (or set config.build_teachers.sft_steps to build one)")
    cfg = to_model_config(group.model)
    teacher = Teacher.from_checkpoint(name, init, cfg, domain=group.domain or None, mesh=mesh,
                                      rules=rules)
    if cfg.tokenizer != config.student.model.tokenizer:
      teacher = dataclasses.replace(teacher, tokenizer=_run_tokenizer(name, cfg, init))
    out.append(teacher)
  return out


def _run_tokenizer(name: str, cfg, init: str):
  """The tokenizer a teacher with another tokenizer than the student's was
  trained with: the one its run directory (``init``'s parent) holds, never
  built here (``train_opd`` then asks it through ``opd.distill.crosstok_pool``)."""
  run_dir = pathlib.Path(init).parent
  kept = run_dir / "tokenizer" / cfg.tokenizer.replace(":", "_")
  if cfg.tokenizer != "byte" and not kept.is_dir():
    raise ValueError(f"teacher {name!r}: tokenizer {cfg.tokenizer!r} (not the student's) has no "
                     f"directory in its run {str(run_dir)!r} (tokenizer/)")
  return common.tokenizer_for(cfg, run_dir)


def _setup(config, workdir):
  """``(mesh, rules, teachers, student_cfg, student_params, tokenizer)``.

  With several jax processes the teachers are loaded on this process's own
  devices (``opd.parallel.distributed.local_mesh``), where the host-driven
  work of OPD runs (docs/DESIGN.md §3, "Several processes").
  """
  mesh, rules = common.mesh_and_rules(config)
  teachers = load_teachers(config, workdir, distributed.host_work_mesh(mesh), rules)
  cfg = to_model_config(config.student.model)
  if config.student.init:
    params = load_params(config.student.init, cfg, mesh=mesh, rules=rules)
  else:
    log.warning("config.student.init is empty: the student starts from a random init")
    params = init_params(cfg, jax.random.key(config.seed))
  return mesh, rules, teachers, cfg, params, common.tokenizer_for(cfg, workdir)


def _domains(teachers) -> tuple[str, ...]:
  domains = tuple(dict.fromkeys(t.domain for t in teachers if t.domain))
  if not domains:
    raise ValueError("no teacher has a domain (config.teachers.<name>.domain): the prompts are "
                     "drawn from the teachers' domains")
  return domains


def run_opd(config, workdir: str) -> dict:
  timer = common.Timer()
  mesh, rules, teachers, student_cfg, params, tok = _setup(config, workdir)
  cfg = from_group(OPDConfig, config.opd, "config.opd")
  domains, diffs = _domains(teachers), tuple(config.data.difficulties)
  prompts = domain_examples(domains, "train", config.data.num_prompts, config.seed, diffs)
  held = domain_examples(domains, "test", config.data.num_heldout, config.seed + 1, diffs,
                         unique=True)
  # Teachers with another tokenizer go to train_opd as Teachers (its
  # cross-tokenizer pool); the held-out reverse KL covers the others only.
  plain = [t for t in teachers if t.tokenizer is None]
  pool = (TeacherPool(plain, student_cfg.vocab_size, distributed.host_work_mesh(mesh), rules=rules)
          if plain else None)
  evaluate = (make_heldout_eval(student_cfg, pool, held, cfg, tokenizer=tok, mesh=pool.mesh,
                                rules=rules, seed=config.seed + 2) if pool is not None else None)
  root = pathlib.Path(workdir)
  with MetricWriter(root) as writer:
    resuming = CheckpointManager(root / "checkpoints").latest_step() is not None
    first = ({} if resuming or evaluate is None
             else {f"eval/{k}": v for k, v in evaluate(params).items()})
    if first:
      writer.write_scalars(0, first)
    # Saved with every checkpoint: a resumed run gets the original step-0 eval back.
    firsts = {0: first} if first else {}
    # A LoRA student (config.student.lora.rank > 0) starts with zero adapters:
    # the step-0 eval above saw exactly its merged params.
    student = common.lora_student(params, config.student.get("lora"), "config.student.lora",
                                  base_checkpoint=config.student.init)
    asked = pool if len(plain) == len(teachers) else teachers
    out = train_opd(student_cfg, student, asked, prompts, cfg, common.optim_config(config.optim),
                    LoopConfig(config.train.steps, save_every=config.train.save_every,
                               eval_every=config.train.eval_every if evaluate else 0,
                               keep_checkpoints=config.train.keep_checkpoints),
                    RunIO(writer=writer, checkpoint_dir=root / "checkpoints",
                          config={"experiment": config_to_dict(config)}, eval_fn=evaluate,
                          first_metrics=firsts),
                    runtime=Runtime(mesh, rules, seed=config.seed, tokenizer=tok))
  first = firsts.get(0, {})
  names, last = [t.name for t in teachers], out.history[-1] if out.history else {}
  plots = [common.plot_curves(root, keys=[f"eval/rkl/{n}" for n in names], filename="rkl.png",
                              title="held-out reverse KL per teacher"),
           common.plot_curves(root, keys=[f"diag/{n}/overlap@8" for n in names],
                              filename="overlap.png", title="top-8 overlap"),
           common.plot_curves(root, keys=[f"skips/{n}/{r}" for n in names
                                          for r in ("error", "timeout", "shape", "nonfinite")],
                              filename="skips.png", title="teacher skips")]
  # The whole run's steps (a resumed launch's history holds only its own).
  metrics = {"steps": common.steps_logged(root) or len(out.history),
             "updates": int(out.state.step), "wall_s": timer.seconds,
             "plots": ",".join(str(p) for p in plots if p)}
  for n in names:
    if f"eval/rkl/{n}" in first:
      metrics[f"rkl_initial/{n}"] = first[f"eval/rkl/{n}"]
    metrics[f"rkl_final/{n}"] = last.get(f"eval/rkl/{n}", float("nan"))
    diag = [m[f"diag/{n}/overlap@8"] for m in out.history if f"diag/{n}/overlap@8" in m]
    metrics[f"overlap@8_last/{n}"] = diag[-1] if diag else float("nan")
    metrics[f"skips/{n}"] = sum(last.get(f"skips/{n}/{r}", 0) for r in
                                ("error", "timeout", "shape", "nonfinite"))
    metrics[f"cache_bytes_per_token/{n}"] = last.get(f"cache/bytes_per_token/{n}", float("nan"))
  metrics["logits_bytes_per_token"] = last.get("cache/bytes_per_token/logits", float("nan"))
  metrics["skipped_steps"] = last.get("skips/steps", 0)
  return metrics


def run_cold_start(config, workdir: str) -> dict:
  timer = common.Timer()
  mesh, rules, teachers, student_cfg, params, tok = _setup(config, workdir)
  cs = config.cold_start
  prompts = domain_examples(_domains(teachers), "train", cs.num_prompts, config.seed,
                            tuple(config.data.difficulties))
  answers = AnswerSampling(max_new_tokens=cs.max_new_tokens, temperature=cs.temperature,
                           samples_per_prompt=cs.samples_per_prompt, min_reward=cs.min_reward,
                           batch_size=cs.sample_batch_size)
  data = teacher_sft_pairs(teachers, prompts, answers, tokenizer=tok, seed=config.seed,
                           mesh=distributed.host_work_mesh(mesh), rules=rules)
  print("[cold_start] " + ", ".join(f"{k.split('/', 1)[1]}={v:g}"
                                    for k, v in data.metrics.items()), flush=True)
  if not data.pairs:
    raise ValueError(f"cold start: no teacher answer passed the verifiers (min_reward="
                     f"{cs.min_reward}): {data.metrics}")
  batches = iter(sft_batches(data.pairs, tok, student_cfg, seq_len=cs.seq_len,
                             batch_size=common.per_process_batch(cs.batch_size),
                             seed=config.seed, mode=common.sft_mode(student_cfg)))
  first: dict = {}  # step 1's metrics, restored from the checkpoint on a resume
  with MetricWriter(workdir) as writer:
    writer.write_scalars(0, data.metrics)
    logger = common.Logger(writer)
    state = lm_trainer.train_lm(
        student_cfg, batches, common.optim_config(config.optim),
        lm_trainer.LMTrainConfig(steps=cs.steps, save_every=cs.steps),
        RunIO(checkpoint_dir=pathlib.Path(workdir) / "checkpoints", on_metrics=logger,
              config={"model": student_cfg.to_dict(), "experiment": config_to_dict(config)},
              first_metrics=first),
        runtime=Runtime(mesh, rules, seed=config.seed),
        params=common.lora_student(params, config.student.get("lora"), "config.student.lora",
                                   base_checkpoint=config.student.init))
  losses = [m["loss"] for _, m in logger.history if "loss" in m]
  return {"steps": int(state.step), **data.metrics,
          "train_loss_first": first[1]["loss"] if 1 in first else float("nan"),
          "train_loss_final": float(np.mean(losses[-3:])) if losses else float("nan"),
          "wall_s": timer.seconds}
