"""Registry of the jobs ``experiments.launch`` can run, by ``config.job`` name.

A job is a function ``run(config, workdir) -> dict`` of final metrics (names
to numbers). Jobs are registered as ``"module:function"`` paths and imported
only when launched, so listing or launching one job never imports the code
(and heavy dependencies) of the others.

The built-in names point at the modules that implement the pipeline stages of
docs/DESIGN.md §3/§5; other code (an extension, a test) adds its own with
``register(name, target)``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Union

JobFn = Callable[[Any, str], dict]
Target = Union[str, JobFn]

# name -> "module:function" (or a callable registered at run time)
_JOBS: dict[str, Target] = {
    "pretrain": "experiments.pretrain:run",
    "sft": "experiments.sft:run",
    "grpo": "experiments.grpo:run",
    "specialists": "experiments.specialists:run",
    "cold_start": "experiments.distill:run_cold_start",
    "opd": "experiments.distill:run_opd",
    "v4": "experiments.v4:run",
    "compat": "experiments.compat:run",
    "baselines": "experiments.baselines:run_baselines",
    "merge": "experiments.baselines:run_merge",
    "task_arithmetic": "experiments.baselines:run_task_arithmetic",
    "offpolicy_kd": "experiments.baselines:run_offpolicy_kd",
    "mixed_rl": "experiments.baselines:run_mixed_rl",
    "sequential_rl": "experiments.baselines:run_sequential_rl",
    "grm": "experiments.grm:run",
    "grm_reward": "experiments.grm_reward:run",
    "mathv2": "experiments.mathv2:run",
    "gencluster": "experiments.gencluster:run",
    "opd_forms": "experiments.opd_forms_experiment:run",
}

# name -> "module:function" of its job-start check (``validate``), where it has one.
_CHECKS: dict[str, Target] = {
    "pretrain": "experiments.job_checks:check_lm",
    "sft": "experiments.job_checks:check_lm",
    "grpo": "experiments.job_checks:check_grpo",
    "specialists": "experiments.job_checks:check_specialists",
    "cold_start": "experiments.job_checks:check_cold_start",
    "opd": "experiments.job_checks:check_opd",
    "v4": "experiments.job_checks:check_v4",
    "compat": "experiments.job_checks:check_compat",
    "baselines": "experiments.job_checks:check_baselines",
    "offpolicy_kd": "experiments.job_checks:check_baselines",
    "mixed_rl": "experiments.job_checks:check_baselines",
    "sequential_rl": "experiments.job_checks:check_baselines",
    "grm": "experiments.job_checks:check_grm",
}


def _describe(target: Target) -> str:
  if isinstance(target, str):
    return target
  return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def register(name: str, target: Target, *, overwrite: bool = False,
             check: Target | None = None) -> None:
  """Adds a job.

  Args:
    name: the value of ``config.job`` that selects it.
    target: ``"package.module:function"`` (imported lazily) or the function.
    overwrite: replace an existing job of that name; otherwise registering a
      different target under a taken name raises (re-registering the same
      target, e.g. when a module is imported twice, is fine).
    check: its job-start check, ``check(config)`` raising ``ValueError``
      (``"module:function"`` or the function; see ``validate``).
  """
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"job name must be an identifier, got {name!r}")
  if isinstance(target, str):
    module, sep, fn = target.partition(":")
    if not sep or not module or not fn:
      raise ValueError(f"job target must look like 'package.module:function', got {target!r}")
  elif not callable(target):
    raise ValueError(f"job target for {name!r} must be a 'module:function' string or "
                     f"callable, got {target!r}")
  if name in _JOBS and not overwrite and _describe(_JOBS[name]) != _describe(target):
    raise ValueError(f"job {name!r} is already registered as {_describe(_JOBS[name])}; "
                     f"pass overwrite=True to replace it with {_describe(target)}")
  _JOBS[name] = target
  if check is not None:
    _CHECKS[name] = check


def known_jobs() -> dict[str, str]:
  """Name -> ``module:function`` of every registered job."""
  return {name: _describe(t) for name, t in sorted(_JOBS.items())}


def validate(config) -> None:
  """Runs ``config.job``'s job-start check (every config group the job, and each
  stage of a pipeline, will read; ``experiments.job_checks``), if it has one.
  The launcher calls it before it records the config or starts the job."""
  if config.job in _CHECKS:
    _resolve(config.job, _CHECKS[config.job])(config)


def get_job(name: str) -> JobFn:
  """Imports and returns the job function registered as ``name``."""
  if name not in _JOBS:
    raise ValueError(f"unknown job {name!r} (config.job); known jobs: {sorted(_JOBS)}")
  return _resolve(name, _JOBS[name])


def _resolve(name: str, target: Target) -> JobFn:
  if callable(target):
    return target
  module_name, _, fn_name = target.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      raise ValueError(f"job {name!r} is registered as {target}, but module {e.name!r} "
                       f"does not exist") from e
    raise
  fn = getattr(module, fn_name, None)
  if not callable(fn):
    raise ValueError(f"job {name!r}: module {module_name!r} has no function {fn_name!r}")
  return fn
