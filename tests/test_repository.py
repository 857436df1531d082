"""Repository-level checks: the README's commands, CI script, linters, layout."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", quick_start, re.S)]


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    serve, tests = commands
    assert "ledger serve" in serve
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, test_command = _readme_commands()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines
    # It installs from scratch: the virtual environment is removed first.
    assert ci_lines.index("rm -rf .venv") < ci_lines.index(test_command)


def test_ci_installs_cpu_torch_before_the_project() -> None:
    _, test_command = _readme_commands()
    assert test_command.index("torch==2.13.0") < test_command.index('-e ".[dev]"')


def _distribution(requirement: str) -> str:
    return re.split(r"[ <>=;\[!~]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _installed_closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with their own dependencies (no extras)."""
    closure: set[str] = set()
    todo = [_distribution(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_distribution(r) for r in requires if "extra ==" not in r]
    return closure


# What a plain install (no extra) must run: the accountants, the client and the client-side
# commands with what they import (issue 14 §4). Everything else in `service/` is the server's,
# `service/worker/` and `service/experiments/` the worker's.
CLIENT_SIDE = (
    "service/__init__.py",
    "service/cli.py",
    "service/client.py",
    "service/commands/__init__.py",
    "service/commands/epsilon.py",
    "service/commands/calibrate.py",
    "service/commands/check.py",
    "service/commands/export.py",
    "service/commands/model_card.py",
    "service/verification/__init__.py",
    "service/verification/signing.py",
    "service/verification/audit_chain.py",
    "service/verification/artifacts.py",
    "service/verification/bundle.py",
    "service/verification/history.py",
)


# The adapters (service/integrations/): each one's library comes with an extra of its own.
INTEGRATIONS = {
    "service/integrations/opacus.py": "opacus",
    "service/integrations/mlflow.py": "mlflow",
    "service/integrations/dp_accounting.py": "dp-accounting",
}


def _extra(relative: str) -> str | None:
    """The extra a source file's imports may come from (``None``: the core install)."""
    if relative in INTEGRATIONS:
        return INTEGRATIONS[relative]
    if relative.startswith("accountant/") or relative in CLIENT_SIDE:
        return None
    if relative.startswith(("service/worker/", "service/training/", "service/experiments/")):
        return "worker"
    return "server"


def _guards_import(node: ast.AST) -> bool:
    """A ``try`` whose handlers catch ``ImportError`` / ``ModuleNotFoundError``."""
    if not isinstance(node, ast.Try):
        return False
    names = set()
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {k.id for k in kinds if isinstance(k, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


@pytest.mark.slow
def test_each_install_has_every_library_its_code_imports() -> None:
    """``pip install privacy-ledger`` (no extra) runs the accountants, the client and ``ledger
    epsilon`` / ``check`` / ``export``; the ``server`` extra adds what the service imports; the
    ``worker`` extra (which includes ``server``) what the trainers and experiments import."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = project["dependencies"]
    server = [*core, *project["optional-dependencies"]["server"]]
    worker = [*server, *(r for r in project["optional-dependencies"]["worker"] if "privacy-ledger" not in r)]
    extras = project["optional-dependencies"]

    def requirements(extra: str) -> list[str]:
        """An extra's requirements, ``privacy-ledger[x]`` expanded to x's."""
        out: list[str] = []
        for r in extras[extra]:
            if r.startswith("privacy-ledger["):
                for inner in r[len("privacy-ledger[") : -1].split(","):
                    out += requirements(inner)
            else:
                out.append(r)
        return out

    closures: dict[str | None, set[str]] = {
        None: _installed_closure(core),
        "server": _installed_closure(server),
        "worker": _installed_closure(worker),
        **{e: _installed_closure([*core, *requirements(e)]) for e in set(INTEGRATIONS.values())},
    }
    providers = importlib.metadata.packages_distributions()
    missing: dict[str, set[str]] = {}
    for path in [*ROOT.glob("service/**/*.py"), *ROOT.glob("accountant/**/*.py")]:
        relative = path.relative_to(ROOT).as_posix()
        closure = closures[_extra(relative)]
        tree = ast.parse(path.read_text())
        optional = {id(n) for t in ast.walk(tree) if _guards_import(t) for b in t.body for n in ast.walk(b)}  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if id(node) in optional:
                continue  # `try: import x / except ImportError:` — used when installed
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("service", "accountant"):
                    continue
                names = {d.lower().replace("_", "-") for d in providers.get(top, [])}
                if not names & closure:
                    missing.setdefault(top, set()).add(relative)
    assert not missing, f"imported but not in that install: {missing}"
    assert "privacy-ledger[server]" in project["optional-dependencies"]["worker"]


def test_top_level_layout_is_the_agreed_one() -> None:
    allowed = {
        "pyproject.toml",
        "service",
        "accountant",
        "alembic",
        "tests",
        "docker-compose.yml",
        "Dockerfile",
        "README.md",
        ".ci",
        "bench",
        "docs",
        "examples",
        ".git",
        ".gitignore",
    }
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {path.split("/", 1)[0] for path in tracked}
    assert top <= allowed, sorted(top - allowed)


# The review's twelve concepts (issue 29 §4): a newcomer finds each in one try from the table.
REVIEW_CONCEPTS = (
    "lifelong rule",
    "Rényi filter admission",
    "commit path, from the call to the SQL",
    "certificate contents",
    "DP-SGD clip and noise",
    "where the worker refuses to release",
    "geometric allowance",
    "plan segments",
    "quote route",
    "job params",
    "one-run audit",
    "dashboard numbers",
)


def _where_to_find_things() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("## Where to find things", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in table.splitlines() if line.startswith("| ") and " | " in line]
    return [(what.removeprefix("| "), where) for what, where in rows[1:]]


def test_where_to_find_things_names_files_that_exist_and_the_reviews_concepts() -> None:
    """Every path in ARCHITECTURE's table exists (a move updates the table), and each of the twelve
    concepts of the review has its row."""
    rows = _where_to_find_things()
    assert len(rows) > 40
    paths = {p for _, where in rows for p in re.findall(r"`([\w./*-]+/[\w./*-]*)`", where)}
    assert len(paths) > 40
    missing = sorted(p for p in paths if not any(ROOT.glob(p.rstrip("/"))))
    assert missing == []
    firsts = [what for what, _ in rows]
    assert [c for c in REVIEW_CONCEPTS if not any(c in what for what in firsts)] == []


def test_alembic_folder_never_shadows_the_library() -> None:
    assert not (ROOT / "alembic" / "__init__.py").exists()


def _tool(name: str) -> str:
    candidate = Path(sys.executable).with_name(name)
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it is part of the dev extra")
    return found


@pytest.mark.slow
def test_ruff_is_clean() -> None:
    result = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_code_is_formatted() -> None:
    result = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_strict_on_accountant() -> None:
    result = subprocess.run(
        [_tool("mypy"), "--strict", "accountant"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
