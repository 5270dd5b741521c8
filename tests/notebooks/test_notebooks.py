"""Notebooks are stored without outputs and their code runs top to bottom."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def _code(nb):
  return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_clean_and_runs(path, tmp_path):
  nb = json.loads(path.read_text())
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None, "stored outputs"
  assert "colab-badge" in "".join("".join(c["source"]) for c in nb["cells"])
  script = tmp_path / "nb.py"
  # The last expression of a cell is displayed in Jupyter; here it is just evaluated.
  script.write_text("\n\n".join(_code(nb)))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, str(script)], cwd=path.parent, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "| reward@1 |" in proc.stdout
