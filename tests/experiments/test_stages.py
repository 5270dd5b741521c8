"""``experiments.common.Stages``: finished stages of another run are read, never rerun or written."""
import dataclasses
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
  """A stage written before ``opd.loss.teacher_temperature`` existed ran with 1.0."""
  src, calls = tmp_path / "src", []
  old = ml_collections.ConfigDict({"job": "opd", "opd": {"loss": {"estimator": "full"}}})
  common.Stages.of(src).run("s", _counting_fn(calls), _cfg(**old), "a")
  assert common.ADDED_FIELDS["opd.loss.teacher_temperature"] == 1.0
  new = _cfg(**old)
  new.opd.loss.teacher_temperature = 1.0
  assert common.Stages.of(tmp_path / "dst", [src]).find(new, "a") == src / "a"
  common.run_stage("s", _counting_fn(calls), new, src / "a")  # resumes, does not refuse
  new.opd.loss.teacher_temperature = 0.5
  assert common.Stages.of(tmp_path / "dst", [src]).find(new, "a") is None
  with pytest.raises(ValueError, match=r"opd.loss.teacher_temperature: was '<missing>', now 0.5"):
    common.run_stage("s", _counting_fn(calls), new, src / "a")
  new.opd.loss.teacher_temperature = 1.0
  new.opd.other = 3  # a field not in the table is a mismatch when missing
  with pytest.raises(ValueError, match=r"opd.other: was '<missing>', now 3"):
    common.run_stage("s", _counting_fn(calls), new, src / "a")
  assert len(calls) == 1


def test_a_model_field_added_later_matches_under_any_model_group_only_when_off(tmp_path):
  """A stage saved before ``ModelConfig.v4`` / ``tokenizer`` existed ran a model
  without them: ``v4: None`` and ``tokenizer: 'byte'`` match under ``model``,
  ``student.model`` and ``teachers.<name>.model``; any other value does not."""
  src, calls = tmp_path / "src", []
  model = {"d_model": 8}
  old = {"job": "x", "model": dict(model), "student": {"model": dict(model)},
         "teachers": {"math": {"model": dict(model)}}}
  common.Stages.of(src).run("s", _counting_fn(calls), _cfg(**old), "a")
  new = _cfg(**old)
  for group in (new.model, new.student.model, new.teachers.math.model):
    group.v4, group.tokenizer = None, "byte"
  assert common.Stages.of(tmp_path / "dst", [src]).find(new, "a") == src / "a"
  new.teachers.math.model.tokenizer = "bpe:1024"
  assert common.Stages.of(tmp_path / "dst", [src]).find(new, "a") is None
  with pytest.raises(ValueError, match=r"teachers.math.model.tokenizer: was '<missing>', "
                                       r"now 'bpe:1024'"):
    common.run_stage("s", _counting_fn(calls), new, src / "a")
  new.teachers.math.model.tokenizer = "byte"
  new.v4 = None  # not under a model group: a mismatch when missing
  with pytest.raises(ValueError, match=r"v4: was '<missing>', now None"):
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
  # The benchmark's own fields (its k list, bootstrap, and the #27 yardstick switches:
  # constrained decoding, the content-blind control, swap-averaged pairwise) are read by
  # the benchmark stage alone; RFT and the meta-RM read only the sampling fields.
  assert set(kept) == set(c.benchmark) - {"ks", "ks_by_stage", "bootstrap_samples", "constrained",
                                          "content_blind", "pairwise_both_orders"}
  assert all(kept[k] == c.benchmark[k] for k in kept)
  assert "ks" in c.benchmark  # the job's own config is left whole
  assert grm_job._without(c.rft, "rft", grm_job.BENCHMARK_ONLY) is c.rft


# --- crash-safe records and content-addressed stages (issue 33) ------------------------------

def test_a_torn_stage_json_names_its_path(tmp_path):
  from opd.training.files import ResultFileError
  calls = []
  common.run_stage("s", _counting_fn(calls), _cfg(), tmp_path / "a")
  final = tmp_path / "a" / common.FINAL
  final.write_text(final.read_text()[:5])  # what an in-place write cut by a crash leaves
  with pytest.raises(ResultFileError, match=rf"result file '{final}' is not valid JSON"):
    common.run_stage("s", _counting_fn(calls), _cfg(), tmp_path / "a")
  part = tmp_path / "part.json"
  part.write_text('{"acc')
  with pytest.raises(ResultFileError, match=rf"result file '{part}' is not valid JSON"):
    common.cached_json(part, lambda: {"acc": 1})
  assert len(calls) == 1


def _chain(calls, lr=1e-3):
  """base -> sft -> grpo -> results (which reads base and grpo), each a counting stage."""
  def stage(name, *upstream):
    def fn(cfg, workdir):
      calls.append(name)
      return {"run": len(calls)}
    return common.Stage(name, fn, _cfg(lr=lr, job=name), upstream)
  return [stage("base"), stage("sft", "base"), stage("grpo", "sft"),
          stage("results", "base", "grpo")]


def test_a_rebuilt_base_refuses_the_stages_built_on_the_old_one(tmp_path):
  """Deleting base/ and relaunching used to retrain the base and reuse SFT,
  GRPO and the results built on the old one; now the launch is refused before
  anything runs, naming the stage and its upstream, or with
  ``--rerun_downstream`` every stage after the base reruns."""
  import shutil
  calls = []
  stages = common.Stages.of(tmp_path)
  first = stages.run_all(_chain(calls))
  assert calls == ["base", "sft", "grpo", "results"]
  assert common.Stages.of(tmp_path).run_all(_chain(calls)) == first and len(calls) == 4
  shutil.rmtree(tmp_path / "base")
  with pytest.raises(common.StaleStageError, match=r"stage 'sft' .* upstream stage\(s\) base "
                                                   r"will rerun"):
    stages.run_all(_chain(calls))
  assert len(calls) == 4 and not (tmp_path / "base").exists()  # refused before any work
  with common.stage_options(rerun_downstream=True):
    again = stages.run_all(_chain(calls))
  assert calls[4:] == ["base", "sft", "grpo", "results"]
  assert again == {f"{n}/run": 5 + i for i, n in enumerate(["base", "sft", "grpo", "results"])}
  aside = sorted(p.name.split(".stale-")[0] for p in tmp_path.glob("*.stale-*"))
  assert aside == ["grpo", "results", "sft"]  # the old results moved aside, not deleted


def test_an_upstream_rerun_under_the_same_config_is_detected_stage_by_stage(tmp_path):
  """The pipelines that build stages one by one (specialists, v4) pass the
  directories each stage reads: a rerun upstream changes its record's digest."""
  import shutil
  calls = []
  stages = common.Stages.of(tmp_path)
  _, base = stages.run("base", _counting_fn(calls), _cfg(), "base")
  stages.run("sft", _counting_fn(calls), _cfg(init=str(base)), "sft", [base])
  digest = common.record_digest(base)
  shutil.rmtree(base)
  stages.run("base", _counting_fn(calls), _cfg(), "base")  # same config, new run
  assert common.record_digest(base) != digest
  with pytest.raises(common.StaleStageError, match=rf"stage 'sft' .* upstream stage\(s\) {base} "
                                                   r"that changed"):
    stages.run("sft", _counting_fn(calls), _cfg(init=str(base)), "sft", [base])
  assert len(calls) == 3

  def interrupted(cfg, workdir):
    raise RuntimeError("killed")

  # A stage interrupted mid-run keeps the inputs it started on: resuming it
  # after its upstream changed is refused as well.
  with pytest.raises(RuntimeError, match="killed"):
    stages.run("grpo", interrupted, _cfg(), "grpo", [tmp_path / "sft"])
  shutil.rmtree(tmp_path / "sft")
  with common.stage_options(rerun_downstream=True):
    stages.run("sft", _counting_fn(calls), _cfg(init=str(base)), "sft", [base])
  with pytest.raises(common.StaleStageError, match=r"stage 'grpo'"):
    stages.run("grpo", _counting_fn(calls), _cfg(), "grpo", [tmp_path / "sft"])


def test_a_reused_stage_must_have_been_built_on_the_current_inputs(tmp_path):
  src, calls = tmp_path / "src", []
  _, base = common.Stages.of(src).run("base", _counting_fn(calls), _cfg(), "base")
  common.Stages.of(src).run("sft", _counting_fn(calls), _cfg(), "sft", [base])
  assert common.Stages.of(tmp_path / "dst", [src]).find(_cfg(), "sft", [base]) == src / "sft"
  (base / common.RECORD).unlink()
  (base / common.FINAL).unlink()
  common.run_stage("base", _counting_fn(calls), _cfg(), base)  # rebuilt in place
  assert common.Stages.of(tmp_path / "dst", [src]).find(_cfg(), "sft", [base]) is None


def test_stage_checks_run_before_the_first_stage(tmp_path):
  calls = []

  def check(cfg):
    raise ValueError(f"config.benchmark.ks={cfg.lr!r} bad")

  chain = _chain(calls)
  chain[-1] = dataclasses.replace(chain[-1], check=check)
  with pytest.raises(ValueError, match=r"config.benchmark.ks=0.001 bad"):
    common.Stages.of(tmp_path / "run").run_all(chain)
  assert not calls and not (tmp_path / "run").exists()


def test_steps_logged_counts_a_resumed_runs_steps_once(tmp_path):
  """experiments.common.steps_logged: distinct steps > 0 of metrics.jsonl (step 0
  is the eval before training; a step written twice, as a resume replays the
  rows after the checkpoint, counts once)."""
  import json  # noqa: PLC0415
  rows = [{"step": 0, "eval/x": 1.0}] + [{"step": s, "loss": 1.0} for s in (1, 2, 3, 4)]
  rows += [{"step": 4, "eval/x": 0.5}] + [{"step": s, "loss": 0.9} for s in (5, 6)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert common.steps_logged(tmp_path) == 6
  assert common.steps_logged(tmp_path / "nowhere") == 0
