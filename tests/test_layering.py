"""Imports only point down: pallas_kernels <- opd <- grm <- experiments (docs/DESIGN.md §1).

Inside ``opd`` the subpackages are ranked as the data flow runs; a module may
import its own subpackage or a lower-ranked one, never a higher one. The
check parses every module's imports (function-local ones included), so a
lazy import that runs back up is caught too. Within a layer, no module
imports itself back through others (no import cycle), and no module reaches
into another's underscore names.
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


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """Dotted name -> file of every module of the four packages (a package is its __init__)."""
  out = {}
  for top in TOP:
    for path in sorted((root / top).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _import_graph(root: pathlib.Path) -> dict[str, set[str]]:
  """Module -> the repo modules it imports (function-local imports included).

  ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
  else to ``pkg``; the implicit import of parent packages is not an edge.
  """
  mods = _modules(root)
  graph = {m: set() for m in mods}
  for mod, path in mods.items():
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                   else node.module for a in node.names]
      else:
        continue
      graph[mod].update(t for t in targets if t in mods and t != mod)
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
  """The strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, out = {}, {}, set(), [], []
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph[start])))]
    index[start] = low[start] = len(index)
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        comp = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          comp.append(member)
          if member == node:
            break
        if len(comp) > 1:
          out.append(tuple(sorted(comp)))
  return sorted(out)


# Cycles that exist today (issue #24 assigns them); each entry must still be
# a cycle, so the list only shrinks.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def test_no_module_imports_itself_back():
  found = set(_cycles(_import_graph(ROOT)))
  assert not found - KNOWN_CYCLES, f"import cycles: {sorted(found - KNOWN_CYCLES)}"
  assert not KNOWN_CYCLES - found, f"fixed, drop from KNOWN_CYCLES: {KNOWN_CYCLES - found}"


def _private_uses(root: pathlib.Path) -> list[str]:
  """``file:line: name`` for every underscore name a module takes from another
  repo module: ``from m import _x`` or ``alias._x`` on an imported name."""
  out = []
  for mod, path in _modules(root).items():
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        bound.update((a.asname or a.name).split(".")[0] for a in node.names
                     if a.name.split(".")[0] in TOP)
      elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in TOP):
        for a in node.names:
          if a.name.startswith("_") and not a.name.startswith("__"):
            out.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{a.name}")
          bound.add(a.asname or a.name)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        base = node.value
        while isinstance(base, ast.Attribute):
          base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
          out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
  return out


def test_no_module_uses_another_modules_underscore_names():
  bad = _private_uses(ROOT)
  assert not bad, "\n".join(bad)


def test_cycle_and_private_checks_can_fail(tmp_path):
  # Plant a two-module cycle and both kinds of private use in a fake tree.
  for top in TOP:
    (tmp_path / top).mkdir()
    (tmp_path / top / "__init__.py").write_text("")
  (tmp_path / "opd" / "a.py").write_text("def f():\n  from opd import b\n  return b._hidden\n")
  (tmp_path / "opd" / "b.py").write_text("from opd.a import f\n_hidden = 1\n")
  (tmp_path / "grm" / "c.py").write_text("from opd.b import _hidden\n")
  assert _cycles(_import_graph(tmp_path)) == [("opd.a", "opd.b")]
  assert sorted(_private_uses(tmp_path)) == ["grm/c.py:1: opd.b._hidden",
                                             "opd/a.py:3: b._hidden"]
