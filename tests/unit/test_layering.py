"""The package's layering, read from its import statements (WORKSPACE.md, "Layering").

    layers -> core -> parallel -> checkpoint -> observe -> trainer -> launch -> the API facade

A module may import its own layer's modules and the layers below, never one above; no chain
of imports comes back to where it started; and no import of a megajax module hides inside a
function (a lazy import is how a cycle gets dodged). Every import statement counts, at any
depth. Importing `a.b.c` runs the parent packages' __init__ too, but that is Python's doing,
not the module's: only the named module is an edge.
"""

import ast
import os
import tomllib

import pytest

from tests.support import REPO

# Lowest first. A module belongs to the layer one of whose prefixes its name is or starts with;
# the package's own __init__ (the API facade) is the top layer and is matched exactly.
LAYERS = (
    ("layers", ("megajax.layers",)),
    ("core", ("megajax.sections", "megajax.config", "megajax.config_checks", "megajax.config_parallel", "megajax.model", "megajax.loss", "megajax.optim",
              "megajax.flops", "megajax.data", "megajax.token_files", "megajax.tokenizer", "megajax.text_inputs",
              "megajax.reference_step")),
    ("parallel", ("megajax.parallel", "megajax.sampling")),   # sampling: decoding, heads split over tp
    ("checkpoint", ("megajax.checkpoint",)),
    ("observe", ("megajax.observe",)),
    ("trainer", ("megajax.trainer",)),
    ("launch", ("megajax.launch",)),
    ("api", ()),
)
API = "megajax"     # megajax/__init__.py, the facade over all of it


def _package_dirs() -> dict[str, str]:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def modules() -> dict[str, str]:
  """Module name -> file, for every .py file of the installed namespace (package-dir mapping)."""
  found = {}
  for package, folder in _package_dirs().items():
    root = os.path.join(REPO, folder)
    for directory, subdirs, files in os.walk(root):
      subdirs[:] = [d for d in subdirs if d != "__pycache__"]
      relative = os.path.relpath(directory, root)
      prefix = package if relative == "." else f"{package}.{relative.replace(os.sep, '.')}"
      for name in files:
        if name.endswith(".py"):
          found[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(directory, name)
  return found


def layer_of(module: str) -> int:
  if module == API:
    return len(LAYERS) - 1
  for index, (_, prefixes) in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return index
  raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to WORKSPACE.md)")


def imports(module: str, path: str, known: set[str]) -> list[tuple[str, int, bool]]:
  """(imported megajax module, line, inside a function or class) for every import statement."""
  tree = ast.parse(open(path).read(), path)
  package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
  nested = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
      nested.update(id(child) for child in ast.walk(node) if child is not node)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: resolved against this module's package
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
      # `from package import submodule` names the submodule; `from module import name`, the module.
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    else:
      continue
    for target in targets:
      if target == "megajax" or target.startswith("megajax."):
        found.append((target, node.lineno, id(node) in nested))
  return found


@pytest.fixture(scope="module")
def graph():
  known = modules()
  return known, {module: imports(module, path, set(known)) for module, path in known.items()}


def test_every_module_is_in_a_layer(graph):
  known, _ = graph
  assert len(known) > 60 and "megajax.trainer.loop" in known and "megajax.layers.kernels.band" in known
  for module in known:
    layer_of(module)


def test_no_module_imports_a_layer_above_its_own(graph):
  known, edges = graph
  upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]}), "
            f"{os.path.relpath(known[module], REPO)}:{line}"
            for module, found in edges.items() for target, line, _ in found
            if target in known and layer_of(target) > layer_of(module)]
  assert not upward, "\n".join(upward)


def test_every_import_names_a_module_that_exists(graph):
  known, edges = graph
  missing = [f"{module}:{line} imports {target}" for module, found in edges.items() for target, line, _ in found
             if target not in known]
  assert not missing, "\n".join(missing)


def test_no_megajax_import_hides_inside_a_function(graph):
  known, edges = graph
  lazy = [f"{os.path.relpath(known[module], REPO)}:{line} imports {target}"
          for module, found in edges.items() for target, line, inside in found if inside]
  assert not lazy, "\n".join(lazy)


def test_the_imports_have_no_cycle(graph):
  _, edges = graph
  targets = {module: sorted({t for t, _, _ in found if t in edges and t != module}) for module, found in edges.items()}
  state, path = {}, []

  def visit(module):
    state[module] = "open"
    path.append(module)
    for target in targets[module]:
      if state.get(target) == "open":
        raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
      if target not in state:
        visit(target)
    path.pop()
    state[module] = "done"

  for module in sorted(targets):
    if module not in state:
      visit(module)


def test_the_checker_catches_what_it_is_for(tmp_path):
  """The reading itself: an upward, a lazy and a relative import are found as such."""
  source = tmp_path / "probe.py"
  source.write_text("from . import sharding\n"
                    "from megajax.trainer import loop\n"
                    "def f():\n  from megajax.config import validate\n")
  found = imports("megajax.parallel.probe", str(source), {"megajax.parallel.sharding", "megajax.trainer.loop"})
  assert found == [("megajax.parallel.sharding", 1, False), ("megajax.trainer.loop", 2, False),
                   ("megajax.config", 4, True)]
  assert layer_of("megajax.trainer.loop") > layer_of("megajax.parallel.probe")
  with pytest.raises(AssertionError, match="megajax.unplaced is in no layer"):
    layer_of("megajax.unplaced")
