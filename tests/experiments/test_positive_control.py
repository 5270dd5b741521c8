"""The positive control's summary (experiments.positive_control): retention at
every checkpoint against a numpy ratio of means, steps to 90% against a plain
loop over the curve, and the config checks."""
import math

import ml_collections
import numpy as np
import pytest

from experiments import positive_control as pc
from opd.eval.results import DomainResult, EvalConfig, EvalResult
from opd.eval.stats import Estimate


def _result(name, greedy, sampled):
  g, s = np.asarray(greedy, float), np.asarray(sampled, float)
  metrics = {"reward@1": Estimate(100 * g.mean(), 0.0),
             "mean@4": Estimate(100 * s.mean(), 0.0)}
  ids = [f"e{i}" for i in range(len(g))]
  d = DomainResult("math", metrics, ids, g.tolist(), None, s.tolist(), None, {}, [])
  return EvalResult(name, EvalConfig(domains=("math",)), {"math": d}, {})


def _first_crossing(steps, curve, target):
  """Reference: the first step whose score reaches 0.9 * target, linearly
  interpolated from the previous evaluation (None if never)."""
  c = 0.9 * target
  for i, (s, y) in enumerate(zip(steps, curve)):
    if y >= c:
      if i == 0:
        return float(s)
      s0, y0 = steps[i - 1], curve[i - 1]
      return s0 + (c - y0) * (s - s0) / (y - y0)
  return None


def test_summary_reports_retention_and_steps_to_90_percent():
  rng = np.random.default_rng(0)
  n = 50
  teacher = _result("teacher", rng.uniform(size=n) < 0.6, rng.uniform(size=(n, 4)) < 0.5)
  # The student improves with steps: success probability p at each checkpoint.
  steps = [0, 40, 80, 120]
  students = [_result(f"s{k}", rng.uniform(size=n) < p, rng.uniform(size=(n, 4)) < p * 0.8)
              for k, p in zip(steps, (0.1, 0.3, 0.55, 0.65))]
  out = pc.summarize([teacher] + students, "math", steps, "mean@4")
  for mode, metric in (("greedy", "reward@1"), ("sampled", "mean@4")):
    t = teacher.score("math", metric).value
    curve = [r.score("math", metric).value for r in students]
    assert out[f"teacher_{mode}"] == t and out[f"student_{mode}"] == curve
    key = "greedy_rewards" if mode == "greedy" else "sampled_rewards"
    want = [np.mean(getattr(r.domains["math"], key)) / np.mean(getattr(teacher.domains["math"], key))
            for r in students]
    np.testing.assert_allclose(out[f"retention_{mode}"], want, rtol=1e-12)
    assert all(se > 0 for se in out[f"retention_{mode}_se"])
    ref = _first_crossing(steps, curve, t)
    got = out[f"steps_to_90_{mode}"]
    assert (got is None) == (ref is None) and (ref is None or got == pytest.approx(ref))
  text = pc.render({"math": out})
  assert "| math |" in text and "0: " in text


def test_a_teacher_scoring_zero_gives_no_ratio_and_no_crossing():
  zero = _result("teacher", [0.0] * 4, [[0.0] * 4] * 4)
  student = _result("s0", [1.0, 0, 0, 0], [[1.0, 0, 0, 0]] * 4)
  out = pc.summarize([zero, student], "math", [0], "mean@4")
  assert math.isnan(out["retention_greedy"][0]) and out["steps_to_90_greedy"] is None
  assert "not reached" in pc.render({"math": out})


@pytest.mark.parametrize("group, match", [
    (dict(steps=-1, eval_every=40), "positive_control.steps=-1"),
    (dict(steps=100, eval_every=40), "divide steps=100"),
    (dict(steps=80, eval_every=0), "eval_every=0"),
    (dict(steps=80, eval_every=True), "eval_every=True"),
    (dict(steps=0, eval_every=40, only=True), "only=True stops after the control"),
])
def test_bad_fields_are_refused_naming_them(group, match):
  config = ml_collections.ConfigDict(dict(positive_control=group,
                                          specialists=dict(domains=("math", "code"))))
  with pytest.raises(ValueError, match=match):
    pc.check(config)
  ok = ml_collections.ConfigDict(dict(positive_control=dict(steps=0, eval_every=40, domains=()),
                                      specialists=dict(domains=("math", "code"))))
  pc.check(ok)
  ok.positive_control.domains = ("writing",)
  with pytest.raises(ValueError, match=r"positive_control.domains names \['writing'\]"):
    pc.check(ok)
