"""The CI recipes (examples/ci/, docs/CI.md) fail when the privacy check fails (issue 28 §4).

Each recipe runs under the shell its CI system uses — a GitHub Actions ``run:`` step as ``bash -e
{0}``, or ``bash --noprofile --norc -eo pipefail {0}`` with ``shell: bash`` — with the real
``ledger`` CLI against a real ``ledger serve`` whose dataset fails the gate (the recipe's model has
no release: exit 1), and against no server at all (exit 2). The old recipe, ``ledger check ... |
tee`` in a plain ``run:`` step, is run beside them: it passes a failing check, which is what this
test exists to catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import URL

from service.db.session import Database
from service.ledger import datasets, tenancy
from tests.service.live_server import free_port, serve, settings_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / "examples" / "ci" / "privacy-gate.yml"
SCRIPT = ROOT / "examples" / "ci" / "privacy-check.sh"
OLD_STEP = (
    'ledger check --dataset "$DATASET" --model mlp-digits --max-epsilon 2.0 --json \\\n'
    "  | tee privacy-report.json\n"
)


def _github_shell(step: dict[str, Any]) -> list[str]:
    """The command GitHub Actions runs a Linux ``run:`` step's script file with."""
    if step.get("shell") == "bash":
        return ["bash", "--noprofile", "--norc", "-eo", "pipefail"]
    assert "shell" not in step, step  # sh, pwsh, ...: not what the recipes use
    return ["bash", "-e"]


def _check_steps() -> list[dict[str, Any]]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = [s for job in workflow["jobs"].values() for s in job["steps"] if "run" in s]
    return [s for s in steps if "ledger check" in s["run"]]


def _run(shell: list[str], script: str, cwd: Path, env: dict[str, str]) -> int:
    path = cwd / "step.sh"
    path.write_text(script)
    done = subprocess.run([*shell, str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode


def _env(url: str, key: str, dataset: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # the venv's `ledger`
    return {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "LEDGER_URL": url,
        "LEDGER_API_KEY": key,
        "DATASET": dataset,
    }


def test_the_docs_show_the_workflows_check_step() -> None:
    (step,) = _check_steps()
    docs = (ROOT / "docs" / "CI.md").read_text()
    assert step["shell"] == "bash"
    assert all(line.strip() in docs for line in step["run"].splitlines() if line.strip())
    assert "| tee" not in docs.split("## A plain shell step")[0].split("Never pipe")[0]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_every_recipe_fails_when_the_check_fails(database_url: URL, db: Database, tmp_path: Path) -> None:
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    viewer = tenancy.create_api_key(db, "acme", "viewer")  # makes the tenant
    dataset = datasets.create_dataset(db, "acme", name="gated", budget=budget).id
    (step,) = _check_steps()
    with serve(settings_for(database_url, tmp_path / "artifacts"), db) as url:
        env = _env(url, viewer, dataset)
        # The guarantee fails (no release of mlp-digits): exit 1, the report written.
        assert _run(_github_shell(step), step["run"], tmp_path, env) == 1
        report = json.loads((tmp_path / "privacy-report.json").read_text())
        assert report["ok"] is False
        assert _run(["bash", "-e"], SCRIPT.read_text(), tmp_path, {**env, "MODEL": "mlp-digits"}) == 1
        # The recipe this project shipped before: the same failing check, and the step passes.
        assert _run(["bash", "-e"], OLD_STEP, tmp_path, env) == 0
    # No server: the check cannot run (exit 2), and neither recipe passes.
    env = _env(f"http://127.0.0.1:{free_port()}", viewer, dataset)
    assert _run(_github_shell(step), step["run"], tmp_path, env) == 2
    assert _run(["bash", "-e"], SCRIPT.read_text(), tmp_path, env) == 2
