"""Runs sandboxed programs as an unprivileged caller (``namespaces-user``), for
``test_sandbox_escapes.py``: started by a root test under another uid with an
interpreter that uid can read.

Usage: ``python -I sandbox_user_driver.py REPO SITE_PACKAGES`` with a JSON
request on stdin, ``{"guard": bool, "single": [source...], "batch": [source...],
"allow_all_filter": bool}`` (the last replaces the seccomp filter by one that
allows every call, to test the layers under it);
prints ``{"isolation": level, "single": [result...], "batch": [result...]}``
with each ``SandboxResult`` as a dict. ``opd.tasks`` is entered as a bare
namespace so that only the sandbox package (and ``opd.config.fields``) load.
"""
import dataclasses
import json
import os
import sys
import types

# One BPF instruction, ``ret SECCOMP_RET_ALLOW`` (code BPF_RET | BPF_K = 6).
ALLOW_ALL = (6).to_bytes(2, "little") + b"\0\0" + (0x7FFF0000).to_bytes(4, "little")


def main(repo: str, site_packages: str):
  sys.path[:0] = [repo]
  sys.path.append(site_packages)
  for name in ("opd", "opd.tasks"):  # packages without their __init__'s imports
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(repo, *name.split("."))]
    sys.modules[name] = module
  from opd.tasks.sandbox import Sandbox, SandboxLimits, run_python_batch, seccomp
  request = json.load(sys.stdin)
  if request.get("allow_all_filter"):
    seccomp.program_filter = lambda: ALLOW_ALL
  sandbox = Sandbox(SandboxLimits(cpu_s=2, wall_s=3.0), isolation="namespaces-user",
                    python_guard=request["guard"])
  single = [dataclasses.asdict(sandbox.run_python(s)) for s in request["single"]]
  batch = [dataclasses.asdict(r) for r in run_python_batch(sandbox, request["batch"])]
  json.dump({"isolation": sandbox.isolation, "enforced": sandbox.enforced, "single": single,
             "batch": batch}, sys.stdout)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
