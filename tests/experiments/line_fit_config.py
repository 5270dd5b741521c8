"""Test-only config for the ``line_fit`` job of ``line_fit_job.py``.

  python -m experiments.launch --config=tests/experiments/line_fit_config.py:steps=200 \
      --workdir=/tmp/line_fit --jobs_module=line_fit_job   # with tests/experiments on PYTHONPATH
"""
import ml_collections

from opd.config import overrides as config_utils


def get_config(arg=None):
  arg = config_utils.parse_arg(arg, steps=100, tiny=False)
  config = ml_collections.ConfigDict()
  config.job = "line_fit"
  config.seed = 0
  config.data = ml_collections.ConfigDict(dict(n=64, slope=2.0, intercept=-1.0, noise=0.1))
  config.optim = ml_collections.ConfigDict(dict(lr=0.1))
  config.train = ml_collections.ConfigDict(dict(steps=10 if arg["tiny"] else arg["steps"]))
  return config


def get_sweep(arg=None):
  del arg
  # The last entry is meant to crash (the job rejects lr <= 0).
  return [{"optim.lr": 0.05}, {"optim.lr": 0.5}, {"optim.lr": -1.0}, {"optim.lr": 0.2}]
