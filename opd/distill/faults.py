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
``nonfinite_rows``). A teacher whose output head ``W_k`` holds a non-finite
entry is never called: it is a ``"nonfinite"`` skip on every batch, and
:attr:`FaultTolerantTeachers.heads` gives the loss its head with those
entries zeroed (its weight is 0, so the loss is that of the others). Skipped
entries are zeroed, so no NaN ever reaches the loss;
:func:`opd.distill.teacher_weighting.apply_availability` then renormalises the
weights over the teachers that answered, masks rows none answered and the
caller skips the step when no row is left (``TeacherAnswers.batch_ok``).

Every fault's message is logged (``logging``, logger ``opd.distill.faults``):
in full at the first occurrence per teacher and reason, then a count line at
the 10th, 100th, 1000th, ... occurrence; the counts are also metrics
(:meth:`SkipCounter.metrics`). A transient fault never stops training; a
teacher that answered none of its rows on ``window`` consecutive batches it
was asked about raises :class:`TeacherFaultError` (a run would otherwise
distil from nobody, or without that teacher, and say nothing).

Bad input is not a teacher fault: token ids outside ``[0, V)`` raise
``ValueError`` before any teacher is asked.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from opd.distill.teachers import row_groups

REASONS = ("error", "timeout", "shape", "nonfinite")
DEFAULT_WINDOW = 20  # OPDConfig.fault_window's default: consecutive unanswered batches

log = logging.getLogger(__name__)

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


class TeacherFaultError(RuntimeError):
  """A teacher answered none of its rows on ``window`` consecutive batches."""


class SkipCounter:
  """Skip counts per teacher and reason, for the metrics JSONL, and the fault log.

  Args:
    label: where the calls come from, at the head of every log line
      (``"opd"`` for training, ``"held-out eval"``, ...).
  """

  def __init__(self, label: str = "opd"):
    self.label = label
    self.counts: collections.Counter = collections.Counter()
    self.nonfinite_rows: collections.Counter = collections.Counter()
    self.skipped_steps = 0

  def record(self, name: str, reason: str, message: str) -> None:
    """Counts one fault of teacher ``name``; logs the first in full, then counts."""
    self.counts[(name, reason)] += 1
    n = self.counts[(name, reason)]
    if n == 1:
      log.warning("%s: teacher %r skipped (%s): %s [first %r fault of this teacher; later ones "
                  "are counted in skips/%s/%s]", self.label, name, reason, message, reason, name,
                  reason)
    elif n >= 10 and 10 ** round(np.log10(n)) == n:
      log.warning("%s: teacher %r: %d %r faults so far; latest: %s", self.label, name, n, reason,
                  message)

  def metrics(self, names) -> dict[str, int]:
    out = {f"skips/{n}/{r}": self.counts[(n, r)] for n in names for r in REASONS}
    out.update({f"skips/{n}/nonfinite_rows": self.nonfinite_rows[n] for n in names})
    out["skips/total"] = sum(self.counts.values())
    out["skips/steps"] = self.skipped_steps
    return out


def call_with_deadline(fn: Callable[[], object], deadline_s: float,
                       abandoned: list[threading.Thread] | None = None):
  """Runs ``fn()`` in a daemon thread; waits at most ``deadline_s`` seconds.

  A thread still running at the deadline is appended to ``abandoned`` (when
  given): Python cannot stop it, only watch it end.

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
    if abandoned is not None:
      abandoned.append(thread)
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
    heads: ``{name: W_k [D_k, V]}`` (optional): a teacher whose head holds a
      non-finite entry is skipped on every batch without being called.
    vocab_size: V (optional): token ids outside ``[0, V)`` raise ValueError.
    window: a teacher that answered none of its rows on this many
      consecutive batches it was asked about raises
      :class:`TeacherFaultError` (0: never).

  Attributes:
    abandoned: calls abandoned at their deadline (their threads may still run;
      :meth:`abandoned_alive` counts those that do).
  """

  def __init__(self, teachers: Mapping[str, TeacherFn], widths: Mapping[str, int], *,
               deadline_s: float, counter: SkipCounter | None = None,
               heads: Mapping[str, jax.Array] | None = None, vocab_size: int | None = None,
               window: int = DEFAULT_WINDOW):
    if not teachers:
      raise ValueError("teachers={}: distillation needs at least one teacher")
    if set(widths) != set(teachers):
      raise ValueError(f"widths names {sorted(widths)} differ from teachers {sorted(teachers)}")
    if not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
      raise ValueError(f"deadline_s={deadline_s!r} must be a positive number of seconds")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
      raise ValueError(f"window={window!r} must be an int >= 0 (0: never stop)")
    if heads is not None and set(heads) != set(teachers):
      raise ValueError(f"heads names {sorted(heads)} differ from teachers {sorted(teachers)}")
    self.teachers = dict(teachers)
    self.widths = dict(widths)
    self.deadline_s = float(deadline_s)
    self.counter = counter or SkipCounter()
    self.vocab_size = vocab_size
    self.window = window
    self.abandoned = 0
    self._threads: list[threading.Thread] = []
    self._streak = {n: [] for n in self.teachers}  # the current run of unanswered batches
    self.head_faults: dict[str, str] = {}
    self.heads: dict[str, jax.Array] | None = None
    if heads is not None:
      self.heads = {}
      for name in self.teachers:
        w = jnp.asarray(heads[name])
        finite = jnp.isfinite(w)
        n_bad = int(jnp.size(w) - jnp.sum(finite))
        if n_bad:
          first = tuple(int(i) for i in np.argwhere(~np.asarray(finite))[0])
          self.head_faults[name] = (f"output head W_k{tuple(w.shape)} has {n_bad} non-finite "
                                    f"entries (first at {list(first)}); the teacher is never "
                                    "called and its weight is 0")
          w = jnp.where(finite, w, jnp.zeros((), w.dtype))
        self.heads[name] = w

  @classmethod
  def from_pool(cls, pool, *, deadline_s: float, counter: SkipCounter | None = None,
                window: int = DEFAULT_WINDOW):
    """Wraps a :class:`opd.distill.teachers.TeacherPool`'s teachers (with
    their heads and the pool's V)."""
    fns = {t.name: (lambda tok, m, n=t.name: pool.hidden(n, tok, m)) for t in pool.teachers}
    return cls(fns, {t.name: t.cfg.d_model for t in pool.teachers}, deadline_s=deadline_s,
               counter=counter, heads=dict(zip(pool.names, pool.heads)),
               vocab_size=pool.vocab_size, window=window)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.teachers)

  def abandoned_alive(self) -> int:
    """How many threads of calls abandoned at their deadline still run."""
    self._threads = [th for th in self._threads if th.is_alive()]
    return len(self._threads)

  def __call__(self, tokens, mask, teacher_of_row=None) -> TeacherAnswers:
    """Asks every teacher about ``tokens`` / ``mask`` ([B, T]); a fault is a skip.

    With ``teacher_of_row`` ([B] int, prompt routing) each teacher is asked
    about its own rows only (teacher-sorted batching); a teacher with no
    rows is not called (not a skip), and its hidden states are zero.

    Raises:
      ValueError: a token id outside ``[0, vocab_size)`` (bad input, not a
        teacher fault), or a bad ``teacher_of_row``.
      TeacherFaultError: a teacher answered none of its rows on ``window``
        consecutive batches.
    """
    tokens = np.asarray(tokens)
    mask = np.asarray(mask, bool)
    if self.vocab_size is not None and tokens.size and (
        tokens.min() < 0 or tokens.max() >= self.vocab_size):
      raise ValueError(f"tokens hold ids in [{tokens.min()}, {tokens.max()}] outside "
                       f"[0, V={self.vocab_size}) (teachers {list(self.names)})")
    tokens = tokens.astype(np.int32)
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
      if name in self.head_faults:
        value, reason, detail = None, "nonfinite", self.head_faults[name]
      else:
        value, reason, detail = call_with_deadline(
            lambda fn=self.teachers[name], tok=tok, m=m: fn(tok, m), self.deadline_s,
            self._threads)
      if reason == "timeout":
        self.abandoned += 1
      want = (rows.size, t, self.widths[name])
      if reason is None and (getattr(value, "shape", None) != want or
                             not jnp.issubdtype(getattr(value, "dtype", np.int32), jnp.floating)):
        reason = "shape"
        detail = (f"returned shape={getattr(value, 'shape', None)} "
                  f"dtype={getattr(value, 'dtype', type(value).__name__)}; expected {want} float")
      if reason is not None:
        self.counter.record(name, reason, detail)
        skipped[name], messages[name] = reason, detail
        self._unanswered(name, reason, detail)
        continue
      h, bad = _screen(jnp.asarray(value), jnp.asarray(m))
      bad = np.asarray(bad)
      available[rows, k] = ~bad
      hidden[name] = h if full else zeros.at[rows].set(h)
      if bad.any():
        messages[name] = f"non-finite hidden states in rows {rows[bad].tolist()}"
        self.counter.record(name, "nonfinite", messages[name])
        self.counter.nonfinite_rows[name] += int(bad.sum())
      if bad.all():
        skipped[name] = "nonfinite"
        self._unanswered(name, "nonfinite", messages[name])
      else:
        self._streak[name] = []
    answers = TeacherAnswers(hidden, available, skipped, messages)
    if not answers.batch_ok:
      self.counter.skipped_steps += 1
      log.warning("%s: no teacher answered any row of this batch: %s", self.counter.label,
                  messages)
    return answers

  def _unanswered(self, name: str, reason: str, detail: str) -> None:
    """One more consecutive batch ``name`` answered none of its rows of."""
    streak = self._streak[name]
    streak.append(reason)
    if self.window and len(streak) >= self.window:
      reasons = dict(collections.Counter(streak))
      raise TeacherFaultError(
          f"{self.counter.label}: teacher {name!r} answered none of its rows on the last "
          f"{len(streak)} batches it was asked about (fault window {self.window}; reasons "
          f"{reasons}); last fault: {detail}. Stopping rather than distilling without it: "
          "fix or remove the teacher, or raise OPDConfig.fault_window")
