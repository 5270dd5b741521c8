"""experiments/configs/grm.py: the ``tiny`` GRM job through the real CLI.

One launch builds two random tiny models, their preference groups, the three
GRM stages, the shared-backbone GRM, the BT RM, the pairwise judge, the meta-RM and the benchmark; a
second launch reuses every finished stage.
"""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import grm as grm_job
from experiments.grm_benchmark import MULTI, recompute_yardstick, stage_ks
from experiments.configs import grm as grm_config
from grm import pairwise as pairwise_lib
from grm import yardstick
from grm.benchmark_set import OVERALL, SUBSETS
from grm.correctness import best_index
from grm.data import PreferenceGroup
from grm.training import RFT_COUNTS
from subprocess_env import one_device_env  # tests/ (on sys.path via conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "grm.py"


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
  workdir = tmp_path_factory.mktemp("grm_tiny")
  _launch(workdir)
  return workdir, json.loads((workdir / "final_metrics.json").read_text())


def test_every_stage_finishes_and_rft_counts_add_up(run):
  workdir, metrics = run
  for name, _, _ in grm_job.STAGES:
    assert (workdir / name / "final_metrics.json").is_file(), name
  rft = json.loads((workdir / "rft" / "final_metrics.json").read_text())
  assert set(RFT_COUNTS) <= set(rft)
  assert rft["samples"] == rft["groups"] * 2  # tiny: n_rft = 2
  assert rft["rejected_incorrect"] + rft["kept_sampled"] + rft["too_easy_samples"] == rft["samples"]
  assert rft["hinted_kept"] + rft["hinted_rejected"] == rft["hinted_groups"]
  assert rft["kept"] == rft["kept_sampled"] + rft["hinted_kept"]
  assert metrics["data/train_groups"] + metrics["data/test_groups"] == metrics["data/kept"]
  shared = json.loads((workdir / grm_job.SHARED / "final_metrics.json").read_text())
  assert shared["steps"] == 1 and 0.0 <= shared["meta_accuracy_final"] <= 1.0


def test_benchmark_is_on_test_groups_only_and_consistent_with_invalid_rates(run):
  workdir, _ = run
  groups = json.loads((workdir / "data" / "groups.json").read_text())
  subsets = json.loads((workdir / "data" / "subsets.json").read_text())
  assert set(subsets) == set(SUBSETS)
  test_ids = {g["example_id"] for g in groups["test"]}
  train_queries = {g["query"] for g in groups["train"]}
  ids = [i for v in subsets.values() for i in v]
  assert sorted(ids) == sorted(test_ids)
  assert not {g["query"] for g in groups["test"]} & train_queries
  bench = json.loads((workdir / "benchmark" / "benchmark.json").read_text())
  assert bench["sizes"][OVERALL]["groups"] == len(test_ids)
  config = grm_config.get_config("tiny")
  # tiny: ks (1, 2), but cold start votes only at k = 1 (benchmark.ks_by_stage).
  assert stage_ks(config, "cold_start") == (1,)
  assert "cold_start/vote@2" not in bench["accuracy"]
  for stage in grm_job.GRM_STAGES + (grm_job.SHARED,):
    for k in stage_ks(config, stage):
      for kind in ("vote", "meta"):
        row = bench["accuracy"][f"{stage}/{kind}@{k}"]
        assert 0.0 <= row[OVERALL]["value"] <= 100.0
        # Without one valid sample no vote can pick the truth.
        if bench["invalid"][f"{stage}/sampled"]["invalid_rate"] == 1.0:
          assert row[OVERALL]["value"] == 0.0
  assert "random" in bench["accuracy"] and bench["paper"] == {"1": 85.6, "32": 89.6}
  # The like-for-like column: every method on the n >= 2 groups, recomputed
  # here from the cached per-group results and the groups' sizes.
  n_of = {g["example_id"]: len(g["responses"]) for g in groups["test"]}
  multi = [i for v in subsets.values() for i in v if n_of[i] >= 2]
  assert bench["sizes"][MULTI]["groups"] == len(multi)
  cached = json.loads((workdir / "benchmark" / "results_rule_rl.json").read_text())["correct"]
  for name, per_subset in cached.items():
    flags = [v for s, ids in subsets.items() for v, i in zip(per_subset.get(s, []), ids)
             if n_of[i] >= 2]
    row = bench["accuracy"].get(f"rule_rl/{name}")
    if row is not None and flags:
      assert row[MULTI]["value"] == pytest.approx(100 * sum(flags) / len(flags))
  bt = bench["accuracy"].get("bt_rm")
  if bt is not None:  # its lists hold only the n >= 2 groups already
    assert bt[MULTI]["value"] == pytest.approx(bt[OVERALL]["value"])
  report = (workdir / "benchmark" / "report.md").read_text()
  assert all(f"| {name} |" in report for name in bench["accuracy"])
  assert "RFT counts: groups" in report
  for name in grm_job.GRM_STAGES + (grm_job.SHARED, "baselines"):  # per-model results, cached
    assert (workdir / "benchmark" / f"results_{name}.json").is_file()
  for name, _, _ in grm_job.STAGES:
    stage = json.loads((workdir / name / "final_metrics.json").read_text())
    assert stage["time/wall_s"] > 0 and stage["time/cpu_s"] > 0
  assert (workdir / "benchmark" / "k_curve.png").stat().st_size > 0


def test_yardstick_recomputes_from_the_records_beside_chance_and_the_control(run):
  workdir, _ = run
  bench = json.loads((workdir / "benchmark" / "benchmark.json").read_text())
  yard = bench["yardstick"]
  groups = json.loads((workdir / "data" / "groups.json").read_text())
  ns = [len(g["responses"]) for g in groups["test"]]
  multi = [1 / n for n in ns if n >= 2]
  if multi:  # chance is mean(1/n), computed
    assert yard["chance"]["n>=2"]["value"] == pytest.approx(100 * sum(multi) / len(multi))
  config = grm_config.get_config("tiny")
  res = json.loads((workdir / "benchmark" / "results_rule_rl.json").read_text())
  assert len(res["records"]) == len(ns)
  again = yardstick.recompute(res["records"], stage_ks(config, "rule_rl"),
                              num_resamples=config.benchmark.bootstrap_samples, seed=config.seed)
  for name, row in again.items():
    got = yard[f"rule_rl/{name}"]
    assert {k: got[k] for k in row} == row  # the table is a function of the records alone
    if multi:  # strict n >= 2 is the like-for-like column of the accuracy table
      assert row["n>=2"]["strict"]["value"] == pytest.approx(
          bench["accuracy"][f"rule_rl/{name}"][MULTI]["value"])
    assert set(got["control"]) == set(row) or "control_error" in got
  # The whole table again from the run directory's files alone.
  assert json.loads(json.dumps(recompute_yardstick(workdir, config))) == yard
  report = (workdir / "benchmark" / "report.md").read_text()
  assert "## Yardstick" in report and "| rule_rl/vote@1 |" in report
  assert "pairwise_swap" in bench["accuracy"] or not multi
  if bench["position"] is not None:
    assert 0.0 <= bench["position"]["a_rate_before"] <= 1.0 or bench["position"][
        "a_rate_before"] != bench["position"]["a_rate_before"]  # NaN: no valid judgement


def test_a_second_launch_reuses_every_stage(run):
  workdir, _ = run
  out = _launch(workdir).stdout
  assert out.count("done earlier") == len(grm_job.STAGES)


def test_pairwise_sft_targets_name_the_best_response():
  g = PreferenceGroup("math", "e", "train", "q", ("a", "b", "c"), (0.2, 1.0, 0.5),
                      ("wrong", "ok", "wrong"))
  pairs = grm_job._pairwise_pairs([g] * 4, seed=0)
  assert len(pairs) == 4 * 2
  swaps = set()
  for e, (text, target) in enumerate(pairs):
    i = (0, 2)[e % 2]
    p = pairwise_lib.build_pairwise_prompt(g.query, g.responses[best_index(g.ratings)],
                                           g.responses[i], seed=(0, e // 2, i))
    assert p.text == text
    swaps.add(p.swapped)
    assert pairwise_lib.preferred_index(pairwise_lib.parse_pairwise(target), p.swapped) == 0
  assert swaps == {True, False}  # both orders occur, so the letter is not constant


def test_skip_stages_and_grm_width_errors_name_the_field(tmp_path):
  c = grm_config.get_config("tiny")
  c.skip_stages = ("nope",)
  with pytest.raises(ValueError, match=r"config.skip_stages=\('nope',\): unknown stages"):
    grm_job._skipped(c, tmp_path)
  c.skip_stages = ("rft", "shared", "benchmark")  # rule_rl reads rft, which never finished
  with pytest.raises(ValueError, match=r"stage 'rule_rl' reads \['rft'\], which is skipped"):
    grm_job._skipped(c, tmp_path)
  (tmp_path / "rft").mkdir()
  (tmp_path / "rft" / "final_metrics.json").write_text("{}")  # finished earlier: fine
  assert grm_job._skipped(c, tmp_path) == {"rft", "shared", "benchmark"}
  for width, match in ((-1, r"config.grm_width=-1: expected an int >= 0"),
                       (30, r"config.grm_width=30: must be a multiple of n_heads=4"),
                       (36, r"config.grm_width=36: the head dimension 9")):
    c.grm_width = width
    with pytest.raises(ValueError, match=match):
      grm_job.grm_model(c)


def test_a_grm_of_another_width_has_its_own_base_and_compares_with_the_shared_one(run, tmp_path):
  """grm_width = 16 (the tiny source models are 32 wide): the GRM and its meta-RM
  pre-train their own base; the data stage, copied from the fixture run, is read
  as done; then experiments.grm_compare scores the fixture's shared backbone
  against this run's GRM + meta-RM on the same groups."""
  import shutil

  import jax
  import numpy as np

  from experiments import grm_compare
  from opd.models import init_params, to_model_config
  shared_dir, _ = run
  workdir = tmp_path / "narrow"
  shutil.copytree(shared_dir / "data", workdir / "data")
  env = one_device_env()
  cmd = [sys.executable, "-m", "experiments.launch", f"--config={CONFIG}:tiny",
         f"--workdir={workdir}", "--config.grm_width=16",
         "--config.skip_stages=('shared','bt_rm','pairwise','benchmark')"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "[stage] data: done earlier" in proc.stdout
  for name in ("shared", "bt_rm", "pairwise", "benchmark"):
    assert f"[grm] {name}: skipped" in proc.stdout and not (workdir / name).exists()
  width = {}
  for name in ("grm_base", "data", "cold_start", "rft", "rule_rl", "meta_rm"):
    assert (workdir / name / "final_metrics.json").exists(), name
    width[name] = json.loads((workdir / name / "config.json").read_text())["model"]["d_model"]
  assert width == {"grm_base": 16, "data": 32, "cold_start": 16, "rft": 16, "rule_rl": 16,
                   "meta_rm": 16}
  out = tmp_path / "compare"
  cmd = [sys.executable, "-m", "experiments.grm_compare", f"--shared={shared_dir}",
         f"--separate={workdir}", f"--out={out}", "--ks=1,2", "--bootstrap_samples=50"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((out / "compare.json").read_text())
  assert set(result["accuracy"]) == {"greedy", "vote@1", "meta@1", "vote@2", "meta@2"}
  n = result["test_groups"]
  for arm in grm_compare.ARMS:
    arm_dir = shared_dir if arm == "shared" else workdir
    raw = json.loads((out / grm_compare._cache_name(arm, arm_dir, (1, 2))).read_text())["correct"]
    for name, row in result["accuracy"].items():
      flat = np.concatenate([np.asarray(v, float) for v in raw[name].values()])
      assert flat.size == n
      assert row[arm]["value"] == pytest.approx(100 * flat.mean(), abs=1e-9)
  for row in result["accuracy"].values():  # the paired mean is the difference of the means
    assert row["shared_minus_separate"]["value"] == pytest.approx(
        row["shared"]["value"] - row["separate"]["value"], abs=1e-9)
  # Parameter counts against the arrays themselves.
  c = grm_config.get_config("tiny")
  wide = to_model_config(c.model)
  c.grm_width = 16
  narrow = to_model_config(grm_job.grm_model(c))

  def count(cfg):
    return sum(x.size for x in jax.tree_util.tree_leaves(init_params(cfg, jax.random.key(0))))

  assert result["params"]["shared"] == count(wide.replace(scalar_head=True))
  assert result["params"]["separate"] == count(narrow) + count(narrow.replace(scalar_head=True))
  first_table = (out / "compare.md").read_text().split("Yardstick")[0]
  assert first_table.count("\n| ") == len(result["accuracy"])
  assert set(result["yardstick"]["rows"]) == set(result["accuracy"])
  assert (out / "compare.png").stat().st_size > 0


def test_compare_summary_against_numpy():
  """grm_compare.summarize on constructed results: accuracy is 100 x the mean over
  every subset's groups, the paired difference is the mean of per-group
  differences, and its SE is below the unpaired one when the arms agree often."""
  import numpy as np

  from experiments import grm_compare
  rng = np.random.default_rng(0)
  sizes = {"chat": 40, "code": 25}
  names = ["greedy", "vote@1", "meta@1", "vote@4", "meta@4"]
  base = {s: rng.random(n) < 0.5 for s, n in sizes.items()}
  parts = {}
  for arm, flip in (("shared", 0.1), ("separate", 0.3)):
    parts[arm] = {"correct": {name: {s: [bool(b) != (rng.random() < flip) for b in base[s]]
                                     for s in sizes} for name in names}}
  table = grm_compare.summarize(parts, (1, 4), num_resamples=400, seed=0)
  for name in names:
    a, b = (np.concatenate([np.asarray(parts[arm]["correct"][name][s], float) for s in sizes])
            for arm in grm_compare.ARMS)
    assert table[name]["shared"]["value"] == pytest.approx(100 * a.mean(), abs=1e-9)
    assert table[name]["separate"]["value"] == pytest.approx(100 * b.mean(), abs=1e-9)
    d = table[name]["shared_minus_separate"]
    assert d["value"] == pytest.approx(100 * (a - b).mean(), abs=1e-9)
    # bootstrap SE of a mean: within 25% of the analytic std / sqrt(n) at 400 resamples
    analytic = 100 * (a - b).std() / np.sqrt(a.size)
    assert d["se"] == pytest.approx(analytic, rel=0.25)
    unpaired = np.hypot(table[name]["shared"]["se"], table[name]["separate"]["se"])
    assert d["se"] < unpaired


def test_control_variant_writes_the_control_set_and_pretrains_its_own_base(tmp_path):
  """grm.py:control: the data stage writes grm.control_set's groups (n = 2, all in the
  reasoning subset), the GRM pre-trains its own base (no source models), and the stages
  without a use for it are skipped; the default and tiny variants keep theirs."""
  import dataclasses
  import types

  from grm import control_set
  c = grm_config.get_config("control")
  assert grm_job.has_own_base(c) and not grm_job.has_own_base(grm_config.get_config())
  assert not grm_job.has_own_base(grm_config.get_config("control,tiny"))  # random models
  assert set(c.skip_stages) == {"shared", "bt_rm", "pairwise", "meta_rm", "benchmark"}
  c.data.update(num_train=6, num_test=5)
  metrics = grm_job._stage_data(types.SimpleNamespace(config=c), tmp_path)
  groups = json.loads((tmp_path / "groups.json").read_text())
  for split, n, seed in (("train", 6, c.seed), ("test", 5, c.seed + 1)):
    _, want = control_set.control_groups(split, n, cue="marker", seed=seed)
    assert groups[split] == [json.loads(json.dumps(dataclasses.asdict(g))) for g in want]
  subsets = json.loads((tmp_path / "subsets.json").read_text())
  assert subsets["reasoning"] == [g["example_id"] for g in groups["test"]]
  assert sum(map(len, subsets.values())) == 5
  assert (metrics["train_groups"], metrics["test_groups"], metrics["kept_n2"]) == (6, 5, 11)
  c.data.source = "elsewhere"
  with pytest.raises(ValueError, match="config.data.source='elsewhere'"):
    grm_job._stage_data(types.SimpleNamespace(config=c), tmp_path)


def test_grm_yardstick_cli_resamples_the_benchmark_without_a_meta_rm(run, tmp_path):
  """experiments.grm_yardstick on the fixture run: the same seeds and sampling settings
  as the benchmark stage, so its records hold the benchmark's scores and validity (meta
  scores 0: no meta-RM), and its table is recompute() of them with no meta rows."""
  workdir, _ = run
  out = tmp_path / "yard"
  cmd = [sys.executable, "-m", "experiments.grm_yardstick", f"--workdir={workdir}",
         "--stages=cold_start", "--ks=1", f"--out={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=one_device_env(), timeout=900,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  mine = json.loads((out / "results_cold_start_k1.json").read_text())
  bench = json.loads((workdir / "benchmark" / "results_cold_start.json").read_text())
  for key in ("records", "control_records"):
    if key not in bench:
      continue
    assert len(mine[key]) == len(bench[key])
    for a, b in zip(mine[key], bench[key]):
      assert a["greedy"] == b["greedy"] and a["ratings"] == b["ratings"]
      assert {k: a["samples"][k] for k in ("scores", "valid", "reasons")} == \
          {k: b["samples"][k] for k in ("scores", "valid", "reasons")}
      assert a["samples"]["meta"] == [0.0] * len(a["samples"]["valid"])
  table = json.loads((out / "yardstick.json").read_text())
  assert {k for k in table if "/" in k} == {"cold_start/greedy", "cold_start/vote@1"}
  config = grm_config.get_config("tiny")
  again = yardstick.recompute(mine["records"], (1,), num_resamples=config.benchmark.bootstrap_samples,
                              seed=config.seed)
  for name in ("greedy", "vote@1"):
    got = table[f"cold_start/{name}"]
    assert {k: got[k] for k in again[name]} == again[name]
  assert "| cold_start/greedy |" in proc.stdout


def test_grm_yardstick_cli_with_the_meta_rm_gives_the_benchmarks_meta_scores(run, tmp_path):
  """``--meta_rm``: the run's meta-RM scores the same samples as in the benchmark stage
  (same seeds), so every sample's meta score is the benchmark's, and the meta@k rows
  are recompute() of the records (k_meta over the valid judgements)."""
  workdir, _ = run
  out = tmp_path / "yard_meta"
  cmd = [sys.executable, "-m", "experiments.grm_yardstick", f"--workdir={workdir}",
         "--stages=cold_start", "--ks=1", f"--out={out}", "--meta_rm"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=one_device_env(), timeout=900,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  mine = json.loads((out / "results_cold_start_k1_meta.json").read_text())
  bench = json.loads((workdir / "benchmark" / "results_cold_start.json").read_text())
  assert len(mine["records"]) == len(bench["records"])
  for a, b in zip(mine["records"], bench["records"]):
    assert a["samples"]["valid"] == b["samples"]["valid"]
    # The same rows through the same scorer and batching: float32, ~1e-6 relative.
    np.testing.assert_allclose(a["samples"]["meta"], b["samples"]["meta"], rtol=1e-5, atol=1e-6)
  table = json.loads((out / "yardstick.json").read_text())
  assert {k for k in table if "/" in k} == {"cold_start/greedy", "cold_start/vote@1",
                                            "cold_start/meta@1"}
  config = grm_config.get_config("tiny")
  again = yardstick.recompute(mine["records"], (1,), num_resamples=config.benchmark.bootstrap_samples,
                              seed=config.seed)
  got = table["cold_start/meta@1"]
  assert {k: got[k] for k in again["meta@1"]} == again["meta@1"]
  assert "(meta-RM)" in proc.stdout


def test_grm_yardstick_split_judges_each_response_alone_and_joins_them(run, tmp_path):
  """``--split`` (in process): one record per n >= 2 test group, for the groups and for
  their control, each sample's n scores from n single judgements; the table holds only
  n >= 2 rows and equals recompute() of those records; pair.json is written."""
  from experiments import grm_yardstick
  from experiments.grm_common import load_test_subsets
  workdir, _ = run
  out = tmp_path / "yard_split"
  table = grm_yardstick.measure(workdir, ("cold_start",), (1, 2), out, split=True)
  mine = json.loads((out / "results_cold_start_k1-2_split.json").read_text())
  ctx = grm_job.saved_run_context(workdir, (1, 2))
  groups = [g for gs in load_test_subsets(ctx).values() for g in gs if g.n >= 2]
  for key in ("records", "control_records"):
    assert [r["n"] for r in mine[key]] == [g.n for g in groups]
    assert [r["ratings"] for r in mine[key]] == [list(g.ratings) for g in groups]
    for r in mine[key]:
      assert np.shape(r["samples"]["scores"]) == (2, r["n"])
  config = grm_config.get_config("tiny")
  again = yardstick.recompute(mine["records"], (1, 2),
                              num_resamples=config.benchmark.bootstrap_samples, seed=config.seed)
  for name in ("greedy", "vote@1", "vote@2"):
    got = table[f"cold_start/{name}"]
    assert set(again[name]) == {yardstick.MULTI}
    assert got[yardstick.MULTI] == again[name][yardstick.MULTI]
  pair = json.loads((out / "pair.json").read_text())
  assert set(pair["cold_start"]) == {"grm", "control"}
  assert "each response judged alone" in (out / "yardstick.md").read_text()


def test_grm_yardstick_on_the_train_split_judges_the_train_groups(run, tmp_path):
  """``--on=train``: one record per train group, in the data stage's order, with its
  ratings; the table is recompute() of them."""
  from experiments import grm_yardstick
  from experiments.grm_common import load_groups
  workdir, _ = run
  out = tmp_path / "yard_train"
  table = grm_yardstick.measure(workdir, ("cold_start",), (1,), out, on="train")
  mine = json.loads((out / "results_cold_start_k1_train.json").read_text())
  train = load_groups(grm_job.saved_run_context(workdir, (1,)))["train"]
  assert [r["ratings"] for r in mine["records"]] == [list(g.ratings) for g in train]
  config = grm_config.get_config("tiny")
  again = yardstick.recompute(mine["records"], (1,),
                              num_resamples=config.benchmark.bootstrap_samples, seed=config.seed)
  assert {k: table["cold_start/vote@1"][k] for k in again["vote@1"]} == again["vote@1"]
  assert "on the train split" in (out / "yardstick.md").read_text()
  with pytest.raises(ValueError, match="--on='dev'"):
    grm_yardstick.measure(workdir, ("cold_start",), (1,), out, on="dev")


def test_grm_yardstick_bad_arguments_name_the_flag(tmp_path):
  from experiments import grm_compare  # noqa: F401  (defines its own --ks at import)
  from experiments import grm_yardstick
  assert grm_yardstick.parse_ks("1,4") == (1, 4)
  for text in ("0", "1,x", ""):
    with pytest.raises(ValueError, match=f"--ks={text!r}"):
      grm_yardstick.parse_ks(text)
  with pytest.raises(ValueError, match=r"--stages='meta_rm': \['meta_rm'\] not among"):
    grm_yardstick.measure(tmp_path, ("meta_rm",), (1,), tmp_path / "out")
  with pytest.raises(FileNotFoundError, match=r"stages \['rft'\] have not finished"):
    grm_yardstick.measure(tmp_path, ("rft",), (1,), tmp_path / "out")
  (tmp_path / "rft").mkdir()
  (tmp_path / "rft" / "final_metrics.json").write_text("{}")
  with pytest.raises(FileNotFoundError, match=r"stages \['meta_rm'\] have not finished"):
    grm_yardstick.measure(tmp_path, ("rft",), (1,), tmp_path / "out", meta_rm=True)


def _records(rng, ns, k):
  """Constructed per-group records (``grm.yardstick.group_record``'s layout): ratings with
  a unique best for n >= 2, random 1..10 scores and validity."""
  out = []
  for n in ns:
    ratings = rng.permutation(n).astype(float).tolist() if n >= 2 else [float(rng.integers(1, 11))]
    out.append({"subset": "s", "n": n, "ratings": ratings,
                "greedy": {"scores": rng.integers(1, 11, (1, n)).tolist(),
                           "valid": (rng.random(1) < 0.8).tolist()},
                "samples": {"scores": rng.integers(1, 11, (k, n)).tolist(),
                            "valid": (rng.random(k) < 0.8).tolist(),
                            "meta": rng.random(k).tolist()}})
  return out


def _strict(scores, valid, ratings):
  """numpy: a vote's strict correctness (summed valid scores; a unique top at the best)."""
  s, v = np.asarray(scores, float), np.asarray(valid, bool)
  if not v.any():
    return 0.0
  totals = s[v].sum(0)
  top = np.flatnonzero(totals == totals.max())
  return float(top.size == 1 and top[0] == int(np.argmax(ratings)))


def test_compare_yardstick_against_numpy():
  """grm_compare.yardstick on constructed records: n >= 2 strict accuracy per arm,
  the paired difference, chance mean(1/n), and the control rows."""
  import numpy as np

  from experiments import grm_compare
  rng = np.random.default_rng(5)
  ns = [1, 2, 3, 4, 2, 3] * 10
  parts = {arm: {"records": _records(rng, ns, 4), "control_records": _records(rng, ns, 4)}
           for arm in grm_compare.ARMS}
  got = grm_compare.yardstick(parts, (1, 4), num_resamples=200, seed=0)
  multi = [i for i, n in enumerate(ns) if n >= 2]
  assert got["chance"]["n>=2"]["value"] == pytest.approx(100 * np.mean([1 / ns[i] for i in multi]))
  for name, pick in (("greedy", lambda r: (r["greedy"]["scores"], r["greedy"]["valid"])),
                     ("vote@1", lambda r: (r["samples"]["scores"][:1], r["samples"]["valid"][:1])),
                     ("vote@4", lambda r: (r["samples"]["scores"], r["samples"]["valid"]))):
    strict = {a: np.asarray([_strict(*pick(parts[a]["records"][i]),
                                     parts[a]["records"][i]["ratings"]) for i in multi])
              for a in grm_compare.ARMS}
    row = got["rows"][name]
    for a in grm_compare.ARMS:
      assert row[a]["value"] == pytest.approx(100 * strict[a].mean(), abs=1e-9)
      control = np.mean([_strict(*pick(parts[a]["control_records"][i]),
                                 parts[a]["control_records"][i]["ratings"]) for i in multi])
      assert row[f"{a}_control"]["value"] == pytest.approx(100 * control, abs=1e-9)
    assert row["shared_minus_separate"]["value"] == pytest.approx(
        100 * (strict["shared"] - strict["separate"]).mean(), abs=1e-9)
  assert set(got["pair"]) == set(grm_compare.ARMS)
  assert "| vote@4 |" in grm_compare.render_yardstick(got)
  assert grm_compare.yardstick({a: {} for a in grm_compare.ARMS}, (1,), 10, 0) == {}
