"""Upstream checks of stages finished before stage records existed, and the pipelines' upstream tables.

A stage directory written before ``stage.json`` records holds only
``config.json`` and ``final_metrics.json``: it is stale when one of its
upstream stages finished after it (the old ``check_upstream`` rule), and
otherwise adopted (its record written with the inputs as they are now).
"""
import os

import ml_collections
import pytest

from experiments import common
from experiments import gencluster, grm, mathv2


def _finish(root, name, t):
  d = root / name
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text('{"job": "x"}')
  (d / common.FINAL).write_text("{}")
  os.utime(d / common.FINAL, ns=(t, t))
  return d


def test_a_stage_without_a_record_is_stale_only_when_an_upstream_finished_later(tmp_path):
  a, b = _finish(tmp_path, "a", 1_000), _finish(tmp_path, "b", 2_000)
  assert common.stale_inputs(b, [a]) == []                     # b read a: fresh
  assert common.stale_inputs(tmp_path / "c", [a, b]) == []     # c never ran
  assert common.stale_inputs(b, [a, tmp_path / "missing"]) == []  # an unfinished upstream passes
  _finish(tmp_path, "a", 3_000)                                # a rerun after b
  assert common.stale_inputs(b, [a]) == [str(a)]
  assert common.stale_inputs(b, []) == []                      # b declares no upstream
  cfg = ml_collections.ConfigDict({"job": "x"})
  with pytest.raises(common.StaleStageError, match=rf"stage 'b' .* upstream stage\(s\) {a}"):
    common.run_stage("b", lambda c, w: {}, cfg, b, [a])
  _finish(tmp_path, "a", 1_000)
  assert common.run_stage("b", lambda c, w: {"rerun": 1}, cfg, b, [a]) == {}  # adopted, not rerun
  assert (b / common.RECORD).exists()
  assert common.stale_inputs(b, [a]) == []


@pytest.mark.parametrize("job", [mathv2, gencluster], ids=lambda j: j.__name__)
def test_every_upstream_stage_runs_earlier(job):
  order = [name for name, _, _ in job.STAGES]
  for name, ups in job.UPSTREAM.items():
    assert name in order and ups, name
    assert all(u in order and order.index(u) < order.index(name) for u in ups), (name, ups)


def test_grm_needs_name_earlier_stages():
  order = [name for name, _, _ in grm.STAGES]
  assert set(grm.NEEDS) == set(order)
  for name, ups in grm.NEEDS.items():
    assert all(order.index(u) < order.index(name) for u in ups), (name, ups)
  assert set(grm.READS_BASE) <= set(order)
