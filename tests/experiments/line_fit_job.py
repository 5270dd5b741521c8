"""A small real job for the launcher and sweep tests: fit y = a x + b by gradient descent.

Importing this module registers it as job ``line_fit`` (launch it with
``--jobs_module=line_fit_job`` and this directory on ``PYTHONPATH``).
"""
import numpy as np

from experiments import jobs
from opd.training.metrics_writer import MetricWriter


def make_data(config):
  rng = np.random.default_rng(config.seed)
  x = rng.uniform(-1.0, 1.0, size=config.data.n)
  y = config.data.slope * x + config.data.intercept + config.data.noise * rng.normal(size=x.shape)
  return x, y


def run(config, workdir):
  """Full-batch gradient descent on the mean squared error; logs every step."""
  if not config.optim.lr > 0:
    raise ValueError(f"config.optim.lr must be > 0, got {config.optim.lr}")
  x, y = make_data(config)
  a = b = 0.0
  with MetricWriter(workdir) as writer:
    for step in range(config.train.steps):
      err = a * x + b - y
      writer.write_scalars(step, {"loss": np.mean(err ** 2)})
      a -= config.optim.lr * 2 * np.mean(err * x)
      b -= config.optim.lr * 2 * np.mean(err)
    final_loss = float(np.mean((a * x + b - y) ** 2))
    writer.write_scalars(config.train.steps, {"loss": final_loss})
  return {"final_loss": final_loss, "slope": a, "intercept": b}


jobs.register("line_fit", run)
