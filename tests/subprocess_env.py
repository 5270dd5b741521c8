"""The environment for the tests' subprocesses (not a test module).

``one_device_env()``: the test process's environment without the eight fake
devices that tests/conftest.py asks for (a job launched through the CLI runs
on one CPU device, as a user's would), keeping every other XLA flag: the
optimisation level conftest sets and, under ``../shared/tools/perturbed-tests``,
its ``--xla_cpu_max_isa``.
"""
import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_without_device_count(flags: str) -> str:
  return " ".join(f for f in flags.split() if not f.startswith(_DEVICE_FLAG))


def one_device_env(**extra: str) -> dict[str, str]:
  env = dict(os.environ)
  flags = xla_flags_without_device_count(env.get("XLA_FLAGS", ""))
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  env.update(extra)
  return env
