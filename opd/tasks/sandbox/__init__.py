"""Runs untrusted programs in a subprocess with kernel-enforced isolation and resource limits.

``api`` is the caller's side (``outcome`` reads and classifies a run,
``cgroup`` makes the per-run control groups); ``launcher`` is the child-side
program, run by file path with ``python -I -S`` and kept free of heavy
imports, and ``guard`` the audit hook it installs. ``batch`` runs many
programs with one set-up (``run_python_batch``), each still alone in its own
process, uid and work directory.
"""
from opd.tasks.sandbox.api import (ISOLATION_LEVELS, KERNEL_ISOLATION, UID_BASE,
                                   IsolationUnavailable, Sandbox, SandboxLimits, SandboxResult,
                                   isolation_report, probe_isolation)
from opd.tasks.sandbox.batch import run_python_batch
