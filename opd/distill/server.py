"""Out-of-process teachers: a local teacher server over a Unix socket (docs/DESIGN.md §3).

A teacher may run in its own process so that a crash, a hang or a SIGKILL
of that process costs skipped batches, never the trainer. The server loads
one teacher and answers requests for last hidden states; the trainer side is
a :class:`RemoteTeacher`, a ``fn(tokens, mask) -> [B, T, D]`` callable that
:class:`opd.distill.faults.FaultTolerantTeachers` treats like an in-process
teacher (a dead server is an ``"error"`` skip, a stuck one a ``"timeout"``).

Wire format (``multiprocessing.connection`` framing, no pickle): each message
is one JSON header frame followed by one raw frame per array the header
lists as ``{"shape": [...], "dtype": "..."}``.

* request ``{"op": "info"}`` → ``{"ok": true, "name", "d_model", "vocab_size"}``;
* request ``{"op": "hidden", "arrays": [tokens int32 [B, T], mask bool [B, T]]}``
  → ``{"ok": true, "arrays": [hidden float32 [B, T, D]]}``;
* any failure → ``{"ok": false, "error": "..."}``.

Every client call is bounded: connecting within ``timeout_s`` and the whole
exchange (request and reply) within ``read_timeout_s``, on a socket with
those timeouts, closed on every exit. A hung or stalled server therefore
costs a ``TimeoutError`` (an ``"error"`` skip) and never a thread or a file
descriptor that outlives the call: with ``timeout_s + read_timeout_s`` at
most the fault layer's deadline, a hung server's call ends before it.

Launch: ``python -m opd.distill.server --socket PATH --name NAME
--config_json '{...ModelConfig...}' (--checkpoint DIR | --hf DIR | --seed N)``
(:func:`launch` does it and waits until the socket accepts connections).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Listener
from typing import Sequence

import numpy as np

_DTYPES = ("int32", "bool", "float32")


class _Channel:
  """The client's end: ``multiprocessing.connection`` framing over a socket
  whose every operation must finish by ``deadline`` (``time.monotonic()``).

  A frame is a 4-byte big-endian signed length and the bytes (a length over
  2**31 - 1 is sent as -1 and an 8-byte unsigned length), as
  ``Connection.send_bytes`` writes it.
  """

  def __init__(self, sock: socket.socket, deadline: float, what: str):
    self.sock, self.deadline, self.what = sock, deadline, what

  def _timeout(self) -> float:
    left = self.deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError(f"{self.what}: no complete answer within the read timeout")
    return left

  def send_bytes(self, data: bytes) -> None:
    n = len(data)
    head = struct.pack("!i", n) if n <= 0x7fffffff else struct.pack("!iQ", -1, n)
    for part in (head, data):
      self.sock.settimeout(self._timeout())
      try:
        self.sock.sendall(part)
      except socket.timeout as e:
        raise TimeoutError(f"{self.what}: the request was not taken within the read "
                           "timeout") from e

  def _recv(self, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
      self.sock.settimeout(self._timeout())
      try:
        k = self.sock.recv_into(view[got:])
      except socket.timeout as e:
        raise TimeoutError(f"{self.what}: no complete answer within the read timeout") from e
      if k == 0:
        raise EOFError(f"{self.what}: the server closed the connection")
      got += k
    return bytes(buf)

  def recv_bytes(self) -> bytes:
    n, = struct.unpack("!i", self._recv(4))
    if n == -1:
      n, = struct.unpack("!Q", self._recv(8))
    return self._recv(n)


def send(conn: "Connection | _Channel", header: dict, arrays: Sequence[np.ndarray] = ()) -> None:
  """One message: the JSON header (with the arrays' shapes / dtypes) and raw frames."""
  header = dict(header, arrays=[{"shape": list(a.shape), "dtype": str(a.dtype)} for a in arrays])
  conn.send_bytes(json.dumps(header).encode())
  for a in arrays:
    conn.send_bytes(np.ascontiguousarray(a).tobytes())


def receive(conn: "Connection | _Channel") -> tuple[dict, list[np.ndarray]]:
  """The inverse of :func:`send`; raises ValueError on a malformed message."""
  header = json.loads(conn.recv_bytes().decode())
  arrays = []
  for spec in header.get("arrays", []):
    if spec.get("dtype") not in _DTYPES:
      raise ValueError(f"message array dtype={spec.get('dtype')!r}: expected one of {_DTYPES}")
    shape = tuple(int(s) for s in spec["shape"])
    data = conn.recv_bytes()
    arrays.append(np.frombuffer(data, spec["dtype"]).reshape(shape))
  return header, arrays


class RemoteTeacher:
  """Client of a teacher server: ``fn(tokens, mask) -> [B, T, D]`` float32.

  One connection per call, so that a call abandoned at its deadline never
  shares a connection with the next; the socket is closed when the call
  ends, however it ends. Any transport failure (the server was killed,
  closed the connection, answered ``ok: false``, did not answer in time)
  raises.

  Args:
    socket_path: the server's Unix socket.
    timeout_s: how long to keep trying to connect (the server may be
      starting, or its accept queue full).
    read_timeout_s: how long the exchange may take once connected (sending
      the request and receiving the whole reply): a hung server raises
      ``TimeoutError`` then. Keep ``timeout_s + read_timeout_s`` at most the
      fault layer's ``deadline_s`` (``OPDConfig.deadline_s``).
  """

  def __init__(self, socket_path: str, *, timeout_s: float = 10.0, read_timeout_s: float = 50.0):
    for field, value in (("timeout_s", timeout_s), ("read_timeout_s", read_timeout_s)):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"RemoteTeacher.{field}={value!r} must be a positive number of seconds")
    self.socket_path = socket_path
    self.timeout_s = float(timeout_s)
    self.read_timeout_s = float(read_timeout_s)

  def _connect(self) -> socket.socket:
    deadline = time.monotonic() + self.timeout_s
    while True:
      sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
      try:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        sock.connect(self.socket_path)
        return sock
      except (FileNotFoundError, ConnectionRefusedError, BlockingIOError, socket.timeout) as e:
        sock.close()  # BlockingIOError / timeout: the server's accept queue is full
        if time.monotonic() > deadline:
          if isinstance(e, BlockingIOError):
            raise TimeoutError(f"teacher server {self.socket_path}: its accept queue stayed full "
                               f"for timeout_s={self.timeout_s}") from e
          raise
        time.sleep(0.05)
      except BaseException:
        sock.close()
        raise

  def _request(self, header: dict, arrays=()) -> tuple[dict, list[np.ndarray]]:
    with self._connect() as sock:
      conn = _Channel(sock, time.monotonic() + self.read_timeout_s,
                      f"teacher server {self.socket_path}")
      send(conn, header, arrays)
      reply, out = receive(conn)
    if not reply.get("ok"):
      raise RuntimeError(f"teacher server {self.socket_path}: {reply.get('error')}")
    return reply, out

  def info(self) -> dict:
    """``{"name", "d_model", "vocab_size"}`` of the served teacher."""
    return self._request({"op": "info"})[0]

  def width(self, vocab_size: int) -> int:
    """The served teacher's D, after checking its vocabulary against the student's V."""
    info = self.info()
    if info["vocab_size"] != vocab_size:
      raise ValueError(f"teacher {info['name']!r} at {self.socket_path} has vocab_size="
                       f"{info['vocab_size']} but the student has vocab_size={vocab_size}")
    return int(info["d_model"])

  def __call__(self, tokens, mask) -> np.ndarray:
    _, (hidden,) = self._request({"op": "hidden"}, [np.asarray(tokens, np.int32),
                                                    np.asarray(mask, bool)])
    return hidden


def launch(socket_path: str, name: str, config_json: str, *, seed: int | None = None,
           checkpoint: str | None = None, hf: str | None = None, delay_s: float = 0.0,
           ready_timeout_s: float = 300.0, env: dict | None = None) -> subprocess.Popen:
  """Starts a teacher server process and waits until its socket answers ``info``.

  Exactly one of ``seed`` (random params: tests, tiny configs), ``checkpoint``
  (our checkpoint directory) or ``hf`` (a HF safetensors directory).
  ``delay_s`` delays every answer (fault-injection tests).

  Raises:
    RuntimeError: the process exited or was not ready within ``ready_timeout_s``.
  """
  sources = {"--seed": seed, "--checkpoint": checkpoint, "--hf": hf}
  given = {k: v for k, v in sources.items() if v is not None}
  if len(given) != 1:
    raise ValueError(f"give exactly one of seed / checkpoint / hf, got {sorted(given)}")
  cmd = [sys.executable, "-m", "opd.distill.server", "--socket", socket_path, "--name", name,
         "--config_json", config_json, "--delay_s", str(delay_s)]
  for flag, value in given.items():
    cmd += [flag, str(value)]
  proc = subprocess.Popen(cmd, env=env)
  deadline = time.monotonic() + ready_timeout_s
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"teacher server {name!r} exited with code {proc.returncode}")
    if os.path.exists(socket_path):
      try:
        RemoteTeacher(socket_path, timeout_s=1.0).info()
        return proc
      except (OSError, EOFError):
        pass
    time.sleep(0.1)
  proc.kill()
  raise RuntimeError(f"teacher server {name!r} not ready after {ready_timeout_s}s")


def _load(args):
  import jax
  from opd.distill.teachers import Teacher
  from opd.models import ModelConfig
  cfg = ModelConfig.from_dict(json.loads(args.config_json))
  if args.checkpoint:
    return Teacher.from_checkpoint(args.name, args.checkpoint, cfg)
  if args.hf:
    return Teacher.from_hf(args.name, args.hf, config=cfg)
  return Teacher(args.name, cfg, jax.device_get(Teacher.random(args.name, cfg, args.seed).params))


def serve(args) -> None:
  """Loads the teacher, then answers requests until killed."""
  import jax
  from opd.models import forward
  teacher = _load(args)
  run = jax.jit(lambda p, t, m: forward(teacher.cfg, p, t, None, m, return_logits=False,
                                        return_hidden=True).hidden.astype("float32"))
  if os.path.exists(args.socket):
    os.unlink(args.socket)
  with Listener(args.socket, family="AF_UNIX") as listener:
    while True:
      with listener.accept() as conn:
        try:
          header, arrays = receive(conn)
          if header.get("op") == "info":
            send(conn, {"ok": True, "name": teacher.name, "d_model": teacher.cfg.d_model,
                        "vocab_size": teacher.cfg.vocab_size})
          elif header.get("op") == "hidden" and len(arrays) == 2:
            time.sleep(args.delay_s)
            hidden = np.asarray(run(teacher.params, arrays[0], arrays[1].astype(bool)))
            send(conn, {"ok": True}, [hidden])
          else:
            send(conn, {"ok": False, "error": f"bad request {header!r}"})
        except (EOFError, OSError):
          continue  # the client went away; serve the next one
        except Exception as e:  # noqa: BLE001 - report, keep serving
          send(conn, {"ok": False, "error": f"{type(e).__name__}: {e}"})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--socket", required=True)
  parser.add_argument("--name", required=True)
  parser.add_argument("--config_json", required=True, help="the teacher's ModelConfig as JSON")
  parser.add_argument("--seed", type=int)
  parser.add_argument("--checkpoint")
  parser.add_argument("--hf")
  parser.add_argument("--delay_s", type=float, default=0.0)
  serve(parser.parse_args(argv))


if __name__ == "__main__":
  main()
