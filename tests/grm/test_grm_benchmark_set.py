import numpy as np
import pytest

from grm.benchmark_set import (SUBSETS, accuracy, benchmark_set, decision_correct,
                               forbids_content, subset_sizes)
from grm.data import PreferenceGroup
from opd import tasks as tasks_lib


def _group(ex, n=2, split=None):
  ratings = (7.0,) if n == 1 else tuple(float(i == 0) for i in range(n))
  return PreferenceGroup(ex.domain, ex.id, split or ex.split, ex.prompt,
                         tuple(f"r{i}" for i in range(n)), ratings, ("ok",) * n)


def test_subsets_follow_domains_and_forbidding_rules_and_keep_only_the_test_split():
  examples = []
  for domain in ("math", "code", "instruct", "writing", "agent"):
    for split in ("train", "test"):
      examples += tasks_lib.get_task(domain).examples(split, 6, seed=3, difficulty=3)
  groups = [_group(ex, n=1 + i % 3) for i, ex in enumerate(examples)]
  subsets = benchmark_set(groups, examples)
  assert set(subsets) == set(SUBSETS)
  # Independent reference: read each instruct example's constraints directly.
  expect = {s: 0 for s in SUBSETS}
  for ex in examples:
    if ex.split != "test":
      continue
    kinds = [c["kind"] for c in ex.meta.get("constraints", ())]
    name = {"math": "reasoning", "code": "code", "writing": "chat", "agent": "tool_use",
            "instruct": "constraint_safety" if "exclude" in kinds else "chat"}[ex.domain]
    expect[name] += 1
  assert {s: len(v) for s, v in subsets.items()} == expect
  assert expect["constraint_safety"] > 0 and all(forbids_content(
      next(e for e in examples if e.id == g.example_id)) for g in subsets["constraint_safety"])
  assert all(g.split == "test" for v in subsets.values() for g in v)
  sizes = subset_sizes(subsets)
  assert sizes["overall"]["groups"] == sum(expect.values())
  assert sum(v for k, v in sizes["overall"].items() if k.startswith("n")) == sum(expect.values())
  with pytest.raises(ValueError, match="example_id"):
    benchmark_set(groups, examples[:1])


def test_decision_rule_n1_rating_and_n2_unique_best():
  assert decision_correct((0.2, 0.9, 0.1), pick=1)
  assert not decision_correct((0.2, 0.9, 0.1), pick=0)
  assert not decision_correct((0.2, 0.9, 0.1), pick=-1)  # a tie: no winner
  assert decision_correct((7.0,), rating=7) and not decision_correct((7.0,), rating=6)
  assert not decision_correct((7.0,), rating=None)


def test_accuracy_means_and_bootstrap_ses_match_the_binomial_reference():
  rng = np.random.default_rng(0)
  correct = {"chat": rng.random(400) < 0.7, "code": rng.random(300) < 0.4, "reasoning": []}
  B = 4000
  acc = accuracy(correct, num_resamples=B, seed=1)
  assert set(acc) == {"chat", "code", "overall"}
  pooled = np.concatenate([correct["chat"], correct["code"]])
  for name, v in (("chat", correct["chat"]), ("code", correct["code"]), ("overall", pooled)):
    p, n = v.mean(), v.size
    assert acc[name].value == pytest.approx(100 * p, abs=1e-9)
    # The bootstrap SE of a mean of n Bernoulli values estimates sqrt(p(1-p)/n) (ddof 0);
    # its own relative error is ~1/sqrt(2B) = 1.1%, so 5 of those bound it.
    ref = 100 * np.sqrt(p * (1 - p) / n)
    assert acc[name].se == pytest.approx(ref, rel=5 / np.sqrt(2 * B))
