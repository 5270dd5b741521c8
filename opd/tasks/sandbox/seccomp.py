"""The sandbox's seccomp-bpf filter: the kernel calls a program may not make.

Built once per caller process with libseccomp (through the ``pyseccomp``
binding) and exported as raw BPF; the launcher's worker loads those bytes
with ``prctl(PR_SET_SECCOMP)`` after dropping its privileges and before any
program code runs (``launcher._load_filter``), so the child needs neither
libseccomp nor the binding. The filter outlives ``execve`` and is inherited
by every process the program starts; it cannot be removed.

Every rule answers ``EPERM`` (``clone3`` answers ``ENOSYS``: its flags sit
behind a pointer no filter can read, and the C library then falls back to
``clone``, whose flags are checked). Everything else is allowed. What is
denied, and why:

* debugging other processes: ``ptrace``, ``process_vm_readv/writev``,
  ``pidfd_getfd``;
* kernel keyrings (state that would outlive the run): ``add_key``,
  ``keyctl``, ``request_key``;
* kernel attack surface a program never needs: ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``io_uring_setup/enter/register``, modules, ``kexec``,
  ``reboot``, swap, ``acct``, ``quotactl``, file handles;
* mounts: ``mount``, ``umount2``, ``pivot_root``, ``chroot`` and the new
  mount API (``open_tree``, ``move_mount``, ``fsopen``, ``fsconfig``,
  ``fsmount``, ``fspick``, ``mount_setattr``);
* namespaces: ``unshare``, ``setns`` and every ``CLONE_NEW*`` flag on ``clone``;
* sockets of any family but ``AF_UNIX`` (``socket``, ``socketpair``); the
  run's network namespace keeps Unix sockets to the run itself;
* signals to pid 1 (``kill``, ``tkill``, ``tgkill``, ``rt_sigqueueinfo``,
  ``rt_tgsigqueueinfo``) and to pid -1 (every process the caller may
  signal), and ``pidfd_send_signal`` altogether. In a
  pid namespace every other pid names a process of the run itself, and pid 1
  is the supervisor; outside one ("rlimits"), pids of other processes cannot
  be told apart by a filter and the per-run uid is what keeps the host's
  processes out of reach.

Foreign system-call ABIs (x32, i386 on x86_64) are not in the filter and
kill the process (libseccomp's default for an architecture it was not told
about).
"""
from __future__ import annotations

import errno
import tempfile
import threading

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "add_key", "keyctl", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl",
    "name_to_handle_at", "open_by_handle_at",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "unshare", "setns", "pidfd_send_signal")
CLONE_NAMESPACE_FLAGS = {"CLONE_NEWTIME": 0x80, "CLONE_NEWNS": 0x00020000,
                         "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                         "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
                         "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
AF_UNIX = 1
# First argument: the target pid (or thread group id).
PID_ARG_SYSCALLS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
_LOCK = threading.Lock()
_CACHE: dict[str, bytes | str] = {}


def _build() -> bytes:
  import pyseccomp as seccomp  # here: the binding loads libseccomp when imported

  f = seccomp.SyscallFilter(seccomp.ALLOW)
  deny = seccomp.ERRNO(errno.EPERM)
  for name in DENIED:
    f.add_rule(deny, name)
  f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
  for flag in CLONE_NAMESPACE_FLAGS.values():
    f.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
  for name in ("socket", "socketpair"):
    f.add_rule(deny, name, seccomp.Arg(0, seccomp.NE, AF_UNIX))
  for name in PID_ARG_SYSCALLS:
    # 32-bit pids: compare the low word only, so that -1 matches however it was widened.
    for pid in (1, 0xFFFFFFFF):
      f.add_rule(deny, name, seccomp.Arg(0, seccomp.MASKED_EQ, 0xFFFFFFFF, pid))
  with tempfile.TemporaryFile() as out:
    f.export_bpf(out)
    out.seek(0)
    return out.read()


def program_filter() -> bytes:
  """The filter as raw BPF (``struct sock_filter`` array), built once per process.

  Raises:
    OSError: libseccomp or the ``pyseccomp`` binding is missing or failed;
      the message says which (the sandbox then refuses to run, see
      ``opd.tasks.sandbox.api``).
  """
  with _LOCK:
    if "bpf" not in _CACHE and "error" not in _CACHE:
      try:
        _CACHE["bpf"] = _build()
      except (ImportError, OSError, RuntimeError, ValueError) as e:
        _CACHE["error"] = (f"cannot build the seccomp filter ({type(e).__name__}: {e}); "
                           "install libseccomp2 and `pip install pyseccomp`")
    if "error" in _CACHE:
      raise OSError(errno.ENOSYS, _CACHE["error"])
    return _CACHE["bpf"]  # type: ignore[return-value]


def problem() -> str | None:
  """None when the filter can be built here, else why not."""
  try:
    program_filter()
  except OSError as e:
    return e.strerror
  return None

