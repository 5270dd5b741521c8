"""The seccomp filter, one test per denied family of system calls.

Every call runs with the Python guard off (the filter must hold on its own)
through ``ctypes``/``socket``, at every level available here. A denied call
fails with ``EPERM`` (``clone3``: ``ENOSYS``, so that the C library falls
back to ``clone``), the program raises, and the sandbox reports the
program's own failure (``exit_code:1``), never ``ok`` and never an
infrastructure error. Each call below succeeds, or fails with another errno,
without the filter (noted per call where the kernel would refuse anyway and
the filter only makes sure), so a family whose rule is missing fails its test.
System-call numbers come from libseccomp's table for this machine.
"""
import errno

import pyseccomp
import pytest

from opd.tasks.sandbox import seccomp
from opd.tasks.sandbox.api import Sandbox, SandboxLimits, isolation_report

LIMITS = SandboxLimits(cpu_s=2, wall_s=3.0)
LEVELS = [level for level, state in isolation_report().items() if state == "available"]
_NR = {}

# The program's side: a raw system call that raises OSError on -1 (arguments
# as C longs / pointers so that 64-bit values and -1 survive).
PRELUDE = """
import ctypes, os, socket
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
def call(nr, *args):
  conv = [ctypes.c_char_p(a) if isinstance(a, bytes) else a if isinstance(a, ctypes._SimpleCData)
          or isinstance(a, ctypes.Array) else ctypes.c_long(a) for a in args]
  r = _libc.syscall(ctypes.c_long(nr), *conv)
  if r == -1:
    e = ctypes.get_errno()
    raise OSError(e, os.strerror(e))
  return r
buf = lambda n: ctypes.create_string_buffer(n)
"""
# Make the calls below reach their target (a user namespace where a mount
# would be allowed) when the filter is missing; ignored when denied.
IN_OWN_NAMESPACE = ("try:\n  call(NR['unshare'], 0x10000000 | 0x00020000)\n"
                    "except OSError:\n  pass\n")

# family -> [(label, program text after PRELUDE; may use NR[name])]
FAMILIES = {
    "ptrace": [
        ("ptrace", "call(NR['ptrace'], 0, 0, 0, 0)"),  # PTRACE_TRACEME: allowed without the filter
        ("process_vm_readv", "b = buf(8)\nv = (ctypes.c_void_p * 2)(ctypes.addressof(b), 8)\n"
                             "call(NR['process_vm_readv'], os.getpid(), v, 1, v, 1, 0)"),
        ("pidfd_getfd", "call(NR['pidfd_getfd'], os.pidfd_open(os.getpid()), 0, 0)"),
    ],
    "keyrings": [  # -4: KEY_SPEC_USER_KEYRING
        ("add_key", "call(NR['add_key'], b'user', b'opd-seccomp-test', b'v', 1, -4)"),
        ("keyctl", "call(NR['keyctl'], 0, -4, 0)"),  # KEYCTL_GET_KEYRING_ID
        ("request_key", "call(NR['request_key'], b'user', b'opd-none', 0, 0)"),  # else ENOKEY
    ],
    "kernel_surface": [
        ("bpf", "call(NR['bpf'], 0, buf(72), 72)"),  # BPF_MAP_CREATE of nothing: else EINVAL/EPERM
        # PERF_TYPE_SOFTWARE, TASK_CLOCK, user-space only, this process: allowed at paranoid 2.
        ("perf_event_open",
         "a = buf(64)\nctypes.memmove(a, (1).to_bytes(4, 'little') + (64).to_bytes(4, 'little') + "
         "(1).to_bytes(8, 'little'), 16)\nctypes.memmove(ctypes.addressof(a) + 40, "
         "(0b1100000).to_bytes(8, 'little'), 8)\ncall(NR['perf_event_open'], a, 0, -1, -1, 0)"),
        ("io_uring_setup", "call(NR['io_uring_setup'], 1, buf(120))"),
        ("userfaultfd", "call(NR['userfaultfd'], 1)"),  # UFFD_USER_MODE_ONLY
    ],
    "mounts": [
        ("mount", IN_OWN_NAMESPACE + "call(NR['mount'], b'none', b'/sandbox', b'tmpfs', 0, 0)"),
        ("umount2", IN_OWN_NAMESPACE + "call(NR['umount2'], b'/sandbox', 2)"),
        ("pivot_root", IN_OWN_NAMESPACE + "call(NR['pivot_root'], b'.', b'.')"),
        ("fsopen", IN_OWN_NAMESPACE + "call(NR['fsopen'], b'tmpfs', 0)"),
    ],
    "namespaces": [
        ("unshare", "call(NR['unshare'], 0x10000000)"),  # CLONE_NEWUSER: unprivileged, else allowed
        ("setns", "call(NR['setns'], os.open('/proc/self/ns/uts', os.O_RDONLY), 0)"),
        # clone(CLONE_NEWUSER | SIGCHLD) as a fork: the child leaves at once.
        ("clone", "pid = call(NR['clone'], 0x10000000 | 17, 0, 0, 0, 0)\nif pid == 0:\n"
                  "  os._exit(0)\nos.waitpid(pid, 0)"),
        ("clone3", "call(NR['clone3'], buf(88), 88)"),
    ],
    "sockets": [
        ("netlink", "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)"),
        ("inet", "socket.socket(socket.AF_INET, socket.SOCK_STREAM)"),
        ("inet6_pair", "socket.socketpair(socket.AF_INET6)"),
    ],
    "signals": [
        # -1: every process the caller may signal (else ESRCH: none in the run).
        ("kill_all", "os.kill(-1, 0)"),
        ("kill_supervisor", "os.kill(1, 0)"),
        ("tgkill_supervisor", "call(NR['tgkill'], 1, 1, 0)"),
        ("sigqueue_supervisor", "call(NR['rt_sigqueueinfo'], 1, 0, buf(128))"),
        ("pidfd_send_signal", "import signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getpid()), 0)"),
    ],
}
ENOSYS_CALLS = {"clone3"}


def _numbers() -> dict:
  if not _NR:
    arch = pyseccomp.system_arch()
    names = ["ptrace", "process_vm_readv", "pidfd_getfd", "add_key", "keyctl", "request_key",
             "bpf", "perf_event_open", "io_uring_setup", "userfaultfd", "mount", "umount2",
             "pivot_root", "fsopen", "unshare", "setns", "clone", "clone3", "tgkill", "rt_sigqueueinfo"]
    _NR.update({name: pyseccomp.resolve_syscall(arch, name) for name in names})
  return _NR


@pytest.fixture(scope="module", params=LEVELS)
def kernel_only(request):
  return Sandbox(LIMITS, isolation=request.param, python_guard=False)


def program(body: str) -> str:
  return PRELUDE + f"NR = {_numbers()!r}\n" + body + "\nprint('returned')\n"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_denied_family_fails_with_eperm(kernel_only, family):
  for label, body in FAMILIES[family]:
    r = kernel_only.run_python(program(body))
    code = errno.ENOSYS if label in ENOSYS_CALLS else errno.EPERM
    assert (r.reason, r.infrastructure_error) == ("exit_code:1", False), (label, r)
    assert f"[Errno {code}] {__import__('os').strerror(code)}" in r.stderr, (label, r.stderr)
    assert "returned" not in r.stdout, (label, r)


def test_allowed_calls_still_work(kernel_only):
  """What programs need stays allowed: Unix sockets, fork, threads, signals to themselves."""
  body = ("a, b = socket.socketpair()\na.sendall(b'x')\nassert b.recv(1) == b'x'\n"
          "socket.socket(socket.AF_UNIX).close()\n"
          "pid = os.fork()\nif pid == 0:\n  os._exit(7)\nassert os.waitstatus_to_exitcode("
          "os.waitpid(pid, 0)[1]) == 7\nimport threading\nout = []\n"
          "t = threading.Thread(target=out.append, args=(1,))\nt.start()\nt.join()\n"
          "assert out == [1]\nos.kill(os.getpid(), 0)\n")
  r = kernel_only.run_python(program(body))
  assert r.ok and r.stdout.strip() == "returned", r


def test_filter_is_built_from_the_deny_list():
  """The exported filter is a BPF program (8-byte instructions) that names
  each denied call's number (an independent check of ``_build``: the numbers
  come from libseccomp's table, the comparison from the raw bytes)."""
  bpf = seccomp.program_filter()
  assert len(bpf) % 8 == 0 and len(bpf) // 8 < 4096
  arch = pyseccomp.system_arch()
  # A BPF "jeq k" instruction holds its constant k in bytes 4..8.
  constants = {int.from_bytes(bpf[i + 4:i + 8], "little") for i in range(0, len(bpf), 8)}
  for name in seccomp.DENIED + seccomp.PID_ARG_SYSCALLS + ("clone3", "clone", "socket",
                                                           "socketpair"):
    assert pyseccomp.resolve_syscall(arch, name) in constants, name
