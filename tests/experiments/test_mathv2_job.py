"""experiments/configs/mathv2.py: the ``tiny`` DeepSeekMath-V2 job through the real CLI.

One launch pre-trains a tiny base, fine-tunes the generator, verifier and
meta-verifier, runs the two verifier GRPO runs and the generator GRPO run,
and evaluates; a second launch reuses every finished stage.
"""
import json
import math
import pathlib
import subprocess
import sys

import pytest

from experiments import mathv2 as job
from opd.config import overrides as config_utils
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "mathv2.py"


def _launch(workdir):
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:tiny",
         f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  if proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("mathv2_tiny")
  _launch(workdir)
  return workdir, json.loads((workdir / "final_metrics.json").read_text())


def _final(workdir, stage):
  return json.loads((workdir / stage / "final_metrics.json").read_text())


def test_every_stage_finishes_with_consistent_counts(run):
  workdir, metrics = run
  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  for name, _, _ in job.STAGES:
    assert (workdir / name / "final_metrics.json").is_file(), name
  data = json.loads((workdir / "data" / "data.json").read_text())
  for split in ("train", "test"):
    n = len(data[split]["items"])
    assert metrics[f"data/{split}_proofs"] == n
    assert sum(metrics[f"data/{split}_label_{s}"] for s in ("0", "0.5", "1")) == n
    # Every problem contributes its reference proof first.
    assert sum(r["source"] == "reference" for r in data[split]["items"]) == \
        len(data[split]["examples"]) == metrics[f"data/{split}_problems"]
  for stage in ("verifier_rl", "verifier_rl_meta"):
    assert _final(workdir, stage)["steps"] == cfg.rl.verifier_steps
  assert _final(workdir, "generator_rl")["steps"] == cfg.rl.generator_steps
  # Only the second verifier run has the meta-verifier in its reward.
  assert "meta_final" in _final(workdir, "verifier_rl_meta")
  assert "meta_final" not in _final(workdir, "verifier_rl")
  assert {"r_y_final", "self_match_final", "meta_z_final", "checker_final"} <= set(
      _final(workdir, "generator_rl"))


def test_results_table_is_complete_and_consistent(run):
  workdir, _ = run
  cfg = config_utils.load_config(f"{CONFIG}:tiny")
  res = json.loads((workdir / "evaluate" / "results.json").read_text())
  test_proofs = len(json.loads((workdir / "data" / "data.json").read_text())["test"]["items"])
  assert list(res["verifiers"]) == list(job.VERIFIERS)
  for v in res["verifiers"].values():
    assert v["n"] == test_proofs and 0 <= v["accuracy"] <= v["format"] <= 1
    # Faithfulness is a share of stated issues: undefined (NaN) when none was stated.
    assert (v["stated_issues"] == 0) == (v["faithfulness"] is None or math.isnan(
        v["faithfulness"]))
  assert list(res["generators"]) == list(job.GENERATORS)
  for row in res["generators"].values():
    cols = ["single"] + [f"refine@{r}" for r in cfg.eval.rounds]
    assert all(0 <= row[c]["correct"] <= row[c]["mean_score"] <= 1 for c in cols)
  assert res["search"]["problems"] == cfg.eval.search_problems
  # The pool holds at least the round-0 candidates.
  assert res["search"]["candidates"] >= cfg.eval.search_pool
  pairs = [(r["n"], r["m"]) for r in res["labelling"]]
  assert pairs == [(n, m) for n in cfg.eval.label_ns for m in cfg.eval.label_ms]
  assert all(0 <= r["agreement"] <= 1 for r in res["labelling"])
  report = (workdir / "evaluate" / "report.md").read_text()
  assert all(f"| {name} |" in report for name in (*job.VERIFIERS, *job.GENERATORS))
  assert (workdir / "evaluate" / "mathv2.png").stat().st_size > 0


def test_a_second_launch_reuses_every_stage(run):
  workdir, _ = run
  out = _launch(workdir).stdout
  assert out.count("done earlier") == len(job.STAGES)


def test_constrained_roles_reach_the_sampler_with_their_grammar(monkeypatch):
  """config.sample.constrained_roles: those roles' samplers decode under their whole
  grammar (grm.verify.format), the others and the default unconstrained; a role
  outside ROLE_PATTERNS is refused naming the field."""
  import types

  from experiments.configs import mathv2 as mathv2_config
  from grm.verify import format as verify_format
  from opd.text.tokenizers import ByteTokenizer
  seen = []

  def fake_sampler_fn(*args, constrained, **kwargs):
    seen.append(constrained)
    return lambda prompts: []

  monkeypatch.setattr(job.sampling_lib, "sampler_fn", fake_sampler_fn)
  c = mathv2_config.get_config("tiny")
  assert tuple(c.sample.constrained_roles) == ()  # default: as the measured runs
  for roles in ((), ("verifier", "meta")):
    c.sample.constrained_roles = roles
    ctx = types.SimpleNamespace(config=c, tok=ByteTokenizer(), model_cfg=None, mesh=None,
                                rules=None)
    for role in ("generator", "verifier", "meta"):
      job._sampler(ctx, None, role)
  assert seen == [False] * 3 + [False, verify_format.ANALYSIS_PATTERN,
                                verify_format.META_PATTERN]
  c.sample.constrained_roles = ("generator",)
  with pytest.raises(ValueError, match=r"config.sample.constrained_roles=\('generator',\)"):
    job.run(c, "/nonexistent/never-created")
