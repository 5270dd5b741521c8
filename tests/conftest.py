"""Test-wide set-up.

Eight fake CPU devices are requested here, once, before anything imports jax,
so that mesh tests can build (8,1,1), (2,2,2) and (1,4,2) meshes. Tests that
need a single device use ``jax.devices()[:1]`` explicitly.
"""
import os

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests' models are tiny, so compiling dominates their time: XLA's CPU
# backend at optimisation level 0 with the loop emitters compiles them ~2.5x
# faster and runs these sizes no slower (tests/subprocess_env.py,
# docs/LOG.md). Numerics are the same float32 operations in possibly another
# order, which every tolerance here must absorb anyway. Subprocesses inherit
# the flags; set a level in XLA_FLAGS to override both.
from subprocess_env import with_fast_compile  # noqa: E402  (tests/, no jax import)

os.environ["XLA_FLAGS"] = with_fast_compile(os.environ["XLA_FLAGS"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep each xdist worker to one intra-op thread pool of reasonable size.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")

# Property tests draw the same examples on every machine and every run, so a
# CI result never depends on luck; HYPOTHESIS_PROFILE=explore draws fresh ones
# (see docs/DEVELOPING.md).
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
_hyp_settings.register_profile("explore", derandomize=False, print_blob=True)
_hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
