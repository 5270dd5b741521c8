"""``experiments.common.Stages``: finished stages of another run are read, never rerun or written."""
import json

import ml_collections
import pytest

from experiments import common


def _cfg(**kw):
  return ml_collections.ConfigDict({**dict(job="x", lr=1e-3, init="a/ckpt"), **kw})


def _counting_fn(calls):
  def fn(cfg, workdir):
    calls.append(workdir)
    return {"lr": cfg.lr}
  return fn


def _snapshot(root):
  return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def test_finished_matching_stage_is_read_from_the_reuse_root(tmp_path):
  src, dst, calls = tmp_path / "src", tmp_path / "dst", []
  metrics, d = common.Stages.of(src).run("s", _counting_fn(calls), _cfg(), "a/b")
  assert d == src / "a" / "b" and calls == [str(src / "a" / "b")]
  before = _snapshot(src)
  got, d2 = common.Stages.of(dst, [src]).run("s", _counting_fn(calls), _cfg(), "a/b")
  assert d2 == src / "a" / "b" and got == metrics == {"lr": 1e-3}
  assert len(calls) == 1  # not rerun
  assert not dst.exists()  # nothing written in the new root
  assert _snapshot(src) == before  # nor in the reused one


@pytest.mark.parametrize("change", [dict(lr=2e-3), dict(init="b/ckpt")])
def test_a_changed_stage_config_runs_in_the_own_root(tmp_path, change):
  src, dst, calls = tmp_path / "src", tmp_path / "dst", []
  common.Stages.of(src).run("s", _counting_fn(calls), _cfg(), "a")
  before = _snapshot(src)
  cfg = _cfg()
  cfg.update(change)
  got, d = common.Stages.of(dst, [src]).run("s", _counting_fn(calls), cfg, "a")
  assert d == dst / "a" and calls[-1] == str(dst / "a") and len(calls) == 2
  assert got == {"lr": cfg.lr}
  assert json.loads((dst / "a" / "config.json").read_text())["init"] == cfg.init
  assert _snapshot(src) == before


def test_an_unfinished_stage_is_not_reused(tmp_path):
  src, dst, calls = tmp_path / "src", tmp_path / "dst", []
  common.Stages.of(src).run("s", _counting_fn(calls), _cfg(), "a")
  (src / "a" / common.FINAL).unlink()  # e.g. a run interrupted mid-stage
  _, d = common.Stages.of(dst, [src]).run("s", _counting_fn(calls), _cfg(), "a")
  assert d == dst / "a" and len(calls) == 2


def test_the_first_matching_root_wins(tmp_path):
  a, b, calls = tmp_path / "a", tmp_path / "b", []
  common.Stages.of(a).run("s", _counting_fn(calls), _cfg(), "x")
  common.Stages.of(b).run("s", _counting_fn(calls), _cfg(lr=5e-3), "x")  # another config
  common.Stages.of(b).run("s", _counting_fn(calls), _cfg(), "y")
  stages = common.Stages.of(tmp_path / "c", [b, a])
  assert stages.find(_cfg(), "x") == a / "x"  # b's x is another config
  assert stages.find(_cfg(), "y") == b / "y"
  assert stages.find(_cfg(), "z") is None


def test_bad_reuse_roots_name_the_value(tmp_path):
  with pytest.raises(ValueError, match=r"reuse_from='.*nowhere' is not a directory"):
    common.Stages.of(tmp_path / "new", [tmp_path / "nowhere"])
  tmp_path.joinpath("run").mkdir()
  with pytest.raises(ValueError, match=r"reuse_from='.*run' is the workdir itself"):
    common.Stages.of(tmp_path / "run", [tmp_path / "run"])


def test_a_field_added_later_matches_only_at_its_reproducing_value(tmp_path):
  """A stage written before ``opd.teacher_temperature`` existed ran with 1.0."""
  src, calls = tmp_path / "src", []
  old = ml_collections.ConfigDict({"job": "opd", "opd": {"estimator": "full"}})
  common.Stages.of(src).run("s", _counting_fn(calls), _cfg(**old), "a")
  assert common.ADDED_FIELDS["opd.teacher_temperature"] == 1.0
  new = _cfg(**old)
  new.opd.teacher_temperature = 1.0
  assert common.Stages.of(tmp_path / "dst", [src]).find(new, "a") == src / "a"
  common.run_stage("s", _counting_fn(calls), new, src / "a")  # resumes, does not refuse
  new.opd.teacher_temperature = 0.5
  assert common.Stages.of(tmp_path / "dst", [src]).find(new, "a") is None
  with pytest.raises(ValueError, match=r"opd.teacher_temperature: was '<missing>', now 0.5"):
    common.run_stage("s", _counting_fn(calls), new, src / "a")
  new.opd.teacher_temperature = 1.0
  new.opd.other = 3  # a field not in the table is a mismatch when missing
  with pytest.raises(ValueError, match=r"opd.other: was '<missing>', now 3"):
    common.run_stage("s", _counting_fn(calls), new, src / "a")
  assert len(calls) == 1


def test_a_field_left_out_of_the_new_stage_config_still_matches(tmp_path):
  """What the grm job relies on when RFT's stage config stops holding the
  benchmark's voting k's: a saved config may hold more fields; every field
  the new config holds is still compared."""
  calls = []
  common.run_stage("s", _counting_fn(calls), _cfg(benchmark={"ks": [1, 2], "temperature": 0.7}),
                   tmp_path / "a")
  common.run_stage("s", _counting_fn(calls), _cfg(benchmark={"temperature": 0.7}),
                   tmp_path / "a")  # reused
  with pytest.raises(ValueError, match=r"benchmark.temperature: was 0.7, now 1.0"):
    common.run_stage("s", _counting_fn(calls), _cfg(benchmark={"temperature": 1.0}),
                     tmp_path / "a")
  with pytest.raises(ValueError, match=r"benchmark.ks: was \[1, 2\], now \[1, 2, 4\]"):
    common.run_stage("s", _counting_fn(calls),
                     _cfg(benchmark={"ks": [1, 2, 4], "temperature": 0.7}), tmp_path / "a")
  assert len(calls) == 1


def test_grm_stage_configs_hold_the_benchmark_sampling_fields_only():
  from experiments import grm as grm_job
  from experiments.configs import grm as grm_config
  c = grm_config.get_config("tiny")
  kept = grm_job._without(c.benchmark, "benchmark", grm_job.BENCHMARK_ONLY)
  assert set(kept) == set(c.benchmark) - {"ks", "ks_by_stage", "bootstrap_samples"}
  assert all(kept[k] == c.benchmark[k] for k in kept)
  assert "ks" in c.benchmark  # the job's own config is left whole
  assert grm_job._without(c.rft, "rft", grm_job.BENCHMARK_ONLY) is c.rft
