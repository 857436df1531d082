"""``accountant`` is pure mathematics: importing every module pulls in no service or web code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def _top_level_imports() -> dict[str, set[str]]:
    """Each ``accountant`` module's module-level imports of other ``accountant`` modules."""
    import ast

    graph: dict[str, set[str]] = {}
    for path in ROOT.joinpath("accountant").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        body = ast.parse(path.read_text(encoding="utf-8")).body
        graph[name] = {
            node.module
            for node in body
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accountant")
        }
    return graph


def test_the_package_imports_form_a_dag() -> None:
    """Issue 14 §5: no module-level import cycle (the registry sits above the accountants, the
    errors in a leaf module)."""
    graph = _top_level_imports()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in graph.get(name, ()):
            if dep in graph:
                visit(dep, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())
    assert graph["accountant.errors"] <= {"accountant.events"}
    assert "accountant.registry" not in set().union(
        *(graph[m] for m in ("accountant.basic", "accountant.rdp", "accountant.prv"))
    )
