"""Fault injection (opd.distill.faults): every teacher fault is skipped, counted, renormalised."""
import threading
import time

import numpy as np
import pytest

import jax.numpy as jnp

import pallas_kernels
from opd.distill import FaultTolerantTeachers, SkipCounter, apply_availability, call_with_deadline
from opd.distill.faults import TeacherFaultError

EPS32 = np.finfo(np.float32).eps
B, T, V = 4, 6, 32
WIDTHS = {"good": 8, "raises": 8, "hangs": 5, "nan": 6, "wrong_width": 7}
DEADLINE = 0.5


def _hidden(seed, width):
  return np.random.default_rng(seed).normal(size=(B, T, width)).astype(np.float32)


@pytest.fixture
def release():
  event = threading.Event()
  yield event
  event.set()  # let the abandoned thread finish


def _teachers(release):
  def raises(tok, m):
    raise RuntimeError("teacher OOM")

  def hangs(tok, m):
    release.wait(30)
    return _hidden(2, 5)

  def nan(tok, m):
    h = _hidden(3, 6)
    h[1, 2, 0] = np.nan  # a real token of row 1
    h[3, 5, :] = np.inf  # a pad position of row 3: zeroed, row kept
    return h

  return {"good": lambda tok, m: _hidden(0, 8), "raises": raises, "hangs": hangs, "nan": nan,
          "wrong_width": lambda tok, m: _hidden(4, 6)}


def test_each_fault_is_skipped_counted_and_renormalised(release):
  mask = np.ones((B, T), bool)
  mask[3, 5] = False
  ft = FaultTolerantTeachers(_teachers(release), WIDTHS, deadline_s=DEADLINE)
  start = time.monotonic()
  answers = ft(np.zeros((B, T), np.int32), mask)
  assert time.monotonic() - start < DEADLINE + 5  # the hang cost one deadline, not 30 s
  assert answers.skipped == {"raises": "error", "hangs": "timeout", "wrong_width": "shape"}
  assert "teacher OOM" in answers.messages["raises"]
  assert "(4, 6, 6)" in answers.messages["wrong_width"]
  expect_avail = np.zeros((B, 5), bool)
  expect_avail[:, 0] = True
  expect_avail[:, 3] = [True, False, True, True]
  np.testing.assert_array_equal(answers.available, expect_avail)
  assert answers.sample_ok.all() and answers.batch_ok
  for name, h in answers.hidden.items():
    assert h.shape == (B, T, WIDTHS[name]) and bool(jnp.isfinite(h).all()), name
  np.testing.assert_array_equal(answers.hidden["raises"], 0.0)
  nan_h = _hidden(3, 6)
  np.testing.assert_array_equal(answers.hidden["nan"][0], nan_h[0])
  np.testing.assert_array_equal(answers.hidden["nan"][1, 2, 0], 0.0)
  assert ft.abandoned == 1
  got = ft.counter.metrics(ft.names)
  expect = {f"skips/{n}/{r}": 0 for n in WIDTHS for r in ("error", "timeout", "shape", "nonfinite")}
  expect.update({f"skips/{n}/nonfinite_rows": 0 for n in WIDTHS})
  expect.update({"skips/raises/error": 1, "skips/hangs/timeout": 1, "skips/wrong_width/shape": 1,
                 "skips/nan/nonfinite": 1, "skips/nan/nonfinite_rows": 1, "skips/total": 4,
                 "skips/steps": 0})
  assert got == expect

  # The loss over the answers equals the loss over the survivors alone.
  rng = np.random.default_rng(5)
  heads = {n: rng.normal(size=(d, V)).astype(np.float32) for n, d in WIDTHS.items()}
  h_s, w_s = rng.normal(size=(B * T, 8)).astype(np.float32), rng.normal(size=(8, V)).astype(
      np.float32)
  weights = rng.random((B, T, 5)).astype(np.float32) + 0.1
  w, row_ok = apply_availability(weights, answers.available)
  assert np.asarray(row_ok).all()
  names = list(WIDTHS)
  flat = lambda h: np.asarray(h).reshape(B * T, -1)
  got_loss = pallas_kernels.fused_reverse_kl(
      h_s, w_s, [flat(answers.hidden[n]) for n in names], [heads[n] for n in names],
      np.asarray(w).reshape(B * T, 5), mask=mask.reshape(-1), impl="reference")
  survivors = ["good", "nan"]
  w_ref = weights[..., [0, 3]].copy()
  w_ref[1, :, 1] = 0.0  # the NaN row of teacher "nan"
  ref_loss = pallas_kernels.fused_reverse_kl(
      h_s, w_s, [flat(_hidden(0, 8)), flat(np.nan_to_num(_hidden(3, 6)))],
      [heads[n] for n in survivors], w_ref.reshape(B * T, 2), mask=mask.reshape(-1),
      impl="reference")
  # |logits| = O(|h| |W| sqrt(D)); KL cancellation a few eps of it per token.
  tol = 64 * EPS32 * (float(np.abs(flat(_hidden(0, 8)) @ heads["good"]).max()) + np.log(V))
  np.testing.assert_allclose(got_loss, ref_loss, rtol=0, atol=tol)


def test_no_teacher_for_a_sample_and_for_the_batch(release):
  def nan_row0(tok, m):
    h = _hidden(0, 4)
    h[0] = np.nan
    return h

  ft = FaultTolerantTeachers({"a": nan_row0}, {"a": 4}, deadline_s=DEADLINE)
  answers = ft(np.zeros((B, T)), np.ones((B, T), bool))
  np.testing.assert_array_equal(answers.sample_ok, [False, True, True, True])
  assert answers.batch_ok and "a" not in answers.skipped
  none = FaultTolerantTeachers({"a": _teachers(release)["raises"]}, {"a": 8},
                               deadline_s=DEADLINE)
  answers = none(np.zeros((B, T)), np.ones((B, T), bool))
  assert not answers.batch_ok and not answers.sample_ok.any()
  assert none.counter.skipped_steps == 1


def test_flaky_teacher_counts_every_failure():
  fails = np.random.default_rng(7).random(20) < 0.3
  calls = iter(fails)

  def flaky(tok, m):
    if next(calls):
      raise ConnectionError("dropped")
    return _hidden(1, 4)

  counter = SkipCounter()
  ft = FaultTolerantTeachers({"flaky": flaky, "steady": lambda t, m: _hidden(2, 4)},
                             {"flaky": 4, "steady": 4}, deadline_s=DEADLINE, counter=counter)
  ok = [ft(np.zeros((B, T)), np.ones((B, T), bool)).available[:, 0].all() for _ in range(20)]
  np.testing.assert_array_equal(ok, ~fails)
  assert counter.metrics(ft.names)["skips/flaky/error"] == fails.sum() > 0
  assert counter.metrics(ft.names)["skips/steady/error"] == 0


def test_call_with_deadline_outcomes():
  assert call_with_deadline(lambda: 3, 1.0) == (3, None, "")
  value, reason, detail = call_with_deadline(lambda: 1 / 0, 1.0)
  assert (value, reason) == (None, "error") and "ZeroDivisionError" in detail
  event = threading.Event()
  try:
    value, reason, detail = call_with_deadline(lambda: event.wait(30), 0.05)
    assert (value, reason) == (None, "timeout") and "deadline 0.05s" in detail
  finally:
    event.set()


def test_bad_arguments_name_the_field():
  with pytest.raises(ValueError, match="deadline_s=0"):
    FaultTolerantTeachers({"a": None}, {"a": 4}, deadline_s=0)
  with pytest.raises(ValueError, match="teachers={}"):
    FaultTolerantTeachers({}, {}, deadline_s=1)
  with pytest.raises(ValueError, match=r"widths names \['b'\] differ from teachers \['a'\]"):
    FaultTolerantTeachers({"a": None}, {"b": 4}, deadline_s=1)


def test_routed_call_asks_each_teacher_about_its_rows_only():
  seen = {}

  def teacher(name, width, nan_at=None):
    def fn(tok, m):
      seen[name] = np.asarray(tok).copy()
      h = tok[..., None].astype(np.float32) + np.arange(width, dtype=np.float32)
      if nan_at is not None:
        h[nan_at] = np.nan
      return h
    return fn

  tokens = np.arange(B * T).reshape(B, T)
  rows = np.array([1, 0, 1, 1])
  ft = FaultTolerantTeachers(
      {"a": teacher("a", 3), "b": teacher("b", 5, nan_at=(1, 0, 0)), "idle": teacher("idle", 2)},
      {"a": 3, "b": 5, "idle": 2}, deadline_s=DEADLINE)
  answers = ft(tokens, np.ones((B, T), bool), teacher_of_row=rows)
  assert set(seen) == {"a", "b"}  # "idle" has no rows: never called
  np.testing.assert_array_equal(seen["a"], tokens[[1]])
  np.testing.assert_array_equal(seen["b"], tokens[[0, 2, 3]])
  # b's second group row (batch row 2) was NaN: that row only is dropped.
  np.testing.assert_array_equal(answers.available, [[0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 1, 0]])
  np.testing.assert_array_equal(answers.sample_ok, [True, True, False, True])
  for name, width, group in (("a", 3, [1]), ("b", 5, [0, 2, 3])):
    h = np.asarray(answers.hidden[name])
    expect = np.zeros((B, T, width), np.float32)
    expect[group] = tokens[group][..., None] + np.arange(width)
    if name == "b":
      expect[2, 0, 0] = 0.0  # the NaN, zeroed (the row is unavailable anyway)
    np.testing.assert_array_equal(h, expect)
  np.testing.assert_array_equal(answers.hidden["idle"], 0.0)
  got = ft.counter.metrics(ft.names)
  assert got["skips/b/nonfinite"] == 1 and got["skips/b/nonfinite_rows"] == 1
  assert got["skips/total"] == 1 and answers.skipped == {}
  with pytest.raises(ValueError, match=r"teacher_of_row must lie in \[0, K=3\); got \[0, 3\]"):
    ft(tokens, np.ones((B, T), bool), teacher_of_row=np.array([0, 3, 0, 0]))


def test_each_fault_message_is_logged_once_then_counted(caplog):
  """The first fault per (teacher, reason) is logged with its message; later
  ones are counted (a count line at the 10th), never dropped."""
  def raises(tok, m):
    raise RuntimeError("teacher OOM at layer 3")

  ft = FaultTolerantTeachers({"good": lambda t, m: _hidden(0, 8), "bad": raises},
                             {"good": 8, "bad": 8}, deadline_s=DEADLINE)
  with caplog.at_level("WARNING", logger="opd.distill.faults"):
    for _ in range(12):  # < the default window of 20
      ft(np.zeros((B, T), np.int32), np.ones((B, T), bool))
  lines = [r.getMessage() for r in caplog.records]
  full = [s for s in lines if "teacher OOM at layer 3" in s]
  assert len(full) == 2, lines  # the first fault in full, then the 10th's count line
  assert "'bad' skipped (error)" in full[0] and "skips/bad/error" in full[0]
  assert "10 'error' faults so far" in full[1]
  assert not any("'good'" in s for s in lines)
  assert ft.counter.metrics(ft.names)["skips/bad/error"] == 12


def test_a_non_finite_head_is_a_fault_of_its_teacher_on_every_batch(caplog):
  """A NaN in W_k: the teacher is never called, skipped as ``nonfinite`` with
  the head named in the message, and the loss gets its head zeroed."""
  called = []
  heads = {"good": np.ones((8, V), np.float32), "nan_head": np.ones((6, V), np.float32)}
  heads["nan_head"][2, 5] = np.nan

  def nan_head(tok, m):
    called.append(1)
    return _hidden(3, 6)

  ft = FaultTolerantTeachers({"good": lambda t, m: _hidden(0, 8), "nan_head": nan_head},
                             {"good": 8, "nan_head": 6}, deadline_s=DEADLINE, heads=heads,
                             window=0)
  with caplog.at_level("WARNING", logger="opd.distill.faults"):
    for _ in range(3):
      answers = ft(np.zeros((B, T), np.int32), np.ones((B, T), bool))
      assert answers.skipped == {"nan_head": "nonfinite"} and answers.batch_ok
      np.testing.assert_array_equal(answers.available, [[True, False]] * B)
  assert not called
  assert "W_k(6, 32) has 1 non-finite entries (first at [2, 5])" in caplog.text
  assert ft.counter.metrics(ft.names)["skips/nan_head/nonfinite"] == 3
  want = np.ones((6, V), np.float32)
  want[2, 5] = 0.0
  np.testing.assert_array_equal(ft.heads["nan_head"], want)
  np.testing.assert_array_equal(ft.heads["good"], heads["good"])


def test_a_teacher_unanswered_for_a_whole_window_stops_with_its_message():
  """Window 3: two failures, an answer (the streak restarts), then three
  failures in a row raise TeacherFaultError naming the teacher and the fault."""
  outcomes = iter([False, False, True, False, False, False])

  def sometimes(tok, m):
    if not next(outcomes):
      raise ConnectionError("server at /tmp/t.sock dropped the connection")
    return _hidden(1, 4)

  ft = FaultTolerantTeachers({"flaky": sometimes, "steady": lambda t, m: _hidden(2, 4)},
                             {"flaky": 4, "steady": 4}, deadline_s=DEADLINE, window=3)
  for _ in range(5):
    ft(np.zeros((B, T), np.int32), np.ones((B, T), bool))
  with pytest.raises(TeacherFaultError, match=r"teacher 'flaky' answered none of its rows on the "
                     r"last 3 batches .*fault window 3.*dropped the connection"):
    ft(np.zeros((B, T), np.int32), np.ones((B, T), bool))
  with pytest.raises(ValueError, match="window=-1"):
    FaultTolerantTeachers({"a": None}, {"a": 4}, deadline_s=1, window=-1)


def test_token_ids_outside_the_vocabulary_are_bad_input_not_a_fault():
  ft = FaultTolerantTeachers({"a": lambda t, m: _hidden(0, 4)}, {"a": 4}, deadline_s=DEADLINE,
                             vocab_size=V)
  tokens = np.zeros((B, T), np.int32)
  tokens[1, 2] = V
  with pytest.raises(ValueError, match=r"ids in \[0, 32\] outside \[0, V=32\)"):
    ft(tokens, np.ones((B, T), bool))
  assert ft.counter.metrics(ft.names)["skips/total"] == 0
