"""Repository-level checks: the README's commands, CI script, linters, layout."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
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


def test_alembic_folder_never_shadows_the_library() -> None:
    assert not (ROOT / "alembic" / "__init__.py").exists()


def _tool(name: str) -> str:
    candidate = Path(sys.executable).with_name(name)
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it is part of the dev extra")
    return found


def test_ruff_is_clean() -> None:
    result = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_formatted() -> None:
    result = subprocess.run(
        [_tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_on_accountant() -> None:
    result = subprocess.run(
        [_tool("mypy"), "--strict", "accountant"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
