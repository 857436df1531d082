"""Data-source escapes (issue 12): a dataset's ``file://`` source never reads outside its tenant's
data roots, neither when an admin sets it nor when the worker reads it later.

The real app (``service.app.create_app``) over both databases, with the operator's roots::

    {"acme": [<tmp>/roots/a], "rival": [<tmp>/roots/shared/rival], "*": [<tmp>/roots/shared]}

``acme`` and ``rival`` are the two tenants of the ``keys`` fixture, each with a root of its own;
rival's root is nested inside the shared ``"*"`` root, which tenant ``other`` (no entry of its
own) uses. Outside every root, ``<tmp>/outside`` holds a valid CSV whose header carries a
distinctive secret, so that a source which escaped would be read and would train.

* The API (``POST /v1/datasets`` with ``data_source``, ``PUT /v1/datasets/{id}/data-source``):
  every escape answers 422 naming ``data_source`` with the rule that refused it, and changes
  nothing: no dataset, the source as it was, no audit entry. A regular file under the tenant's
  root is accepted and audited; trainers and viewers cannot set a source.
* The worker (``load_data`` with the tenant's roots, and a real ``Worker`` with a
  ``SourceLoader``): a file accepted by the API and swapped afterwards (a symlink out, a FIFO, a
  larger file) is refused when it is read, and the outside file is never opened (inotify).

Each refusal asserts the exact reason, so that a test fails if the check it targets is removed:
either the source is accepted, or another rule refuses it with another message.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import func, select

from service.app import create_app
from service.contract.data_roots import DataRoots, TenantRoots, check_source
from service.contract.data_sources import SourceLocationError
from service.db.models import AuditEntry
from service.db.session import Database
from service.ledger import batches, datasets, tenancy
from service.settings import Settings
from service.training.data import load_data
from tests.service.api.conftest import Keys, bearer
from tests.worker.digits_world import budget

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (Starlette's deprecation warning about httpx: see the api conftest)
    from starlette.testclient import TestClient

MAX_BYTES = 4096
SECRET = "sk_live_4eC39HqLyjWDarjtT1zdp7dcESCAPE"
RECORDS = [f"r{i:02d}" for i in range(40)]
LOCATION = "must name a regular file under a data root of tenant {tenant!r} (LEDGER_DATA_ROOTS)"


def csv_text(feature_names: tuple[str, ...] = ("f1", "f2")) -> str:
    """A valid source: RECORDS with two numeric features and labels 0/1."""
    lines = [",".join(("record_id", *feature_names, "label"))]
    lines += [f"{r},{i / 40:.3f},{1 - i / 40:.3f},{i % 2}" for i, r in enumerate(RECORDS)]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Dirs:
    a: Path  # acme's root
    shared: Path  # the "*" root
    rival: Path  # rival's root, nested inside the shared root
    outside: Path  # in no root
    good: Path  # a regular file under acme's root
    secret: Path  # outside every root, a valid CSV whose header holds SECRET

    def roots(self) -> dict[str, list[str]]:
        return {"acme": [str(self.a)], "rival": [str(self.rival)], "*": [str(self.shared)]}

    def data_roots(self) -> DataRoots:
        return DataRoots(self.roots(), max_bytes=MAX_BYTES)


def uri(path: Path | str) -> str:
    return f"file://{path}"


@pytest.fixture
def dirs(tmp_path: Path) -> Dirs:
    base = tmp_path / "roots"
    found = Dirs(
        a=base / "a",
        shared=base / "shared",
        rival=base / "shared" / "rival",
        outside=tmp_path / "outside",
        good=base / "a" / "good.csv",
        secret=tmp_path / "outside" / "secret.csv",
    )
    for folder in (found.a, found.rival, found.outside):
        folder.mkdir(parents=True)
    found.good.write_text(csv_text())
    found.secret.write_text(csv_text(("f1", SECRET)))
    assert found.good.stat().st_size <= MAX_BYTES
    return found


@pytest.fixture
def settings(settings: Settings, dirs: Dirs) -> Settings:
    """tests/service/api/conftest.py's settings, with this suite's data roots."""
    return Settings.model_validate(
        {**settings.model_dump(), "data_roots": dirs.roots(), "max_source_bytes": MAX_BYTES}
    )


@pytest.fixture
def other_admin(db: Database) -> str:
    """An admin key of tenant ``other``, which has no roots of its own: it uses the "*" roots."""
    return tenancy.create_api_key(db, "other", "admin")


# ---------------------------------------------------------------------------------------------
# Watching the file system: was a file opened? did an open block?
# ---------------------------------------------------------------------------------------------

_IN_OPEN = 0x20


class OpenWatch:
    """Which of ``paths`` were opened (inotify ``IN_OPEN``) while the watch was on. A completed
    open of a FIFO or a file is seen, whether or not anything was read."""

    def __init__(self, *paths: Path) -> None:
        if not sys.platform.startswith("linux"):
            pytest.skip("inotify is Linux only")
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self._fd >= 0, os.strerror(ctypes.get_errno())
        self._paths: dict[int, Path] = {}
        for path in paths:
            wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _IN_OPEN)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self._paths[wd] = path

    def opened(self) -> set[Path]:
        seen: set[Path] = set()
        with contextlib.suppress(BlockingIOError):
            buffer = os.read(self._fd, 65536)
            offset = 0
            while offset < len(buffer):
                wd, mask, _, length = struct.unpack_from("iIII", buffer, offset)
                if mask & _IN_OPEN:
                    seen.add(self._paths[wd])
                offset += 16 + length
        return seen

    def close(self) -> None:
        os.close(self._fd)


@contextlib.contextmanager
def watching(*paths: Path) -> Iterator[OpenWatch]:
    watch = OpenWatch(*paths)
    try:
        yield watch
    finally:
        watch.close()


T = TypeVar("T")


def without_blocking_on(fifo: Path, call: Callable[[], T], timeout_s: float = 20.0) -> T:
    """``call()``, which must not block opening ``fifo``. If it has not returned after
    ``timeout_s``, a writer opens the FIFO (which releases a reader blocked in its open, so the
    test never hangs) and the test fails."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        reader = "a reader was blocked in it"
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: no reader has it open
            reader = "no reader had it open"
        thread.join(timeout_s)
        pytest.fail(f"still running after {timeout_s} s with the FIFO as its source ({reader})")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------
# The escapes, one per rule
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Escape:
    """A source ``make(dirs)`` builds on disk and names, and the exact reason it is refused."""

    name: str
    make: Callable[[Dirs], str]
    reason: str
    located: bool = True  # True: a data-root rule (the LOCATION text); False: the URI's syntax


def _absolute_outside(d: Dirs) -> str:
    return uri(d.secret)


def _symlink_in_to_out(d: Dirs) -> str:
    (d.a / "link.csv").symlink_to(d.secret)
    return uri(d.a / "link.csv")


def _symlinked_directory_in_to_out(d: Dirs) -> str:
    (d.a / "sub").symlink_to(d.outside, target_is_directory=True)
    return uri(d.a / "sub" / "secret.csv")


def _symlink_out_to_in(d: Dirs) -> str:
    (d.outside / "in.csv").symlink_to(d.good)
    return uri(d.outside / "in.csv")


def _fifo(d: Dirs) -> str:
    os.mkfifo(d.a / "pipe.csv")
    return uri(d.a / "pipe.csv")


def _directory(d: Dirs) -> str:
    (d.a / "x.csv").mkdir()
    return uri(d.a / "x.csv")


def _too_large(d: Dirs) -> str:
    (d.a / "big.csv").write_text(csv_text() + "#" * MAX_BYTES)
    return uri(d.a / "big.csv")


def _another_tenants_root(d: Dirs) -> str:
    (d.rival / "theirs.csv").write_text(csv_text())
    return uri(d.rival / "theirs.csv")


def _symlink_to_another_tenants_root(d: Dirs) -> str:
    (d.rival / "theirs.csv").write_text(csv_text())
    (d.a / "theirs.csv").symlink_to(d.rival / "theirs.csv")
    return uri(d.a / "theirs.csv")


def _hard_link_to_another_tenants_file(d: Dirs) -> str:
    (d.rival / "theirs.csv").write_text(csv_text())
    os.link(d.rival / "theirs.csv", d.a / "theirs.csv")  # no symlink: realpath stays in acme's root
    return uri(d.a / "theirs.csv")


def _hard_link_to_outside(d: Dirs) -> str:
    os.link(d.secret, d.a / "secret.csv")
    return uri(d.a / "secret.csv")


NOT_UNDER = "the path is not under any of its roots"
LEAVES = "its real path (symlinks resolved) leaves the data roots"
THEIRS = "its real path lies in another tenant's data root"
LINKED = "it has 2 hard links (a file with other names may lie elsewhere)"
DOTS = "the path must not hold '..', '.' or empty components."

ESCAPES = [
    Escape("absolute path outside every root", _absolute_outside, NOT_UNDER),
    Escape(
        "relative path", lambda d: "file:x.csv", "the path must be absolute (file:///absolute/path).", False
    ),
    Escape(
        "host part",
        lambda d: "file://relative/x.csv",
        "a file URI takes no host part; write file:///absolute/path.",
        False,
    ),
    Escape("dot-dot", lambda d: uri(f"{d.a}/../../outside/secret.csv"), DOTS, False),
    Escape("percent-encoded dot-dot", lambda d: uri(f"{d.a}/%2e%2e/%2E%2E/outside/secret.csv"), DOTS, False),
    Escape("symlink inside pointing out", _symlink_in_to_out, LEAVES),
    Escape("symlinked directory inside pointing out", _symlinked_directory_in_to_out, LEAVES),
    Escape("symlink outside pointing in", _symlink_out_to_in, NOT_UNDER),
    Escape("FIFO", _fifo, "it is a FIFO"),
    Escape("directory named x.csv", _directory, "it is a directory"),
    Escape(
        "larger than max_bytes",
        _too_large,
        f"it holds {len(csv_text()) + MAX_BYTES} bytes, more than LEDGER_MAX_SOURCE_BYTES = {MAX_BYTES}",
    ),
    Escape("another tenant's root", _another_tenants_root, NOT_UNDER),
    Escape("symlink into another tenant's root", _symlink_to_another_tenants_root, THEIRS),
    Escape("hard link to another tenant's file", _hard_link_to_another_tenants_file, LINKED),
    Escape("hard link to a file outside every root", _hard_link_to_outside, LINKED),
]


def refusal(source: str, reason: str, *, located: bool = True, tenant: str = "acme") -> str:
    """The 422 message of ``check_data_source`` for ``source``: the rule, never file contents."""
    if located:
        return f"data_source is refused: data source {source!r} {LOCATION.format(tenant=tenant)}: {reason}."
    return f"data_source is refused: data source {source!r}: {reason}"


def assert_refused(
    response: Any, source: str, reason: str, *, located: bool = True, tenant: str = "acme"
) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "invalid_input"
    assert body["field"] == "data_source"
    assert body["message"] == refusal(source, reason, located=located, tenant=tenant)
    assert SECRET not in response.text


def audit_rows(db: Database) -> int:
    with db.session(readonly=True) as session:
        return int(session.scalar(select(func.count()).select_from(AuditEntry)) or 0)


def chain(client: TestClient, key: str, dataset_id: str) -> dict[str, Any]:
    answer = client.get(f"/v1/datasets/{dataset_id}/audit", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def create(client: TestClient, key: str, data_source: str | None = None, name: str = "ds") -> Any:
    body: dict[str, Any] = {"name": name, "budget": budget()}
    if data_source is not None:
        body["data_source"] = data_source
    return client.post("/v1/datasets", json=body, headers=bearer(key))


def put_source(client: TestClient, key: str, dataset_id: str, data_source: str | None) -> Any:
    return client.put(
        f"/v1/datasets/{dataset_id}/data-source", json={"data_source": data_source}, headers=bearer(key)
    )


def count_datasets(client: TestClient, key: str) -> int:
    answer = client.get("/v1/datasets", headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return int(answer.json()["count"])


# ---------------------------------------------------------------------------------------------
# The API refuses every escape, and changes nothing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("escape", ESCAPES, ids=[e.name for e in ESCAPES])
def test_creating_a_dataset_with_an_escaping_source_is_refused_and_stores_nothing(
    client: TestClient, keys: Keys, db: Database, dirs: Dirs, escape: Escape
) -> None:
    admin = keys.get("acme", "admin")
    source = escape.make(dirs)
    before = audit_rows(db)
    with watching(dirs.secret) as watch:
        response = without_blocking_on(dirs.a / "pipe.csv", lambda: create(client, admin, source))
        assert watch.opened() == set()  # the outside file was never opened
    assert_refused(response, source, escape.reason, located=escape.located)
    assert count_datasets(client, admin) == 0
    assert audit_rows(db) == before


@pytest.mark.parametrize("escape", ESCAPES, ids=[e.name for e in ESCAPES])
def test_setting_an_escaping_source_is_refused_and_changes_nothing(
    client: TestClient, keys: Keys, db: Database, dirs: Dirs, escape: Escape
) -> None:
    admin = keys.get("acme", "admin")
    created = create(client, admin, uri(dirs.good))
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    source = escape.make(dirs)
    head = chain(client, admin, dataset_id)
    before = audit_rows(db)
    with watching(dirs.secret) as watch:
        response = without_blocking_on(
            dirs.a / "pipe.csv", lambda: put_source(client, admin, dataset_id, source)
        )
        assert watch.opened() == set()
    assert_refused(response, source, escape.reason, located=escape.located)
    shown = client.get(f"/v1/datasets/{dataset_id}", headers=bearer(admin))
    assert shown.status_code == 200 and shown.json()["data_source"] == uri(dirs.good)
    assert chain(client, admin, dataset_id) == head
    assert audit_rows(db) == before


def test_a_fifo_source_is_refused_without_ever_being_opened(
    client: TestClient, keys: Keys, dirs: Dirs
) -> None:
    """A reader's open of a FIFO blocks until a writer comes: the API must never open it (the
    guard releases a blocked open after a timeout, and the test then fails instead of hanging)."""
    admin = keys.get("acme", "admin")
    fifo = dirs.a / "pipe.csv"
    source = _fifo(dirs)
    created = create(client, admin)
    assert created.status_code == 201, created.text
    with watching(fifo) as watch:
        posted = without_blocking_on(fifo, lambda: create(client, admin, source, name="fifo"))
        put = without_blocking_on(fifo, lambda: put_source(client, admin, created.json()["id"], source))
        assert watch.opened() == set()
    assert_refused(posted, source, "it is a FIFO")
    assert_refused(put, source, "it is a FIFO")


def test_a_nested_root_stays_its_tenants_within_the_shared_root(
    client: TestClient, keys: Keys, other_admin: str, db: Database, dirs: Dirs
) -> None:
    """rival's root lies inside the "*" root that tenant ``other`` uses: a file there is
    rival's (the deepest root), so ``other`` cannot name it, though its path is under "*"."""
    theirs = dirs.rival / "theirs.csv"
    theirs.write_text(csv_text())
    mine = dirs.shared / "mine.csv"
    mine.write_text(csv_text())
    before = audit_rows(db)

    refused = create(client, other_admin, uri(theirs))
    assert_refused(refused, uri(theirs), THEIRS, tenant="other")
    assert count_datasets(client, other_admin) == 0
    assert audit_rows(db) == before

    accepted = create(client, other_admin, uri(mine), name="mine")  # a shared file is other's
    assert accepted.status_code == 201, accepted.text
    dataset_id = accepted.json()["id"]
    head = chain(client, other_admin, dataset_id)
    assert_refused(
        put_source(client, other_admin, dataset_id, uri(theirs)), uri(theirs), THEIRS, tenant="other"
    )
    assert chain(client, other_admin, dataset_id) == head

    rivals = create(client, keys.get("rival", "admin"), uri(theirs), name="theirs")  # and rival's
    assert rivals.status_code == 201, rivals.text
    assert rivals.json()["data_source"] == uri(theirs)


def test_without_data_roots_no_file_source_is_accepted(
    settings: Settings, db: Database, keys: Keys, dirs: Dirs
) -> None:
    """The default configuration has no data roots: only ``builtin:`` sources."""
    default = Settings(database_url=settings.database_url)
    assert default.data_roots == {}
    admin = keys.get("acme", "admin")
    source = uri(dirs.good)
    before = audit_rows(db)
    with TestClient(create_app(default, database=db), raise_server_exceptions=False) as client:
        refused = create(client, admin, source)
        assert_refused(refused, source, "no data root is configured for it, so only builtin: sources work")
        assert count_datasets(client, admin) == 0
        assert audit_rows(db) == before

        created = create(client, admin, "builtin:digits")
        assert created.status_code == 201, created.text
        dataset_id = created.json()["id"]
        head = chain(client, admin, dataset_id)
        assert_refused(
            put_source(client, admin, dataset_id, source),
            source,
            "no data root is configured for it, so only builtin: sources work",
        )
        assert client.get(f"/v1/datasets/{dataset_id}", headers=bearer(admin)).json()["data_source"] == (
            "builtin:digits"
        )
        assert chain(client, admin, dataset_id) == head


# ---------------------------------------------------------------------------------------------
# What is allowed, and who may do it
# ---------------------------------------------------------------------------------------------


def test_a_regular_file_under_the_tenants_root_is_accepted_and_audited(
    client: TestClient, keys: Keys, dirs: Dirs
) -> None:
    admin = keys.get("acme", "admin")
    source = uri(dirs.good)
    created = create(client, admin)
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    assert created.json()["data_source"] is None

    answer = put_source(client, admin, dataset_id, source)
    assert answer.status_code == 200, answer.text
    assert answer.json()["data_source"] == source
    shown = client.get(f"/v1/datasets/{dataset_id}", headers=bearer(keys.get("acme", "viewer")))
    assert shown.status_code == 200 and shown.json()["data_source"] == source
    entries = chain(client, admin, dataset_id)["data"]
    assert [e["event_type"] for e in entries][-1] == "dataset.data_source_set"
    assert entries[-1]["payload"] == {"data_source": source, "previous": None}

    # Created with it directly: the same checks, and the creation entry records it.
    second = create(client, admin, source, name="direct")
    assert second.status_code == 201, second.text
    assert second.json()["data_source"] == source
    first_entry = chain(client, admin, second.json()["id"])["data"][0]
    assert first_entry["event_type"] == "dataset.created" and first_entry["payload"]["data_source"] == source


def test_one_file_is_stored_as_one_source(client: TestClient, keys: Keys, dirs: Dirs) -> None:
    """Issue 24 §5: ``file:/abs``, ``FILE:///abs``, ``file:///abs`` (and a percent-escaped
    spelling) name one file and were stored as four strings; all are stored as ``file:///abs``,
    so setting any of them again changes nothing (no audit entry). A path with ``%`` or ``#`` in
    it keeps them escaped, so the stored form reads back as the same file."""
    admin = keys.get("acme", "admin")
    canonical = uri(dirs.good)  # file:///.../roots/a/good.csv
    path = str(dirs.good)
    spellings = [
        f"file:{path}",
        f"FILE://{path}",
        f"File://{path}",
        canonical.replace("good.csv", "%67ood.csv"),
        canonical,
    ]
    dataset_id = create(client, admin, spellings[0]).json()["id"]
    assert client.get(f"/v1/datasets/{dataset_id}", headers=bearer(admin)).json()["data_source"] == canonical
    before = len(chain(client, admin, dataset_id)["data"])
    for spelling in spellings:
        answer = put_source(client, admin, dataset_id, spelling)
        assert answer.status_code == 200, answer.text
        assert answer.json()["data_source"] == canonical
    assert len(chain(client, admin, dataset_id)["data"]) == before  # the same source: no change
    odd = dirs.a / "50% #1.csv"
    odd.write_text(csv_text())
    answer = put_source(
        client, admin, dataset_id, f"file://{str(odd).replace('%', '%25').replace('#', '%23')}"
    )
    assert answer.status_code == 200, answer.text
    stored = answer.json()["data_source"]
    assert stored == f"file://{dirs.a}/50%25 %231.csv"
    assert load_data(stored, dirs.data_roots().for_tenant("acme")).record_ids == tuple(RECORDS)


@pytest.mark.parametrize("scope", ["trainer", "viewer"])
def test_only_an_admin_sets_a_data_source(
    client: TestClient, keys: Keys, db: Database, dirs: Dirs, scope: str
) -> None:
    admin = keys.get("acme", "admin")
    created = create(client, admin, "builtin:digits")
    assert created.status_code == 201, created.text
    dataset_id = created.json()["id"]
    before = audit_rows(db)
    answer = put_source(client, keys.get("acme", scope), dataset_id, uri(dirs.good))
    assert answer.status_code == 403, answer.text
    assert client.get(f"/v1/datasets/{dataset_id}", headers=bearer(admin)).json()["data_source"] == (
        "builtin:digits"
    )
    assert audit_rows(db) == before


def test_another_tenants_admin_cannot_set_the_source(client: TestClient, keys: Keys, db: Database) -> None:
    admin = keys.get("acme", "admin")
    created = create(client, admin, "builtin:digits")
    assert created.status_code == 201, created.text
    before = audit_rows(db)
    answer = put_source(client, keys.get("rival", "admin"), created.json()["id"], None)
    assert answer.status_code == 404, answer.text
    assert client.get(f"/v1/datasets/{created.json()['id']}", headers=bearer(admin)).json()[
        "data_source"
    ] == ("builtin:digits")
    assert audit_rows(db) == before


# ---------------------------------------------------------------------------------------------
# The worker checks again when it reads: a file swapped after the admin set it
# ---------------------------------------------------------------------------------------------


def _swap_for_symlink_out(d: Dirs) -> None:
    d.good.unlink()
    d.good.symlink_to(d.secret)


def _swap_directory_for_symlink_out(d: Dirs) -> None:
    # the accepted file sits in a sub-directory, which is swapped for a symlink to the outside
    (d.a / "sub").rename(d.a / "sub-old")
    (d.a / "sub").symlink_to(d.outside, target_is_directory=True)


def _swap_for_symlink_to_another_tenant(d: Dirs) -> None:
    (d.rival / "good.csv").write_text(csv_text())
    d.good.unlink()
    d.good.symlink_to(d.rival / "good.csv")


def _swap_for_hard_link_out(d: Dirs) -> None:
    d.good.unlink()
    os.link(d.secret, d.good)


def _swap_for_fifo(d: Dirs) -> None:
    d.good.unlink()
    os.mkfifo(d.good)


def _grow(d: Dirs) -> None:
    with d.good.open("a") as handle:
        handle.write("#" * MAX_BYTES)


@dataclass(frozen=True)
class Swap:
    name: str
    swap: Callable[[Dirs], None]
    reason: str
    in_sub: bool = False  # the source is <a>/sub/secret.csv (a copy of the good file)


SWAPS = [
    Swap("symlink to a file outside", _swap_for_symlink_out, LEAVES),
    Swap("directory swapped for a symlink outside", _swap_directory_for_symlink_out, LEAVES, in_sub=True),
    Swap("symlink into another tenant's root", _swap_for_symlink_to_another_tenant, THEIRS),
    Swap("hard link to a file outside", _swap_for_hard_link_out, LINKED),
    Swap("FIFO", _swap_for_fifo, "it is a FIFO"),
    Swap(
        "grown beyond max_bytes",
        _grow,
        f"it holds {len(csv_text()) + MAX_BYTES} bytes, more than LEDGER_MAX_SOURCE_BYTES = {MAX_BYTES}",
    ),
]


def accepted_source(dirs: Dirs, swap: Swap) -> Path:
    """The file the admin set (checked now, as the API checks it)."""
    path = dirs.good
    if swap.in_sub:
        (dirs.a / "sub").mkdir()
        path = dirs.a / "sub" / "secret.csv"  # named like the outside file, so the swap can find one
        path.write_text(csv_text())
    check_source(uri(path), dirs.data_roots().for_tenant("acme"))
    return path


@pytest.mark.parametrize("swap", SWAPS, ids=[s.name for s in SWAPS])
def test_a_file_swapped_after_it_was_set_is_refused_when_read(dirs: Dirs, swap: Swap) -> None:
    roots: TenantRoots = dirs.data_roots().for_tenant("acme")
    path = accepted_source(dirs, swap)
    source = uri(path)
    assert load_data(source, roots).record_ids == tuple(RECORDS)  # readable as it was set
    swap.swap(dirs)
    with watching(dirs.secret, *([dirs.good] if swap.name == "FIFO" else [])) as watch:
        with pytest.raises(SourceLocationError) as info:
            without_blocking_on(dirs.good, lambda: load_data(source, roots))
        assert watch.opened() == set()  # neither the outside file nor the FIFO was opened
    assert str(info.value) == f"data source {source!r} {LOCATION.format(tenant='acme')}: {swap.reason}."
    assert SECRET not in str(info.value)


@pytest.mark.slow
def test_a_job_on_a_dataset_whose_file_was_swapped_fails_without_outside_data(
    db: Database, dirs: Dirs, tmp_path: Path
) -> None:
    """End to end: the admin sets a good file, a job is queued, the file is swapped for a
    symlink to a file outside the roots (same record ids: it would train); the worker refuses
    it with ``data_source`` and nothing of the outside file reaches the job."""
    pytest.importorskip("torch")
    from service.ledger import jobs
    from service.worker.gate import SourceLoader
    from service.worker.worker import Worker

    roots = dirs.data_roots()
    source = uri(dirs.good)
    tenancy.create_api_key(db, "acme", "viewer")  # the tenant exists
    dataset = datasets.create_dataset(
        db, "acme", name="swapped", budget=budget("10"), data_source=source, data_roots=roots
    )
    task = batches.create_task(db, "acme", dataset.id, name="all")
    batches.create_batches(
        db,
        "acme",
        dataset.id,
        task.id,
        batches=[{"name": "b0", "records": RECORDS[:20]}, {"name": "b1", "records": RECORDS[20:]}],
    )
    job = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=dataset.id,
        algorithm="dp_sgd",
        params={"noise_multiplier": 1.0, "sampling_probability": 0.5, "steps": 2, "hidden": 4, "seed": 1},
    )
    _swap_for_symlink_out(dirs)
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", loader=SourceLoader(roots), device="cpu")
    with watching(dirs.secret) as watch:
        assert worker.run_once() == job.id
        assert watch.opened() == set()

    answer = jobs.queue.get_job(db, "acme", job.id)
    assert answer.job.status == "failed"
    error = answer.job.error
    assert error["error"] == "data_source" and error["field"] == "data_source"
    assert error["message"] == f"data source {source!r} {LOCATION.format(tenant='acme')}: {LEAVES}."
    assert SECRET not in json.dumps(answer.to_json())
    assert datasets.get_dataset(db, "acme", dataset.id).data_source == source


@pytest.mark.parametrize("root", ["/", "//", "/srv/..", "/./", "/tmp/../", "//."])
def test_the_whole_host_is_never_a_data_root(root: str) -> None:
    """A root that is "/" once normalised (``/srv/..``) would make every file of the host a data
    source: refused when the settings are read."""
    with pytest.raises(ValueError, match="must not be '/'"):
        Settings(data_roots={"*": [root]})


def test_a_root_that_became_a_symlink_to_the_host_is_dropped(tmp_path: Path) -> None:
    """A configured root replaced by a symlink to "/" after start-up is no root: a file under
    it (anywhere on the host) is refused."""
    root = tmp_path / "root"
    root.symlink_to("/")
    outside = tmp_path / "outside.csv"
    outside.write_text("record_id,label,f0\nr1,0,1.0\n")
    roots = DataRoots({"*": [str(root)]}).for_tenant("acme")
    assert roots.roots == ()
    with pytest.raises(SourceLocationError, match="no data root is configured"):
        check_source(f"file://{root}{outside}", roots)
