"""``opd.training.workdir``: one owner per run directory, and the config check of a relaunch."""
import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from opd.training import workdir as wd
from opd.training.files import ResultFileError


def test_a_held_lock_refuses_a_second_holder_until_released(tmp_path):
  first = wd.WorkdirLock(tmp_path).acquire()
  owner = json.loads((tmp_path / wd.LOCK_FILE).read_text())
  assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
  # flock locks belong to open file descriptions: a second one in this process conflicts too.
  with pytest.raises(wd.WorkdirBusyError, match=rf"in use by pid {os.getpid()} on host "
                                                rf"'{socket.gethostname()}' \(since "):
    wd.WorkdirLock(tmp_path).acquire()
  first.release()
  assert (tmp_path / wd.LOCK_FILE).read_text() == ""  # a clean release leaves no owner
  with wd.WorkdirLock(tmp_path) as again:
    assert again.held and again.stale is None
  assert not again.held


def test_a_lock_dies_with_its_process_and_the_stale_owner_is_reported(tmp_path, caplog):
  """SIGKILL leaves the owner record behind but the kernel drops the flock:
  the next launch takes over and names the dead owner."""
  code = ("import sys, os, signal; from opd.training.workdir import WorkdirLock; "
          "WorkdirLock(sys.argv[1]).acquire(); print(os.getpid(), flush=True); "
          "os.kill(os.getpid(), signal.SIGKILL)")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == -9, proc.stderr
  dead = int(proc.stdout.split()[0])
  assert json.loads((tmp_path / wd.LOCK_FILE).read_text())["pid"] == dead  # left behind
  with caplog.at_level(logging.WARNING, logger=wd.__name__):
    with wd.WorkdirLock(tmp_path) as lock:
      assert lock.stale["pid"] == dead
  assert f"taking over a stale lock left by pid {dead} on host " in caplog.text
  assert "that process is gone" in caplog.text


def test_config_changes_name_changed_added_and_removed_fields(tmp_path):
  saved = {"job": "x", "optim": {"lr": 0.1, "b1": 0.9}, "steps": 10, "old": 1}
  new = {"job": "x", "optim": {"lr": 0.2, "b1": 0.9}, "steps": 20, "extra": [1, 2]}
  assert wd.config_changes(saved, new) == [("extra", "<missing>", [1, 2]),
                                           ("old", 1, "<missing>"), ("optim.lr", 0.1, 0.2),
                                           ("steps", 10, 20)]
  assert wd.check_config(tmp_path, new) == []  # no config.json yet: nothing to compare
  (tmp_path / wd.CONFIG_FILE).write_text(json.dumps(saved))
  with pytest.raises(wd.ConfigChangedError, match=r"extra: was '<missing>', now \[1, 2\]; old: "
                                                  r"was 1, now '<missing>'; optim.lr: was 0.1, "
                                                  r"now 0.2; steps: was 10, now 20"):
    wd.check_config(tmp_path, new)
  # A group name allows every field under it.
  assert wd.check_config(tmp_path, new, allow_change=["optim", "steps", "old", "extra"]) == \
      wd.config_changes(saved, new)
  (tmp_path / wd.CONFIG_FILE).write_text('{"job": "x", "optim": {"lr"')  # torn by a crash
  with pytest.raises(ResultFileError, match=r"config.json' is not valid JSON"):
    wd.check_config(tmp_path, new)


def test_record_config_keeps_a_different_previous_config(tmp_path):
  assert wd.record_config(tmp_path, {"a": 1}) is None
  stat = (tmp_path / wd.CONFIG_FILE).stat()
  assert wd.record_config(tmp_path, {"a": 1}) is None  # identical: untouched
  assert (tmp_path / wd.CONFIG_FILE).stat().st_mtime_ns == stat.st_mtime_ns
  kept = wd.record_config(tmp_path, {"a": 2})
  assert json.loads(kept.read_text()) == {"a": 1}
  assert json.loads((tmp_path / wd.CONFIG_FILE).read_text()) == {"a": 2}
