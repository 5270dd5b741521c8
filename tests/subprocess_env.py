"""The environment for the tests' subprocesses (not a test module).

``one_device_env()``: the test process's environment without the eight fake
devices that tests/conftest.py asks for (a job launched through the CLI runs
on one CPU device, as a user's would), keeping every other XLA flag: the
optimisation level conftest sets and, under ``../shared/tools/perturbed-tests``,
its ``--xla_cpu_max_isa``.
"""
import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count"

# XLA CPU flags that make the tests' tiny programs compile ~2.5x faster
# (docs/LOG.md, 2026-12-02): optimisation level 0, and the classic loop
# emitters instead of the fusion emitters (together: a tiny training step
# 5.5 -> 1.5 s of compile; the tiny V4 pipeline with an empty compilation
# cache 230 -> 88 CPU s). The fusion-emitter flag is only a gain at level 0
# (at the default level it compiles slower), so the two go together.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def with_fast_compile(flags: str) -> str:
  """``flags`` plus :data:`FAST_COMPILE_FLAGS` unless they set a level."""
  if "--xla_backend_optimization_level" in flags:
    return flags
  return f"{flags} {FAST_COMPILE_FLAGS}".strip()


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
