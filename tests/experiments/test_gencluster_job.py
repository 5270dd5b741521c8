"""experiments/configs/gencluster.py: the ``tiny`` GENCLUSTER job through the real CLI.

One launch: a random tiny policy (its candidates, generators and validators
rarely parse) plus two planted candidates per subtask (the reference and an
off-by-one distractor), inputs, clustering, the tournament, submissions and
the report; a second launch reuses every finished stage.
"""
import itertools
import json
import math
import pathlib
import subprocess
import sys

import pytest

from experiments import gencluster as job
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "gencluster.py"


def _launch(workdir):
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:tiny",
         f"--workdir={workdir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
  if proc.returncode:
    raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("gencluster_tiny")
  _launch(workdir)
  return workdir, json.loads((workdir / "final_metrics.json").read_text())


def _read(workdir, stage, name):
  return json.loads((workdir / stage / name).read_text())


def test_counts_add_up_and_planted_candidates_behave(run):
  workdir, m = run
  assert m["execute/parsed"] + m["execute/dropped_parse"] + m["execute/dropped_compile"] \
      == m["execute/candidates"] == m["samples/candidates"]
  n_sub = m["problems/subtasks"]
  assert m["inputs/generators_model"] + m["inputs/generators_fallback"] == n_sub * 1
  assert m["inputs/validators_model"] + m["inputs/validators_fallback"] == n_sub * 2
  # kept: at most max_inputs (6 in tiny) of those the filter passed.
  assert m["inputs/kept"] <= min(m["inputs/inputs"] - m["inputs/removed"], 6 * n_sub)
  clusters = _read(workdir, "execute", "clusters.json")
  samples = _read(workdir, "samples", "samples.json")
  for pid, row in clusters.items():
    for j in range(3):
      cands = samples[pid]["candidates"][j]
      n = len(cands)
      distractor, reference = j * n + n - 2, j * n + n - 1   # planted last (job.planted)
      assert row["texts"][reference] == cands[-1] and row["parsed"][reference]
      # The reference passes every subtask's hidden tests; the off-by-one distractor none.
      assert row["passes"][reference] == [0, 1, 2] and row["passes"][distractor] == []
      for v in job.VARIANTS:
        members = [c for cl in row["variants"][v][j]["clusters"] for c in cl]
        assert reference in members and len(members) == len(set(members))
        assert not any(distractor in cl and reference in cl
                       for cl in row["variants"][v][j]["clusters"])
  assert m["execute/upper_bound"] == 1.0


def test_tournament_judges_every_pair_and_report_is_complete(run):
  workdir, m = run
  clusters = _read(workdir, "execute", "clusters.json")
  pairs = sum(math.comb(min(3, len(sub["clusters"])), 2)  # tiny: max_clusters = 3, games = 1
              for row in clusters.values() for v in job.VARIANTS for sub in row["variants"][v])
  assert m["rank/matches"] == pairs > 0
  assert 0 <= m["rank/valid_judgements"] <= pairs
  # The judge stage fine-tuned the policy (2 steps in tiny) and the tournament used it.
  assert m["judge/trained"] == 1 and m["judge/pairs"] > 0
  assert (workdir / "judge" / "checkpoints").is_dir()
  # Judge accuracy is over the pairs where exactly one representative (a cluster's
  # first member) passes the subtask's hidden tests, counted here from clusters.json.
  informative = 0
  for row in clusters.values():
    for v in job.VARIANTS:
      for j, sub in enumerate(row["variants"][v]):
        ok = [j in row["passes"][cl[0]] for cl in sub["clusters"][:3]]
        informative += sum(a != b for a, b in itertools.combinations(ok, 2))
  assert m["rank/informative_matches"] == informative
  # The judge's position bias is reported; single order (tiny), so the combined
  # verdict's credit to A is the single judgements' A rate.
  before, after = m["rank/judge_a_rate_before"], m["rank/judge_a_rate_after"]
  if m["rank/valid_judgements"]:
    assert 0 <= before <= 1 and after == pytest.approx(before)
  if informative:
    assert 0 <= m["rank/judge_accuracy"] <= 1
  results = _read(workdir, "report", "results.json")
  for name in job.STRATEGIES:
    curve = results["curves"][name]
    assert len(curve) == 8 and all(a <= b for a, b in zip(curve, curve[1:]))  # budget 8
    assert all(0.0 <= x <= results["upper_bound"] for x in curve)
  # Tiny: each subtask's candidates are the reference and the distractor (the random
  # policy's rarely parse), so every strategy that can reach both solves all by budget 8,
  # except when a model candidate parses (then fewer may be reached).
  if m["execute/parsed"] == 2 * m["problems/subtasks"]:
    for name in ("gencluster", "no_validators", "random"):
      assert results["curves"][name][-1] == 1.0, name
  report = (workdir / "report" / "report.md").read_text()
  assert all(f"| {job.LABELS[n]} |" in report for n in job.STRATEGIES)
  assert "programs/s" in report and "75% filter" in report
  assert (workdir / "report" / "solve_rate.png").stat().st_size > 0


def test_second_launch_reuses_every_stage(run):
  workdir, _ = run
  proc = _launch(workdir)
  for name, _, _ in job.STAGES:
    assert f"[stage] {name}: done earlier" in proc.stdout, name


def test_tournament_constrained_flag_reaches_the_judge(monkeypatch):
  """config.tournament.constrained (default off) is what the job's judge decodes under
  (grm.gencluster.pipeline.model_judge: the "Better: A|B" grammar)."""
  import types

  from experiments.configs import gencluster as gencluster_config
  from opd.text.tokenizers import ByteTokenizer
  seen = []
  monkeypatch.setattr(job, "_policy_params", lambda ctx: None)
  monkeypatch.setattr(job.pipeline, "model_judge",
                      lambda policy, sampling, *, batch_size, constrained: seen.append(constrained))
  c = gencluster_config.get_config("tiny")
  c.judge.checkpoint, c.judge.train_steps = "", 0
  assert c.tournament.constrained is False
  for flag in (False, True):
    c.tournament.constrained = flag
    job._judge(types.SimpleNamespace(config=c, tok=ByteTokenizer(), model_cfg=None, mesh=None,
                                     rules=None, root=pathlib.Path("/nonexistent")))
  assert seen == [False, True]
