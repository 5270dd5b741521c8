"""Asking teachers with another tokenizer about a student batch (docs/DESIGN.md §3).

``CrossTokenizerPool.answer(host)`` does what the hidden-state cache does for
the student's own tokenizer, in two phases:

1. every row is transcoded and aligned for every cross-tokenizer teacher
   (``opd.distill.crosstok.cross_tokenizer_rows``); a row a teacher cannot
   read raises ``ValueError`` naming the teacher and the example **before
   any teacher is called**, so no fault, skip or call is counted for a
   refused batch;
2. each teacher runs on its own rows through its own fault layer
   (``opd.distill.faults.FaultTolerantTeachers``: deadline, shape and
   non-finite screens, fault window), which gives its hidden states
   ``[B, T'_k, D_k]`` and the rows it answered.

:meth:`CrossTokenizerAnswers.loss_entries` puts them into an OPD loss batch
(``opd.distill.loss.make_opd_loss(cross_tokenizer=...)``): teacher k's
hidden states in ``teacher_hidden[k]``, its span keys, ``loss_mask`` cut to
the trained spans, and teacher k's weight zeroed on the rows it did not
answer (the others' renormalised by the loss, as for a skip).
``opd.distill.source.OPDSource(cross=...)`` does both for each rollout
batch (the confidence schedule and the diagnostics read teachers' log-probs
of the student's tokens: not with these teachers); ``train_opd`` builds
the pool from the ``Teacher``s whose ``tokenizer`` is not the student's
(:func:`from_teacher`) and passes ``cross_tokenizer`` to the loss. Not
built: placement on a teacher mesh, int8, out-of-process cross-tokenizer
teachers, and the held-out reverse-KL eval of such a teacher.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

import jax

from opd.distill import crosstok
from opd.distill.cache import CachedBatch
from opd.distill.faults import (DEFAULT_WINDOW, FaultTolerantTeachers, SkipCounter,
                                TeacherAnswers, TeacherFn)
from opd.models import forward

__all__ = ["CrossTokenizerAnswers", "CrossTokenizerPool", "CrossTokenizerTeacher",
           "EmptyTeachers", "from_teacher"]


@dataclasses.dataclass(frozen=True)
class CrossTokenizerTeacher:
  """A teacher whose tokenizer is not the student's.

  Attributes:
    name: the teacher's name (as in the pool's K order).
    tokenizer: its tokenizer (the byte tokenizer or a byte-level BPE).
    fn: ``fn(tokens [B, T'], mask [B, T']) -> [B, T', D_k]`` its hidden
      states on its own ids.
    width: D_k.
  """
  name: str
  tokenizer: Any
  fn: TeacherFn
  width: int


def from_teacher(teacher) -> CrossTokenizerTeacher:
  """A ``opd.distill.teachers.Teacher`` with a ``tokenizer``, its forward jitted
  on the default device (no placement, no int8)."""
  cfg, params = teacher.cfg, teacher.params
  if teacher.tokenizer is None or teacher.int8:
    raise ValueError(f"teacher {teacher.name!r}: a cross-tokenizer teacher needs a tokenizer and "
                     f"int8=False (got tokenizer={teacher.tokenizer!r}, int8={teacher.int8})")
  run = jax.jit(lambda tokens, mask: forward(cfg, params, tokens, None, mask, return_logits=False,
                                             return_hidden=True).hidden.astype(np.float32))
  return CrossTokenizerTeacher(teacher.name, teacher.tokenizer, run, cfg.d_model)


class EmptyTeachers:
  """The same-tokenizer side of a pool whose teachers all have another
  tokenizer: ``OPDSource``'s ``teachers`` asking nobody."""

  names: tuple[str, ...] = ()

  def __init__(self):
    self.counter = SkipCounter("opd")

  def __call__(self, tokens, mask, teacher_of_row=None) -> TeacherAnswers:
    return TeacherAnswers({}, np.zeros((np.shape(tokens)[0], 0), bool), {}, {})


@dataclasses.dataclass(frozen=True)
class CrossTokenizerAnswers:
  """The cross-tokenizer teachers' answers for one student batch.

  Attributes:
    rows: ``{name: CrossTokenizerRows}``.
    hidden: ``{name: [B, T'_k, D_k]}`` (zeros where it did not answer).
    available: ``{name: [B] bool}`` the rows it answered.
  """
  rows: dict[str, crosstok.CrossTokenizerRows]
  hidden: dict[str, Any]
  available: dict[str, np.ndarray]

  def extend(self, cached: CachedBatch, sharding=None) -> CachedBatch:
    """``cached`` (the same-tokenizer teachers' batch) with these teachers'
    hidden states and rows answered after its own; ``sharding`` places them."""
    names = tuple(self.rows)
    hidden = tuple(self.hidden[n] if sharding is None else jax.device_put(self.hidden[n], sharding)
                   for n in names)
    available = np.stack([self.available[n] for n in names], axis=1)
    return CachedBatch(cached.key, cached.names + names, cached.hidden + hidden,
                       np.concatenate([cached.available, available], axis=1),
                       dict(cached.skipped), dict(cached.messages))

  def loss_entries(self, batch: Mapping[str, Any], names: Sequence[str]) -> dict:
    """``batch`` (an OPD loss batch over the K teachers ``names``) with these
    teachers' answers put in (module docstring); a new dict."""
    out = dict(batch)
    hidden, weights = list(out["teacher_hidden"]), np.array(out["teacher_weights"])
    loss_mask = np.asarray(out["loss_mask"]).copy()
    for name, rows in self.rows.items():
      k = list(names).index(name)
      hidden[k] = self.hidden[name]
      out.update(crosstok.batch_entries(k, rows))
      loss_mask = loss_mask * rows.trained
      weights[~self.available[name], :, k] = 0.0
    out.update(teacher_hidden=tuple(hidden), teacher_weights=weights, loss_mask=loss_mask)
    return out


class CrossTokenizerPool:
  """The cross-tokenizer teachers of a pool, each behind its own fault layer.

  Args:
    teachers: the :class:`CrossTokenizerTeacher`s.
    student_tokenizer: the student's tokenizer.
    deadline_s, window: as ``FaultTolerantTeachers``.
    length_bucket: teacher rows are padded to a multiple of this (0: the
      longest row).

  Attributes:
    counters: ``{name: SkipCounter}`` (``skips/<name>/...`` metrics).

  Raises:
    ValueError: no teachers, a duplicate name, a tokenizer with no byte
      spans, or one that is the student's (such a teacher belongs in the
      plain pool), naming the teacher.
  """

  def __init__(self, teachers: Sequence[CrossTokenizerTeacher], student_tokenizer, *,
               deadline_s: float, window: int = DEFAULT_WINDOW, length_bucket: int = 0):
    teachers = tuple(teachers)
    names = [t.name for t in teachers]
    if not teachers or len(set(names)) != len(names):
      raise ValueError(f"teachers {names}: expected at least one, with unique names")
    for t in teachers:
      crosstok.check_tokenizer(t.tokenizer, f"teacher {t.name!r}")
      if crosstok.same_tokenizer(t.tokenizer, student_tokenizer):
        raise ValueError(f"teacher {t.name!r} has the student's tokenizer "
                         f"({getattr(t.tokenizer, 'spec', None)!r}): give it to the plain pool")
    self.teachers, self.student_tokenizer = teachers, student_tokenizer
    self.length_bucket = length_bucket
    self.counters = {t.name: SkipCounter("opd") for t in teachers}
    self._asked = {t.name: FaultTolerantTeachers(
        {t.name: t.fn}, {t.name: t.width}, deadline_s=deadline_s, counter=self.counters[t.name],
        vocab_size=t.tokenizer.vocab_size, window=window) for t in teachers}

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(t.name for t in self.teachers)

  def answer(self, host, *, example_ids: Sequence[str] | None = None) -> CrossTokenizerAnswers:
    """Transcodes every row for every teacher, then asks each (module docstring).

    Args:
      host: the student batch's ``tokens, targets, mask, loss_mask`` [B, T].
      example_ids: B example ids, named in errors.
    """
    return self.ask(self.rows(host, example_ids=example_ids))

  def rows(self, host, *, example_ids: Sequence[str] | None = None
           ) -> dict[str, crosstok.CrossTokenizerRows]:
    """Phase 1: every teacher's rows (raises before any teacher is called)."""
    return {t.name: crosstok.cross_tokenizer_rows(
        self.student_tokenizer, t.tokenizer, host, teacher=t.name, example_ids=example_ids,
        length_bucket=self.length_bucket) for t in self.teachers}

  def ask(self, rows: Mapping[str, crosstok.CrossTokenizerRows]) -> CrossTokenizerAnswers:
    """Phase 2: each teacher on its own ``rows`` through its fault layer."""
    hidden, available = {}, {}
    for name, r in rows.items():
      answers = self._asked[name](r.tokens, r.mask)
      hidden[name], available[name] = answers.hidden[name], answers.available[:, 0]
    return CrossTokenizerAnswers(dict(rows), hidden, available)

  def metrics(self) -> dict[str, int]:
    """``skips/<name>/<reason>`` of every cross-tokenizer teacher."""
    out = {}
    for name, counter in self.counters.items():
      own = counter.metrics([name])
      out.update({k: v for k, v in own.items() if k.startswith(f"skips/{name}/")})
    return out
