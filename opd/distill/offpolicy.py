"""Off-policy forward-KL distillation on teacher rollouts (docs/DESIGN.md §3, Baselines).

The distillation tunix and maxtext implement, and one of OPD's baselines:
each teacher answers its domain's prompts once (``teacher_rollouts``, the
cold start's generation, ``opd.distill.cold_start.teacher_sft_pairs``), and
the student is then trained on those **fixed** sequences to match the
generating teacher's whole next-token distribution at every response
token::

    L_t = KL(q_k,t ‖ p_s,t) = Σ_v q_v (log q_v − log p_v)    (forward KL, τ divides all logits)

with k the teacher that wrote the row (one-hot weights), by
``pallas_kernels.fused_forward_kl`` from hidden states and heads: ``[B, T, V]``
logits are never materialised. Forward KL on the teacher's text is
mass-covering and sees only teacher prefixes (the train/test mismatch that
on-policy distillation removes).

``train_offpolicy_kd`` = ``OffPolicySource`` (batches of teacher text,
resumable position, the teachers' hidden states for each batch) +
``make_forward_kl_loss`` in the shared train step, driven by
``opd.training.loop.train`` (resume, checkpoints, eval, metrics, NaN stop),
like ``train_opd`` and the cold start. ``make_heldout_forward_kl`` measures
the loss on held-out teacher text.

Batch (as ``opd.distill.loss.make_opd_loss``'s, without the GRPO keys)::

    tokens, targets   [B, T] int    teacher text and next tokens
    mask              [B, T] bool   real tokens
    loss_mask         [B, T] float  targets the teacher sampled (its policy tokens)
    teacher_hidden    K arrays [B, T, D_k]  (zeros on rows another teacher wrote)
    teacher_weights   [B, T, K]     one-hot: the row's teacher
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from opd.config import fields
from opd.distill.cold_start import AnswerSampling, teacher_sft_pairs
from opd.distill.loss import AGGREGATIONS, BATCH_KEYS
from opd.distill.teachers import Teacher, TeacherPool
from opd.models import ModelConfig, forward, head_matrix
from opd.parallel import sharding as sharding_lib
from opd.rollout.batches import PromptStream, training_arrays
from opd.rollout.episodes import Episode
from opd.tasks import Example
from opd.training import loop as train_loop
from opd.training.loop_config import LoopConfig, RunIO, Runtime
from opd.training.train_step import (OptimConfig, init_train_state, make_optimizer,
                                     make_train_step, shard_batch)

__all__ = ["OffPolicyConfig", "OffPolicyRun", "OffPolicySource", "TeacherText",
           "make_forward_kl_loss", "make_heldout_forward_kl", "teacher_rollouts",
           "train_offpolicy_kd"]


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
  """Off-policy distillation settings; hashable and JSON-ready (``to_dict``).

  Attributes:
    batch_size: B, teacher sequences per update.
    seq_len: L, the longest training row (longer teacher text is cut).
    length_bucket: rows are padded to the batch's longest, rounded up to a
      multiple of this (0: always ``seq_len``).
    kl_temperature: τ dividing every logit in the loss.
    aggregation: ``"token_mean"`` or ``"sequence_mean"`` (``opd.distill.loss``).
    max_new_tokens, temperature: the teachers' sampling (per assistant turn).
    samples_per_prompt: answers each teacher samples per prompt.
    min_reward: verifier reward a teacher answer needs to be kept (0: every
      finished answer; truncated ones are always dropped).
    sample_batch_size: sampler rows per call.
  """
  batch_size: int = 16
  seq_len: int = 256
  length_bucket: int = 32
  kl_temperature: float = 1.0
  aggregation: str = "token_mean"
  max_new_tokens: int = 64
  temperature: float = 1.0
  samples_per_prompt: int = 1
  min_reward: float = 0.0
  sample_batch_size: int = 32

  def __post_init__(self):
    fields.check_fields(
        self, "OffPolicyConfig", ints={"batch_size": 1, "seq_len": 2, "length_bucket": 0,
                                       "max_new_tokens": 1, "samples_per_prompt": 1,
                                       "sample_batch_size": 1},
        positive=("kl_temperature", "temperature"),
        floats={"min_reward": dict(min_value=0, max_value=1)},
        choices={"aggregation": AGGREGATIONS})

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


class TeacherText(NamedTuple):
  """Fixed teacher rollouts: ``episodes[i]`` was written by teacher ``teacher_of_row[i]``
  (an index into the pool's teachers); ``metrics`` as the cold start's."""
  episodes: list[Episode]
  teacher_of_row: np.ndarray
  metrics: dict[str, float]


def teacher_rollouts(teachers: Sequence[Teacher], prompts: Sequence[Example],
                     cfg: OffPolicyConfig, *, tokenizer, seed: int = 0, mesh=None,
                     rules=None) -> TeacherText:
  """Each teacher answers its domain's ``prompts`` (``teacher_sft_pairs``); the kept
  answers with the index of the teacher that wrote each."""
  teachers = list(teachers)
  answers = AnswerSampling(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                           samples_per_prompt=cfg.samples_per_prompt, min_reward=cfg.min_reward,
                           batch_size=cfg.sample_batch_size)
  data = teacher_sft_pairs(teachers, prompts, answers, tokenizer=tokenizer, seed=seed, mesh=mesh,
                           rules=rules)
  # teacher_sft_pairs appends each teacher's kept answers in teacher order.
  kept = [int(data.metrics.get(f"cold_start/{t.name}/kept", 0)) for t in teachers]
  owner = np.repeat(np.arange(len(teachers)), kept).astype(np.int32)
  if owner.size != len(data.episodes):
    raise ValueError(f"teacher_rollouts: {len(data.episodes)} episodes but per-teacher kept "
                     f"counts {kept}")
  for ep, k in zip(data.episodes, owner):
    if teachers[k].domain not in (None, ep.example.domain):
      raise ValueError(f"episode {ep.example.id!r} ({ep.example.domain}) attributed to teacher "
                       f"{teachers[k].name!r} of domain {teachers[k].domain!r}")
  return TeacherText(list(data.episodes), owner, dict(data.metrics))


def _check_text(data: TeacherText, k: int) -> None:
  if not data.episodes:
    raise ValueError("TeacherText has no episodes: no teacher answer was kept")
  owner = np.asarray(data.teacher_of_row)
  if owner.shape != (len(data.episodes),) or owner.min() < 0 or owner.max() >= k:
    raise ValueError(f"TeacherText.teacher_of_row has shape {owner.shape} and values in "
                     f"[{owner.min()}, {owner.max()}]: expected [{len(data.episodes)}] indices "
                     f"into the {k} teachers")


def _check_batch(batch, widths: Sequence[int]) -> None:
  """Keys and shapes of a loss batch (module docstring)."""
  missing = [key for key in BATCH_KEYS if key not in batch]
  if missing:
    raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
  hidden = batch["teacher_hidden"]
  if len(hidden) != len(widths):
    raise ValueError(f"batch['teacher_hidden'] has {len(hidden)} arrays for K={len(widths)} "
                     "teacher heads")
  bt = tuple(batch["tokens"].shape)
  want = {"targets": bt, "mask": bt, "loss_mask": bt, "teacher_weights": bt + (len(widths),)}
  got = {key: tuple(batch[key].shape) for key in want}
  for i, (h, d) in enumerate(zip(hidden, widths)):
    want[f"teacher_hidden[{i}]"], got[f"teacher_hidden[{i}]"] = bt + (d,), tuple(h.shape)
  for key, shape in want.items():
    if len(bt) != 2 or got[key] != shape:
      raise ValueError(f"batch[{key}].shape={got[key]}: expected {shape} (tokens: [B, T]={bt})")


def _aggregate(per_token, keep, aggregation: str):
  """Scalar from [B, T] per-token losses over ``keep``: the mean over kept tokens
  (``token_mean``) or the mean over rows with any of each row's mean (``sequence_mean``)."""
  keep = keep.astype(jnp.float32)
  if aggregation == "sequence_mean":
    n = jnp.sum(keep, axis=1, keepdims=True)
    keep = keep / jnp.maximum(n, 1.0) / jnp.maximum(jnp.sum(n > 0), 1)
    return jnp.sum(per_token * keep)
  return jnp.sum(per_token * keep) / jnp.maximum(jnp.sum(keep), 1.0)


def make_forward_kl_loss(student_cfg: ModelConfig, teacher_heads: Sequence[jax.Array], *,
                         temperature: float = 1.0, aggregation: str = "token_mean",
                         teacher_names: Sequence[str] | None = None, impl: str = "auto"):
  """``loss_fn(params, batch, rng) -> (loss, metrics)``: the aggregated forward KL.

  Metrics: ``fkl/<name>`` (mean forward KL over the tokens teacher k weighs)
  and ``kd_tokens`` (trained tokens).
  """
  heads = tuple(teacher_heads)
  if not heads:
    raise ValueError("teacher_heads=(): distillation needs at least one teacher")
  for i, w in enumerate(heads):
    if w.ndim != 2 or w.shape[1] != student_cfg.vocab_size:
      raise ValueError(f"teacher_heads[{i}].shape={w.shape}: expected [D_k, "
                       f"V={student_cfg.vocab_size}]")
  fields.check_choice("make_forward_kl_loss", "aggregation", aggregation, AGGREGATIONS)
  tau = fields.check_float("make_forward_kl_loss", "temperature", temperature, min_value=0,
                           min_exclusive=True)
  names = tuple(teacher_names) if teacher_names is not None else tuple(
      f"t{i}" for i in range(len(heads)))
  if len(names) != len(heads):
    raise ValueError(f"teacher_names has {len(names)} names for {len(heads)} teacher_heads")
  widths = [w.shape[0] for w in heads]

  def loss_fn(params, batch, rng):
    del rng
    _check_batch(batch, widths)
    b, t = batch["tokens"].shape
    out = forward(student_cfg, params, batch["tokens"], batch.get("positions"), batch["mask"],
                  return_logits=False, return_hidden=True)
    weights = batch["teacher_weights"].astype(jnp.float32).reshape(b * t, -1)
    keep = ((batch["loss_mask"] > 0) & batch["mask"].astype(bool)).reshape(b * t)
    keep = keep & (jnp.sum(weights, axis=-1) > 0)
    per_tok = pallas_kernels.fused_forward_kl(
        out.hidden.reshape(b * t, -1), head_matrix(student_cfg, params),
        [h.reshape(b * t, h.shape[-1]) for h in batch["teacher_hidden"]], heads, weights,
        mask=keep, temperature=tau, impl=impl)
    uses = (weights > 0) & keep[:, None]  # [BT, K]
    per_k = jnp.sum(per_tok[:, None] * uses, axis=0) / jnp.maximum(jnp.sum(uses, axis=0), 1)
    metrics = {f"fkl/{n}": per_k[i] for i, n in enumerate(names)}
    metrics["kd_tokens"] = jnp.sum(keep.astype(jnp.float32))
    return _aggregate(per_tok.reshape(b, t), keep.reshape(b, t), aggregation), metrics

  return loss_fn


def _host_batch(pool: TeacherPool, episodes: Sequence[Episode], owner: np.ndarray,
                cfg: OffPolicyConfig, pad_id: int) -> tuple[dict, tuple]:
  """Training arrays of ``episodes`` and each teacher's hidden states on them."""
  host, _ = training_arrays(episodes, seq_len=cfg.seq_len, length_bucket=cfg.length_bucket,
                            pad_id=pad_id)
  del host["old_logprobs"]
  hidden = pool.hidden_routed(host["tokens"], host["mask"], owner)
  shape = host["tokens"].shape
  zeros = lambda t: jax.device_put(jnp.zeros(shape + (t.cfg.d_model,), jnp.float32),
                                   sharding_lib.batch_sharding(pool.mesh, pool.rules, 3))
  host["teacher_weights"] = np.broadcast_to(
      np.eye(len(pool.names), dtype=np.float32)[owner][:, None, :],
      shape + (len(pool.names),)).copy()
  return host, tuple(hidden[t.name] if t.name in hidden else zeros(t) for t in pool.teachers)


class OffPolicySource:
  """Batches of fixed teacher text for ``opd.training.loop.train`` (module docstring).

  Rows are drawn without replacement within an epoch in an order from
  ``(seed, epoch)`` (``PromptStream`` over row indices), so the position
  is the whole state and a resumed run sees what an uninterrupted one would.
  """

  def __init__(self, pool: TeacherPool, data: TeacherText, cfg: OffPolicyConfig, *,
               pad_id: int, mesh, rules=sharding_lib.DEFAULT_RULES, seed: int = 0):
    _check_text(data, len(pool.names))
    self.pool, self.data, self.cfg, self.pad_id = pool, data, cfg, pad_id
    self.mesh, self.rules = mesh, rules
    self.rows = PromptStream(list(range(len(data.episodes))), seed=seed)
    self.updates_per_batch = 1
    self._tokens = 0.0

  def next_batch(self, state, step: int):
    del state, step
    t0 = time.perf_counter()
    idx = np.asarray([next(self.rows) for _ in range(self.cfg.batch_size)])
    host, hidden = _host_batch(self.pool, [self.data.episodes[i] for i in idx],
                               np.asarray(self.data.teacher_of_row)[idx], self.cfg, self.pad_id)
    batch = shard_batch(host, self.mesh, self.rules)
    batch["teacher_hidden"] = hidden
    self._tokens = float(host["mask"].sum())
    metrics = {"kd/response_tokens": float(host["loss_mask"].sum()),
               "perf/teacher_time_s": time.perf_counter() - t0}
    for k, name in enumerate(self.pool.names):
      metrics[f"kd/rows/{name}"] = float(np.sum(np.asarray(self.data.teacher_of_row)[idx] == k))
    return batch, metrics

  def step_metrics(self, host_metrics, train_metrics, *, batch_time_s: float,
                   train_time_s: float) -> dict[str, float]:
    """Host metrics, ``train/<k>`` of the update, ``perf/...`` times."""
    metrics = dict(host_metrics)
    metrics.update({f"train/{k}": v for k, v in train_metrics.items()
                    if k not in ("finite", "loss_finite", "grads_finite")})
    metrics.update({"perf/step_time_s": batch_time_s + train_time_s,
                    "perf/train_tokens_per_s": self._tokens / max(train_time_s, 1e-9)})
    return metrics

  def texts(self, step: int) -> dict[str, str]:
    return {}

  def get_state(self) -> dict:
    return {"rows": self.rows.get_state()}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if "rows" not in state:
      raise ValueError(f"cannot restore the off-policy source's position from {dict(state)}")
    self.rows.set_state(state["rows"])


OffPolicyRun = train_loop.TrainRun  # the final state and one metrics dict per step run


def make_heldout_forward_kl(student_cfg: ModelConfig, pool: TeacherPool, data: TeacherText,
                            cfg: OffPolicyConfig, *, pad_id: int, mesh,
                            rules=sharding_lib.DEFAULT_RULES) -> Callable[[Any], dict]:
  """``fn(params) -> {"fkl": ..., "fkl/<teacher>": ...}``: the forward KL on held-out
  teacher text (token-weighted over batches of ``cfg.batch_size``; teacher hidden
  states computed once, here)."""
  _check_text(data, len(pool.names))
  loss_fn = make_forward_kl_loss(student_cfg, pool.heads, temperature=cfg.kl_temperature,
                                 aggregation="token_mean", teacher_names=pool.names)
  jitted = jax.jit(lambda p, b: loss_fn(p, b, None))
  batches = []
  for lo in range(0, len(data.episodes), cfg.batch_size):
    sl = slice(lo, lo + cfg.batch_size)
    host, hidden = _host_batch(pool, data.episodes[sl], np.asarray(data.teacher_of_row)[sl],
                               cfg, pad_id)
    batches.append((host, hidden))

  def fn(params) -> dict[str, float]:
    total, per = 0.0, {n: [0.0, 0.0] for n in pool.names}
    tokens = 0.0
    for host, hidden in batches:
      batch = shard_batch(host, mesh, rules)
      batch["teacher_hidden"] = hidden
      loss, m = jitted(params, batch)
      n = float(m["kd_tokens"])
      total, tokens = total + float(loss) * n, tokens + n
      rows = host["loss_mask"] > 0
      for k, name in enumerate(pool.names):
        nk = float(np.sum(rows * host["teacher_weights"][..., k]))
        per[name][0] += float(m[f"fkl/{name}"]) * nk
        per[name][1] += nk
    out = {"fkl": total / max(tokens, 1.0)}
    out.update({f"fkl/{n}": s / c for n, (s, c) in per.items() if c})
    return out

  return fn


def train_offpolicy_kd(student_cfg: ModelConfig, params, teachers: Sequence[Teacher] | TeacherPool,
                       data: TeacherText, cfg: OffPolicyConfig, optim: OptimConfig,
                       loop: LoopConfig, io: RunIO | None = None, *, runtime: Runtime,
                       pad_id: int) -> OffPolicyRun:
  """Trains the student on ``data`` for ``loop.steps`` updates (module docstring).

  Args:
    params: the student's initial params (None: random init from ``runtime.seed``).
    teachers: ``Teacher``s (placed on ``runtime.mesh``) or a ``TeacherPool``, in the
      order ``data.teacher_of_row`` indexes.
    data: the teachers' text (``teacher_rollouts``).
    pad_id: the tokenizer's pad id.
    Others: as ``opd.distill.trainer.train_opd`` (``model``, ``offpolicy``,
      ``teachers`` and ``rows`` added to ``io.config``).
  """
  for name, value, typ in (("cfg", cfg, OffPolicyConfig), ("optim", optim, OptimConfig),
                           ("loop", loop, LoopConfig), ("runtime", runtime, Runtime)):
    if not isinstance(value, typ):
      raise ValueError(f"{name} must be a {typ.__name__}, got {type(value).__name__}")
  mesh, rules, seed = runtime.mesh, runtime.rules, runtime.seed
  pool = teachers if isinstance(teachers, TeacherPool) else TeacherPool(
      teachers, student_cfg.vocab_size, mesh, rules=rules)
  source = OffPolicySource(pool, data, cfg, pad_id=pad_id, mesh=mesh, rules=rules, seed=seed)
  optimizer = make_optimizer(optim)
  state, shardings = init_train_state(student_cfg, optimizer, mesh, rules, rng=seed,
                                      params=params)
  loss_fn = make_forward_kl_loss(student_cfg, pool.heads, temperature=cfg.kl_temperature,
                                 aggregation=cfg.aggregation, teacher_names=pool.names)
  step_fn = make_train_step(loss_fn, optimizer, mesh, shardings, rules=rules)
  io = (io if io is not None else RunIO()).with_config(
      {"model": student_cfg.to_dict(), "offpolicy": cfg.to_dict(), "teachers": list(pool.names),
       "rows": len(data.episodes)})
  return train_loop.train(state, step_fn, source, loop, io, desc="offpolicy_kd",
                          progress_key="loss")
