"""Smoke test of experiments/benchmarks/rollout.py at --quick sizes (no baseline child).

Timings are not asserted (the reference machine is shared). The test checks
the JSON record (machine, sizes, per-stage seconds and shares, rates), and
the baseline merge on a baseline built here from the run's own rows, whose
speedups are known exactly.
"""
import copy
import json

import jax
import numpy as np

from experiments.benchmarks import rollout


def test_quick_record_and_merge(tmp_path):
  payload = rollout.main(["--quick", "--policies", "random", "--out", str(tmp_path)])
  record = json.loads((tmp_path / "rollout.json").read_text())
  assert record["machine"]["backend"] == "cpu" and "cpu_count" in record["machine"]
  assert record["policies"] == "random" and "commit" in record
  sizes = record["sizes"]
  assert sizes["quick"] and sizes["grpo_domains"] == ["math"]
  assert sizes["grpo"]["group_size"] >= 2 and sizes["opd"]["teachers"]
  assert [r["batch"] for r in record["rows"]] == ["grpo/math", "opd"]
  for row, stages in zip(record["rows"], (rollout.GRPO_STAGES, rollout.OPD_STAGES)):
    assert set(row["stages"]) == set(stages)
    assert row["stages"]["sample"] > 0 and row["stages"]["assembly"] > 0
    # One timed batch: the total is the sum of its stages, the shares sum to 1.
    assert abs(sum(row["stages"].values()) - row["total_s"]) <= 1e-9 * row["total_s"] + 1e-12
    assert abs(sum(row["share"].values()) - 1.0) < 1e-9
    assert row["prompts_per_s"] == row["prompts"] / row["total_s"]
    assert row["tokens_per_s"] == row["policy_tokens"] / row["total_s"] and row["policy_tokens"] > 0
  assert record["rows"][0]["stages"]["reference"] > 0  # kl_coef > 0 in the GRPO config
  assert record["rows"][1]["stages"]["teacher"] > 0
  assert record["grpo_total"]["largest_stage"] in rollout.GRPO_STAGES
  assert "baseline" not in record and payload["rows"] == record["rows"]
  assert record["share_prefill"] and record["prefill_ab"] == []  # --quick: no A/B
  for row in record["sample_cpu"]:
    assert row["cpu_s"] > 0 and len(row["digests"]) == 1

  # A baseline whose every stage took twice as long: every speedup is 2.
  base = copy.deepcopy(payload)
  base.update(commit="0" * 40, dirty=False)
  for row in base["rows"]:
    row["stages"] = {s: 2 * v for s, v in row["stages"].items()}
    row["total_s"] *= 2
  for row in base["sample_cpu"]:
    row["cpu_s"] *= 2
  base["grpo_total"] = rollout._aggregate(base["rows"][:1], rollout.GRPO_STAGES)
  merged = rollout.merge(payload, base)
  assert merged["outputs_match"] and merged["baseline"]["commit"] == "0" * 40
  for s in merged["speedups"]:
    assert abs(s["total"] - 2) < 1e-12 and abs(s["sample"] - 2) < 1e-12
  assert abs(merged["largest_stage"]["speedup"] - 2) < 1e-12
  assert [r["batch"] for r in merged["sample_cpu_speedups"]] == ["grpo/math", "opd"]
  assert all(abs(r["speedup"] - 2) < 1e-12 and r["outputs_match"]
             for r in merged["sample_cpu_speedups"])
  total = merged["sample_cpu_grpo_total"]
  assert abs(total["speedup"] - 2) < 1e-12 and total["outputs_match"]
  # Different episodes in the baseline: the comparison is flagged as unequal work.
  base["rows"][0]["digests"] = ["different"]
  assert not rollout.merge(payload, base)["outputs_match"]


def test_sampler_breakdown_and_prefill_ab_tiny():
  from experiments.benchmarks.rollout import _configs, _grpo_setups, _sampler_breakdown
  from opd.parallel import sharding
  spec, _ = _configs(quick=True)
  rules = sharding.validate_rules(tuple(spec.sharding_rules))
  mesh = sharding.make_mesh((1, 1, 1), jax.devices()[:1])
  name, setup = _grpo_setups(spec, None, ["math"], mesh, rules)[0]
  row = _sampler_breakdown(name, setup, reps=1)
  g, n = spec.grpo.group_size, spec.grpo.max_new_tokens
  assert row["rows"] == spec.grpo.prompts_per_step * g and 1 <= row["steps"] <= n
  assert row["prompt_len"] % 32 == 0
  assert row["prefill_share"] == row["prefill_s"] / row["generate_s"]
  assert row["bound_free_sampler"] == row["generate_s"] / row["forward_only_s"]
  # Running each prompt's prefill once saves at most (1 - 1/G) of the prefill.
  assert row["bound_prefill_once"] == 1 / (1 - row["prefill_share"] * (1 - 1 / g))
  assert row["generate_s"] > 0 and row["forward_only_s"] > 0
  # CPU-time minima over one run: the difference may be noise, not its formula.
  assert row["decode_ms_per_step"] == 1e3 * (row["generate_s"] - row["prefill_s"]) / max(
      row["steps"] - 1, 1)
  assert row["speedup_shared"] == row["generate_s"] / row["generate_shared_s"]

  # The sample stage's before/after: g = 4 rows per prompt, so sharing runs.
  ab = rollout._prefill_ab(name, setup, reps=2)
  assert ab["outputs_match"] and ab["prompts"] == row["rows"] and ab["policy_tokens"] > 0
  off, on = ab["cpu_s"]["off"], ab["cpu_s"]["on"]
  assert len(off) == len(on) == 2 and ab["off_cpu_s"] == float(np.median(off))
  ratios = sorted(a / b for a, b in zip(off, on))
  assert ab["ratio"] == float(np.median(ratios)) and [ab["ratio_min"], ab["ratio_max"]] == ratios
  assert ab["on_prompts_per_cpu_s"] == ab["prompts"] / ab["on_cpu_s"]
  assert ab["off_tokens_per_cpu_s"] == ab["policy_tokens"] / ab["off_cpu_s"]
  # Summed over one batch, the total's ratios are that batch's.
  total = rollout._ab_total([ab])
  assert total["ratio"] == ab["ratio"] and total["outputs_match"]
  assert (total["ratio_min"], total["ratio_max"]) == (ab["ratio_min"], ab["ratio_max"])
