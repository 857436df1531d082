"""Deployment files: ``docker-compose.yml`` validates and says what the deployment promises, and
the ``Dockerfile`` has the agreed stages (an ``api`` target without torch, a ``worker`` target with
torch on a configurable base image), a non-root user, and migrations at start-up.

``docker compose config`` (or the standalone ``docker-compose config``) needs no Docker engine,
only the client: the validation runs whenever one is installed and skips, saying which, when none
is. The structure is read with PyYAML, or from ``docker compose config --format json``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SECRETS = {
    "POSTGRES_PASSWORD": "test-password",
    "LEDGER_BOOTSTRAP_ADMIN_KEY": "pl_test_key_0123456789abcdefghij",
}


# ---------------------------------------------------------------------------------------------
# docker compose
# ---------------------------------------------------------------------------------------------


@cache
def compose_command() -> tuple[list[str] | None, str]:
    """The compose CLI (``docker compose`` plugin, else standalone ``docker-compose``), or None
    and why not."""
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "compose"], "docker compose"
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        return [standalone], "docker-compose"
    if docker is None:
        return None, "no docker client is installed (neither `docker` nor `docker-compose`)"
    return None, (
        "a docker client is installed but neither its compose plugin (`docker compose`) nor the "
        "standalone `docker-compose` is, so the compose file cannot be validated here"
    )


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command, why = compose_command()
    if command is None:
        pytest.skip(why)
    child_env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    child_env.update(env or {})
    return subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_docker_compose_config_validates() -> None:
    result = compose("config", "-q", env=SECRETS)
    assert result.returncode == 0, result.stdout + result.stderr
    services = compose("--profile", "cpu", "config", "--services", env=SECRETS)
    assert services.returncode == 0, services.stderr
    assert set(services.stdout.split()) == {"postgres", "api", "worker", "worker-cpu"}


@pytest.mark.slow
def test_secrets_have_no_usable_default() -> None:
    result = compose(
        "config", "-q", env={"LEDGER_BOOTSTRAP_ADMIN_KEY": SECRETS["LEDGER_BOOTSTRAP_ADMIN_KEY"]}
    )
    assert result.returncode != 0
    assert "POSTGRES_PASSWORD" in result.stdout + result.stderr


def load_compose() -> dict[str, Any]:
    """The compose file as data: PyYAML when installed, else the compose CLI's JSON."""
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ModuleNotFoundError:
        command, why = compose_command()
        if command is None or command[-1] != "compose":
            pytest.skip(
                f"PyYAML is not installed and `docker compose config --format json` is unavailable: {why}"
            )
        result = compose("--profile", "cpu", "config", "--format", "json", "--no-interpolate", env=SECRETS)
        assert result.returncode == 0, result.stderr
        document: dict[str, Any] = json.loads(result.stdout)
        return document
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return loaded


def test_compose_services_volumes_health_and_gpu() -> None:
    document = load_compose()
    services = document["services"]
    assert {"postgres", "api", "worker", "worker-cpu"} <= set(services)

    postgres = services["postgres"]
    assert postgres["image"].startswith("postgres:")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert any(str(v).startswith("pgdata:") for v in postgres["volumes"])
    assert "${POSTGRES_PASSWORD:?" in str(postgres["environment"]["POSTGRES_PASSWORD"])

    api = services["api"]
    assert api["build"]["target"] == "api"
    assert api["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert str(api["environment"]["LEDGER_DATABASE_URL"]).startswith("postgresql+psycopg://")
    assert {"serve", "--no-worker"} <= set(api["command"])
    assert "/healthz" in " ".join(api["healthcheck"]["test"])
    assert "${LEDGER_BOOTSTRAP_ADMIN_KEY:?" in str(api["environment"]["LEDGER_BOOTSTRAP_ADMIN_KEY"])

    for name in ("worker", "worker-cpu"):
        worker = services[name]
        assert worker["build"]["target"] == "worker"
        assert "BASE_IMAGE" in worker["build"]["args"]
        assert worker["command"] == ["worker"]
        assert worker["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert str(worker["environment"]["LEDGER_DATABASE_URL"]).startswith("postgresql+psycopg://")
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in services["worker-cpu"] and services["worker-cpu"]["profiles"] == ["cpu"]

    # one artifact volume, mounted where LEDGER_ARTIFACT_DIR points, in the api and every worker
    mounts = {}
    for name in ("api", "worker", "worker-cpu"):
        service = services[name]
        (mount,) = [str(v) for v in service["volumes"] if str(v).startswith("artifacts:")]
        mounts[name] = mount
        assert mount == f"artifacts:{service['environment']['LEDGER_ARTIFACT_DIR']}"
    assert len(set(mounts.values())) == 1
    assert {"pgdata", "artifacts"} <= set(document["volumes"])


# ---------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: dict[str, Stage]

    def chain(self, name: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        out = [self.stages[name]]
        while out[-1].base in self.stages:
            out.append(self.stages[out[-1].base])
        return out


def parse_dockerfile(text: str) -> Dockerfile:
    """Instructions (continuation lines joined, comments dropped), grouped by stage."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not current):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args.strip(), re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            stage = Stage(match.group(2), match.group(1))
            stages[stage.name] = stage
        elif stage is None:
            assert keyword == "ARG", f"only ARG may precede the first FROM: {line}"
            name, _, default = args.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            stage.instructions.append((keyword, args.strip()))
    return Dockerfile(global_args, stages)


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_dockerfile_stages_and_targets(dockerfile: Dockerfile) -> None:
    assert {"base", "api", "worker"} <= set(dockerfile.stages)
    assert dockerfile.stages["api"].base == "base"
    # the worker's base image is a build argument, defaulting to a CPU Python image
    assert dockerfile.stages["worker"].base == "${BASE_IMAGE}"
    assert re.fullmatch(r"python:3\.1[1-9]\S*", dockerfile.global_args["BASE_IMAGE"])
    assert "nvidia" not in dockerfile.global_args["BASE_IMAGE"]


def test_images_run_as_a_non_root_user(dockerfile: Dockerfile) -> None:
    for name in ("api", "worker"):
        users = [u for stage in dockerfile.chain(name) for u in stage.all("USER")]
        assert users, f"{name} sets no USER"
        assert users[0].split(":")[0] not in ("root", "0"), f"{name} runs as {users[0]}"


@pytest.mark.slow
def test_the_api_image_installs_no_torch(dockerfile: Dockerfile) -> None:
    for stage in dockerfile.chain("api"):
        for run in stage.all("RUN"):
            assert "torch" not in run, f"stage {stage.name} installs torch: {run}"
            assert "[worker" not in run and ",worker" not in run and "dev]" not in run, run
    # and the API really starts without it: nothing the app imports pulls torch in
    probe = (
        "import sys; from service.app import create_app; from service.settings import Settings; "
        "from service.cli import build_parser; build_parser(); "
        "create_app(Settings(database_url='sqlite:///unused.db')); "
        "loaded = [m for m in ('torch', 'opacus', 'sklearn') if m in sys.modules]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_worker_image_installs_torch_and_the_worker_extra(dockerfile: Dockerfile) -> None:
    worker = dockerfile.stages["worker"]
    args = dict(a.partition("=")[::2] for a in worker.all("ARG"))
    assert args["TORCH_VERSION"] == "2.13.0"  # the version the README's test command pins
    assert "TORCH_INDEX_URL" in args
    runs = " ".join(worker.all("RUN"))
    assert "torch==${TORCH_VERSION}" in runs and '--index-url "$TORCH_INDEX_URL"' in runs
    assert runs.index("torch==") < runs.index(".[postgres,worker]")


@pytest.mark.slow
def test_migrations_at_start_up(dockerfile: Dockerfile, tmp_path: Path) -> None:
    # both images start a command that migrates first: `ledger serve` (its tests check it) and
    # `ledger worker`, checked here on an empty database
    for name in ("api", "worker"):
        chain = dockerfile.chain(name)
        entrypoint = next(e for stage in chain for e in stage.all("ENTRYPOINT"))
        command = next(c for stage in chain for c in stage.all("CMD"))
        assert json.loads(entrypoint) == ["ledger"]
        assert json.loads(command)[0] == ("serve" if name == "api" else "worker")
    assert "--no-worker" in json.loads(dockerfile.stages["api"].all("CMD")[0])
    # the migrations are found next to the editable install of `service`
    copies = " ".join(dockerfile.stages["base"].all("COPY"))
    assert "alembic" in copies and "service" in copies and "accountant" in copies
    assert 'pip install -e ".[server,postgres]"' in " ".join(dockerfile.stages["base"].all("RUN"))

    from service.db import migrations

    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "worker", "--once", "--database-url", url,
         "--artifact-dir", str(tmp_path / "artifacts"), "--log-level", "warning"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # 1: no job queued
    assert migrations.current_revision(url) is not None
