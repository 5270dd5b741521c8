"""The OPD trainer (docs/DESIGN.md §3): a rollout source and a loss composed into the loop.

``train_opd`` = ``opd.distill.source.OPDSource`` (student rollouts, teacher
hidden states through the fault layer and the cache, scheduled weights) +
``opd.distill.loss.make_opd_loss`` in the shared train step, driven by
``opd.training.loop.train`` (resume, checkpoints, eval, metrics, NaN stop).
Only the student is differentiated, optimised and checkpointed; the teachers
hold params only. Metrics: the source's (module docstring of
``opd.distill.source``) plus ``train/{loss,kl/<teacher>,student_entropy,...}``.

``make_heldout_eval`` measures what distillation should lower: the reverse
KL ``KL(p_s ‖ q_k)`` of each teacher on the student's own responses to
held-out prompts of the teacher's domain.

Both ask the teachers through the fault layer (``opd.distill.faults``): a
teacher that raises, hangs, answers a wrong shape or non-finite states, or
whose output head is non-finite, is skipped (its message logged, its head
zeroed for the loss) and training and evaluation go on; a teacher that
answered none of ``OPDConfig.fault_window`` consecutive training batches
stops the run with ``TeacherFaultError``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from opd import rollout as rollout_lib
from opd.distill import crosstok, crosstok_pool
from opd.distill.faults import FaultTolerantTeachers, SkipCounter, TeacherFn
from opd.distill.loss import make_opd_loss
from opd.distill.source import OPDConfig, OPDSource, make_hidden_fn
from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, head_matrix, moe_balance
from opd.parallel import distributed
from opd.parallel import sharding as sharding_lib
from opd.rollout.batches import prompt_stream, training_length
from opd.tasks import Example
from opd.training import loop as train_loop
from opd.training.lora_state import init_student
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import OptimConfig, make_train_step

__all__ = ["OPDConfig", "OPDRun", "make_heldout_eval", "train_opd"]


OPDRun = train_loop.TrainRun  # the final state and one metrics dict per step run


def train_opd(student_cfg: ModelConfig, params, teachers: Sequence[Teacher] | TeacherPool,
              prompts: Sequence[Example], cfg: OPDConfig, optim: OptimConfig, loop: LoopConfig,
              io: RunIO | None = None, *, runtime: Runtime,
              teacher_fns: Mapping[str, TeacherFn] | None = None) -> OPDRun:
  """Distils ``teachers`` into the student for ``loop.steps`` rollout batches (module docstring).

  Args:
    params: the student's initial params (None: random init from ``runtime.seed``);
      a ``opd.training.lora_state.LoRAStudent`` trains adapters on its frozen
      base (rollouts, diagnostics and ``io.eval_fn`` see the merged params).
    teachers: ``Teacher``s (placed colocated on ``runtime.mesh``) or a ``TeacherPool``;
      a ``Teacher`` whose ``tokenizer`` is not the student's is asked through
      ``opd.distill.crosstok_pool`` (its forward jitted on the default device;
      the advantage form only), after the others in the K order.
    prompts: ``Example``s, drawn through ``prompt_stream(prompts, cfg.rollout,
      seed=runtime.seed)`` (a ``DomainBalancedStream`` with ``cfg.rollout.domain_balance``).
    loop: ``loop.steps`` rollout batches, each ``cfg.updates_per_batch``
      updates; save / eval cadence as in every trainer.
    io: as ``opd.rl.grpo.train_grpo``'s (``model``, ``opd`` and ``teachers``
      added to ``io.config``); ``io.eval_fn(params)`` e.g. ``make_heldout_eval``;
      ``io.first_metrics``: key 0 may hold the held-out eval before training,
      key 1 gets step 1's metrics (restored on resume).
    runtime: mesh, rules, seed and the tokenizer (needed: rollouts).
    teacher_fns: ``{name: fn(tokens, mask) -> [B, T, D_k]}`` replacing the
      in-process forward of those teachers (e.g. a ``RemoteTeacher``); their
      heads still come from ``teachers``.

  Raises:
    ValueError: bad arguments (naming them); with several jax processes, a
      ``TeacherPool`` placed on other processes' devices.
    NonFiniteError: a NaN/inf loss or gradient; nothing saved for that step.
    TeacherFaultError: a teacher answered none of its rows on
      ``cfg.fault_window`` consecutive batches.

  Several jax processes: the step trains on ``runtime.mesh`` (all processes'
  devices); rollouts, teacher forwards and diagnostics run in every process
  on its own devices (``opd.distill.source``), the teachers placed there
  (pass ``Teacher``s, or a pool built on
  ``opd.parallel.distributed.local_mesh()``).
  """
  for name, value, typ in (("cfg", cfg, OPDConfig), ("optim", optim, OptimConfig),
                           ("loop", loop, LoopConfig), ("runtime", runtime, Runtime)):
    if not isinstance(value, typ):
      raise ValueError(f"{name} must be a {typ.__name__}, got {type(value).__name__}")
  if runtime.tokenizer is None:
    raise ValueError("train_opd samples rollouts: Runtime.tokenizer must be set, got None")
  mesh, rules, seed = runtime.mesh, runtime.rules, runtime.seed
  multi = jax.process_count() > 1
  host_mesh = distributed.host_work_mesh(mesh)
  plain, cross = _split_by_tokenizer(teachers, runtime.tokenizer)
  pool = teachers if isinstance(teachers, TeacherPool) else (TeacherPool(
      plain, student_cfg.vocab_size, host_mesh, rules=rules) if plain or not cross else None)
  if pool is None and teacher_fns:
    raise ValueError(f"teacher_fns names {sorted(teacher_fns)}, but every teacher has another "
                     "tokenizer than the student's (those take no teacher_fn)")
  asked = (_fault_layer(pool, cfg, teacher_fns, SkipCounter("opd"), cfg.fault_window)
           if pool is not None else crosstok_pool.EmptyTeachers())
  # A non-finite head is a fault of its teacher: the loss gets it zeroed (its weight is 0).
  safe_heads = tuple(asked.heads[n] for n in asked.names) + tuple(t.head for t in cross)
  names = asked.names + tuple(t.name for t in cross)
  xpool = crosstok_pool.CrossTokenizerPool(
      [crosstok_pool.from_teacher(t) for t in cross], runtime.tokenizer,
      deadline_s=cfg.deadline_s, window=cfg.fault_window,
      length_bucket=cfg.rollout.length_bucket) if cross else None
  source = OPDSource(student_cfg, cfg, prompt_stream(prompts, cfg.rollout, seed=seed),
                     teachers=asked, heads=safe_heads,
                     domains=[t.domain for t in (*(pool.teachers if pool else ()), *cross)],
                     total_steps=loop.steps, tokenizer=runtime.tokenizer,
                     mesh=pool.mesh if pool else host_mesh, rules=rules, seed=seed,
                     train_mesh=mesh, cross=xpool)
  student = init_student(student_cfg, optim, runtime, params)
  # With several processes the heads live on this process's devices: the
  # step (on every process's devices) takes them as host constants.
  heads = [np.asarray(h) for h in safe_heads] if multi else safe_heads
  loss_fn = make_opd_loss(student_cfg, heads, cfg.loss, teacher_names=names,
                          cross_tokenizer=[n in {t.name for t in cross} for n in names],
                          sampling_temperature=cfg.rollout.temperature)
  hook = student.after_update(moe_balance.bias_update_hook(student_cfg))
  step_fn = make_train_step(student.loss(loss_fn), student.optimizer, mesh, student.shardings,
                            rules=rules, after_update=hook)
  io = (io if io is not None else RunIO())
  io = io.replace(eval_fn=student.eval_fn(io.eval_fn)).with_config(
      {"model": student_cfg.to_dict(), "opd": cfg.to_dict(), "teachers": list(names),
       **student.config_entries})
  return train_loop.train(student.state, step_fn, student.source(source), loop, io, desc="opd",
                          progress_key="loss")


def _split_by_tokenizer(teachers, student_tokenizer) -> tuple[list, list]:
  """``(plain, cross)``: the teachers of the student's tokenizer and the others
  (``Teacher.tokenizer`` set and not the student's; ``opd.distill.crosstok``)."""
  if isinstance(teachers, TeacherPool):
    return list(teachers.teachers), []
  teachers = list(teachers)
  cross = [t for t in teachers if isinstance(t, Teacher) and t.tokenizer is not None
           and not crosstok.same_tokenizer(t.tokenizer, student_tokenizer)]
  return [t for t in teachers if t not in cross], cross


def _fault_layer(pool: TeacherPool, cfg: OPDConfig, teacher_fns, counter: SkipCounter,
                 window: int) -> FaultTolerantTeachers:
  """The pool's teachers (``teacher_fns`` replacing some) behind deadlines and screens."""
  asked = FaultTolerantTeachers.from_pool(pool, deadline_s=cfg.deadline_s, counter=counter,
                                          window=window)
  unknown = sorted(set(teacher_fns or {}) - set(pool.names))
  if unknown:
    raise ValueError(f"teacher_fns names {unknown} are not teachers; teachers: {list(pool.names)}")
  asked.teachers.update(teacher_fns or {})
  return asked


def make_heldout_eval(student_cfg: ModelConfig, pool: TeacherPool, prompts: Sequence[Example],
                      cfg: OPDConfig, *, tokenizer, mesh, rules=sharding_lib.DEFAULT_RULES,
                      seed: int = 1, teacher_fns: Mapping[str, TeacherFn] | None = None
                      ) -> Callable[[Any], dict[str, float]]:
  """``fn(params) -> {"rkl/<teacher>": mean KL(p_s ‖ q_k)}`` on held-out prompts.

  The student samples one response per prompt (a fixed key, so successive
  calls differ only through the params) as ``cfg.rollout`` samples; the KL
  at ``cfg.loss.temperature`` is averaged over the response tokens of the prompts
  in the teacher's domain (all prompts for a teacher without one), from
  ``pallas_kernels.fused_reverse_kl``'s per-teacher ``kl``.

  The teachers are asked through the fault layer (``cfg.deadline_s``;
  ``teacher_fns`` as in ``train_opd``): a faulty teacher's KL is averaged
  over the rows it answered, and is NaN when it answered none (the fault is
  logged as ``held-out eval``); a fault never stops the evaluation.
  """
  prompts = list(prompts)
  if not prompts:
    raise ValueError("prompts=[]: the held-out eval needs prompts")
  sampling = cfg.rollout.sampling(tokenizer)
  hidden_fn = make_hidden_fn(student_cfg, mesh=mesh, rules=rules)
  rows = {t.name: np.asarray([t.domain is None or ex.domain == t.domain for ex in prompts])
          for t in pool.teachers}
  for name, r in rows.items():
    if not r.any():
      raise ValueError(f"no held-out prompt is in teacher {name!r}'s domain "
                       f"{pool.teacher(name).domain!r}")
  # window=0: evaluation reports a teacher that never answers (NaN), it does not stop.
  asked = _fault_layer(pool, cfg, teacher_fns, SkipCounter("held-out eval"), window=0)

  def fn(params) -> dict[str, float]:
    if jax.process_count() > 1:
      params = distributed.replicate_on(params, mesh)
    policy = rollout_lib.Policy(student_cfg, params, tokenizer, mesh, rules)
    episodes = rollout_lib.rollout(policy, prompts, seed, sampling, verify=False)
    host = rollout_lib.batch_episodes(
        episodes, seq_len=training_length(episodes, cfg.rollout.seq_len,
                                          cfg.rollout.length_bucket),
        pad_id=tokenizer.pad_id)
    b, t = host["tokens"].shape
    h_s = hidden_fn(params, host["tokens"], host["mask"]).reshape(b * t, -1)
    answers = asked(host["tokens"], host["mask"])
    h_k = [np.asarray(answers.hidden[n]).reshape(b * t, -1) for n in pool.names]
    mask = jnp.asarray(host["loss_mask"].reshape(-1) > 0)
    k = len(pool.names)
    _, aux = pallas_kernels.fused_reverse_kl(
        h_s, head_matrix(student_cfg, params), h_k, [asked.heads[n] for n in pool.names],
        jnp.full((b * t, k), 1.0 / k), mask=mask, temperature=cfg.loss.temperature,
        return_aux=True)
    kl = np.asarray(aux["kl"]).reshape(b, t, k)
    lm = host["loss_mask"] > 0
    out = {}
    for i, n in enumerate(pool.names):
      r = rows[n] & answers.available[:, i]
      out[f"rkl/{n}"] = float(kl[r][..., i][lm[r]].mean()) if lm[r].any() else float("nan")
    return out

  return fn
