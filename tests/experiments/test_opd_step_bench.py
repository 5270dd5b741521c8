"""Smoke test of experiments/benchmarks/opd_step.py at --quick sizes (tunix off).

Timings are not asserted (the reference machine is shared). The dense
architecture's record gets the full checks; the DeepSeek-V4 one (the model
list's ``v4``, one teacher to keep its compile short) the row fields and the
same-loss check with a bound for its deeper layers. The test checks
the JSON record and that the three measured steps (fused OPD on cached
hidden states, materialised logits from a logit cache, teachers recomputed
in the step) compute the same first-step loss from the same state and
batch: the check that the baselines do the same work.

The cache dtype is float32 here: with bf16, the recompute row rounds its
in-step teacher states to bf16 where a last-bit float32 difference can flip
a rounding (a 2⁻⁸ jump), which no eps-scale bound covers. The benchmark's
default (bf16) runs in ``run_all --quick``.
"""
import json
import math

import pytest

from experiments.benchmarks import opd_step as bench

EPS = 2.0 ** -23  # float32


@pytest.fixture(scope="module")
def record(tmp_path_factory):
  out = tmp_path_factory.mktemp("opd_step")
  payload = bench.main(["--quick", "--teachers", "3", "--cache_dtype", "float32",
                        "--tunix", "off", "--archs", "dense", "--out", str(out)])
  saved = json.loads((out / "opd_step_quick.json").read_text())
  assert saved["rows"] == json.loads(json.dumps(payload["rows"]))
  return saved


def test_record_fields(record):
  s = record["sizes"]
  assert record["benchmark"] == "opd_step_quick" and record["quick"] is True
  assert {"cpu_count", "jax", "backend"} <= set(record["machine"])
  assert s["K"] == [3] and s["tokens_per_step"] == s["batch"] * s["seq"]
  assert [r["method"] for r in record["rows"]] == list(bench.METHODS)
  for r in record["rows"]:
    assert r["ran"] and r["V"] == s["vocab"][0] and r["K"] == 3
    assert r["step_median_s"] > 0 and r["compile_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / r["step_median_s"])
    x = r["xla_bytes"]
    assert r["xla_peak_bytes"] == x["argument"] + x["output"] - x["alias"] + x["temp"] + x[
        "constant"]
    # A detached loss would give a zero gradient; every step trains the student.
    assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
  opd, mat, rec = record["rows"]
  # The fused rows run a pallas_kernels entry; the materialised one none.
  assert opd["kernel_entries"] and opd["kernel_entries"] == rec["kernel_entries"]
  assert mat["kernel_entries"] == [] and record["kernel_entry"] == opd["kernel_entries"]
  # The opd program holds the K teacher heads [D, V] float32 as constants.
  assert opd["xla_bytes"]["constant"] == 3 * s["d_model"] * s["vocab"][0] * 4
  # (a) takes the K cached [B, T, V] float32 logits as arguments.
  assert mat["xla_bytes"]["argument"] >= 3 * s["tokens_per_step"] * s["vocab"][0] * 4
  (ratio,) = record["ratios"]
  assert ratio["vs_materialised"]["peak_mem_ratio"] == pytest.approx(
      mat["xla_peak_bytes"] / opd["xla_peak_bytes"])
  assert ratio["vs_recompute"]["time_ratio"] == pytest.approx(
      opd["step_median_s"] / rec["step_median_s"])
  (cache,) = record["cache_bytes"]
  assert cache["logit_cache_bytes"] == 3 * s["tokens_per_step"] * s["vocab"][0] * 4
  assert cache["hidden_cache_bytes"] == 3 * s["tokens_per_step"] * s["d_model"] * 4
  assert record["tunix"]["status"].startswith("tunix not run")


def test_three_steps_compute_the_same_loss(record):
  """Same state, batch and loss; only float32 rounding differs.

  Per token, KL(p ‖ q) moves by at most 2·M·max|δz| + 2·max|δx| + δ_sum when
  the student / teacher logits z / x move by δz / δx: Σ_v |∂KL/∂z_v| =
  Σ_v p_v |(z_v − y_v) − E_p[z − y]| ≤ 2M with M = max|z| + max|x| ≥ |z − y|,
  and Σ_v |∂KL/∂x_v| = Σ_v |q_v − p_v| ≤ 2. The token mean of the loss
  moves by at most the per-token bound.
  * δz: the rows compute z in different programs: the fused kernel's tiled
    D-term dot products vs one matmul (random-walk rounding, sqrt(D)·eps
    relative to Σ_i |h_i W_iv| ≤ ‖h‖·‖W_v‖ = S, recorded as ``hw_bound``),
    and the L decoder layers compiled differently (each reduction over at
    most n = max(D, F, T) terms: sqrt(L·n)·eps relative, same scale S).
    Four standard deviations for the max over entries.
  * δx: the same for the teachers (the recompute row reruns them).
  * δ_sum: vocabulary sums in another order (online tiles vs log_softmax):
    lse and E_p[z − y] over V terms bounded by M, 4·sqrt(V)·eps·(M + 2).
  A real bug moves the loss by O(loss): teachers are the student plus noise
  (``opd_step.TEACHER_NOISE``), so teacher logits paired with the wrong rows
  or positions about triple the KL; prompt tokens counted, or a wrong
  temperature, move it by tens of percent.
  """
  s = record["sizes"]
  d, f, t, n_layers = s["d_model"], s["d_ff"], s["seq"], s["n_layers"]
  _same_loss(record, math.sqrt(d) + math.sqrt(n_layers * max(d, f, t)))


def _same_loss(record, growth):
  """The three rows' first-step losses agree within the bound derived above (``growth``:
  the relative rounding growth of the logits, in units of 4·eps·S)."""
  s = record["sizes"]
  mat = next(r for r in record["rows"] if r["method"] == "materialised")
  sc = mat["scales"]
  v = s["vocab"][0]
  m = sc["student_logit_absmax"] + sc["teacher_logit_absmax"]
  dz = 4 * EPS * sc["student_hw_bound"] * growth
  dx = 4 * EPS * sc["teacher_hw_bound"] * growth
  tol = 2 * m * dz + 2 * dx + 4 * math.sqrt(v) * EPS * (m + 2)
  losses = {r["method"]: r["loss"] for r in record["rows"]}
  assert losses["opd"] > 10 * tol  # the check is not vacuous: a far-from-zero KL
  assert abs(losses["materialised"] - losses["opd"]) <= tol, (losses, tol)
  assert abs(losses["recompute"] - losses["opd"]) <= tol, (losses, tol)
  # Same trained tokens in every row (the mask and the weights agree).
  assert len({r["opd_tokens"] for r in record["rows"]}) == 1


@pytest.fixture(scope="module")
def record_v4(tmp_path_factory):
  out = tmp_path_factory.mktemp("opd_step_v4")
  bench.main(["--quick", "--teachers", "1", "--cache_dtype", "float32", "--tunix", "off",
              "--archs", "v4", "--out", str(out)])
  return json.loads((out / "opd_step_quick.json").read_text())


def test_v4_rows(record_v4):
  s = record_v4["sizes"]
  assert s["archs"] == ["v4"]
  cfg = bench.model_config(s, s["vocab"][0], "v4")
  assert cfg.v4 is not None and cfg.moe.moe_d_ff * 3 == s["d_ff"]
  assert [(r["method"], r["arch"]) for r in record_v4["rows"]] == [
      (m, "v4") for m in bench.METHODS]
  for r in record_v4["rows"]:
    assert r["ran"] and r["K"] == 1 and r["step_median_s"] > 0
    assert r["flops_per_token"] == cfg.flops_per_token(s["seq"])
    assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
  (ratio,) = record_v4["ratios"]
  assert ratio["arch"] == "v4" and "vs_materialised" in ratio


def test_v4_three_steps_compute_the_same_loss(record_v4):
  # As the dense bound, with V4's reductions per layer: two mHC sites over N·D terms,
  # attention and MoE (D, F, T terms): four stages of at most n = max(N·D, D, F, T).
  s = record_v4["sizes"]
  n = max(4 * s["d_model"], s["d_ff"], s["seq"])  # N = 4 streams (opd_step.model_config)
  _same_loss(record_v4, math.sqrt(s["d_model"]) + math.sqrt(4 * s["n_layers"] * n))
