"""Test-only job ``gated_line_fit``: ``line_fit_job.run`` held open until the test says go.

It writes ``$GATE_DIR/started`` once it runs (so the test knows the launcher
holds the workdir) and waits for ``$GATE_DIR/go`` before fitting. Launch it
with ``--jobs_module=gated_job --config.job=gated_line_fit`` and this
directory on ``PYTHONPATH``.
"""
import os
import pathlib
import time

import line_fit_job
from experiments import jobs

WAIT_S = 300  # a test that never says go fails instead of hanging


def run(config, workdir):
  gate = pathlib.Path(os.environ["GATE_DIR"])
  (gate / "started").write_text(str(os.getpid()))
  deadline = time.monotonic() + WAIT_S
  while not (gate / "go").exists():
    if time.monotonic() > deadline:
      raise TimeoutError(f"{gate / 'go'} did not appear within {WAIT_S} s")
    time.sleep(0.05)
  return line_fit_job.run(config, workdir)


jobs.register("gated_line_fit", run)
