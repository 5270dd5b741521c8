"""Runs untrusted programs in a subprocess with kernel-enforced isolation and resource limits.

``api`` is the caller's side; ``launcher`` is the child-side program, run by
file path with ``python -I -S`` and kept free of heavy imports.
"""
from opd.tasks.sandbox.api import (ISOLATION_LEVELS, UID_BASE, Sandbox, SandboxLimits,
                                   SandboxResult, isolation_report, probe_isolation)
