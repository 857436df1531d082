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
    for expected in ("accountant.rules", "accountant.filter", "accountant.certificates"):
        assert expected in report["imported"]
    leaked = [m for m in report["modules"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []
