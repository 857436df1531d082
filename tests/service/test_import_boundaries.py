"""Import boundaries inside ``service`` (issue 29 §2), as ``tests/accountant/test_imports.py``
draws them around ``accountant``:

* ``service.verification`` (what a client and a verifier need, and the server uses too) imports
  no SQL, torch or web code and none of the server's or the worker's modules (its signatures and
  audit-chain walk not even numpy);
* ``service.client`` imports neither the server's ledger and database nor the trainers.

Each is checked twice: statically, on every import statement of the module at any depth (a
function-level import counts), and by importing the module in a fresh interpreter and listing
what it loaded.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.accountant.test_imports import _cycle
from tests.accountant.test_imports import _imports as _package_imports

ROOT = Path(__file__).resolve().parents[2]

SERVER_LIBRARIES = ("sqlalchemy", "alembic", "fastapi", "starlette", "uvicorn", "pydantic", "torch")
SERVER_MODULES = (
    "service.ledger",
    "service.db",
    "service.api",
    "service.training",
    "service.worker",
    "service.experiments",
    "service.app",
)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (absolute imports: the project uses no other)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            found.add(str(node.module))
    return found


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _loaded_by(*modules: str) -> list[str]:
    program = (
        "import importlib, json, sys\n"
        f"for name in {list(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def test_the_verification_package_imports_no_sql_torch_web_or_server_code() -> None:
    files = sorted(ROOT.joinpath("service", "verification").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "signing.py", "audit_chain.py"}
    allowed_libraries = {"cryptography", "accountant"}
    for path in files:
        for module in _imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or module == "__future__":
                continue
            assert top in allowed_libraries or _within(module, ("service.verification",)), (
                f"{path.relative_to(ROOT)} imports {module}"
            )
    names = [
        "service.verification",
        *(f"service.verification.{f.stem}" for f in files if f.stem != "__init__"),
    ]
    loaded = _loaded_by(*names)
    leaked = [
        m for m in loaded if m.split(".")[0] in (*SERVER_LIBRARIES, "httpx") or _within(m, SERVER_MODULES)
    ]
    assert leaked == []
    # The signatures and the chain walk load not even numpy (an artifact's check re-hashes a
    # certificate with ``accountant.certificates``, which does).
    loaded = _loaded_by("service.verification.signing", "service.verification.audit_chain")
    assert [m for m in loaded if m.split(".")[0] == "numpy"] == []


@pytest.mark.slow
def test_the_client_imports_neither_the_server_nor_the_trainers() -> None:
    path = ROOT / "service" / "client.py"
    reached = sorted(m for m in _imports(path) if _within(m, SERVER_MODULES))
    assert reached == []
    loaded = _loaded_by("service.client")
    leaked = [m for m in loaded if m.split(".")[0] in SERVER_LIBRARIES or _within(m, SERVER_MODULES)]
    assert leaked == []


def test_the_contract_the_trainers_import_is_the_servers_and_light() -> None:
    """The algorithms, job params and data-source contract (``service.contract``) import no
    trainer and no server module: the API process loads them. The data sources and roots import
    no numpy either (the job params need ``accountant.events``, which does)."""
    files = sorted(ROOT.joinpath("service", "contract").glob("*.py"))
    assert {f.name for f in files} >= {"job_params.py", "data_sources.py", "data_roots.py"}
    for path in files:
        reached = sorted(m for m in _imports(path) if _within(m, SERVER_MODULES))
        assert reached == [], path.name
    loaded = _loaded_by("service.contract.job_params")
    leaked = [m for m in loaded if m.split(".")[0] in SERVER_LIBRARIES or _within(m, SERVER_MODULES)]
    assert leaked == []
    loaded = _loaded_by("service.contract.data_sources", "service.contract.data_roots")
    leaked = [
        m for m in loaded if m.split(".")[0] in (*SERVER_LIBRARIES, "numpy") or _within(m, SERVER_MODULES)
    ]
    assert leaked == []


def test_the_server_imports_no_trainer_and_the_database_no_ledger() -> None:
    """Issue 29 §2: the ledger and the API owned what the trainers need (not the reverse), and
    ``service.db`` sits below the ledger (the ledger registers its errors with it)."""
    below = {
        "ledger": ("service.training", "service.worker"),
        "api": ("service.training", "service.worker"),
        "db": ("service.ledger", "service.api", "service.training", "service.worker"),
    }
    offenders: dict[str, list[str]] = {}
    for package, forbidden in below.items():
        for path in sorted(ROOT.joinpath("service", package).rglob("*.py")):
            bad = sorted(m for m in _imports(path) if _within(m, forbidden))
            if bad:
                offenders[path.relative_to(ROOT).as_posix()] = bad
    assert offenders == {}


def test_only_the_ledger_touches_its_tables() -> None:
    """Issue 29 §2: the worker reads and writes ledger rows through ledger functions only (as only
    procrastinate's manager touches its rows): no SQL, no ORM model in ``service/worker``."""
    files = sorted(ROOT.joinpath("service", "worker").rglob("*.py"))
    assert ROOT / "service" / "worker" / "gate" / "release.py" in files  # the gate's package too
    offenders = {
        path.relative_to(ROOT).as_posix(): bad
        for path in files
        if (bad := sorted(m for m in _imports(path) if _within(m, ("sqlalchemy", "service.db.models"))))
    }
    assert offenders == {}


def test_the_trainers_import_no_pricing_rule() -> None:
    """Issue 29 §4: a trainer calibrates against a price it is handed (a dataset's quote, as
    DP-SGD's ``plan(price=...)``) or built by ``accountant.calibration`` (what a fresh budget
    charges), never by importing the ledger's pricing rules."""
    offenders = {
        path.name: bad
        for path in sorted(ROOT.joinpath("service", "training").rglob("*.py"))  # data/ included
        if (bad := sorted(m for m in _imports(path) if _within(m, ("accountant.rules.prices",))))
    }
    assert offenders == {}


def test_the_service_imports_form_a_dag() -> None:
    """Issue 29 §4, as ``tests/accountant/test_imports.py`` checks ``accountant``: no import cycle
    among ``service``'s modules, a function-level import counted (it is a cycle all the same, only
    deferred); ``certificates`` ↔ ``reservations`` (a geometric certificate's levels) and
    ``l2dp_ml`` ↔ ``functional_mechanism`` (the shared task plan) were such cycles."""
    graph = _package_imports(ROOT, top_level_only=False, package="service")
    assert "service.worker.gate.release" in graph and "service.ledger.spending.engine" in graph
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
