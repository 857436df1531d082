"""Which modules of ``service`` and ``accountant`` a test run reaches: a pytest plugin and its report.

The fast loop (README "Development") must still touch every module. This plugin answers that for
any selection: during each test's setup, call and teardown it records the files of the functions
that ran (``sys.settrace``'s ``call`` event, on every thread: the ASGI test client runs the app on
its own), and at the end of the run it lists the modules that no test ran a function of. A module
that defines no function (only constants, types or re-exports) is reached when a test ran with it
imported. Tracing slows the run about twofold, so it is a check to run now and then, not part of
the loop::

    python -m pytest -m "not slow" -p tests.module_reach

Each xdist worker writes what it saw to ``$MODULE_REACH_DIR`` (default: the run's temporary
folder); the controller merges them and prints the modules not reached (an empty list is the aim)
and writes the report to ``module-reach.json`` in that folder.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("service", "accountant")


def _modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _defines_functions(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) for node in ast.walk(tree))


def _folder(config: pytest.Config) -> Path:
    chosen = os.environ.get("MODULE_REACH_DIR")
    if chosen:
        return Path(chosen)
    if hasattr(config, "workerinput"):
        return Path(config.workerinput["module_reach_dir"])
    return Path(tempfile.mkdtemp(prefix="module-reach-"))


class ModuleReach:
    def __init__(self, config: pytest.Config) -> None:
        self.folder = _folder(config)
        self.files: set[str] = set()
        self.imported: set[str] = set()
        self.prefixes = tuple(str(ROOT / package) + os.sep for package in PACKAGES)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> None:
        filename = frame.f_code.co_filename
        if filename not in self.files and filename.startswith(self.prefixes):
            self.files.add(filename)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        sys.settrace(self._trace)
        threading.settrace(self._trace)
        try:
            yield
        finally:
            sys.settrace(None)
            threading.settrace(None)  # type: ignore[arg-type]
            self.imported.update(name for name in sys.modules if name.split(".")[0] in PACKAGES)

    def pytest_configure_node(self, node: Any) -> None:  # the controller, per xdist worker
        node.workerinput["module_reach_dir"] = str(self.folder)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
        (self.folder / f"reach-{worker}.json").write_text(
            json.dumps({"files": sorted(self.files), "imported": sorted(self.imported)})
        )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(terminalreporter.config, "workerinput"):
            return
        files: set[str] = set()
        imported: set[str] = set()
        for part in self.folder.glob("reach-*.json"):
            seen = json.loads(part.read_text())
            files.update(seen["files"])
            imported.update(seen["imported"])
        never_imported, never_run = [], []
        for name, path in _modules().items():
            if str(path) in files:
                continue
            if name not in imported:
                never_imported.append(name)
            elif _defines_functions(path):
                never_run.append(name)
        report = {"modules": len(_modules()), "never_imported": never_imported, "never_run": never_run}
        (self.folder / "module-reach.json").write_text(json.dumps(report, indent=2))
        write = terminalreporter.write_line
        write(f"module reach: {len(_modules())} modules of {', '.join(PACKAGES)}; report in {self.folder}")
        write(f"  imported by no test: {never_imported or 'none'}")
        write(f"  imported, but no test ran a function of it: {never_run or 'none'}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ModuleReach(config), "module-reach")
