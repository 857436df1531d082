"""Jobs and the model registry over HTTP (the real app through its ASGI interface, its in-process
worker training for real), the registry's crash recovery (``registry.sweep``), and the API
process staying free of torch. SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from sqlalchemy import update
from sqlalchemy.engine import URL

from accountant.certificates import verify
from service.app import create_app
from service.db.base import utcnow
from service.db.models import Job
from service.db.session import Database
from service.ledger import jobs, reservations, tenancy
from service.ledger import model_registry as registry
from service.ledger.errors import Conflict, NotFound
from service.ledger.reservations import parse_event
from service.settings import Settings
from tests.worker.digits_world import DIGITS, digits_dataset, digits_train_ids, staged_files

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys(db: Database) -> dict[str, str]:
    return {
        "admin": tenancy.create_api_key(db, "acme", "admin"),
        "trainer": tenancy.create_api_key(db, "acme", "trainer"),
        "viewer": tenancy.create_api_key(db, "acme", "viewer"),
        "rival": tenancy.create_api_key(db, "rival", "admin"),
    }


@pytest.fixture
def client(db: Database, database_url: URL, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        database_url=database_url.render_as_string(hide_password=False),
        artifact_dir=tmp_path / "artifacts",
        expiry_sweep_interval_s=1.0,
    )
    with TestClient(create_app(settings, database=db, worker=True), raise_server_exceptions=False) as c:
        yield c


def _created(response: Any) -> dict[str, Any]:
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.slow
def test_a_job_over_http_publishes_certified_versions(client: TestClient, keys: dict[str, str]) -> None:
    admin, trainer, viewer, rival = (_bearer(keys[k]) for k in ("admin", "trainer", "viewer", "rival"))
    dataset = _created(
        client.post(
            "/v1/datasets",
            headers=admin,
            json={
                "name": "digits",
                "budget": {"rule": "sequential", "epsilon": 3, "delta": 1e-5, "accountant": "rdp"},
            },
        )
    )
    task = _created(client.post(f"/v1/datasets/{dataset['id']}/tasks", headers=admin, json={"name": "t"}))
    ids = list(digits_train_ids())
    _created(
        client.post(
            f"/v1/datasets/{dataset['id']}/tasks/{task['id']}/batches",
            headers=admin,
            json={"batches": [{"name": "b0", "records": ids[:700]}, {"name": "b1", "records": ids[700:]}]},
        )
    )
    params = {
        "model_name": "digits-mlp",
        "target_epsilon": 2,
        "delta": 1e-5,
        "checkpoint_every": 100,
        "seed": 11,
    }
    body = {"dataset_id": dataset["id"], "algorithm": "dp_sgd", "params": params}

    # Scopes and tenants.
    assert client.post("/v1/jobs", headers=viewer, json=body).status_code == 403
    assert client.post("/v1/jobs", headers=rival, json=body).status_code == 404
    unknown = client.post("/v1/jobs", headers=trainer, json={**body, "algorithm": "sgd"})
    assert unknown.status_code == 422 and unknown.json()["field"] == "algorithm"

    # The data source is the dataset's: a job cannot name one, and a dataset without one (this
    # one so far) takes no job. Nothing is stored. Only an admin sets it.
    named = client.post(
        "/v1/jobs", headers=trainer, json={**body, "params": {**params, "data_source": DIGITS}}
    )
    assert named.status_code == 422 and named.json()["field"] == "params.data_source"
    unsourced = client.post("/v1/jobs", headers=trainer, json=body)
    assert unsourced.status_code == 422 and unsourced.json()["field"] == "dataset_id"
    assert client.get("/v1/jobs", headers=viewer).json()["count"] == 0
    source_path = f"/v1/datasets/{dataset['id']}/data-source"
    assert client.put(source_path, headers=trainer, json={"data_source": DIGITS}).status_code == 403
    sourced = client.put(source_path, headers=admin, json={"data_source": DIGITS})
    assert sourced.status_code == 200 and sourced.json()["data_source"] == DIGITS

    job = _created(client.post("/v1/jobs", headers=trainer, json=body))
    assert job["status"] == "queued" and job["progress"] == {"step": 0, "total": None}
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
        job = client.get(f"/v1/jobs/{job['id']}", headers=viewer).json()
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"] == {"step": 225, "total": 225}
    assert [v["version"] for v in job["versions"]] == [1, 2, 3]
    assert client.get(f"/v1/jobs/{job['id']}", headers=rival).status_code == 404
    assert client.get("/v1/jobs", headers=viewer).json()["count"] == 1
    finished = client.post(f"/v1/jobs/{job['id']}/cancel", headers=trainer)
    assert finished.status_code == 409 and finished.json()["reason"] == "job_finished"
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=viewer).status_code == 403

    # The registry.
    listed = client.get("/v1/models/digits-mlp/versions", headers=viewer).json()
    assert listed["count"] == 3 and [v["step"] for v in listed["data"]] == [100, 200, 225]
    version = client.get("/v1/models/digits-mlp/versions/3", headers=viewer).json()
    assert version["job_id"] == job["id"] and version["created_at"]
    assert version["metrics"]["test_accuracy"] > 0.8
    certificate = version["certificate"]
    assert certificate["id"] == version["certificate_id"]
    assert certificate["release"] == {
        "model": "digits-mlp",
        "version": 3,
        "artifact_sha256": version["artifact"]["sha256"],
    }
    assert verify(certificate["certificate"]).ok
    assert certificate["certificate"]["result"]["charge"]["epsilon"] == job["epsilon_committed"]

    artifact = client.get("/v1/models/digits-mlp/versions/3/artifact", headers=viewer)
    assert artifact.status_code == 200
    digest = hashlib.sha256(artifact.content).hexdigest()
    assert digest == artifact.headers["x-artifact-sha256"] == version["artifact"]["sha256"]
    pytest.importorskip("torch")
    from service.training.nets import load_state

    state = load_state(artifact.content, version["artifact"]["format"])  # safetensors where installed
    assert "net.1.weight" in state

    for path in (
        "/v1/models/digits-mlp/versions",
        "/v1/models/digits-mlp/versions/3",
        "/v1/models/digits-mlp/versions/3/artifact",
    ):
        assert client.get(path, headers=rival).status_code == 404
    assert client.get("/v1/models/no-such-model/versions", headers=viewer).status_code == 404
    assert client.get("/v1/models/digits-mlp/versions/4", headers=viewer).status_code == 404
    bad = client.get("/v1/models/digits-mlp/versions/three", headers=viewer)
    assert bad.status_code == 422 and bad.json()["field"] == "version"
    assert client.get("/v1/models/digits-mlp/versions").status_code == 401


# ---------------------------------------------------------------------------------------------
# Crash recovery of the registry
# ---------------------------------------------------------------------------------------------


def _stage(artifacts: Path, job_id: str, dataset_id: str, version: int) -> registry.StagedArtifact:
    payload = f"weights of v{version}".encode()

    def write(handle: IO[bytes]) -> None:
        handle.write(payload)

    return registry.stage(
        artifacts,
        tenant_id="acme",
        name="m",
        version=version,
        job_id=job_id,
        attempt=1,
        dataset_id=dataset_id,
        step=version,
        metrics={"test_accuracy": 0.5},
        fmt="torch",
        write=write,
    )


def _steps(count: int) -> dict[str, Any]:
    return {"kind": "self_composed", "count": count, "event": {"kind": "gaussian", "noise_multiplier": 5.0}}


def test_sweep_rolls_committed_candidates_forward_and_deletes_the_others(
    db: Database, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    world = digits_dataset(db, records=[f"r{i}" for i in range(4)], epsilon="10")
    params = {"model_name": "m", "noise_multiplier": 1.0, "steps": 4}  # (never trained here)
    dead = jobs.queue.create_job(
        db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd", params=params
    ).id
    live = jobs.queue.create_job(
        db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd", params=params
    ).id
    held = reservations.reserve(
        db,
        "acme",
        world.dataset_id,
        event=parse_event(_steps(4)),
        batch_ids=list(world.batch_ids),
    ).to_json()

    def commit(staged: registry.StagedArtifact, steps: int) -> str:
        release = {"model": "m", "version": staged.version, "artifact_sha256": staged.sha256}
        answer = reservations.commit(
            db, "acme", held["id"], release=release, event=parse_event(_steps(steps))
        ).to_json()
        return str(answer["certificate"]["id"])

    # v1: crashed after the commit, before the publication.
    one = _stage(artifacts, dead, world.dataset_id, 1)
    cert_one = commit(one, 1)
    # v2: crashed inside the publication, after the file moved, before the row committed.
    two = _stage(artifacts, dead, world.dataset_id, 2)
    cert_two = commit(two, 2)
    (artifacts / two.final_path).parent.mkdir(parents=True, exist_ok=True)
    os.replace(two.staging_path(artifacts), artifacts / two.final_path)
    # v3: crashed before its commit: never certified.
    _stage(artifacts, dead, world.dataset_id, 3)
    # A live worker's candidate (its lease is valid): left alone.
    claimed = jobs.leases.claim(db, "alive", 60)
    assert claimed is not None and claimed.id == dead  # the oldest; finish it, then claim the other
    jobs.leases.finish(db, claimed.lease, "failed")
    alive = jobs.leases.claim(db, "alive", 60)
    assert alive is not None and alive.id == live
    _stage(artifacts, live, world.dataset_id, 9)

    outcome = registry.sweep(db, artifacts, now=utcnow())
    assert sorted(outcome["published"]) == [one.staging_name, two.staging_name]
    assert len(outcome["discarded"]) == 1 and "v3" in outcome["discarded"][0]
    assert len(outcome["skipped"]) == 1 and live in outcome["skipped"][0]

    listed = registry.list_versions(db, "acme", "m")
    assert [(v.version, v.certificate_id) for v in listed.data] == [(1, cert_one), (2, cert_two)]
    for staged in (one, two):
        path = artifacts / staged.final_path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == staged.sha256
    assert all(name.startswith(live) for name in staged_files(artifacts))
    assert registry.next_version(db, "acme", "m") == 3
    assert registry.sweep(db, artifacts)["published"] == []  # nothing left to do


def test_sweep_publishes_a_candidate_only_under_its_own_release_certificate(
    db: Database, tmp_path: Path
) -> None:
    """Issue 24 §6: job A stages v1 and dies before its commit; another committer then takes
    release m/1 (the version numbers staged candidates do not reserve). The sweep published A's
    uncommitted weights under that other certificate."""
    artifacts = tmp_path / "artifacts"
    world = digits_dataset(db, records=[f"r{i}" for i in range(4)], epsilon="10")
    params = {"model_name": "m", "noise_multiplier": 1.0, "steps": 4}
    dead = jobs.queue.create_job(
        db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd", params=params
    ).id
    orphan = _stage(artifacts, dead, world.dataset_id, 1)
    other = reservations.reserve(
        db, "acme", world.dataset_id, event=parse_event(_steps(1)), batch_ids=list(world.batch_ids)
    ).to_json()
    other_weights = hashlib.sha256(b"the other trainer's weights").hexdigest()
    certified = reservations.commit(
        db, "acme", other["id"], release={"model": "m", "version": 1, "artifact_sha256": other_weights}
    ).to_json()
    assert certified["certificate"]["certificate"]["release"]["artifact_sha256"] == other_weights

    outcome = registry.sweep(db, artifacts, now=utcnow())
    assert outcome["published"] == [] and outcome["discarded"] == [orphan.staging_name]
    with pytest.raises(NotFound):
        registry.list_versions(db, "acme", "m")
    assert staged_files(artifacts) == []
    # publish itself refuses bytes the certificate does not name.
    again = _stage(artifacts, dead, world.dataset_id, 1)
    with pytest.raises(Conflict) as refused:
        registry.publish(db, artifacts, again, certificate_id=certified["certificate"]["id"])
    assert refused.value.reason == "artifact_not_certified"

    # A certificate issued before releases named their artifact is the candidate's only when its
    # reservation is the candidate's job's.
    held = reservations.reserve(
        db, "acme", world.dataset_id, event=parse_event(_steps(1)), batch_ids=list(world.batch_ids)
    ).to_json()
    legacy = _stage(artifacts, dead, world.dataset_id, 2)
    reservations.commit(db, "acme", held["id"], release={"model": "m", "version": 2})
    assert registry.sweep(db, artifacts)["discarded"] == [again.staging_name, legacy.staging_name]
    legacy = _stage(artifacts, dead, world.dataset_id, 2)
    with db.session() as session:
        session.execute(update(Job).where(Job.id == dead).values(reservation_id=held["id"]))
    assert registry.sweep(db, artifacts)["published"] == [legacy.staging_name]


@pytest.mark.slow
def test_the_api_process_does_not_import_torch(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from service.app import create_app\n"
        "from service.settings import Settings\n"
        f"create_app(Settings(database_url='sqlite:///{tmp_path}/x.db'), worker=True)\n"
        "import service.worker.worker, service.worker.gate, service.ledger.model_registry\n"
        "print('torch' in sys.modules)\n"
    )
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
