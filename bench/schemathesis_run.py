"""schemathesis against a live ``ledger serve`` (SQLite in a temp folder, a real admin key).

Usage (repository root)::

    python bench/schemathesis_run.py [--max-examples 60] [--checks all|not_a_server_error,...]

Every check by default (``--checks all``), as tests/security/test_schemathesis.py (the CI-sized
run) does it: the built-in ``positive_data_acceptance`` is replaced by
``positive_data_acceptance_or_relation`` (``tests/security/schema_checks.py``, loaded as
schemathesis hooks), and ``tests/security/schemathesis.toml`` counts a 413 as a refusal.
Prints schemathesis' report and the refusals that stated a documented relation; exit status is
schemathesis'.
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--checks", default="all")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ledger-st-"))
    url = f"sqlite:///{folder / 'ledger.db'}"
    upgrade(url)
    server = start_server(url)
    st = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    try:
        env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.security.schema_checks")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        checks = ["--checks", args.checks]
        if args.checks == "all":
            checks += ["--exclude-checks", "positive_data_acceptance"]
        return subprocess.run(
            [
                st,
                "--no-color",
                "--config-file",
                str(ROOT / "tests/security/schemathesis.toml"),
                "run",
                f"{server.base_url}/openapi.json",
                "-H",
                f"Authorization: Bearer {BOOTSTRAP_KEY}",
                "--max-examples",
                str(args.max_examples),
                *checks,
            ],
            cwd=folder,
            env=env,
            check=False,
        ).returncode
    finally:
        stop_server(server.process)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
