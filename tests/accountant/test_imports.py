"""``accountant`` is pure mathematics: importing every module pulls in no service or web code."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

FORBIDDEN = ("service", "sqlalchemy", "fastapi", "torch")
ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import importlib, json, pkgutil, sys
import accountant
names = ["accountant"]
for info in pkgutil.walk_packages(accountant.__path__, "accountant."):
    names.append(info.name)
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "modules": sorted(sys.modules)}))
"""


def test_accountant_imports_no_service_database_web_or_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout)
    for expected in ("accountant.rules", "accountant.rdp_filter", "accountant.certificates"):
        assert expected in report["imported"]
    leaked = [m for m in report["modules"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []


def _is_type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(root: Path = ROOT, *, top_level_only: bool, package: str = "accountant") -> dict[str, set[str]]:
    """Each module of ``package`` (``accountant``; ``service`` in tests/service) and its imports of
    the package's other modules: at module level, and
    with ``top_level_only=False`` also inside functions and methods (a function-level import is
    a cycle all the same, only deferred). Imports under ``if TYPE_CHECKING:`` never run and are
    left out. ``from package import name`` depends on ``package.name`` when that is a module (a
    package's ``__init__`` may import it midway), else on ``package`` itself."""
    modules = {_module_name(path, root) for path in root.joinpath(package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in root.joinpath(package).rglob("*.py"):
        found: set[str] = set()

        def visit(node: ast.AST, found: set[str] = found) -> None:
            for child in ast.iter_child_nodes(node):
                if _is_type_checking_block(child):
                    continue
                if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                    for alias in child.names:
                        submodule = f"{child.module}.{alias.name}"
                        found.add(submodule if submodule in modules else child.module)
                elif isinstance(child, ast.Import):
                    found.update(alias.name for alias in child.names)
                if top_level_only and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    continue
                visit(child)

        visit(ast.parse(path.read_text(encoding="utf-8")))
        graph[_module_name(path, root)] = {m for m in found if m.split(".")[0] == package}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (depth-first), or None for a DAG."""
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for dep in sorted(graph.get(name, ())):
            if dep in graph and (found := visit(dep, (*path, name))):
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        if found := visit(name, ()):
            return found
    return None


def test_the_package_imports_form_a_dag() -> None:
    """Issue 14 §5: no module-level import cycle (the registry sits above the accountants, the
    errors in a leaf module). Issue 29 §4: none through a function-level import either
    (``events`` ↔ ``dp_accounting_form``, ``rules.budget`` ↔ ``rules.prices``, the rule modules
    imported inside ``rules/__init__`` were such cycles)."""
    graph = _imports(top_level_only=False)
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
    assert graph["accountant.errors"] == set()
    prv_stages = [m for m in graph if m == "accountant.prv" or m.startswith("accountant.prv.")]
    assert len(prv_stages) > 1
    for below_the_registry in ("accountant.basic", "accountant.rdp", *prv_stages):
        assert "accountant.registry" not in graph[below_the_registry], below_the_registry


def test_the_cycle_check_counts_function_level_imports(tmp_path: Path) -> None:
    """A cycle closed by an import inside a function is found; one closed only under
    ``if TYPE_CHECKING:`` (never run) is not; a module-level-only graph misses the first."""
    package = tmp_path / "accountant"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from accountant.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from accountant.a import f\n\n    return f\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom accountant import a\n\n"
        "if TYPE_CHECKING:\n    from accountant.c import x\n"
    )
    (package / "d.py").write_text("from accountant import c\n")
    everything = _imports(tmp_path, top_level_only=False)
    assert everything["accountant.c"] == {"accountant.a"}  # a submodule, not the package
    assert _cycle(everything) in (
        ["accountant.a", "accountant.b", "accountant.a"],
        ["accountant.b", "accountant.a", "accountant.b"],
    )
    assert _cycle(_imports(tmp_path, top_level_only=True)) is None


SURFACE = """
import importlib, json, sys
import accountant
loaded_by_the_package = sorted(m for m in sys.modules if m.startswith("accountant"))
import accountant.events
loaded_by_events = sorted(m for m in sys.modules if m.startswith("accountant"))
homes = {}
for name in accountant.__all__:
    home = importlib.import_module(accountant._EXPORTS[name])
    assert getattr(accountant, name) is getattr(home, name), name
    homes[name] = getattr(accountant, name).__module__
try:
    accountant.no_such_name
    missing = "no error"
except AttributeError as exc:
    missing = str(exc)
print(json.dumps({"package": loaded_by_the_package, "events": loaded_by_events, "homes": homes,
                  "dir": sorted(set(accountant.__all__) - set(dir(accountant))), "missing": missing}))
"""


@pytest.mark.slow  # a fresh interpreter, ~3 s; the fast loop runs the in-process test below
def test_the_package_exports_its_public_surface_loaded_on_first_use() -> None:
    """Issue 29 §4: ``accountant`` exports its public surface (``__all__``), each name the object
    of its module, without loading the accountants on ``import accountant`` or on the client's
    ``import accountant.events``; the type checkers' imports list the same names; the package
    ships ``py.typed``."""
    out = subprocess.run(
        [sys.executable, "-c", SURFACE], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout)
    assert report["package"] == ["accountant"]
    assert "accountant.prv" not in report["events"] and "accountant.rules" not in report["events"]
    assert {"GaussianEvent", "make_accountant", "PrvAccountant", "Budget"} <= set(report["homes"])
    assert report["dir"] == [] and "no_such_name" in report["missing"]

    tree = ast.parse(ROOT.joinpath("accountant", "__init__.py").read_text(encoding="utf-8"))
    exported = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
    )
    typed = {
        (node.module, alias.name)
        for block in tree.body
        if _is_type_checking_block(block)
        for node in ast.walk(block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    import accountant

    assert sorted(exported) == sorted(accountant._EXPORTS) == sorted(name for _, name in typed)
    assert typed == {(module, name) for name, module in accountant._EXPORTS.items()}
    assert ROOT.joinpath("accountant", "py.typed").is_file()
    assert 'accountant = ["py.typed"]' in ROOT.joinpath("pyproject.toml").read_text(encoding="utf-8")


def test_a_public_name_is_loaded_from_its_module_on_first_use_and_then_kept() -> None:
    """The same surface in this process (the fast loop's tracing sees it; the test above needs a
    fresh interpreter for what ``import`` loads): with every public name dropped from the
    package's namespace, ``dir`` still lists them, each first use loads the object of its module
    and keeps it there, and an unknown name is an ``AttributeError`` that names it."""
    import accountant

    namespace = vars(accountant)
    kept = {name: namespace.pop(name) for name in accountant.__all__ if name in namespace}
    try:
        assert set(accountant.__all__) <= set(dir(accountant))
        assert not set(accountant.__all__) & set(namespace)
        for name in accountant.__all__:
            home = importlib.import_module(accountant._EXPORTS[name])
            assert getattr(accountant, name) is getattr(home, name), name
            assert namespace[name] is getattr(home, name), name
        unknown = "no_such_name"
        with pytest.raises(AttributeError, match=r"^module 'accountant' has no attribute 'no_such_name'$"):
            getattr(accountant, unknown)
        assert unknown not in namespace
    finally:
        namespace.update(kept)
