"""Fault-tolerant teacher calls (docs/DESIGN.md §3).

Every teacher call runs in a worker thread with a deadline. A teacher is
skipped for the batch when it

* raises (reason ``"error"``),
* has not answered by the deadline (``"timeout"``; the thread is abandoned
  and counted in ``abandoned``: Python cannot stop it, which is why a teacher
  that may hang should run out of process),
* returns an array of the wrong shape or dtype (``"shape"``),

and skipped for the rows where its hidden states are non-finite at a real
token (``"nonfinite"``, counted once per batch, the rows in
``nonfinite_rows``). Skipped entries are zeroed, so no NaN ever reaches the
loss; :func:`opd.distill.teacher_weighting.apply_availability` then renormalises the
weights over the teachers that answered, masks rows none answered and the
caller skips the step when no row is left (``TeacherAnswers.batch_ok``).
Training never crashes on a teacher fault.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from opd.distill.teachers import row_groups

REASONS = ("error", "timeout", "shape", "nonfinite")

# A teacher callable: fn(tokens [B, T] int32, mask [B, T] bool) -> [B, T, D_k].
TeacherFn = Callable[[np.ndarray, np.ndarray], jax.Array]


@dataclasses.dataclass
class TeacherAnswers:
  """The teachers' answers for one batch.

  Attributes:
    hidden: ``{name: [B, T, D_k] float32}`` for every teacher, zeros where
      it did not answer (so the arrays can always go to the loss).
    available: [B, K] bool, whether teacher k answered for row b.
    skipped: ``{name: reason}`` for teachers skipped for the whole batch.
    messages: ``{name: detail}`` (the exception text etc.) for the log.
  """
  hidden: dict[str, jax.Array]
  available: np.ndarray
  skipped: dict[str, str]
  messages: dict[str, str]

  @property
  def sample_ok(self) -> np.ndarray:
    """[B] bool: some teacher answered for the row (else its loss is masked)."""
    return self.available.any(axis=1)

  @property
  def batch_ok(self) -> bool:
    """False when no teacher answered for any row: skip the step and log it."""
    return bool(self.sample_ok.any())


class SkipCounter:
  """Skip counts per teacher and reason, for the metrics JSONL."""

  def __init__(self):
    self.counts: collections.Counter = collections.Counter()
    self.nonfinite_rows: collections.Counter = collections.Counter()
    self.skipped_steps = 0

  def metrics(self, names) -> dict[str, int]:
    out = {f"skips/{n}/{r}": self.counts[(n, r)] for n in names for r in REASONS}
    out.update({f"skips/{n}/nonfinite_rows": self.nonfinite_rows[n] for n in names})
    out["skips/total"] = sum(self.counts.values())
    out["skips/steps"] = self.skipped_steps
    return out


def call_with_deadline(fn: Callable[[], object], deadline_s: float):
  """Runs ``fn()`` in a daemon thread; waits at most ``deadline_s`` seconds.

  Returns:
    ``(value, None, "")`` on success, ``(None, "error", text)`` if it raised,
    ``(None, "timeout", text)`` if it is still running at the deadline (the
    thread is left to finish on its own).
  """
  box: dict = {}

  def target():
    try:
      value = fn()
      box["value"] = jax.block_until_ready(value)  # async dispatch: wait inside the deadline
    except BaseException as e:  # noqa: BLE001 - any teacher fault is a skip
      box["error"] = f"{type(e).__name__}: {e}"

  thread = threading.Thread(target=target, daemon=True, name="teacher-call")
  start = time.monotonic()
  thread.start()
  thread.join(deadline_s)
  if thread.is_alive():
    waited = time.monotonic() - start
    return None, "timeout", f"no answer after {waited:.2f}s (deadline {deadline_s}s)"
  if "error" in box:
    return None, "error", box["error"]
  return box["value"], None, ""


@jax.jit
def _screen(hidden, mask):
  """(zeroed hidden [B, T, D] float32, bad_rows [B] bool)."""
  finite = jnp.isfinite(hidden)
  bad = jnp.any(~finite & mask[:, :, None], axis=(1, 2))
  return jnp.where(finite, hidden, 0.0).astype(jnp.float32), bad


class FaultTolerantTeachers:
  """Calls K teachers with a deadline each and screens their answers.

  Args:
    teachers: ``{name: fn(tokens, mask) -> [B, T, D_k]}`` in the order of the
      weights' K axis (in-process or out-of-process teachers alike).
    widths: ``{name: D_k}`` the expected hidden width of each.
    deadline_s: seconds each call may take.
    counter: a shared :class:`SkipCounter` (default: a new one).
  """

  def __init__(self, teachers: Mapping[str, TeacherFn], widths: Mapping[str, int], *,
               deadline_s: float, counter: SkipCounter | None = None):
    if not teachers:
      raise ValueError("teachers={}: distillation needs at least one teacher")
    if set(widths) != set(teachers):
      raise ValueError(f"widths names {sorted(widths)} differ from teachers {sorted(teachers)}")
    if not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
      raise ValueError(f"deadline_s={deadline_s!r} must be a positive number of seconds")
    self.teachers = dict(teachers)
    self.widths = dict(widths)
    self.deadline_s = float(deadline_s)
    self.counter = counter or SkipCounter()
    self.abandoned = 0

  @classmethod
  def from_pool(cls, pool, *, deadline_s: float, counter: SkipCounter | None = None):
    """Wraps a :class:`opd.distill.teachers.TeacherPool`'s teachers."""
    fns = {t.name: (lambda tok, m, n=t.name: pool.hidden(n, tok, m)) for t in pool.teachers}
    return cls(fns, {t.name: t.cfg.d_model for t in pool.teachers}, deadline_s=deadline_s,
               counter=counter)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.teachers)

  def __call__(self, tokens, mask, teacher_of_row=None) -> TeacherAnswers:
    """Asks every teacher about ``tokens`` / ``mask`` ([B, T]); never raises on a fault.

    With ``teacher_of_row`` ([B] int, prompt routing) each teacher is asked
    about its own rows only (teacher-sorted batching); a teacher with no
    rows is not called (not a skip), and its hidden states are zero.
    """
    tokens = np.asarray(tokens, np.int32)
    mask = np.asarray(mask, bool)
    b, t = tokens.shape
    names = self.names
    if teacher_of_row is None:
      groups = [np.arange(b)] * len(names)
    else:
      groups = row_groups(teacher_of_row, b, len(names))
    available = np.zeros((b, len(names)), bool)
    hidden, skipped, messages = {}, {}, {}
    for k, (name, rows) in enumerate(zip(names, groups)):
      zeros = jnp.zeros((b, t, self.widths[name]), jnp.float32)
      hidden[name] = zeros  # until (unless) it answers
      if rows.size == 0:
        continue
      full = rows.size == b
      tok, m = (tokens, mask) if full else (tokens[rows], mask[rows])
      value, reason, detail = call_with_deadline(
          lambda fn=self.teachers[name], tok=tok, m=m: fn(tok, m), self.deadline_s)
      if reason == "timeout":
        self.abandoned += 1
      want = (rows.size, t, self.widths[name])
      if reason is None and (getattr(value, "shape", None) != want or
                             not jnp.issubdtype(getattr(value, "dtype", np.int32), jnp.floating)):
        reason = "shape"
        detail = (f"returned shape={getattr(value, 'shape', None)} "
                  f"dtype={getattr(value, 'dtype', type(value).__name__)}; expected {want} float")
      if reason is not None:
        self.counter.counts[(name, reason)] += 1
        skipped[name], messages[name] = reason, detail
        continue
      h, bad = _screen(jnp.asarray(value), jnp.asarray(m))
      bad = np.asarray(bad)
      available[rows, k] = ~bad
      hidden[name] = h if full else zeros.at[rows].set(h)
      if bad.any():
        self.counter.counts[(name, "nonfinite")] += 1
        self.counter.nonfinite_rows[name] += int(bad.sum())
        messages[name] = f"non-finite hidden states in rows {rows[bad].tolist()}"
        if bad.all():
          skipped[name] = "nonfinite"
    answers = TeacherAnswers(hidden, available, skipped, messages)
    if not answers.batch_ok:
      self.counter.skipped_steps += 1
    return answers
