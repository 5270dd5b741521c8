"""Imports only point down: pallas_kernels <- opd <- grm <- experiments (docs/DESIGN.md §1).

Inside ``opd`` the subpackages are ranked as the data flow runs; a module may
import its own subpackage or a lower-ranked one, never a higher one. The
check parses every module's imports (function-local ones included), so a
lazy import that runs back up is caught too.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = {"pallas_kernels": 0, "opd": 1, "grm": 2, "experiments": 3}
# Rank of each opd subpackage; plain modules directly under opd/ rank like "config".
OPD = {"config": 0, "models": 1, "text": 1, "parallel": 1, "tasks": 2, "training": 2,
       "rollout": 3, "rl": 4, "eval": 4, "distill": 5}


def _imports(path: pathlib.Path):
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        yield node.lineno, a.name
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module
      for a in node.names:  # `from opd import rollout` imports opd.rollout
        yield node.lineno, f"{node.module}.{a.name}"


def _opd_rank(dotted: str) -> int | None:
  parts = dotted.split(".")
  if parts[0] != "opd" or len(parts) < 2:
    return None
  return OPD.get(parts[1], None)


def _violations():
  out = []
  for top in TOP:
    for path in sorted((ROOT / top).rglob("*.py")):
      rel = path.relative_to(ROOT)
      own = ".".join(rel.with_suffix("").parts)
      own_rank = _opd_rank(own) if top == "opd" else None
      for line, mod in _imports(path):
        head = mod.split(".")[0]
        if head in TOP and TOP[head] > TOP[top]:
          out.append(f"{rel}:{line} imports {mod} (a higher layer than {top})")
        if top == "pallas_kernels" and head in ("flax", "optax", "orbax", "grain"):
          out.append(f"{rel}:{line} imports {mod} (pallas_kernels depends on jax only)")
        if own_rank is not None and head == "opd":
          r = _opd_rank(mod)
          if r is not None and r > own_rank and mod.split(".")[1] != own.split(".")[1]:
            out.append(f"{rel}:{line} imports {mod}: opd.{mod.split('.')[1]} ranks above "
                       f"opd.{own.split('.')[1]}")
  return out


def test_every_opd_subpackage_is_ranked():
  subpackages = {p.parent.name for p in (ROOT / "opd").glob("*/__init__.py")}
  assert subpackages <= set(OPD), f"rank the new subpackage(s) {subpackages - set(OPD)} here"


def test_imports_only_point_down():
  bad = _violations()
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, expect", [
    ("from opd.rl import grpo\n", "ranks above"),
    ("import experiments.launch\n", "higher layer"),
])
def test_checker_catches_upward_imports(tmp_path, monkeypatch, source, expect):
  # The checker itself must be able to fail: plant an upward import in a copy of opd/tasks.
  fake = tmp_path / "opd" / "tasks"
  fake.mkdir(parents=True)
  (tmp_path / "opd" / "__init__.py").write_text("")
  (fake / "__init__.py").write_text(source)
  for top in ("pallas_kernels", "grm", "experiments"):
    (tmp_path / top).mkdir()
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  assert any(expect in v for v in _violations())
