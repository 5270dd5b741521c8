"""OPD's batch source (docs/DESIGN.md §3): prompts -> student rollouts -> teacher-scored batches.

``OPDSource`` is an ``opd.training.loop.RolloutSource``. For OPD step s
(0-based) ``next_batch(state, s)``:

1. draws P prompts (``opd.rollout.batches.draw_prompts``, from a resumable
   ``PromptStream``);
2. the student samples G responses per prompt at ``rollout.temperature``
   (``opd.rollout.batches.sample_groups``, key ``fold_in(key(seed), s)``: a
   resumed run samples what an uninterrupted one would), verified only with
   ``verify=True`` or ``loss.grpo_coef > 0`` (then ``reward/mean`` is logged);
   with ``loss.grpo_coef > 0`` (or the advantage form with ``adv_alpha > 0``)
   the rewards of rows ``p*G .. p*G+G-1`` (prompt p's samples) become
   group-normalised advantages (``opd.rl.advantages.group_advantages``),
   put in the batch with the sampler's ``old_logprobs`` for the loss's
   GRPO term (the advantage form always gets ``old_logprobs``: its
   behaviour policy, ``opd.distill.advantage``);
3. builds the teacher weights ``w [B, T, K]``
   (``opd.distill.teacher_weighting``: routing by ``Example.domain``,
   confidence or uniform, as ``OPDConfig.weighting.schedule`` says), annealed
   to uniform over the last ``weighting.anneal_steps`` of the run;
4. asks the teachers once (``FaultTolerantTeachers`` behind a
   ``HiddenStateCache``: K forwards per rollout batch, or one per routed
   group with one-hot routing), so all ``updates_per_batch`` updates on the
   batch train on the same cached hidden states;
5. drops skipped teachers and renormalises per token; rows no teacher
   answered get ``loss_mask`` 0.

Teachers with another tokenizer (``cross``, ``opd.distill.crosstok_pool``):
before step 4 every row is transcoded for each of them (a row one cannot
read stops the run naming the teacher and the example, before any teacher
runs); after it each runs on its own rows, and the batch gets their hidden
states and span keys (``opd.distill.crosstok``).

Several jax processes (docs/DESIGN.md §3, "Several processes"): every
process runs steps 1-5 on the same prompts with the same key, on its own
devices (``mesh`` is then a process-local mesh, e.g.
``opd.parallel.distributed.local_mesh()``) and with a local copy of the
student's params gathered from the training state; each then feeds its own
rows of the identical host batch to the step on ``train_mesh``.

A batch none of the teachers answered is **skipped**: it goes to the loop
with an all-zero ``loss_mask`` (loss 0, gradient 0) and the metric
``opd/skipped_step`` = 1 (the loop has no skip, and keeping the step keeps
step numbering and resume exact). The optimizer's moments still advance on
that update: with Adam the parameters move by the momentum term only.

Host metrics per step: ``skips/<teacher>/<reason>`` (cumulative),
``skips/steps``, ``weight/<teacher>`` (mean weight over response tokens),
``cache/bytes_per_token/<teacher>`` vs ``cache/bytes_per_token/logits``,
``response/length_mean``, ``opd/masked_rows``, ``opd/skipped_step``,
``reward/mean`` (verified), ``advantage/abs_mean`` (outcome advantages), and
every ``diag_every`` steps ``diag/<teacher>/...`` (``opd.distill.diagnostics``)
on a sample of the response tokens that teacher answered.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np

from opd.config import fields
from opd.distill import diagnostics, teacher_weighting
from opd.distill.teacher_weighting import TeacherWeightingConfig
from opd.distill.cache import HiddenStateCache, loss_batch
from opd.distill.crosstok_pool import CrossTokenizerPool
from opd.distill.faults import FaultTolerantTeachers
from opd.distill.loss import OPDLossConfig
from opd.models import ModelConfig, forward, head_matrix
from opd.parallel import distributed
from opd.parallel import sharding as sharding_lib
from opd.rl.advantages import group_advantages
from opd.rl.scoring import score_episodes
from opd.rollout.batches import (PromptPosition, RolloutConfig, draw_prompts, prompt_problem,
                                 sample_groups, training_arrays)
from opd.rollout.episodes import RolloutLog
from opd.rollout.policy import Policy
from opd.tasks import RewardStats
from opd.training.train_step import shard_batch

__all__ = ["OPDConfig", "OPDSource"]

_FLAGS = ("finite", "loss_finite", "grads_finite")


def _default_rollout() -> RolloutConfig:
  return RolloutConfig(group_size=4)


@dataclasses.dataclass(frozen=True)
class OPDConfig:
  """Everything OPD-specific; hashable and JSON-ready (``to_dict``).

  Three nested configs, each validated by its own class, and the fields of
  the teacher pool and the diagnostics (config files: ``config.opd.rollout.*``,
  ``config.opd.weighting.*``, ``config.opd.loss.*``, ``config.opd.<field>``;
  the paths of the older flat layout: ``opd.config.migrations``).

  Attributes:
    rollout: the student's rollouts (``opd.rollout.batches.RolloutConfig``:
      P prompts, G samples each at ``temperature``, ``top_k`` / ``top_p``,
      N new tokens, rows of at most L tokens in buckets, ``domain_balance``;
      default G = 4). The loss's GRPO term and advantage form take their log-probs at
      ``rollout.temperature``.
    weighting: how the teachers are weighed per token
      (``opd.distill.teacher_weighting.TeacherWeightingConfig``: routing,
      confidence or uniform, annealing); the confidence scores are taken at
      the loss's τ.
    loss: the loss (``opd.distill.loss.OPDLossConfig``: estimator, τ and τ_T,
      aggregation, forward-KL and GRPO terms, the exact or advantage form).
    updates_per_batch: optimizer updates on each rollout batch (all served
      from the one hidden-state cache entry).
    deadline_s: seconds each teacher call may take before it is skipped.
    fault_window: a teacher that answers none of its rows on this many
      consecutive batches stops the run (``TeacherFaultError``; 0: never).
    cache_dtype: storage dtype of cached teacher hidden states.
    diag_every: diagnostics every this many steps (0: never).
    diag_tokens: response tokens sampled for the diagnostics.
    verify: run the task verifiers on the rollouts (logs ``reward/mean``).
  """
  rollout: RolloutConfig = dataclasses.field(default_factory=_default_rollout)
  weighting: TeacherWeightingConfig = dataclasses.field(default_factory=TeacherWeightingConfig)
  loss: OPDLossConfig = dataclasses.field(default_factory=OPDLossConfig)
  updates_per_batch: int = 1
  deadline_s: float = 60.0
  fault_window: int = 20
  cache_dtype: str = "bfloat16"
  diag_every: int = 10
  diag_tokens: int = 256
  verify: bool = False

  def __post_init__(self):
    owner = "OPDConfig"
    for name, cls in (("rollout", RolloutConfig), ("weighting", TeacherWeightingConfig),
                      ("loss", OPDLossConfig)):
      if not isinstance(getattr(self, name), cls):
        raise ValueError(f"{owner}.{name} must be a {cls.__name__} (opd.config.fields.from_group "
                         f"builds one from a config group), got {getattr(self, name)!r}")
    fields.check_fields(
        self, owner, ints={"updates_per_batch": 1, "diag_every": 0, "diag_tokens": 1,
                           "fault_window": 0},
        positive=("deadline_s",), bools=("verify",),
        choices={"cache_dtype": ("bfloat16", "float16", "float32")})

  @property
  def verifies(self) -> bool:
    """The rollouts are verified: ``verify`` asked, or the loss needs rewards
    (``loss.outcome_advantages``)."""
    return self.verify or self.loss.outcome_advantages

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "OPDConfig":
    """A copy with ``changes``; a nested config may be given as a mapping of
    its fields to change (``cfg.replace(loss=dict(estimator="token"))``)."""
    for name in ("rollout", "weighting", "loss"):
      if isinstance(changes.get(name), Mapping):
        changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
    return dataclasses.replace(self, **changes)


def make_hidden_fn(model_cfg: ModelConfig, *, mesh, rules):
  """``fn(params, tokens, mask) -> [B, T, D]`` float32 last hidden states (jitted once)."""

  def hidden(params, tokens, mask):
    with nn.logical_axis_rules(rules):
      return forward(model_cfg, params, tokens, None, mask, return_logits=False,
                     return_hidden=True).hidden.astype(np.float32)

  jitted = jax.jit(hidden)

  def fn(params, tokens, mask):
    with jax.set_mesh(mesh):
      return jitted(params, tokens, mask)

  return fn


class OPDSource(PromptPosition):
  """OPD rollout batches for ``opd.training.loop.train`` (module docstring).

  Args:
    student_cfg: the student's model.
    cfg: OPD settings.
    prompts: an iterator of ``Example``s (a ``PromptStream`` to checkpoint).
    teachers: the fault-tolerant teacher calls, in the weights' K order.
    heads: the K heads ``W_k`` [D_k, V] (``TeacherPool.heads``).
    domains: the K teachers' domains (routing; None: never routed to).
    total_steps: the run's length (annealing ends at its last step).
    tokenizer, mesh, rules, seed: as ``opd.rl.rollout_source.GRPOSource``
      (the prompt position is the whole state, ``PromptPosition``);
      with several processes ``mesh`` must hold only this process's devices.
    train_mesh: the mesh of the training step (default ``mesh``); batches
      are placed on it.
    cross: teachers with another tokenizer (``opd.distill.crosstok_pool``),
      after ``teachers`` in the K order of ``heads`` and ``domains``; the
      advantage form only, not with the confidence schedule; every teacher
      is then asked about every row (no routed groups), and the batch holds
      their rows and span keys (``opd.distill.crosstok``).
  """

  def __init__(self, student_cfg: ModelConfig, cfg: OPDConfig, prompts: Iterator, *,
               teachers: FaultTolerantTeachers, heads: Sequence[jax.Array],
               domains: Sequence[str | None], total_steps: int, tokenizer, mesh,
               rules=sharding_lib.DEFAULT_RULES, seed: int = 0, train_mesh=None,
               cross: CrossTokenizerPool | None = None):
    self.student_cfg, self.cfg, self.prompts, self.tokenizer = student_cfg, cfg, prompts, tokenizer
    self.teachers, self.heads, self.domains = teachers, tuple(heads), list(domains)
    self.cross = cross
    self.names = teachers.names + (cross.names if cross is not None else ())
    if cross is not None:
      wt = cfg.weighting
      if set(cross.names) & set(teachers.names) or cfg.loss.form != "advantage" or (
          "confidence" in (wt.schedule, wt.anneal_to)):
        raise ValueError(f"cross-tokenizer teachers {list(cross.names)} need distinct names "
                         f"(teachers {list(teachers.names)}), OPDConfig.loss.form='advantage' "
                         f"(got {cfg.loss.form!r}) and a weighting.schedule / anneal_to other "
                         f"than 'confidence' (got {wt.schedule!r} / {wt.anneal_to!r}: it scores "
                         "the student's tokens)")
    if not (len(self.names) == len(self.heads) == len(self.domains)):
      raise ValueError(f"teachers ({len(self.names)}), heads ({len(self.heads)}) and domains "
                       f"({len(self.domains)}) must have one entry per teacher")
    self.total_steps = fields.check_int("OPDSource", "total_steps", total_steps, min_value=0)
    if cfg.weighting.anneal_steps > total_steps:
      raise ValueError(f"OPDConfig.weighting.anneal_steps={cfg.weighting.anneal_steps} exceeds "
                       f"the run's "
                       f"steps={total_steps}")
    self.mesh, self.rules = mesh, rules
    self.train_mesh = mesh if train_mesh is None else train_mesh
    self._multi = jax.process_count() > 1
    if self._multi:
      foreign = sorted({d.process_index for d in mesh.devices.flat} - {jax.process_index()})
      if foreign:
        raise ValueError(f"with {jax.process_count()} processes OPDSource's rollout mesh must hold "
                         f"only this process's devices; it has devices of processes {foreign} "
                         "(use opd.parallel.distributed.local_mesh())")
    self.updates_per_batch = cfg.updates_per_batch
    self.cache = HiddenStateCache(teachers, dtype=cfg.cache_dtype,
                                  sharding=sharding_lib.batch_sharding(mesh, rules, 3))
    self._key = jax.random.key(seed)
    self._sampling = cfg.rollout.sampling(tokenizer)
    self._problem = functools.partial(prompt_problem, tokenizer=tokenizer, cfg=cfg.rollout,
                                      custom_reward=not cfg.verifies)
    self._student_hidden = make_hidden_fn(student_cfg, mesh=mesh, rules=rules)
    self._tokens = 0.0

  def _weights(self, examples, cached, host, t: int, step: int):
    """[B, T, K] scheduled, annealed weights (before skips)."""
    cfg, k = self.cfg.weighting, len(self.names)
    total = max(self.total_steps, step + 1)
    if cfg.schedule == "routing":
      w = teacher_weighting.routing_weights([ex.domain for ex in examples], self.domains, t)
    elif cfg.schedule == "uniform":
      w = teacher_weighting.uniform_weights(len(examples), t, k)
    else:
      w = self._confidence(cached, host)
    target = None
    if cfg.anneal_to == "confidence" and teacher_weighting.anneal_alpha(
        step, total, cfg.anneal_steps) > 0:
      target = w if cfg.schedule == "confidence" else self._confidence(cached, host)
    return teacher_weighting.anneal(w, step, total, cfg.anneal_steps, target=target)

  def _confidence(self, cached, host):
    """[B, T, K] the confidence schedule's weights on this batch's rows."""
    cfg = self.cfg.weighting
    hidden = [h.astype(np.float32) for h in cached.hidden]
    scores = teacher_weighting.confidence_scores(
        hidden, self.heads, jax.numpy.asarray(host["targets"]), score=cfg.confidence_by,
        temperature=self.cfg.loss.temperature)
    return teacher_weighting.confidence_weights(
        scores, host["loss_mask"] > 0, temperature=cfg.confidence_temperature,
        per=cfg.granularity)

  def _routed_rows(self, examples, t: int, step: int) -> np.ndarray | None:
    """[B] teacher index when this step's weights are one-hot per row (routing,
    not annealing yet): each teacher then runs over its own rows only."""
    if (self.cfg.weighting.schedule != "routing" or self.cross is not None
        or self.cfg.weighting.needs_confidence):
      return None  # confidence weights need every teacher on every row
    w = np.asarray(self._weights(examples, None, None, 1, step))[:, 0, :]
    if not np.all((w > 0).sum(axis=1) == 1):
      return None
    return w.argmax(axis=1).astype(np.int32)

  def next_batch(self, state, step: int):
    """``(batch, host_metrics)`` for 0-based OPD ``step``; None when prompts run out."""
    cfg, t0 = self.cfg, time.perf_counter()
    ro = cfg.rollout
    stats = RewardStats()
    drawn = draw_prompts(self.prompts, ro.prompts_per_step, self._problem, stats)
    if drawn is None:
      return None
    examples = [ex for ex in drawn for _ in range(ro.group_size)]  # row p * G + g: prompt p
    params = distributed.replicate_on(state.params, self.mesh) if self._multi else state.params
    policy = Policy(self.student_cfg, params, self.tokenizer, self.mesh, self.rules)
    episodes = sample_groups(policy, drawn, ro, self._key, step, self._sampling,
                             log=RolloutLog(stats=stats if cfg.verifies else None),
                             verify=cfg.verifies)
    t1 = time.perf_counter()
    host, _ = training_arrays(episodes, seq_len=ro.seq_len, length_bucket=ro.length_bucket,
                              pad_id=self.tokenizer.pad_id)
    t = host["tokens"].shape[1]
    # Rows a cross-tokenizer teacher cannot read are refused before any teacher runs.
    xrows = (self.cross.rows(host, example_ids=[ex.id for ex in examples])
             if self.cross is not None else None)
    routed = self._routed_rows(examples, t, step)
    cached = self.cache.get(step, host["tokens"], host["mask"], routed)
    xans = None
    if self.cross is not None:
      xans = self.cross.ask(xrows)
      cached = xans.extend(cached, self.cache.sharding)
    t2 = time.perf_counter()
    w = self._weights(examples, cached, host, t, step)
    opd, row_ok = loss_batch(host, cached, w)
    skipped = not cached.batch_ok
    opd["loss_mask"] = host["loss_mask"] * row_ok[:, None] * (not skipped)
    if xans is not None:
      opd = xans.loss_entries(opd, self.names)
    if cfg.loss.outcome_advantages:
      # Row p * G + g is sample g of prompt p: [P, G] groups are same-prompt.
      rewards = np.asarray([sc.reward for sc in score_episodes(episodes)])
      opd["advantages"] = group_advantages(rewards.reshape(ro.prompts_per_step,
                                                           ro.group_size)).reshape(-1)
    if cfg.loss.outcome_advantages or cfg.loss.form == "advantage":
      opd["old_logprobs"] = host["old_logprobs"]
    hidden, weights = opd.pop("teacher_hidden"), np.asarray(opd.pop("teacher_weights"))
    batch = self._place({**opd, "teacher_weights": weights}, hidden)
    metrics = self._metrics(episodes, host, cached, weights, row_ok, skipped)
    if "advantages" in opd:
      metrics["advantage/abs_mean"] = float(np.abs(opd["advantages"]).mean())
    if cfg.diag_every and step % cfg.diag_every == 0 and not skipped:
      metrics.update(self._diagnostics(params, opd, cached, step))
    metrics.update({"perf/rollout_time_s": t1 - t0, "perf/teacher_time_s": t2 - t1,
                    "perf/diag_time_s": time.perf_counter() - t2})
    self._tokens = float(host["mask"].sum())
    return batch, metrics

  def _place(self, host_batch, hidden):
    """The step's batch on ``train_mesh``; ``hidden`` (already on ``mesh``)
    is reused as is with one process."""
    if not self._multi:
      batch = shard_batch(host_batch, self.train_mesh, self.rules)
      batch["teacher_hidden"] = hidden
      return batch
    # Every process holds the whole (identical) batch and feeds its own rows.
    rows = distributed.process_batch_rows(self.train_mesh, self.rules,
                                            self.cfg.rollout.batch_size)
    local = {**host_batch, "teacher_hidden": tuple(np.asarray(h) for h in hidden)}
    return shard_batch(jax.tree.map(lambda x: np.asarray(x)[rows], local), self.train_mesh,
                       self.rules)

  def _metrics(self, episodes, host, cached, weights, row_ok, skipped) -> dict[str, float]:
    lengths = [len(ep.response_ids) for ep in episodes]
    metrics = {"response/length_mean": float(np.mean(lengths)),
               "response/length_max": float(np.max(lengths)),
               "response/tokens": float(host["loss_mask"].sum()),
               "opd/skipped_step": float(skipped),
               "opd/masked_rows": float((~row_ok).sum()),
               "cache/computes": float(self.cache.computes)}
    metrics.update(self.teachers.counter.metrics(self.names))
    if self.cross is not None:
      metrics.update(self.cross.metrics())
    metrics.update(teacher_weighting.weight_metrics(weights, host["loss_mask"], self.names))
    for k, v in self.cache.bytes_per_token(self.student_cfg.vocab_size).items():
      metrics[f"cache/bytes_per_token/{k.removeprefix('cache/')}"] = float(v)
    rewards = [ep.reward.reward for ep in episodes if ep.reward is not None]
    if rewards:
      metrics["reward/mean"] = float(np.mean(rewards))
    return metrics

  def _diagnostics(self, params, batch, cached, step: int) -> dict[str, float]:
    """``diag/<teacher>/...`` on the response tokens of the rows each teacher
    answered; ``params`` and ``batch`` (host arrays) as the rollout saw them."""
    h_s = self._student_hidden(params, batch["tokens"], batch["mask"])
    w_s = head_matrix(self.student_cfg, params)
    loss_mask = np.asarray(batch["loss_mask"])
    out = {}
    for k, name in enumerate(self.teachers.names):  # the student's tokens: same tokenizer
      mask_k = loss_mask * cached.available[:, k][:, None]
      if mask_k.sum() == 0:
        continue
      out.update(diagnostics.teacher_diagnostics(
          h_s, w_s, [cached.hidden[k]], [self.heads[k]], [name], np.asarray(batch["targets"]),
          mask_k, n=self.cfg.diag_tokens, seed=step, temperature=self.cfg.loss.temperature))
    return out

  def step_metrics(self, host_metrics, train_metrics, *, batch_time_s: float,
                   train_time_s: float) -> dict[str, float]:
    """Host metrics, ``train/<k>`` means over the updates, ``perf/...`` times."""
    metrics = dict(host_metrics)
    metrics.update({f"train/{k}": v for k, v in train_metrics.items() if k not in _FLAGS})
    metrics.update({"perf/step_time_s": batch_time_s + train_time_s,
                    "perf/train_time_s": train_time_s,
                    "perf/train_tokens_per_s":
                        self._tokens * self.updates_per_batch / max(train_time_s, 1e-9)})
    return metrics

  def texts(self, step: int) -> dict[str, str]:
    return {}
