"""Smoke test of experiments/benchmarks/opd_forms.py at --quick sizes.

Timings are not asserted (the reference machine is shared). The test checks
the JSON record, that its ratios are the rows' own, and that the two
advantage rows (teacher log-probs from the hidden-state cache vs from cached
logits) compute the same first-step loss from the same state and batch: the
check that the baseline does the same work.
"""
import json
import math

import pytest

from experiments.benchmarks import opd_forms as bench

EPS = 2.0 ** -23  # float32


@pytest.fixture(scope="module")
def record(tmp_path_factory):
  out = tmp_path_factory.mktemp("opd_forms")
  payload = bench.main(["--quick", "--out", str(out)])
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
