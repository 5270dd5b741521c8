"""Calls climb back up at most twice from a job's entry to its end point (#24, docs/DESIGN.md §1).

``tools/call_paths.py`` runs a job under ``sys.setprofile`` and records, at
every call that enters the job's end point from outside it, the stack of repo
frames (``pallas_kernels/``, ``opd/``, ``grm/``, ``experiments/``), outermost
first. A *climb* is a consecutive caller -> callee pair whose callee ranks
higher than the caller, with ``tests/test_layering.py``'s ranks (layers
``pallas_kernels`` < ``opd`` < ``grm`` < ``experiments``; inside ``opd`` the
subpackages by rank). Every recorded stack may climb at most ``MAX_CLIMBS``
times:

* the OPD job (``experiments/configs/distill.py:tiny``, ``run_opd``), end
  point every call into ``pallas_kernels/``, traced from ``launch``;
* the GRM benchmark (``experiments/grm_benchmark.py``'s ``stage_benchmark``)
  on a run directory made here with random tiny models for every stage it
  reads (the tiny job's config; the whole tiny job takes minutes), end points
  the judges' model forward (``opd/models/``) and the voting
  (``grm/voting.py``). The frames above ``stage_benchmark`` in a real launch
  (``launch`` -> the ``grm`` job -> the stage runner) are all in
  ``experiments/``: they cannot climb (``python tools/call_paths.py grm``
  traces the whole job).

The checker itself must be able to fail: a planted callback chain that climbs
three times is caught.
"""
import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

import test_layering  # tests/ (on sys.path via conftest.py)
from subprocess_env import one_device_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_CLIMBS = 2


def _load(name: str, path: pathlib.Path, register=sys.modules.__setitem__):
  """The module at ``path``, registered as ``name`` by ``register(name, module)``."""
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  register(name, module)
  spec.loader.exec_module(module)
  return module


call_paths = _load("call_paths", ROOT / "tools" / "call_paths.py")


def _too_high(stacks) -> list[str]:
  return [f"{len(call_paths.climbs(s))} climbs:\n" + "\n".join(
      f"  {p} {f}" for p, f in s) for s in stacks if len(call_paths.climbs(s)) > MAX_CLIMBS]


def test_ranks_are_the_layering_tests():
  assert call_paths.TOP == test_layering.TOP and call_paths.OPD == test_layering.OPD
  assert call_paths.rank("opd/distill/loss.py") > call_paths.rank("opd/training/loop.py")
  assert call_paths.rank("opd/helpers.py") == call_paths.rank("opd/config/fields.py")
  with pytest.raises(ValueError, match=r"path='tools/x.py' is not under one of"):
    call_paths.rank("tools/x.py")


# A callback chain planted in a fake repo: the job hands a callback to a driver
# in opd/training, which calls it in opd/distill (climb 1: training ranks 2,
# distill 5); that hands one to the driver again (down), which calls it in grm
# (climb 2: opd < grm); that hands one to the driver (down), which calls it in
# experiments (climb 3: grm < experiments); that calls the kernel, which calls
# its own helper (inside the end point: not a second stack).
PLANTED = {
    "pallas_kernels/kern.py": """
        def kernel(x):
          return helper(x) + 1
        def helper(x):
          return x
        """,
    "opd/training/drive.py": """
        def drive(callback, x):
          return callback(x)
        """,
    "opd/distill/cb.py": """
        import sys
        def cb(x):
          return sys.modules["plant_drive"].drive(sys.modules["plant_grm"].cb, x)
        """,
    "grm/cb.py": """
        import sys
        def cb(x):
          return sys.modules["plant_drive"].drive(sys.modules["plant_exp"].cb, x)
        """,
    "experiments/cb.py": """
        import sys
        def cb(x):
          return sys.modules["plant_kern"].kernel(x)
        def job(x):
          return sys.modules["plant_drive"].drive(sys.modules["plant_distill"].cb, x)
        """,
}


def test_a_planted_chain_that_climbs_three_times_is_caught(tmp_path, monkeypatch):
  names = {}
  for rel, source in PLANTED.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(textwrap.dedent(source))
  for name, rel in [("plant_kern", "pallas_kernels/kern.py"),
                    ("plant_drive", "opd/training/drive.py"),
                    ("plant_distill", "opd/distill/cb.py"), ("plant_grm", "grm/cb.py"),
                    ("plant_exp", "experiments/cb.py")]:
    names[name] = _load(name, tmp_path / rel,  # removed from sys.modules after the test
                        lambda n, m: monkeypatch.setitem(sys.modules, n, m))
  paths = call_paths.CallPaths(lambda path, fn: path.startswith("pallas_kernels/"),
                               root=tmp_path)
  with paths:
    assert names["plant_exp"].job(1) == 2
  expected = (("experiments/cb.py", "job"), ("opd/training/drive.py", "drive"),
              ("opd/distill/cb.py", "cb"), ("opd/training/drive.py", "drive"),
              ("grm/cb.py", "cb"), ("opd/training/drive.py", "drive"),
              ("experiments/cb.py", "cb"), ("pallas_kernels/kern.py", "kernel"))
  assert dict(paths.stacks) == {expected: 1}  # helper() is inside the end point
  assert call_paths.climbs(expected) == [1, 3, 5]
  assert len(_too_high(paths.stacks)) == 1
  # Filtered on a file no stack passes through: nothing is recorded.
  other = call_paths.CallPaths(lambda path, fn: path.startswith("pallas_kernels/"),
                               via="experiments/none.py", root=tmp_path)
  with other:
    names["plant_exp"].job(1)
  assert not other.stacks


def test_the_opd_job_climbs_at_most_twice_to_the_kernel(tmp_path):
  # One device, as a CLI job (in this process the 8 fake devices would shard
  # the tiny batch 8 ways).
  out = tmp_path / "stacks.json"
  cmd = [sys.executable, str(ROOT / "tools" / "call_paths.py"), "opd",
         f"--workdir={tmp_path / 'opd'}", f"--json={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=one_device_env(), cwd=ROOT,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  stacks = [tuple(tuple(f) for f in row["stack"]) for row in json.loads(out.read_text())]
  assert stacks, "the tiny OPD job never called pallas_kernels/"
  assert all(s[0] == ("experiments/launch.py", "launch") for s in stacks)
  assert any(s[-1][0] == "pallas_kernels/train_loss.py" for s in stacks)
  assert not _too_high(stacks), "\n".join(_too_high(stacks))
  assert "most climbs" in proc.stdout.splitlines()[-1]


def _grm_run(root: pathlib.Path):
  """A ``grm`` run directory holding what the benchmark stage reads, with random
  tiny models for every stage; returns the job context."""
  from experiments import common, grm_common
  from experiments.baselines import save_model
  from experiments.configs import grm as grm_config
  from grm.data import PreferenceGroup
  from opd.models import init_params

  config = grm_config.get_config("tiny")
  ctx = common.JobContext.for_run(config, root)
  head = ctx.model_cfg.replace(scalar_head=True)
  for i, (stage, cfg) in enumerate([*[(s, ctx.model_cfg) for s in grm_common.GRM_STAGES],
                                    (grm_common.SHARED, head), ("bt_rm", head),
                                    ("pairwise", ctx.model_cfg), ("meta_rm", head)]):
    save_model(root / stage / "checkpoints", cfg, init_params(cfg, jax.random.key(i)), config)
  groups = {
      "train": [PreferenceGroup("math", "m0", "train", "1+1?", ("2",), (10.0,), ("ok",))],
      "test": [PreferenceGroup("math", "m1", "test", "2+2?", ("4", "5"), (1.0, 0.0),
                               ("ok", "wrong")),
               PreferenceGroup("instruct", "i1", "test", "Say hi.", ("hi",), (9.0,), ("ok",))]}
  (root / "data").mkdir(parents=True)
  (root / "data" / "groups.json").write_text(json.dumps(
      {s: [dataclasses.asdict(g) for g in gs] for s, gs in groups.items()}))
  (root / "data" / "subsets.json").write_text(json.dumps({"reasoning": ["m1"], "chat": ["i1"]}))
  (root / "rft").mkdir(exist_ok=True)  # holds its checkpoints already
  (root / "rft" / common.FINAL).write_text("{}")
  (root / "benchmark").mkdir()
  return ctx


def test_the_grm_benchmark_climbs_at_most_twice_to_the_forward_and_the_vote(tmp_path):
  from experiments import grm_benchmark
  ctx = _grm_run(tmp_path)
  job = call_paths.JOBS["grm"]
  with call_paths.CallPaths(job.end_point, via=job.via) as paths:
    grm_benchmark.stage_benchmark(ctx, tmp_path / "benchmark")
  stacks = paths.stacks
  assert stacks, "the benchmark never reached its end points"
  assert all(s[0] == ("experiments/grm_benchmark.py", "stage_benchmark") for s in stacks)
  ends = {s[-1][0].split("/")[0] + "/" + s[-1][0].split("/")[1] for s in stacks}
  assert ends == {"opd/models", "grm/voting.py"}, ends
  assert not _too_high(stacks), "\n".join(_too_high(stacks))
