"""``experiments.common.check_upstream``: a finished stage older than a rerun upstream stage is stale."""
import os

import pytest

from experiments import common
from experiments import gencluster, mathv2


def _finish(root, name, t):
  d = root / name
  d.mkdir(parents=True, exist_ok=True)
  (d / common.FINAL).write_text("{}")
  os.utime(d / common.FINAL, ns=(t, t))


def test_stale_only_when_an_upstream_finished_later(tmp_path):
  _finish(tmp_path, "a", 1_000)
  _finish(tmp_path, "b", 2_000)
  common.check_upstream(tmp_path, "b", ("a",))            # b read a: fresh
  common.check_upstream(tmp_path, "c", ("a", "b"))        # c not finished: nothing to check
  common.check_upstream(tmp_path, "b", ("a", "missing"))  # an unfinished upstream passes
  _finish(tmp_path, "a", 3_000)                           # a rerun after b
  with pytest.raises(ValueError, match=r"b finished before its upstream stage\(s\) a were rerun"):
    common.check_upstream(tmp_path, "b", ("a",))
  common.check_upstream(tmp_path, "b", ())                # b declares no upstream: not checked


@pytest.mark.parametrize("job", [mathv2, gencluster], ids=lambda j: j.__name__)
def test_every_upstream_stage_runs_earlier(job):
  order = [name for name, _, _ in job.STAGES]
  for name, ups in job.UPSTREAM.items():
    assert name in order and ups, name
    assert all(u in order and order.index(u) < order.index(name) for u in ups), (name, ups)
