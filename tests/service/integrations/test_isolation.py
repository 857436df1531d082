"""The adapters stay outside the core: no module of ``accountant`` or ``service`` (outside
``service/integrations/``) imports them, and importing the app, the client and the worker loads
none of the adapters' libraries (they are extras)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_no_core_module_imports_an_adapter() -> None:
    offenders = []
    for path in [*ROOT.joinpath("accountant").rglob("*.py"), *ROOT.joinpath("service").rglob("*.py")]:
        if ROOT.joinpath("service", "integrations") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("service.integrations")
            ]
    assert offenders == []


@pytest.mark.slow
def test_the_core_loads_none_of_the_adapters_libraries() -> None:
    program = (
        "import json, sys\n"
        "import service.app, service.cli, service.client, service.worker.worker\n"
        "extras = ('opacus', 'dp_accounting', 'mlflow', 'prometheus_client', 'service.integrations')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(extras))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []
