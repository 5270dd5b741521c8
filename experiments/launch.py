r"""Runs one experiment: ``python -m experiments.launch --config=FILE.py:ARG --workdir=DIR``.

Flags:
  --config=experiments/configs/NAME.py:tiny   the config file and its argument
  --config.a.b=value                          overrides (unknown fields and
                                              wrong types fail with the field named)
  --workdir=DIR                               where the run writes everything
  --jobs_module=pkg.mod                       (repeatable) modules imported
                                              first; they may register extra jobs
  --jax_distributed                           call jax.distributed.initialize() with
                                              cluster auto-detection (Cloud TPU, SLURM)
  --allow_config_change=a.b,c                 config fields (or groups) a relaunch may
                                              change against DIR/config.json and the
                                              checkpoints' configs (each change logged)
  --rerun_downstream                          rerun pipeline stages whose upstream
                                              stages changed instead of refusing them
  --fall_back_on_corrupt                      resume from the previous checkpoint when
                                              the latest fails its checksums

Without --jax_distributed, ``opd.parallel.distributed.initialize_from_env()`` joins a
multi-process job described by ``OPD_COORDINATOR``, ``OPD_NUM_PROCESSES`` and
``OPD_PROCESS_ID`` (and does nothing when they are unset).

The launcher takes DIR's lock (one run per workdir: a second launch is
refused naming the holder), compares the resolved config with the
``DIR/config.json`` of an earlier launch (every differing field is named),
runs the job's start-up checks, then writes ``DIR/config.json``, runs the job
named by ``config.job`` (see ``experiments/jobs.py``) and writes the metrics
it returns to ``DIR/final_metrics.json``. Both files are written atomically,
by the main process only.
"""
from __future__ import annotations

import importlib
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from experiments import jobs
from opd.config import overrides as config_utils
from opd.training import loop
from opd.training import workdir as workdir_lib
from opd.training.files import atomic_write_json

CONFIG_FILE = "config.json"
FINAL_METRICS_FILE = "final_metrics.json"


def _final_metrics_json(metrics: Any, job: str) -> dict[str, Any]:
  if not isinstance(metrics, Mapping):
    raise ValueError(f"job {job!r} must return a dict of final metrics, got {type(metrics).__name__}")
  out = {}
  for key, value in metrics.items():
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
      value = value.item()  # numpy / jax scalars
    try:
      json.dumps(value)
    except (TypeError, ValueError):
      raise ValueError(f"job {job!r} returned final metric {key!r}={value!r}, "
                       "which is not JSON-serialisable") from None
    out[str(key)] = value
  return out


def launch(config, workdir: str | pathlib.Path, *, jobs_modules: Sequence[str] = (),
           allow_config_change: Sequence[str] = (), rerun_downstream: bool = False,
           fall_back_on_corrupt: bool = False) -> dict:
  """Runs ``config.job`` in ``workdir`` and returns its final metrics.

  The main process holds the workdir's lock (``opd.training.workdir``) from
  before it reads anything there until the job returns or fails, so a second
  launch on the same directory is refused with the holder named. Before the
  job starts, the whole resolved config is compared with the ``config.json``
  an earlier launch left (fields outside ``allow_config_change`` that differ
  are refused, all named) and the job's own start-up checks run
  (``jobs.validate``); only then is ``config.json`` written, atomically.

  Args:
    config: the resolved ``ml_collections.ConfigDict``; it is locked before
      the job sees it, so a misspelt new field raises instead of being added.
    workdir: the run directory (created if missing).
    jobs_modules: modules to import before looking up the job.
    allow_config_change: dotted config fields (or groups) a relaunch may
      change, e.g. ``("train.steps",)``; each change is logged. They pass on
      to every training loop's resume check
      (``opd.training.loop.allowed_config_changes``).
    rerun_downstream: a pipeline stage whose upstream stages changed is
      rerun (its old directory moved aside) instead of refused.
    fall_back_on_corrupt: a training loop whose latest checkpoint fails its
      checksums resumes from the previous one (the corrupt one moved aside).

  Returns:
    The job's final metrics, as written to ``workdir/final_metrics.json``.
  """
  for module in jobs_modules:
    importlib.import_module(module)
  if "job" not in config:
    raise ValueError(f"the config has no field 'job'; set config.job to one of "
                     f"{sorted(jobs.known_jobs())}")
  job = jobs.get_job(config.job)
  from experiments import common  # noqa: PLC0415 (imports jax)
  from opd.training.metrics_writer import is_main_process  # noqa: PLC0415
  workdir = pathlib.Path(workdir)
  main = is_main_process()
  lock = workdir_lib.WorkdirLock(workdir) if main else None
  if lock is not None:
    lock.acquire()
  try:
    resolved = config_utils.config_to_dict(config)
    if main:
      workdir_lib.check_config(workdir, resolved, allow_change=allow_config_change)
    config.lock()
    jobs.validate(config)
    if main:
      workdir_lib.record_config(workdir, resolved)
    with common.stage_options(rerun_downstream=rerun_downstream), loop.allowed_config_changes(
        allow_config_change, fall_back_on_corrupt=fall_back_on_corrupt):
      metrics = _final_metrics_json(job(config, str(workdir)), config.job)
    if main:
      atomic_write_json(workdir / FINAL_METRICS_FILE, metrics, sort_keys=True)
  finally:
    if lock is not None:
      lock.release()
  return metrics


def _config_overrides(argv: Sequence[str]) -> tuple[str | None, list[str]]:
  """The ``--config`` spec and the ``--config.x=y`` overrides in ``argv``."""
  spec, overrides = None, []
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg.startswith("--config="):
      spec = arg[len("--config="):]
    elif arg == "--config" and i + 1 < len(args):
      spec = args[i + 1]
    elif arg.startswith("--config.") and "=" in arg:
      overrides.append(arg[len("--config."):])
  return spec, overrides


def explain_flag_error(argv: Sequence[str]) -> str | None:
  """Re-checks ``--config.*`` overrides to name the bad field, or returns None."""
  spec, overrides = _config_overrides(argv)
  if spec is None or not overrides:
    return None
  try:
    config_utils.apply_overrides(config_utils.load_config(spec), overrides)
  except ValueError as e:
    return str(e)
  return None


def parse_flags_or_exit(argv: Sequence[str]) -> list[str]:
  """absl flag parsing whose errors name the config field at fault.

  config_flags reports an unknown ``--config.foo=1`` as a bare
  ``AttributeError: 'foo'`` traceback (ml-collections 1.1.0); this replays
  the overrides through ``config_utils.apply_overrides`` to say which field
  and value are wrong.
  """
  try:
    return flags.FLAGS(list(argv))
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    message = explain_flag_error(argv) or f"{type(e).__name__}: {e}"
    print(f"FATAL Flags parsing error: {message}", file=sys.stderr)
    sys.exit(2)


def _define_flags():
  config = config_flags.DEFINE_config_file("config", None, "Config file, e.g. "
                                           "experiments/configs/NAME.py:tiny", lock_config=True)
  workdir = flags.DEFINE_string("workdir", None, "Run directory.", required=True)
  modules = flags.DEFINE_multi_string("jobs_module", [], "Modules to import before dispatch "
                                      "(they may call experiments.jobs.register).")
  distributed = flags.DEFINE_bool("jax_distributed", False,
                                  "Call jax.distributed.initialize() first (multi-host with "
                                  "cluster auto-detection).")
  allow = flags.DEFINE_list("allow_config_change", [], "Config fields (or groups) a relaunch "
                            "may change against the workdir's config.json, e.g. train.steps.")
  rerun = flags.DEFINE_bool("rerun_downstream", False, "Rerun pipeline stages whose upstream "
                            "stages changed (their old directories are moved aside) instead of "
                            "refusing them.")
  fall_back = flags.DEFINE_bool("fall_back_on_corrupt", False, "Resume from the previous "
                                "checkpoint when the latest fails its checksums.")
  return config, workdir, modules, distributed, allow, rerun, fall_back


def main() -> None:
  config, workdir, modules, distributed, allow, rerun, fall_back = _define_flags()
  flags.mark_flags_as_required(["config"])

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}")
    from experiments.common import enable_compilation_cache
    enable_compilation_cache()
    if distributed.value:
      import jax
      jax.distributed.initialize()
    else:
      from opd.parallel import distributed as opd_distributed
      opd_distributed.initialize_from_env()
    metrics = launch(config.value, workdir.value, jobs_modules=modules.value,
                     allow_config_change=allow.value, rerun_downstream=rerun.value,
                     fall_back_on_corrupt=fall_back.value)
    print(json.dumps(metrics, sort_keys=True))

  app.run(run, flags_parser=parse_flags_or_exit)


if __name__ == "__main__":
  main()
