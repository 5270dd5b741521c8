"""XLA flags for the tests and the environment of their subprocesses (not a test module).

``FAST_COMPILE_FLAGS`` are what tests/conftest.py adds to ``XLA_FLAGS``.
``device_env(n)`` is the test process's environment with ``n`` fake CPU
devices instead of conftest's eight (None: XLA's one), keeping every other
XLA flag: the fast-compile flags and, under ``../shared/tools/perturbed-tests``,
its ``--xla_cpu_max_isa``. ``one_device_env()`` is what a job launched through
the CLI gets: one CPU device, as a user's run would.
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


def device_env(devices: int | None = None, **extra: str) -> dict[str, str]:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
  if devices is not None:
    flags.append(f"{_DEVICE_FLAG}={devices}")
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  env.update(extra)
  return env


def one_device_env(**extra: str) -> dict[str, str]:
  return device_env(None, **extra)
