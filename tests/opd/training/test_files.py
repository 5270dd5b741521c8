"""Crash-safe result files (opd.training.files)."""
import json
import os

import pytest

from opd.training import files


def test_atomic_write_json_round_trips_and_leaves_no_temp(tmp_path):
  path = tmp_path / "sub" / "result.json"
  obj = {"a": 1, "b": [1.5, "x"]}
  files.atomic_write_json(path, obj)
  assert json.loads(path.read_text()) == obj
  assert files.read_json(path, expect=dict) == obj
  assert os.listdir(path.parent) == ["result.json"]


def test_a_failed_write_keeps_the_previous_content(tmp_path):
  path = tmp_path / "result.json"
  files.atomic_write_json(path, {"good": True})
  with pytest.raises(TypeError):
    files.atomic_write_json(path, {"bad": object()})  # not serialisable: fails before the rename
  assert files.read_json(path) == {"good": True}
  assert os.listdir(tmp_path) == ["result.json"]


def test_an_exception_during_the_write_removes_the_temp_file(tmp_path, monkeypatch):
  path = tmp_path / "result.json"
  files.atomic_write_text(path, "old")

  def broken_replace(src, dst):
    raise OSError("disk gone")

  monkeypatch.setattr(files.os, "replace", broken_replace)
  with pytest.raises(OSError, match="disk gone"):
    files.atomic_write_text(path, "new")
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["result.json"]


def test_a_torn_file_names_its_path(tmp_path):
  path = tmp_path / "stage.json"
  path.write_text('{"loss": 1.2, "acc')
  with pytest.raises(files.ResultFileError, match="stage.json.*not valid JSON"):
    files.read_json(path)


def test_a_wrong_top_level_type_is_refused(tmp_path):
  path = tmp_path / "config.json"
  path.write_text("[1, 2]")
  with pytest.raises(files.ResultFileError, match="holds a list, expected a dict"):
    files.read_json(path, expect=dict)
