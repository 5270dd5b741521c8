"""The per-rollout-batch teacher hidden-state cache (docs/DESIGN.md §3).

Each teacher's last hidden states ``[B, T, D_k]`` are computed once per
rollout batch and stored in bf16 (or a configured dtype); every optimizer
step on that batch (PPO-style epochs, gradient accumulation) reads the
cache. Logits are rebuilt only inside the fused loss from ``W_k``
(docs/DESIGN.md §4), so a cached token costs ``D_k × itemsize`` bytes per
teacher instead of the ``V × 4`` of float32 logits.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from opd.distill import teacher_weighting
from opd.distill.faults import TeacherAnswers


@dataclasses.dataclass
class CachedBatch:
  """One rollout batch's teacher answers.

  Attributes:
    key: the batch's identity (e.g. the rollout step).
    names: the K teacher names.
    hidden: K arrays [B, T, D_k] in the cache dtype (zeros where a teacher
      did not answer).
    available: [B, K] bool, which teacher answered for which row.
    skipped: ``{name: reason}`` for teachers skipped for the whole batch.
    messages: ``{name: detail}`` of every fault of the batch (whole-batch
      skips and non-finite rows; the fault layer has logged them).
  """
  key: Hashable
  names: tuple[str, ...]
  hidden: tuple[jax.Array, ...]
  available: np.ndarray
  skipped: dict[str, str]
  messages: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def batch_ok(self) -> bool:
    return bool(self.available.any())


class HiddenStateCache:
  """Computes teacher hidden states once per rollout batch and serves them.

  Args:
    teachers: ``fn(tokens, mask) -> TeacherAnswers`` (a
      :class:`opd.distill.faults.FaultTolerantTeachers`).
    dtype: storage dtype of the cached hidden states (``"bfloat16"``,
      ``"float32"``, ...).
    sharding: where to keep them (e.g. the student's
      ``opd.parallel.sharding.batch_sharding(mesh, rules, 3)``); None keeps
      them where the teachers put them.

  Attributes:
    computes: how many batches were computed (each is one forward per
      teacher); ``hits``: how many requests were served from the cache.
  """

  def __init__(self, teachers: Callable[..., TeacherAnswers], *, dtype: str = "bfloat16",
               sharding: jax.sharding.Sharding | None = None):
    try:
      self.dtype = jnp.dtype(dtype)
    except TypeError as e:
      raise ValueError(f"dtype={dtype!r} is not a dtype") from e
    if not jnp.issubdtype(self.dtype, jnp.floating):
      raise ValueError(f"dtype={dtype!r} must be a floating dtype")
    self.teachers = teachers
    self.sharding = sharding
    self.computes = 0
    self.hits = 0
    self._entry: CachedBatch | None = None

  def get(self, key: Hashable, tokens, mask, teacher_of_row=None) -> CachedBatch:
    """The teachers' answers for batch ``key`` (computed on the first request).

    Only the latest batch is kept: a new ``key`` replaces it.
    ``teacher_of_row`` ([B] int) asks each teacher about its routed rows only.
    """
    if self._entry is not None and self._entry.key == key:
      self.hits += 1
      return self._entry
    if teacher_of_row is None:
      answers = self.teachers(tokens, mask)
    else:
      answers = self.teachers(tokens, mask, teacher_of_row=teacher_of_row)
    names = tuple(answers.hidden)
    hidden = tuple(answers.hidden[n].astype(self.dtype) for n in names)
    if self.sharding is not None:
      hidden = tuple(jax.device_put(h, self.sharding) for h in hidden)
    self._entry = CachedBatch(key, names, hidden, np.asarray(answers.available),
                              dict(answers.skipped), dict(answers.messages))
    self.computes += 1
    return self._entry

  def bytes_per_token(self, vocab_size: int) -> dict[str, int]:
    """Bytes per token: ``cache/<name>`` (``D_k × itemsize``) per cached
    teacher and ``logits`` (``V × 4``, what float32 logits would take)."""
    if self._entry is None:
      raise ValueError("bytes_per_token: the cache holds no batch yet")
    out = {f"cache/{n}": int(h.shape[-1]) * self.dtype.itemsize
           for n, h in zip(self._entry.names, self._entry.hidden)}
    out["logits"] = int(vocab_size) * 4
    return out


def loss_batch(batch: Mapping[str, np.ndarray], cached: CachedBatch,
               weights) -> tuple[dict, np.ndarray]:
  """The OPD loss batch: rollout arrays + cached hidden states + weights.

  Args:
    batch: ``tokens, targets, mask, loss_mask`` (and optionally
      ``positions``), all [B, T].
    cached: the batch's :class:`CachedBatch`.
    weights: [B, T, K] scheduled weights (before skips), each token summing
      to a positive number (:func:`opd.distill.teacher_weighting.normalize`
      checks).

  Returns:
    ``(loss_batch, row_ok)``: the dict :func:`opd.distill.loss.make_opd_loss`
    takes, its weights zeroed for skipped teachers and renormalised
    (:func:`opd.distill.teacher_weighting.apply_availability`); ``row_ok`` [B] bool.
  """
  w, row_ok = teacher_weighting.apply_availability(teacher_weighting.normalize(weights),
                                                   cached.available)
  out = {k: batch[k] for k in ("tokens", "targets", "mask", "loss_mask", "positions")
         if k in batch}
  out["teacher_hidden"] = cached.hidden
  out["teacher_weights"] = w
  return out, np.asarray(row_ok)
