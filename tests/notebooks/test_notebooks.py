"""Notebooks are stored without outputs, their code runs top to bottom, and they show what they claim."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def _code(nb):
  return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_clean_and_runs(path, tmp_path):
  nb = json.loads(path.read_text())
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, "stored outputs"
  assert "colab-badge" in "".join("".join(c["source"]) for c in nb["cells"])
  # Colab: the first code cell installs the package from the repository,
  # never from a path of this machine (``-e ..`` only exists in a checkout).
  install = _code(nb)[0]
  assert "pip" in install and "git+https://github.com/" in install, install
  assert '"-e"' not in install and "/work/" not in install, install
  script = tmp_path / "nb.py"
  # The last expression of a cell is displayed in Jupyter; here it is just evaluated.
  # Each notebook ends with a ``summary`` dict of what it demonstrates; the
  # script prints it so the test can check the claims, not just a header.
  script.write_text("\n\n".join(_code(nb)) + "\n\nimport json as _json\n"
                    "print('SUMMARY ' + _json.dumps(summary))\n")
  env = one_device_env()
  proc = subprocess.run([sys.executable, str(script)], cwd=path.parent, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("SUMMARY ")][-1]
  CHECKS[path.stem](json.loads(line[len("SUMMARY "):]), proc.stdout)


def _check_quickstart(summary, stdout):
  base, sft = summary["base"], summary["sft"]
  # A fresh small-init model predicts close to uniformly over the byte
  # tokenizer's 270 ids, so its first loss is ~ln(270) nats; pre-training on
  # the task text must then move it clearly below where it started.
  assert abs(base["train_loss_first"] - math.log(270)) < 0.5, base
  assert base["train_loss_final"] < base["train_loss_first"] - 0.3, base
  # SFT continues from the base on math answers and must lower its own loss.
  assert sft["train_loss_final"] < sft["train_loss_first"] - 0.3, sft
  # The comparison holds both models, with rewards on the 0-100 scale.
  assert set(summary["reward@1"]) == {"base", "sft"}
  assert all(0.0 <= r <= 100.0 for r in summary["reward@1"].values())
  assert "| reward@1 | math | avg |" in stdout and "| base |" in stdout and "| sft |" in stdout


def _check_estimator_ablation(summary, stdout):
  # The tiny sweep's first two seeds: four estimators, two seeds each, none
  # failed, the reference (full vocabulary) first.
  assert summary["arms"] == ["full", "top-10", "top-32", "token"], summary
  assert summary["seeds"] == {a: 2 for a in summary["arms"]} and summary["failed"] == []
  for arm in summary["arms"]:
    # Losses and gradient norms move from step to step on sampled rollouts.
    assert summary["loss_fluctuation_pct"][arm] > 0 and summary["grad_norm_cv"][arm] > 0, arm
    assert set(summary["rkl_final"][arm]) == {"math", "instruct"}
    assert all(math.isfinite(v) and v >= 0 for v in summary["rkl_final"][arm].values()), arm
  assert summary["plot_bytes"] > 0
  assert "Beside the seed's figures" in stdout and "| token |" in stdout and "±15" in stdout


def _check_grm_voting(summary, stdout):
  # Every one of the k samples per group is either valid or counted under one reason.
  assert summary["samples"] == summary["groups"] * summary["k"] > 0, summary
  assert summary["valid"] + sum(summary["invalid"].values()) == summary["samples"], summary
  assert set(summary["accuracy"]) == {"vote", "meta_vote"}
  for name, acc in summary["accuracy"].items():
    assert len(acc) == len(summary["ks"]) and all(0.0 <= a <= 1.0 for a in acc), name
    if summary["valid"] == 0:  # nothing voted: no winner, never right
      assert acc == [0.0] * len(acc), name
  assert summary["plot_bytes"] > 0 and "invalid samples by reason" in stdout


def _check_gencluster(summary, stdout):
  # Hand-written pool (no checkpoint): fallback generators and rule validators only.
  assert summary["hand_written"] and summary["problems"] == 2, summary
  c = summary["counts"]
  assert c["generators_model"] == 0 and c["generators_fallback"] == 6, c
  assert c["validators_model"] == 0 and c["validators_fallback"] == 12, c
  # The hang and the write outside the work directory (first problem, hardest subtask)
  # each fail alone; no other subtask loses a cluster, and nothing reached the host.
  dropped = summary["dropped"]
  hostile = [k for k, v in dropped.items() if v["clusters_dropped"]]
  assert len(hostile) == 1 and hostile[0].endswith("/2"), dropped
  assert dropped[hostile[0]]["candidates_failed_run"] == 2, dropped
  assert not os.path.exists("/tmp/gencluster_pwned")
  # "abs(x)" agrees with the reference on level 1's non-negative inputs only: one
  # cluster fewer there than on level 2.
  for sizes in summary["clusters"].values():
    assert sizes[0] == sizes[1] - 1, summary["clusters"]
  for name, curve in summary["curves"].items():
    assert all(a <= b for a, b in zip(curve, curve[1:])), name
    assert all(0.0 <= x <= summary["upper_bound"] for x in curve), name
  # The reference is in the pool, so 12 submissions solve every subtask.
  assert summary["upper_bound"] == 1.0 and summary["curves"]["gencluster"][-1] == 1.0
  assert 0 <= summary["valid"] <= summary["judged"] and summary["plot_bytes"] > 0
  assert "clusters kept per subtask" in stdout and "programs/s" in stdout


def _check_opd_walkthrough(summary, stdout):
  # distill.py:tiny: two teachers, 8 OPD steps, diagnostics every 4 (logged at steps 1 and 5
  # for a teacher whose domain was in that step's prompts).
  assert summary["teachers"] == ["instruct", "math"] and summary["steps"] == 8, summary
  for t in summary["teachers"]:
    # OPD minimises the reverse KL to the routed teacher; the held-out sample is drawn with
    # a fixed key, so only the student's params change between the two measurements.
    assert 0 <= summary["rkl_final"][t] < summary["rkl_initial"][t], t
    assert summary["diag_steps"][t] and set(summary["diag_steps"][t]) <= {1.0, 5.0}, t
  rows = {"math-specialist", "instruct-specialist", "student before OPD", "student after OPD"}
  assert set(summary["reward@1"]) == rows
  assert all(0 <= v <= 100 for r in summary["reward@1"].values() for v in r.values())
  assert summary["plot_bytes"] > 0
  assert "| reward@1 | math | instruct | avg |" in stdout and "| student after OPD |" in stdout


def _check_mathv2(summary, stdout):
  # The checker's verdict follows from how each proof was made (opd.tasks.proof_task).
  want = {"reference": 1.0, "wrong_step": 0.0, "missing_step": 0.5, "wrong_final": 0.0}
  assert summary["items"] and all(score == want[src] for src, score in summary["items"])
  v = summary["verifier"]
  assert v["n"] == len(summary["items"]) and 0 <= v["accuracy"] <= v["format"] <= 1, v
  assert all(0 <= c <= 1 for c in summary["refine"].values()) and 0 <= summary["search"] <= 1
  assert all(0 <= r <= 2 for r in summary["stopped"])
  assert [(r["n"], r["m"]) for r in summary["labelling"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
  share_one = sum(score == 1.0 for _, score in summary["items"]) / len(summary["items"])
  for row in summary["labelling"]:
    if row["mean_label"] == 1.0:  # every label 1: agreement is the share of clean proofs
      assert abs(row["agreement"] - share_one) < 1e-12, row
  assert summary["plot_bytes"] > 0 and "| refine@0 |" in stdout and "| search |" in stdout


CHECKS = {"quickstart": _check_quickstart, "estimator_ablation": _check_estimator_ablation,
          "grm_voting": _check_grm_voting,
          "mathv2": _check_mathv2,
          "opd_walkthrough": _check_opd_walkthrough, "gencluster": _check_gencluster}
