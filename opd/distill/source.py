"""OPD's batch source (docs/DESIGN.md §3): prompts -> student rollouts -> teacher-scored batches.

``OPDSource`` is an ``opd.training.loop.RolloutSource``. For OPD step s
(0-based) ``next_batch(state, s)``:

1. draws P prompts (``opd.rollout.batches.draw_prompts``, from a resumable
   ``PromptStream``);
2. the student samples G responses per prompt at ``temperature``
   (``opd.rollout.batches.sample_groups``, key ``fold_in(key(seed), s)``: a
   resumed run samples what an uninterrupted one would), verified only with
   ``verify=True`` or ``grpo_coef > 0`` (then ``reward/mean`` is logged);
   with ``grpo_coef > 0`` (or the advantage form with ``adv_alpha > 0``)
   the rewards of rows ``p*G .. p*G+G-1`` (prompt p's samples) become
   group-normalised advantages (``opd.rl.advantages.group_advantages``),
   put in the batch with the sampler's ``old_logprobs`` for the loss's
   GRPO term (the advantage form always gets ``old_logprobs``: its
   behaviour policy, ``opd.distill.advantage``);
3. builds the teacher weights ``w [B, T, K]``
   (``opd.distill.teacher_weighting``: routing by ``Example.domain``,
   confidence or uniform, as ``OPDConfig.schedule`` says), annealed to
   uniform over the last ``anneal_steps`` of the run;
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
from opd.distill import advantage as advantage_lib
from opd.distill import diagnostics, teacher_weighting
from opd.distill.cache import HiddenStateCache, loss_batch
from opd.distill.crosstok_pool import CrossTokenizerPool
from opd.distill.faults import FaultTolerantTeachers
from opd.distill.loss import AGGREGATIONS, ESTIMATORS, OPDLossConfig
from opd.models import ModelConfig, forward, head_matrix
from opd.parallel import distributed
from opd.parallel import sharding as sharding_lib
from opd.rl.advantages import group_advantages
from opd.rl.config import GRPOConfig
from opd.rl.scoring import score_episodes
from opd.rollout.batches import (PromptPosition, RolloutConfig, check_rollout_fields,
                                 draw_prompts, prompt_problem, sample_groups, training_arrays)
from opd.rollout.episodes import RolloutLog
from opd.rollout.policy import Policy
from opd.tasks import RewardStats
from opd.training.train_step import shard_batch

__all__ = ["OPDConfig", "OPDSource", "SCHEDULES"]

SCHEDULES = ("routing", "confidence", "uniform")
ANNEAL_TARGETS = ("uniform", "confidence")
_FLAGS = ("finite", "loss_finite", "grads_finite")


@dataclasses.dataclass(frozen=True)
class OPDConfig:
  """Everything OPD-specific; hashable and JSON-ready (``to_dict``).

  Attributes:
    prompts_per_step: P, prompts per rollout batch (B = P * G rows).
    group_size: G, student samples per prompt (>= 1).
    temperature: the student's sampling temperature (> 0).
    kl_temperature: τ dividing every logit in the loss and diagnostics.
    teacher_temperature: τ_T, further dividing the teachers' logits in the
      loss only (< 1 sharpens the targets; diagnostics and the held-out KL
      use the teachers as they are).
    max_new_tokens: N, tokens per sampled response.
    seq_len: L, the longest training row (``len(prompt) + N - 1 <= L``).
    length_bucket: rows are padded to the longest episode rounded up to a
      multiple of this (0: always ``seq_len``).
    schedule: ``"routing"`` (the example's domain picks its teacher),
      ``"confidence"`` or ``"uniform"``.
    confidence_by: ``"logprob"`` or ``"neg_entropy"`` (confidence schedule).
    confidence_temperature: softmax temperature over the teachers' confidence.
    confidence_per_token: one weight vector per token instead of per sequence.
    anneal_steps: weights move linearly to ``anneal_to`` over this many final
      steps.
    anneal_to: ``"uniform"`` (the seed's) or ``"confidence"`` (the confidence
      schedule's weights, scored by ``confidence_by`` / ``_temperature`` /
      ``_per_token``); every teacher then answers every row while annealing.
    estimator: ``"full"``, ``"top_k"`` or ``"token"`` (``opd.distill.loss``).
    loss_form: ``"exact"`` (the estimator's loss, default) or ``"advantage"``
      (``opd.distill.advantage``: the sampled-token log-ratio as a per-token
      advantage in GRPO's policy gradient, log-probs at ``temperature``).
    adv_gamma: the advantage form's discount γ in [0, 1] (0 immediate, 1 the
      sequence-level form).
    adv_beta, adv_alpha: ``Â = β Â_OPD + α Â_ORM`` (α > 0 verifies the
      rollouts and adds GRPO's group-normalised outcome advantage).
    is_cap: 0: GRPO's clipped ratio; c >= 1: truncated importance weights
      ``min(π_S / π_behaviour, c)`` (share truncated logged).
    top_k: k of the ``top_k`` estimator.
    aggregation: ``"token_mean"`` or ``"sequence_mean"``.
    forward_kl_coef: weight of the forward-KL term (default 0).
    grpo_coef: weight of the GRPO verifier-reward term (default 0: none,
      and no verification forced).
    grpo_clip_eps_low, grpo_clip_eps_high: that term's ratio clip range
      (``GRPOConfig``'s defaults).
    updates_per_batch: optimizer updates on each rollout batch (all served
      from the one hidden-state cache entry).
    deadline_s: seconds each teacher call may take before it is skipped.
    fault_window: a teacher that answers none of its rows on this many
      consecutive batches stops the run (``TeacherFaultError``; 0: never).
    cache_dtype: storage dtype of cached teacher hidden states.
    diag_every: diagnostics every this many steps (0: never).
    diag_tokens: response tokens sampled for the diagnostics.
    verify: run the task verifiers on the rollouts (logs ``reward/mean``).
    domain_balance: every batch draws the domains equally
      (``opd.rollout.batches.DomainBalancedStream``).
  """
  prompts_per_step: int = 8
  group_size: int = 4
  temperature: float = 1.0
  kl_temperature: float = 1.0
  teacher_temperature: float = 1.0
  max_new_tokens: int = 64
  seq_len: int = 256
  length_bucket: int = 32
  schedule: str = "routing"
  confidence_by: str = "logprob"
  confidence_temperature: float = 1.0
  confidence_per_token: bool = False
  anneal_steps: int = 0
  anneal_to: str = "uniform"
  estimator: str = "full"
  top_k: int = 8
  aggregation: str = "token_mean"
  forward_kl_coef: float = 0.0
  grpo_coef: float = 0.0
  grpo_clip_eps_low: float = GRPOConfig.clip_eps_low
  grpo_clip_eps_high: float = GRPOConfig.clip_eps_high
  updates_per_batch: int = 1
  deadline_s: float = 60.0
  fault_window: int = 20
  cache_dtype: str = "bfloat16"
  diag_every: int = 10
  diag_tokens: int = 256
  verify: bool = False
  domain_balance: bool = False
  loss_form: str = "exact"
  adv_gamma: float = advantage_lib.FORM_DEFAULTS["adv_gamma"]
  adv_beta: float = advantage_lib.FORM_DEFAULTS["adv_beta"]
  adv_alpha: float = advantage_lib.FORM_DEFAULTS["adv_alpha"]
  is_cap: float = advantage_lib.FORM_DEFAULTS["is_cap"]

  def __post_init__(self):
    owner = "OPDConfig"
    check_rollout_fields(self, owner)
    fields.check_fields(
        self, owner, ints={"anneal_steps": 0, "top_k": 1, "updates_per_batch": 1,
                           "diag_every": 0, "diag_tokens": 1,
                           "fault_window": 0},
        positive=("kl_temperature", "teacher_temperature", "confidence_temperature",
                  "deadline_s"),
        non_negative=("forward_kl_coef", "grpo_coef", "grpo_clip_eps_high"),
        floats={"grpo_clip_eps_low": dict(min_value=0, max_value=1, max_exclusive=True)},
        bools=("confidence_per_token", "verify", "domain_balance"),
        choices={"schedule": SCHEDULES, "anneal_to": ANNEAL_TARGETS,
                 "confidence_by": teacher_weighting.SCORES,
                 "estimator": ESTIMATORS, "aggregation": AGGREGATIONS,
                 "cache_dtype": ("bfloat16", "float16", "float32")})
    advantage_lib.check_form_fields(self, owner, "loss_form")

  @property
  def rollout(self) -> RolloutConfig:
    """The rollout fields (P, G, temperature, N, L and its bucket) as one typed
    config; the student samples untruncated (``top_k`` here is the estimator's)."""
    return RolloutConfig(prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                         temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                         seq_len=self.seq_len, length_bucket=self.length_bucket,
                         domain_balance=self.domain_balance)

  @property
  def batch_size(self) -> int:
    """B = prompts_per_step * group_size."""
    return self.prompts_per_step * self.group_size

  @property
  def outcome_advantages(self) -> bool:
    """The loss reads GRPO's outcome advantages (the GRPO term, or the
    advantage form with ``adv_alpha > 0``)."""
    return self.grpo_coef > 0 or (self.loss_form == "advantage" and self.adv_alpha > 0)

  @property
  def verifies(self) -> bool:
    """The rollouts are verified: ``verify`` asked, or the loss needs rewards."""
    return self.verify or self.outcome_advantages

  def loss_config(self) -> OPDLossConfig:
    """The loss's options (``opd.distill.loss.make_opd_loss``)."""
    return OPDLossConfig(estimator=self.estimator, top_k=self.top_k,
                         temperature=self.kl_temperature,
                         teacher_temperature=self.teacher_temperature,
                         aggregation=self.aggregation,
                         forward_kl_coef=self.forward_kl_coef, grpo_coef=self.grpo_coef,
                         grpo_temperature=self.temperature,
                         grpo_clip_eps_low=self.grpo_clip_eps_low,
                         grpo_clip_eps_high=self.grpo_clip_eps_high,
                         form=self.loss_form, adv_gamma=self.adv_gamma,
                         adv_beta=self.adv_beta, adv_alpha=self.adv_alpha, is_cap=self.is_cap)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def replace(self, **changes) -> "OPDConfig":
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
      if set(cross.names) & set(teachers.names) or cfg.loss_form != "advantage" or (
          "confidence" in (cfg.schedule, cfg.anneal_to)):
        raise ValueError(f"cross-tokenizer teachers {list(cross.names)} need distinct names "
                         f"(teachers {list(teachers.names)}), OPDConfig.loss_form='advantage' "
                         f"(got {cfg.loss_form!r}) and a schedule / anneal_to other than "
                         f"'confidence' (got {cfg.schedule!r} / {cfg.anneal_to!r}: it scores the "
                         "student's tokens)")
    if not (len(self.names) == len(self.heads) == len(self.domains)):
      raise ValueError(f"teachers ({len(self.names)}), heads ({len(self.heads)}) and domains "
                       f"({len(self.domains)}) must have one entry per teacher")
    self.total_steps = fields.check_int("OPDSource", "total_steps", total_steps, min_value=0)
    if cfg.anneal_steps > total_steps:
      raise ValueError(f"OPDConfig.anneal_steps={cfg.anneal_steps} exceeds the run's "
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
    cfg, k = self.cfg, len(self.names)
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
    cfg = self.cfg
    hidden = [h.astype(np.float32) for h in cached.hidden]
    scores = teacher_weighting.confidence_scores(
        hidden, self.heads, jax.numpy.asarray(host["targets"]), score=cfg.confidence_by,
        temperature=cfg.kl_temperature)
    return teacher_weighting.confidence_weights(
        scores, host["loss_mask"] > 0, temperature=cfg.confidence_temperature,
        per="token" if cfg.confidence_per_token else "sequence")

  def _routed_rows(self, examples, t: int, step: int) -> np.ndarray | None:
    """[B] teacher index when this step's weights are one-hot per row (routing,
    not annealing yet): each teacher then runs over its own rows only."""
    if self.cfg.schedule != "routing" or self.cross is not None or (
        self.cfg.anneal_to == "confidence" and self.cfg.anneal_steps > 0):
      return None  # confidence weights need every teacher on every row
    w = np.asarray(self._weights(examples, None, None, 1, step))[:, 0, :]
    if not np.all((w > 0).sum(axis=1) == 1):
      return None
    return w.argmax(axis=1).astype(np.int32)

  def next_batch(self, state, step: int):
    """``(batch, host_metrics)`` for 0-based OPD ``step``; None when prompts run out."""
    cfg, t0 = self.cfg, time.perf_counter()
    stats = RewardStats()
    drawn = draw_prompts(self.prompts, cfg.prompts_per_step, self._problem, stats)
    if drawn is None:
      return None
    examples = [ex for ex in drawn for _ in range(cfg.group_size)]  # row p * G + g: prompt p
    params = distributed.replicate_on(state.params, self.mesh) if self._multi else state.params
    policy = Policy(self.student_cfg, params, self.tokenizer, self.mesh, self.rules)
    episodes = sample_groups(policy, drawn, cfg.rollout, self._key, step, self._sampling,
                             log=RolloutLog(stats=stats if cfg.verifies else None),
                             verify=cfg.verifies)
    t1 = time.perf_counter()
    host, _ = training_arrays(episodes, seq_len=cfg.seq_len, length_bucket=cfg.length_bucket,
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
    if cfg.outcome_advantages:
      # Row p * G + g is sample g of prompt p: [P, G] groups are same-prompt.
      rewards = np.asarray([sc.reward for sc in score_episodes(episodes)])
      opd["advantages"] = group_advantages(rewards.reshape(cfg.prompts_per_step,
                                                           cfg.group_size)).reshape(-1)
    if cfg.outcome_advantages or cfg.loss_form == "advantage":
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
    rows = distributed.process_batch_rows(self.train_mesh, self.rules, self.cfg.batch_size)
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
          mask_k, n=self.cfg.diag_tokens, seed=step, temperature=self.cfg.kl_temperature))
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
