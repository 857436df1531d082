"""Migrations: the only way the schema is made. They must agree with the models, and every
revision must downgrade and upgrade again, on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

import alembic
from service.db import migrations
from service.db.models import Base
from service.db.session import create_ledger_engine
from service.ledger.reservations import parse_event


def _diff(url: URL, metadata: sa.MetaData = Base.metadata) -> list[Any]:
    engine = create_ledger_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def _tables(url: URL) -> set[str]:
    engine = create_ledger_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return set(sa.inspect(connection).get_table_names())
    finally:
        engine.dispose()


def test_models_and_migrations_agree(empty_database_url: URL) -> None:
    migrations.upgrade(empty_database_url)
    assert migrations.is_up_to_date(empty_database_url)
    assert _diff(empty_database_url) == []


@pytest.mark.slow
def test_the_comparison_sees_differences(empty_database_url: URL) -> None:
    """Negative control: a model change the migrations lack is reported."""
    migrations.upgrade(empty_database_url)
    changed = sa.MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.tables.values():
        table.to_metadata(changed)
    changed.tables["datasets"].append_column(sa.Column("extra_column", sa.Integer()))
    changed.tables["batches"].c.size.type = sa.String(10)
    kinds = {d[0] if isinstance(d, tuple) else d[0][0] for d in _diff(empty_database_url, changed)}
    assert "add_column" in kinds and "modify_type" in kinds


@pytest.mark.slow
def test_every_revision_downgrades_and_upgrades(empty_database_url: URL) -> None:
    migrations.upgrade(empty_database_url)
    full = _tables(empty_database_url)
    script = ScriptDirectory.from_config(migrations.alembic_config(empty_database_url))
    for revision in script.walk_revisions():  # newest first
        migrations.downgrade(empty_database_url, revision.down_revision or "base")
        migrations.upgrade(empty_database_url, revision.revision)
        migrations.downgrade(empty_database_url, revision.down_revision or "base")
    assert _tables(empty_database_url) <= {"alembic_version"}
    assert migrations.current_revision(empty_database_url) is None
    migrations.upgrade(empty_database_url)
    assert _tables(empty_database_url) == full
    assert _diff(empty_database_url) == []


def test_upgrade_is_idempotent(empty_database_url: URL) -> None:
    migrations.upgrade(empty_database_url)
    migrations.upgrade(empty_database_url)
    assert migrations.current_revision(empty_database_url) == migrations.head_revision()


def test_script_folder_never_shadows_the_alembic_library() -> None:
    location = migrations.script_location()
    assert location.name == "alembic" and (location / "env.py").is_file()
    assert not (location / "__init__.py").exists()
    assert Path(alembic.__file__).resolve().parent != location.resolve()
    for path in (location / "versions").glob("*.py"):  # named <yyyy_mm_dd>_<slug>.py
        assert re.fullmatch(r"\d{4}_\d{2}_\d{2}_[a-z0-9_]+", path.stem), path.name


@pytest.mark.slow
def test_concurrent_upgrades_migrate_once(empty_database_url: URL) -> None:
    """Several processes starting at once (``ledger serve`` workers) may all migrate; so may
    several threads of one process."""
    url = empty_database_url.render_as_string(hide_password=False)
    script = f"from service.db.migrations import upgrade; upgrade({url!r})"
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    children = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE) for _ in range(3)
    ]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            migrations.upgrade(empty_database_url)
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for child in children:
        _, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr.decode()
    assert not errors
    assert migrations.is_up_to_date(empty_database_url)
    assert _diff(empty_database_url) == []


BEFORE_DATA_SOURCE = "7b3e9c1d5a20"  # the revision before 2026_11_25_dataset_data_source


@pytest.mark.slow
def test_existing_datasets_get_a_source_only_from_builtin_jobs(empty_database_url: URL) -> None:
    """The data-source migration: a dataset gets the ``builtin:`` source every one of its jobs
    named, and nothing otherwise (a ``file://`` path may lie outside the data roots or be another
    tenant's file: an admin sets it again, checked against the roots)."""
    from datetime import UTC, datetime

    from service.db.session import Database
    from service.ledger import datasets, tenancy

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    named = {
        "one_builtin": ["builtin:digits", "builtin:digits"],
        "file": ["file:///srv/other-tenant/secret.csv"],
        "mixed": ["builtin:digits", "file:///tmp/x.csv"],
        "two_builtins": ["builtin:digits", "builtin:split-digits?tasks=5"],
        "no_jobs": [],
        "missing_key": [None],
    }
    try:
        tenancy.create_api_key(db, "acme", "viewer")
        ids = {name: datasets.create_dataset(db, "acme", name=name, budget=budget).id for name in named}
    finally:
        db.dispose()
    migrations.downgrade(empty_database_url, BEFORE_DATA_SOURCE)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    jobs = sa.table(
        "jobs",
        *(sa.column(c) for c in ("id", "tenant_id", "dataset_id", "algorithm", "model_name", "status")),
        sa.column("params", sa.JSON()),
        sa.column("max_attempts", sa.Integer()),
        sa.column("created_at", sa.DateTime(timezone=True)),
        sa.column("updated_at", sa.DateTime(timezone=True)),
    )
    at = datetime.now(UTC)
    try:
        with engine.begin() as connection:
            for name, sources in named.items():
                for i, source in enumerate(sources):
                    params = {"steps": 1} if source is None else {"data_source": source}
                    connection.execute(
                        jobs.insert().values(
                            id=f"job_{name}_{i}",
                            tenant_id="acme",
                            dataset_id=ids[name],
                            algorithm="dp_sgd",
                            model_name=f"m-{name}",
                            status="succeeded",
                            params=params,
                            max_attempts=3,
                            created_at=at,
                            updated_at=at,
                        )
                    )
        migrations.upgrade(empty_database_url)
        with engine.connect() as connection:
            found = dict(connection.execute(sa.text("SELECT id, data_source FROM datasets")).all())
    finally:
        engine.dispose()
    assert {name: found[ids[name]] for name in named} == {
        "one_builtin": "builtin:digits",
        "file": None,
        "mixed": None,
        "two_builtins": None,
        "no_jobs": None,
        "missing_key": None,
    }


def _a_spend_and_a_hold(
    db: Any, batches_made: int, spent: slice, held: slice
) -> tuple[str, list[str], dict[str, Any]]:
    """A basic ε = 1 dataset of tenant ``acme`` (with a viewer key) and ``batches_made``
    one-record batches: ε 0.25 reserved and committed on ``spent`` of them, then ε 0.5 held on
    ``held``. ``(dataset id, batch ids, the open reservation)``."""
    from service.ledger import batches, datasets, reservations, tenancy

    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    tenancy.create_api_key(db, "acme", "viewer")
    ds = datasets.create_dataset(db, "acme", name="d", budget=budget).id
    task = batches.create_task(db, "acme", ds, name="t").id
    made = batches.create_batches(
        db, "acme", ds, task, batches=[{"name": f"b{i}", "records": [f"r{i}"]} for i in range(batches_made)]
    )
    ids = [b.id for b in made.data]
    charge = reservations.reserve(
        db, "acme", ds, event=parse_event({"kind": "pure_dp", "epsilon": 0.25}), batch_ids=ids[spent]
    ).to_json()
    reservations.commit(db, "acme", charge["id"], release={"model": "m", "version": "1"})
    hold = reservations.reserve(
        db, "acme", ds, event=parse_event({"kind": "pure_dp", "epsilon": 0.5}), batch_ids=ids[held]
    ).to_json()
    return ds, ids, hold


BEFORE_STATE_CLASSES = "c4a1d2e3f504"


@pytest.mark.slow
def test_state_classes_migrate_both_ways_and_keep_every_ledger(empty_database_url: URL) -> None:
    """The state-class migration: a ledger with committed charges on some batches and an open
    reservation on others is expanded back to one state per batch (downgrade) and regrouped
    (upgrade) with every batch's state, every hold and every reservation intact: the open
    reservation still commits, and its certificate verifies and lists the right batches."""
    from accountant.certificates import check_batch_set, verify
    from service.db.session import Database
    from service.ledger import reservations, views

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        ds, ids, held = _a_spend_and_a_hold(db, 6, spent=slice(None, 4), held=slice(2, None))
        before = views.batch_spend(db, "acme", ds).to_json()["data"]
        members = reservations.all_batches(db, "acme", held["id"])
    finally:
        db.dispose()
    migrations.downgrade(empty_database_url, BEFORE_STATE_CLASSES)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT id, state FROM batches")).all()
            states = {i: (s if isinstance(s, dict) else __import__("json").loads(s)) for i, s in rows}
            held_rows = connection.execute(
                sa.text("SELECT batch_id FROM reservation_batches WHERE reservation_id = :r"),
                {"r": held["id"]},
            ).all()
    finally:
        engine.dispose()
    assert states[ids[0]]["epsilon_spent"] == "0.25" and states[ids[5]]["epsilon_held"] == "0.5"
    assert states[ids[2]]["epsilon_spent"] == "0.25" and states[ids[2]]["epsilon_held"] == "0.5"
    assert sorted(r.batch_id for r in held_rows) == sorted(ids[2:])
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        assert views.batch_spend(db, "acme", ds).to_json()["data"] == before
        assert reservations.get_reservation(db, "acme", held["id"]).to_json()["batches"] == held["batches"]
        assert reservations.all_batches(db, "acme", held["id"]) == members
        answer = reservations.commit(db, "acme", held["id"], release={"model": "m", "version": "2"}).to_json()
        certificate = answer["certificate"]["certificate"]
        assert verify(certificate).ok
        assert certificate["result"]["epsilon"] == "0.75"  # the batches read twice
        assert check_batch_set(certificate, members).ok
    finally:
        db.dispose()


BEFORE_PLAN_SEGMENTS = "c4a1d2e3f505"  # the revision before 2026_11_25_plan_segments


@pytest.mark.slow
def test_plan_segments_cannot_be_downgraded_away_while_a_dataset_has_declared_one(
    empty_database_url: URL,
) -> None:
    """Code from before ``datasets.plan_segments`` reads a budget as its first plan alone: a batch
    whose first plan was closed could run it again. The downgrade refuses while any dataset has
    declared a segment, changes nothing, and goes through once none has (the count reset here by
    hand, as an operator would after deciding what those budgets become)."""
    from service.db.session import Database
    from service.ledger import datasets, plan_segments, tenancy

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    pure = {"kind": "pure_dp", "epsilon": 0.5}
    budget = {
        "rule": "sequential",
        "epsilon": "2",
        "delta": "1e-5",
        "accountant": "prv",
        "plan": [pure],
        "plan_delta": "5e-6",
    }
    try:
        tenancy.create_tenant(db, "acme")
        plain = datasets.create_dataset(db, "acme", name="plain", budget=budget).id
        segmented = datasets.create_dataset(db, "acme", name="segmented", budget=budget).id
        plan_segments.declare_segment(db, "acme", segmented, plan=[parse_event(pure)], delta="5e-6")
    finally:
        db.dispose()
    try:
        migrations.downgrade(empty_database_url, BEFORE_PLAN_SEGMENTS)
    except RuntimeError as exc:
        assert segmented in str(exc) and plain not in str(exc)
    else:
        raise AssertionError("the downgrade went through with a declared segment")
    assert migrations.is_up_to_date(empty_database_url)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            assert dict(connection.execute(sa.text("SELECT id, plan_segments FROM datasets")).all()) == {
                plain: 0,
                segmented: 1,
            }
            connection.execute(sa.text("UPDATE datasets SET plan_segments = 0"))
    finally:
        engine.dispose()
    migrations.downgrade(empty_database_url, BEFORE_PLAN_SEGMENTS)
    migrations.upgrade(empty_database_url)
    assert _diff(empty_database_url) == []


BEFORE_LEAN_BATCHES = "c4a1d2e3f5a1"  # the revision before 2026_11_26_lean_batch_pointers


@pytest.mark.slow
def test_lean_batch_rows_migrate_both_ways(empty_database_url: URL) -> None:
    """Lean batch rows: downgraded, each batch's copied spend columns are refilled from its state
    (held, spent and untouched batches alike) and the index and foreign keys come back; upgraded,
    they go, and on PostgreSQL ``batches`` leaves half of each page free (heap-only moves)."""
    from service.db.session import Database
    from service.ledger import batches

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        ds, ids, _ = _a_spend_and_a_hold(db, 3, spent=slice(None, 2), held=slice(1, None))
        shown = {b["id"]: b for b in batches.list_batches(db, "acme", ds).to_json()["data"]}
    finally:
        db.dispose()
    assert shown[ids[1]]["epsilon_spent"] == "0.25" and shown[ids[1]]["epsilon_held"] == "0.5"

    def inspect() -> tuple[dict[str, tuple[str, ...]], set[str], set[str], Any]:
        engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
        try:
            with engine.connect() as connection:
                info = sa.inspect(connection)
                columns = {c["name"] for c in info.get_columns("batches")}
                spend: dict[str, tuple[str, ...]] = {}
                if "epsilon_spent" in columns:
                    for row in connection.execute(
                        sa.text(
                            "SELECT id, epsilon_spent, epsilon_held, delta_spent, naive_epsilon FROM batches"
                        )
                    ):
                        spend[row[0]] = tuple(str(Decimal(str(v)).normalize()) for v in row[1:])
                keys = {
                    fk["name"]
                    for table in ("batches", "batch_records", "reservation_batches")
                    for fk in info.get_foreign_keys(table)
                }
                indexes = {ix["name"] for ix in info.get_indexes("batches")}
                options = (
                    connection.scalar(sa.text("SELECT reloptions FROM pg_class WHERE relname = 'batches'"))
                    if connection.dialect.name == "postgresql"
                    else None
                )
                return spend, keys, indexes, options
        finally:
            engine.dispose()

    spend, keys, indexes, options = inspect()
    assert spend == {} and "ix_batches_state_id" not in indexes
    assert not keys & {
        "fk_batches_state_id_batch_states",
        "fk_reservation_batches_batch_id_batches",
        "fk_batch_records_batch_id_batches",
    }
    if empty_database_url.get_backend_name() == "postgresql":
        assert options == ["fillfactor=50"]

    migrations.downgrade(empty_database_url, BEFORE_LEAN_BATCHES)
    spend, keys, indexes, options = inspect()
    for batch_id, b in shown.items():
        expected = (b["epsilon_spent"], b["epsilon_held"], b["delta_spent"], b["naive_sequential_epsilon"])
        assert spend[batch_id] == tuple(str(Decimal(v).normalize()) for v in expected)
    assert "ix_batches_state_id" in indexes
    assert {
        "fk_batches_state_id_batch_states",
        "fk_reservation_batches_batch_id_batches",
        "fk_reservation_batches_reservation_id_reservations",
        "fk_batch_records_batch_id_batches",
        "fk_batch_records_dataset_id_datasets",
    } <= keys
    assert options is None
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        assert {b["id"]: b for b in batches.list_batches(db, "acme", ds).to_json()["data"]} == shown
    finally:
        db.dispose()


BEFORE_CHARGED_ABORTS = "e2b7c9d4f1a6"  # the revision before 2026_11_27_charged_aborts


@pytest.mark.slow
def test_charged_aborts_cannot_be_downgraded_away(empty_database_url: URL) -> None:
    """An aborted reservation's certificate names no release (``certificates.release_id`` NULL);
    code from before lists certificates through their release, so it would drop that charge from
    every listing and bundle. The downgrade refuses while one exists, changes nothing, and goes
    through once none does (removed here by hand, as an operator would decide)."""
    from service.db.session import Database
    from service.ledger import batches, datasets, reservations, tenancy

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        tenancy.create_tenant(db, "acme")
        budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
        dataset = datasets.create_dataset(db, "acme", name="d", budget=budget).id
        task = batches.create_task(db, "acme", dataset, name="t")
        (batch,) = batches.create_batches(
            db, "acme", dataset, task.id, batches=[{"name": "b", "records": ["r"]}]
        ).data
        held = reservations.reserve(
            db,
            "acme",
            dataset,
            batch_ids=[batch.id],
            event=parse_event({"kind": "pure_dp", "epsilon": 0.5}),
        ).to_json()
        reservations.abort(db, "acme", held["id"])
    finally:
        db.dispose()
    try:
        migrations.downgrade(empty_database_url, BEFORE_CHARGED_ABORTS)
    except RuntimeError as exc:
        assert "cert_" in str(exc) and "f3b8a1c42d90" in str(exc)
    else:
        raise AssertionError("the downgrade went through with an aborted reservation's certificate")
    assert migrations.is_up_to_date(empty_database_url)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            assert connection.execute(sa.text("SELECT release_id FROM certificates")).scalars().all() == [
                None
            ]
            connection.execute(sa.text("DELETE FROM certificates"))
    finally:
        engine.dispose()
    migrations.downgrade(empty_database_url, BEFORE_CHARGED_ABORTS)
    migrations.upgrade(empty_database_url)
    assert _diff(empty_database_url) == []


BEFORE_EXTERNAL_VERSIONS = "f3b8a1c42d90"


def test_external_model_versions_cannot_be_downgraded_away(empty_database_url: URL, tmp_path: Path) -> None:
    """A version trained outside the service names no job (``model_versions.job_id`` NULL); code
    from before reads every version's job. The downgrade refuses while one exists and changes
    nothing."""
    import hashlib

    from service.db.session import Database
    from service.ledger import batches, datasets, reservations, tenancy
    from service.ledger import model_registry as registry

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        tenancy.create_tenant(db, "acme")
        budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
        dataset = datasets.create_dataset(db, "acme", name="d", budget=budget).id
        task = batches.create_task(db, "acme", dataset, name="t")
        (batch,) = batches.create_batches(
            db, "acme", dataset, task.id, batches=[{"name": "b", "records": ["r"]}]
        ).data
        held = reservations.reserve(
            db,
            "acme",
            dataset,
            batch_ids=[batch.id],
            event=parse_event({"kind": "pure_dp", "epsilon": 0.5}),
        ).to_json()
        certificate = reservations.commit(
            db, "acme", held["id"], release={"model": "ext", "version": 1}
        ).to_json()
        upload = registry.ArtifactUpload(tmp_path / "artifacts", max_bytes=1024)
        upload.write(b"weights")
        registry.register_external(
            db,
            tmp_path / "artifacts",
            upload,
            tenant_id="acme",
            name="ext",
            version=1,
            certificate_id=certificate["certificate"]["id"],
            sha256=hashlib.sha256(b"weights").hexdigest(),
            fmt="bytes",
            architecture="a",
            preprocessing="p",
        )
    finally:
        db.dispose()
    try:
        migrations.downgrade(empty_database_url, BEFORE_EXTERNAL_VERSIONS)
    except RuntimeError as exc:
        assert "ext v1" in str(exc) and "a7c2e5d8b3f1" in str(exc)
    else:
        raise AssertionError("the downgrade went through with an external model version")
    assert migrations.is_up_to_date(empty_database_url)
    assert (tmp_path / "artifacts" / "acme" / "ext" / "v1.bin").read_bytes() == b"weights"


BEFORE_UNIQUE_NAMES = "a7c2e5d8b3f1"


@pytest.mark.slow
def test_duplicate_dataset_names_are_renamed_and_every_ledger_stays_valid(empty_database_url: URL) -> None:
    """Issue 28 §6: names are unique per tenant. Duplicates made before the constraint (here by
    hand, at the revision before it) are renamed in creation order — the oldest keeps its name,
    later ones take ``" (k)"`` skipping suffixes in use — and certificates and audit chains
    verify as before. Another tenant's dataset of the same name is left alone."""
    from accountant.certificates import verify
    from service.db.session import Database
    from service.ledger import audit, batches, certificates, datasets, reservations, tenancy
    from service.ledger.errors import Conflict

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    try:
        for tenant in ("acme", "rival"):
            tenancy.create_tenant(db, tenant)
        ids = [
            datasets.create_dataset(db, "acme", name=n, budget=budget).id for n in ("a", "b", "a (2)", "c")
        ]
        other = datasets.create_dataset(db, "rival", name="a", budget=budget).id
        task = batches.create_task(db, "acme", ids[1], name="t")
        (batch,) = batches.create_batches(
            db, "acme", ids[1], task.id, batches=[{"name": "b", "records": ["r"]}]
        ).data
        held = reservations.reserve(
            db,
            "acme",
            ids[1],
            batch_ids=[batch.id],
            event=parse_event({"kind": "pure_dp", "epsilon": 0.5}),
        ).to_json()
        reservations.commit(db, "acme", held["id"], release={"model": "m", "version": 1})
    finally:
        db.dispose()
    migrations.downgrade(empty_database_url, BEFORE_UNIQUE_NAMES)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            connection.execute(
                sa.text("UPDATE datasets SET name = 'a' WHERE id IN (:b, :c)"), {"b": ids[1], "c": ids[3]}
            )
    finally:
        engine.dispose()
    migrations.upgrade(empty_database_url)
    assert _diff(empty_database_url) == []
    db = Database(empty_database_url)
    try:
        names = [datasets.get_dataset(db, "acme", i).name for i in ids]
        assert names == ["a", "a (3)", "a (2)", "a (4)"]
        assert datasets.get_dataset(db, "rival", other).name == "a"
        assert audit.verify(db).ok
        (stored,) = certificates.list_certificates(db, "acme", ids[1])["data"]
        assert verify(stored["certificate"]).ok
        with pytest.raises(Conflict) as taken:
            datasets.create_dataset(db, "acme", name="a (3)", budget=budget)
        assert (taken.value.reason, taken.value.details["dataset_id"]) == ("dataset_name_taken", ids[1])
    finally:
        db.dispose()


BEFORE_CLASSES_INLINE = "5d2f8b7e9a14"  # the revision before 2026_11_27_reservation_classes_inline


@pytest.mark.slow
def test_reservation_classes_move_into_their_reservations_and_back(empty_database_url: URL) -> None:
    """Reservation classes move from ``reservation_classes`` rows into ``reservations.classes``
    and back unchanged: a committed reservation and an open one over two classes answer the
    same after a downgrade and an upgrade, the rows come back one per class, and the open one
    still commits with a certificate that verifies and charges each class its own."""
    from accountant.certificates import verify
    from service.db.session import Database
    from service.ledger import reservations

    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        held = _a_spend_and_a_hold(db, 6, spent=slice(None, 4), held=slice(2, None))[2]
        [committed] = db.read_all(sa.text("SELECT id FROM reservations WHERE status = 'committed'"), {})
        committed_id = committed.id
        before = {
            r: reservations.get_reservation(db, "acme", r).to_json() for r in (held["id"], committed_id)
        }
    finally:
        db.dispose()
    assert len(before[held["id"]]["batches"]["classes"]) == 2  # two batches charged before, two not
    migrations.downgrade(empty_database_url, BEFORE_CLASSES_INLINE)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                sa.text('SELECT reservation_id, "index", batches FROM reservation_classes ORDER BY 1, 2')
            ).all()
    finally:
        engine.dispose()
    assert sorted((str(r[0]), int(r[1]), int(r[2])) for r in rows) == sorted(
        [(committed_id, 0, 4), (held["id"], 0, 2), (held["id"], 1, 2)]
    )
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        assert {r: reservations.get_reservation(db, "acme", r).to_json() for r in before} == before
        answer = reservations.commit(db, "acme", held["id"], release={"model": "m", "version": "2"}).to_json()
        certificate = answer["certificate"]["certificate"]
        assert verify(certificate).ok
        assert certificate["result"]["epsilon"] == "0.75"  # the batches read twice
    finally:
        db.dispose()


BEFORE_COMPACT_TASKS = "e8f4a2c61d37"  # the revision before 2026_11_27_compact_tasks


def test_compact_tasks_migrate_both_ways_and_keep_every_ledger(
    empty_database_url: URL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger with a compact task (its state in ``tasks.state_id``, its batches without a
    pointer), a committed and an open reservation of it as a whole task (``reservation_tasks``)
    downgrades to one pointer and one membership row per batch, with every batch's state, every
    answer and every batch list unchanged, and upgrades again; the open reservation then commits
    with a certificate that verifies on the batches it lists."""
    from accountant.certificates import check_batch_set, verify
    from service.db.session import Database
    from service.ledger import batches, datasets, reservations, tenancy, views
    from service.ledger.spending import store

    monkeypatch.setattr(store, "SMALL_CHARGE", 2)  # a task of 4 batches is charged as a large one
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
        tenancy.create_tenant(db, "acme")
        ds = datasets.create_dataset(db, "acme", name="d", budget=budget).id
        task = batches.create_task(db, "acme", ds, name="t").id
        batches.create_batches(
            db, "acme", ds, task, batches=[{"name": f"b{i}", "records": [f"r{i}"]} for i in range(4)]
        )
        event = {"kind": "pure_dp", "epsilon": 0.25}
        done = reservations.reserve(db, "acme", ds, event=parse_event(event), task_ids=[task])
        reservations.commit(db, "acme", done.id, release={"model": "m", "version": "1"})
        held = reservations.reserve(db, "acme", ds, event=parse_event(event), task_ids=[task])
        compact = db.read_all(sa.text("SELECT COUNT(*) FROM tasks WHERE state_id IS NOT NULL"), {})
        whole = db.read_all(sa.text("SELECT COUNT(*) FROM reservation_tasks"), {})
        assert [compact[0][0], whole[0][0]] == [1, 2]
        ids = (done.id, held.id)
        before = (
            {r: reservations.get_reservation(db, "acme", r).to_json() for r in ids},
            {r: reservations.all_batches(db, "acme", r) for r in ids},
            views.batch_spend(db, "acme", ds).to_json()["data"],
        )
    finally:
        db.dispose()
    migrations.downgrade(empty_database_url, BEFORE_COMPACT_TASKS)
    assert "reservation_tasks" not in _tables(empty_database_url)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            unset = connection.execute(
                sa.text("SELECT COUNT(*) FROM batches WHERE state_id IS NULL")
            ).scalar()
            rows = connection.execute(
                sa.text("SELECT reservation_id, COUNT(*) FROM reservation_batches GROUP BY reservation_id")
            ).all()
    finally:
        engine.dispose()
    assert unset == 0 and sorted((str(r), int(n)) for r, n in rows) == sorted((r, 4) for r in ids)
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        after = (
            {r: reservations.get_reservation(db, "acme", r).to_json() for r in ids},
            {r: reservations.all_batches(db, "acme", r) for r in ids},
            views.batch_spend(db, "acme", ds).to_json()["data"],
        )
        assert after == before
        answer = reservations.commit(db, "acme", held.id, release={"model": "m", "version": "2"})
        certificate = answer.to_json()["certificate"]["certificate"]
        assert verify(certificate).ok and certificate["result"]["epsilon"] == "0.5"
        assert check_batch_set(certificate, reservations.all_batches(db, "acme", held.id)).ok
    finally:
        db.dispose()


BEFORE_INTEGER_RECORD_KEYS = "7c1e5a9d3b20"  # the revision before 2026_11_27_integer_record_keys


def test_batch_records_move_to_integer_keys_and_back(empty_database_url: URL) -> None:
    """``batch_records`` downgraded holds (dataset id, batch id, HMAC(salt, record)) for every
    record of two datasets (one with a deleted batch, so its keys have a gap); upgraded from
    those rows, every record still maps to its batch, a shared record is still refused and
    named, new batches take keys after the old ones, and a deletion removes exactly its batch's
    records."""
    import hashlib
    import hmac

    from service.db.session import Database
    from service.ledger import audit, batches, datasets, tenancy
    from service.ledger.errors import BatchOverlap

    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        tenancy.create_tenant(db, "acme")
        made: dict[str, tuple[batches.CreatedBatch, ...]] = {}
        for name in ("one", "two"):
            ds = datasets.create_dataset(db, "acme", name=name, budget=budget).id
            task = batches.create_task(db, "acme", ds, name="t").id
            sent = [{"name": f"b{i}", "records": [f"r{i}-{j}" for j in range(3)] + [i]} for i in range(5)]
            made[ds] = batches.create_batches(db, "acme", ds, task, batches=sent).data
        first, second = made
        batches.delete_batch(db, "acme", first, made[first][0].task_id, made[first][1].id)
        salts = {
            ds: bytes(db.read_all(sa.text("SELECT record_salt FROM datasets WHERE id = :d"), {"d": ds})[0][0])
            for ds in made
        }
        mapped = {ds: batches.record_batches(db, ds)[1] for ds in made}
    finally:
        db.dispose()
    expected = {
        (ds, b.id, hmac.new(salts[ds], record.encode(), hashlib.sha256).digest())
        for ds in made
        for i, b in enumerate(made[ds])
        if b.id != made[first][1].id
        for record in [f"r{i}-{j}" for j in range(3)] + [str(i)]
    }
    assert {(ds, batch, digest) for ds in made for digest, batch in mapped[ds].items()} == expected

    migrations.downgrade(empty_database_url, BEFORE_INTEGER_RECORD_KEYS)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                sa.text("SELECT dataset_id, batch_id, record_hash FROM batch_records")
            ).all()
            columns = {c["name"] for c in sa.inspect(connection).get_columns("datasets")}
    finally:
        engine.dispose()
    assert {(str(d), str(b), bytes(h)) for d, b, h in rows} == expected and len(rows) == len(expected)
    assert not columns & {"key", "next_batch_key"}

    migrations.upgrade(empty_database_url)
    assert _diff(empty_database_url) == []
    db = Database(empty_database_url)
    try:
        assert {ds: batches.record_batches(db, ds)[1] for ds in made} == mapped
        assert batches.count_records(db, first) == 16 and batches.count_records(db, second) == 20
        task = made[first][0].task_id
        with pytest.raises(BatchOverlap) as over:  # the old rows still refuse a shared record
            batches.create_batches(
                db, "acme", first, task, batches=[{"name": "x", "records": ["new", "r3-1"]}]
            )
        assert over.value.record_id == "r3-1"
        # the deleted batch's records are free again; the upgrade numbered the four batches left
        # 0-3, and a new batch takes the key after them
        again = batches.create_batches(
            db, "acme", first, task, batches=[{"name": "again", "records": ["r1-0"]}]
        )
        keys = dict(db.read_all(sa.text("SELECT id, key FROM batches WHERE dataset_id = :d"), {"d": first}))
        assert keys[again.data[0].id] == 4 and sorted(keys.values()) == [0, 1, 2, 3, 4]
        batches.delete_batch(db, "acme", first, task, made[first][4].id)
        assert batches.count_records(db, first) == 13 and batches.count_records(db, second) == 20
        assert set(batches.record_batches(db, first)[1].values()) == {
            made[first][0].id,
            made[first][2].id,
            made[first][3].id,
            again.data[0].id,
        }
        third = datasets.create_dataset(db, "acme", name="three", budget=budget).id
        numbered = dict(db.read_all(sa.text("SELECT id, key FROM datasets"), {}))
        assert numbered == {first: 1, second: 2, third: 3}  # in creation order; the next after them
        assert audit.verify(db).ok
    finally:
        db.dispose()


BEFORE_PRICED_BEFORE_V3 = "3b9d6e2f8a41"  # the revision before 2026_11_27_priced_before_v3


def test_every_existing_dataset_is_marked_priced_before_v3(empty_database_url: URL) -> None:
    """Upgraded over a dataset that existed before it, the migration marks it (its spend read
    derives the guarantee from its batches, as before); a dataset created since is not; the
    downgrade drops the mark and keeps every ledger."""
    from service.db.session import Database
    from service.ledger import audit, datasets, spent, tenancy

    budget = {"rule": "parallel", "epsilon": "1", "delta": "1e-5", "accountant": "rdp"}
    marks = sa.text("SELECT id, priced_before_v3 FROM datasets")
    migrations.upgrade(empty_database_url)
    db = Database(empty_database_url)
    try:
        tenancy.create_tenant(db, "acme")
        old = datasets.create_dataset(db, "acme", name="old", budget=budget).id
        assert {d: bool(m) for d, m in db.read_all(marks)} == {old: False}
    finally:
        db.dispose()
    migrations.downgrade(empty_database_url, BEFORE_PRICED_BEFORE_V3)
    engine = create_ledger_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            columns = {c["name"] for c in sa.inspect(connection).get_columns("datasets")}
            kept = connection.execute(sa.text("SELECT id FROM datasets")).scalars().all()
    finally:
        engine.dispose()
    assert "priced_before_v3" not in columns and kept == [old]
    migrations.upgrade(empty_database_url)
    assert _diff(empty_database_url) == []
    db = Database(empty_database_url)
    try:
        new = datasets.create_dataset(db, "acme", name="new", budget=budget).id
        assert {d: bool(m) for d, m in db.read_all(marks)} == {old: True, new: False}
        assert spent.get_spend(db, "acme", old).to_json()["guarantee"]["epsilon"] == "0"
        assert audit.verify(db).ok
    finally:
        db.dispose()
