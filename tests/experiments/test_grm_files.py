"""The GRM jobs read their stage files through ``opd.training.files.read_json``:
a torn file is refused naming its path (not a bare JSONDecodeError), and the
benchmark's report is written atomically."""
import types

import pytest

from experiments import grm_common
from opd.training.files import ResultFileError


def test_a_torn_groups_file_names_its_path(tmp_path):
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "groups.json").write_text('{"train": [{"prompt": "x"')  # cut short
  ctx = types.SimpleNamespace(root=tmp_path)
  with pytest.raises(ResultFileError, match=r"data/groups\.json"):
    grm_common.load_groups(ctx)
  (tmp_path / "data" / "groups.json").write_text('{"train": [], "test": []}')
  (tmp_path / "data" / "subsets.json").write_text("[1, 2")
  with pytest.raises(ResultFileError, match=r"data/subsets\.json"):
    grm_common.load_test_subsets(ctx)
