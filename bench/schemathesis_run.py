"""schemathesis against a live ``ledger serve`` (SQLite in a temp folder, a real admin key).

Usage (repository root)::

    python bench/schemathesis_run.py [--max-examples 60] [--checks not_a_server_error|all]

Prints schemathesis' report; exit status is schemathesis'. The CI-sized run is
tests/security/test_schemathesis.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.db.migrations import upgrade  # noqa: E402
from tests.service.api.conftest import BOOTSTRAP_KEY, start_server, stop_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=60)
    parser.add_argument("--checks", default="not_a_server_error")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ledger-st-"))
    url = f"sqlite:///{folder / 'ledger.db'}"
    upgrade(url)
    server = start_server(url)
    st = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    try:
        return subprocess.run(
            [st, "run", f"{server.base_url}/openapi.json", "-H",
             f"Authorization: Bearer {BOOTSTRAP_KEY}", "--max-examples", str(args.max_examples),
             "--checks", args.checks, "--no-color"], cwd=folder, check=False).returncode
    finally:
        stop_server(server.process)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
