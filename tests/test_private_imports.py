"""No module uses another module's underscore names (docs/DESIGN.md §1).

A name that starts with one underscore is private to the module that defines
it; code that another module needs is made public there or moved down into
the library. The check parses every module of ``pallas_kernels/``, ``opd/``,
``grm/`` and ``experiments/`` and every notebook's code cells, and reports
``from m import _name`` (function-local imports included) and ``m._name``
where ``m`` was bound by an import of one of those packages. Dunder names
(``__version__``) are not private.
"""
import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "opd", "grm", "experiments")


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _notebook_source(path: pathlib.Path) -> str:
  """A notebook's code cells, IPython magics and shell lines blanked."""
  cells = json.loads(path.read_text())["cells"]
  lines = []
  for cell in cells:
    if cell["cell_type"] == "code":
      src = "".join(cell["source"])
      lines += ["" if ln.lstrip().startswith(("%", "!")) else ln for ln in src.split("\n")]
  return "\n".join(lines)


def private_uses(source: str, module: str) -> list[str]:
  """``line: what`` for each use of another module's underscore name in ``source``.

  Args:
    source: Python source.
    module: its dotted name (``opd.tasks.base``; "" for a notebook), for
      resolving relative imports.
  """
  tree = ast.parse(source)
  bound = {}  # local name -> the dotted module it names
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.asname:
          bound[a.asname] = a.name
        else:
          bound[a.name.split(".")[0]] = a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = module.split(".")[:-node.level]
        base = ".".join(pkg + ([base] if base else []))
      for a in node.names:
        bound[a.asname or a.name] = f"{base}.{a.name}"
        if _private(a.name):
          out.append(f"{node.lineno}: from {base} import {a.name}")
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      chain, value = [], node.value
      while isinstance(value, ast.Attribute):  # a.b._x: the chain a.b
        chain.insert(0, value.attr)
        value = value.value
      if (isinstance(value, ast.Name) and value.id in bound
          and bound[value.id].split(".")[0] in PACKAGES):
        expr = ".".join([value.id, *chain, node.attr])
        out.append(f"{node.lineno}: {expr} ({value.id} = {bound[value.id]})")
  return out


def _violations() -> list[str]:
  out = []
  for top in PACKAGES:
    for path in sorted((ROOT / top).rglob("*.py")):
      rel = path.relative_to(ROOT)
      parts = rel.with_suffix("").parts
      module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
      if parts[-1] == "__init__":
        module += ".__init__"  # relative imports resolve against the package itself
      out += [f"{rel}:{v}" for v in private_uses(path.read_text(), module)]
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    rel = path.relative_to(ROOT)
    out += [f"{rel} (code cells):{v}" for v in private_uses(_notebook_source(path), "")]
  return out


def test_no_module_uses_another_modules_private_names():
  bad = _violations()
  assert not bad, "make these names public or move them down:\n" + "\n".join(bad)


def test_the_scan_covers_every_package_and_the_notebooks():
  # A glob that silently matched nothing would make the check above vacuous.
  for top in PACKAGES:
    assert len(list((ROOT / top).rglob("*.py"))) >= 5, top
  assert list((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("source, expect", [
    ("from opd.tasks.base import _check\n", "from opd.tasks.base import _check"),
    ("def f():\n  from grm.format import x, _y\n", "from grm.format import _y"),
    ("from . import _helper\n", "from opd.tasks import _helper"),
    ("from opd.tasks import base\nbase._check([], [])\n", "base._check"),
    ("import opd.tasks.base as b\nb._check\n", "b._check"),
    ("import experiments.common\nexperiments.common._x\n", "experiments.common._x"),
])
def test_checker_catches_private_uses(source, expect):
  got = private_uses(source, "opd.tasks.code_task")
  assert len(got) == 1 and expect in got[0], got


def test_checker_ignores_public_dunder_and_foreign_names():
  source = ("import numpy as np\nimport os\nfrom opd.tasks import base\n"
            "np._NoValue\nos._exit\nbase.__doc__\nbase.check_batch\nself._x = 1\n")
  assert private_uses(source, "opd.tasks.code_task") == []
