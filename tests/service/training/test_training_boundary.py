"""``service.training`` is the algorithms apart from the worker (issue 14 §2): no module in it
imports the database, the API, the ledger or the worker, checked on the source (module-level and
function-level imports alike)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = (
    "service.db",
    "service.api",
    "service.ledger",
    "service.worker",
    "sqlalchemy",
    "fastapi",
    "alembic",
)


def test_training_imports_no_database_api_ledger_or_worker() -> None:
    offenders: dict[str, list[str]] = {}
    modules = sorted(ROOT.joinpath("service", "training").glob("*.py"))
    assert len(modules) > 10
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            bad = [n for n in names if n == "service.worker" or n.startswith(FORBIDDEN)]
            if bad:
                offenders.setdefault(path.name, []).extend(bad)
    assert offenders == {}
