"""Smoke test of experiments/benchmarks/opd_forms.py at --quick sizes.

Timings are not asserted (the reference machine is shared). The test checks
the JSON record, that its ratios are the rows' own, and that the two
advantage rows (teacher log-probs from the hidden-state cache vs from cached
logits) compute the same first-step loss from the same state and batch: the
check that the baseline does the same work. The cross-tokenizer rows (a byte
student with a task-BPE teacher and the reverse, each against the same
teacher reading the student's tokens) are checked for their fields, for
token and span counts that follow from the two tokenizations, for a device
step that trains exactly the host's trained spans, and for ratios taken from
their own rows.
"""
import json
import math

import pytest

from experiments.benchmarks import opd_forms as bench

EPS = 2.0 ** -23  # float32


@pytest.fixture(scope="module")
def record(tmp_path_factory):
  out = tmp_path_factory.mktemp("opd_forms")
  payload = bench.main(["--quick", "--teacher_bpe", "bpe:512", "--out", str(out)])
  saved = json.loads((out / "opd_forms_quick.json").read_text())
  assert saved["rows"] == json.loads(json.dumps(payload["rows"]))
  return saved


def test_record_fields_and_ratios(record):
  s = record["sizes"]
  assert record["benchmark"] == "opd_forms_quick" and record["quick"] is True
  assert {"cpu_count", "jax", "backend"} <= set(record["machine"])
  assert s["K"] == [1] and s["advantage_config"] == bench.ADVANTAGE
  assert [r["form"] for r in record["rows"]] == list(bench.FORMS)
  for r in record["rows"]:
    assert r["V"] == s["vocab"][0] and r["K"] == 1 and r["opd_tokens"] > 0
    assert r["step_median_s"] > 0 and r["compile_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / r["step_median_s"])
    x = r["xla_bytes"]
    assert r["xla_peak_bytes"] == x["argument"] + x["output"] - x["alias"] + x["temp"] + x[
        "constant"]
    # Every form trains the student (a detached loss would give 0).
    assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
  exact, adv, logits = record["rows"]
  # The fused rows embed the teacher head [D, V] float32; the logits row
  # takes the cached [B, T, V] float32 logits as an argument instead.
  assert exact["xla_bytes"]["constant"] == adv["xla_bytes"]["constant"] == (
      s["d_model"] * s["vocab"][0] * 4)
  assert logits["xla_bytes"]["constant"] == 0
  assert logits["xla_bytes"]["argument"] >= s["tokens_per_step"] * s["vocab"][0] * 4
  (ratio,) = record["ratios"]
  for other, row in (("exact", exact), ("advantage_logits", logits)):
    got = ratio[f"advantage_vs_{other}"]
    assert got["time_ratio"] == pytest.approx(adv["step_median_s"] / row["step_median_s"])
    assert got["peak_mem_ratio"] == pytest.approx(adv["xla_peak_bytes"] / row["xla_peak_bytes"])


def test_both_advantage_rows_compute_the_same_loss(record):
  """Same state, batch and objective; only float32 rounding differs.

  Each log-prob is a D-term dot product and a V-term logsumexp, reordered
  between the programs: 4 standard deviations of a random walk (τ = 1 here),
  δ1 = 4·(sqrt(D) + sqrt(V))·eps·(1 + M/τ) with M the recorded bound on
  every |logit|. a_t = log q − log p moves by 2δ1, the γ = 1 sum Â_t of up
  to T of them by sqrt(T)·2δ1, the ratio r ≈ 1 by 2δ1 (relative). The loss,
  a token mean of −r·Â, moves by at most sqrt(T)·2δ1·r + mean|Â|·2δ1.
  A wrong teacher log-prob (another row, position or temperature) moves
  each a_t by O(1), the loss by far more.
  """
  s = record["sizes"]
  _, adv, logits = record["rows"]
  m = max(adv["logit_absmax_bound"], logits["logit_absmax_bound"])
  d1 = 4 * (math.sqrt(s["d_model"]) + math.sqrt(s["vocab"][0])) * EPS * (1 + m)
  tol = math.sqrt(s["seq"]) * 2 * d1 * 1.01 + adv["adv_abs_mean"] * 2 * d1
  assert abs(adv["loss"]) > 100 * tol  # not vacuous
  assert abs(adv["loss"] - logits["loss"]) <= tol, (adv["loss"], logits["loss"], tol)


def test_cross_tokenizer_rows_fields_and_ratios(record):
  s, x = record["sizes"], record["cross_tokenizer"]
  v, d = s["vocab"][0], s["d_model"]
  assert x["bpe"] == "bpe:1024" and x["bpe_build_s"] > 0 and x["teacher_bpe"] == "bpe:512"
  rows = x["rows"][:4]  # the fixed pairings; --teacher_bpe's: the test below
  assert [(r["path"], r["student_tokenizer"], r["teacher_tokenizer"]) for r in rows] == [
      ("same", "byte", "byte"), ("cross", "byte", "bpe:1024"),
      ("same", "bpe:1024", "bpe:1024"), ("cross", "bpe:1024", "byte")]
  for r in rows:
    assert r["V"] == v and r["K"] == 1
    assert r["step_median_s"] > 0 and r["compile_s"] > 0 and r["teacher_forward_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / r["step_median_s"])
    assert r["host_plus_step_s"] == pytest.approx(
        r["transcode_align_s"] + r["teacher_forward_s"] + r["step_median_s"])
    xb = r["xla_bytes"]
    assert r["xla_peak_bytes"] == xb["argument"] + xb["output"] - xb["alias"] + xb["temp"] + xb[
        "constant"]
    assert xb["constant"] == d * v * 4  # the teacher head [D, V] float32, embedded
    assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert 0 < r["response_tokens"] < r["student_tokens"] <= s["tokens_per_step"]
  same_byte, cross_byte, same_bpe, cross_bpe = rows
  for same, cross in ((same_byte, cross_byte), (same_bpe, cross_bpe)):
    # One batch per pairing: the same student tokens in both rows.
    assert same["student_tokens"] == cross["student_tokens"]
    # The student's own tokenizer: no transcoding, one token per span, every
    # response token trained.
    assert same["transcode_align_s"] == 0 and same["partial_tokens"] == 0
    assert same["teacher_tokens"] == same["student_tokens"]
    assert same["opd_tokens"] == same["spans"] == same["response_tokens"]
    # Another tokenizer: the step trains exactly the response tokens the host
    # put in trained spans (a loss_mask not cut to the spans fails this).
    assert cross["transcode_align_s"] > 0
    assert cross["opd_tokens"] == cross["response_tokens"] - cross["partial_tokens"] > 0
  # A BPE teacher merges the byte student's bytes: fewer teacher tokens, and a
  # span holds one or more student bytes.
  assert cross_byte["teacher_tokens"] < cross_byte["student_tokens"]
  assert 0 < cross_byte["spans"] < cross_byte["opd_tokens"]
  # A byte teacher ends a token at every byte, so every student BPE token ends
  # a span: one span per trained student token, more teacher tokens.
  assert cross_bpe["teacher_tokens"] > cross_bpe["student_tokens"]
  assert cross_bpe["spans"] == cross_bpe["opd_tokens"]
  ratios = [q for q in x["ratios"] if q["teacher_tokenizer"] != "bpe:512"]
  assert [(q["student_tokenizer"], q["teacher_tokenizer"]) for q in ratios] == [
      ("bpe:1024", "byte"), ("byte", "bpe:1024")]
  for q, same, cross in ((ratios[0], same_bpe, cross_bpe), (ratios[1], same_byte, cross_byte)):
    assert q["V"] == v
    for key, field in (("step_time_ratio", "step_median_s"), ("peak_mem_ratio", "xla_peak_bytes"),
                       ("teacher_forward_ratio", "teacher_forward_s"),
                       ("host_plus_step_ratio", "host_plus_step_s"),
                       ("teacher_tokens_ratio", "teacher_tokens")):
      assert q[key] == pytest.approx(cross[field] / same[field]), key
    assert q["transcode_over_step"] == pytest.approx(
        cross["transcode_align_s"] / cross["step_median_s"])


def test_the_second_bpe_pairing(record):
  """``--teacher_bpe bpe:512``: the strong world's bpe:1024 student with a
  bpe:512 teacher, against the same teacher on the student's tokens."""
  s, x = record["sizes"], record["cross_tokenizer"]
  same, cross = x["rows"][4:]
  assert [(r["path"], r["student_tokenizer"], r["teacher_tokenizer"]) for r in (same, cross)] == [
      ("same", "bpe:1024", "bpe:1024"), ("cross", "bpe:1024", "bpe:512")]
  assert same["student_tokens"] == cross["student_tokens"]
  assert same["pairing"] == cross["pairing"] == "bpe:1024->bpe:512"
  assert math.isfinite(cross["grad_norm"]) and cross["grad_norm"] > 0
  assert cross["opd_tokens"] == cross["response_tokens"] - cross["partial_tokens"] > 0
  # The smaller BPE spells the same text in more tokens; a span holds one or
  # more student tokens, so there are no more spans than trained tokens.
  assert cross["teacher_tokens"] > cross["student_tokens"]
  assert 0 < cross["spans"] <= cross["opd_tokens"]
  (q,) = [q for q in x["ratios"] if q["teacher_tokenizer"] == "bpe:512"]
  assert q["V"] == s["vocab"][0] and q["student_tokenizer"] == "bpe:1024"
  # Over this pairing's own same row, not the bpe:1024 -> byte pairing's.
  assert q["step_time_ratio"] == pytest.approx(cross["step_median_s"] / same["step_median_s"])
  assert q["teacher_tokens_ratio"] == pytest.approx(cross["teacher_tokens"] / same["teacher_tokens"])
