"""Data roots: where the operator lets each tenant's ``file://`` data sources live, and the
checks that a source file is one of them, made when an admin sets a source (``check_source``,
without opening the file) and again when the worker reads it (``read_file``). Owned by the
server (issue 29 §2); the trainers' loaders (``service.training.data``) read through it.

Data roots (``DataRoots``, ``LEDGER_DATA_ROOTS``)
-------------------------------------------------
A ``file://`` source is read only from under the operator's data roots for the dataset's tenant
(none by default: only ``builtin:`` sources work out of the box). The URI must be
``file:///absolute/path`` (or ``file:/absolute/path``): no host part (``file://host/…`` used to be
read relative to the working directory), no query, no ``.``, ``..`` or empty path component,
after percent-decoding (``%2e%2e`` is ``..``), no control character. Then:

* the path as named must lie under one of the tenant's roots, and so must its real path
  (``os.path.realpath``): a symlink inside the root pointing out, or outside pointing in, is
  refused; the real path belongs to the *deepest* configured root that contains it, which must be
  the tenant's (a tenant's root nested inside a shared ``"*"`` root stays that tenant's);
* the file must be a regular file (not a directory, FIFO, device or socket) of at most
  ``LEDGER_MAX_SOURCE_BYTES``, and an ``.npz``'s arrays too, uncompressed;
* the file must have one name only (``st_nlink == 1``): a hard link inside the root to another
  tenant's file, or to one outside every root, has no symlink for ``realpath`` to resolve.

The worker checks all of this again when it reads (the file may have changed since the admin set
it): it walks from the root's directory one component at a time with ``O_NOFOLLOW`` (a symlink
swapped in anywhere on the way fails the walk), ``lstat``s the file before opening it (a FIFO or
a device is never opened: opening either can block or have effects), opens it with
``O_NOFOLLOW | O_NONBLOCK``, checks with ``fstat`` that the descriptor is the regular file it
looked at, with one link, and within the size, and reads the records from that descriptor only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Final

from service.contract.data_sources import DataSource, SourceLocationError, parse_source

if TYPE_CHECKING:
    from service.settings import Settings

DEFAULT_MAX_SOURCE_BYTES: Final = 256 * 1024 * 1024


EVERY_TENANT: Final = "*"  # the LEDGER_DATA_ROOTS entry of tenants without one of their own


def check_source(uri: str, roots: TenantRoots) -> DataSource:
    """``parse_source(uri)``, and for a file source the data-root checks (module docstring) as
    they stand now — without opening the file. The API calls this when an admin sets a source."""
    source = parse_source(uri)
    if source.path is not None:
        inspect_file(source, roots)
    return source


@dataclass(frozen=True, slots=True)
class TenantRoots:
    """One tenant's view of the data roots: where its file sources may live.

    ``roots``: the tenant's roots as configured (absolute); ``real_roots``: the same resolved;
    ``owners``: every configured root of every tenant, resolved, with its owner key, so that a
    real path is attributed to the deepest root that holds it."""

    tenant_id: str
    key: str  # the LEDGER_DATA_ROOTS entry this tenant uses: its own id, or "*"
    roots: tuple[Path, ...]
    real_roots: tuple[Path, ...]
    owners: tuple[tuple[Path, str], ...]
    max_bytes: int = DEFAULT_MAX_SOURCE_BYTES

    def described(self) -> str:
        return f"tenant {self.tenant_id!r} (LEDGER_DATA_ROOTS)"


@dataclass(frozen=True)
class DataRoots:
    """The operator's data roots (``LEDGER_DATA_ROOTS``): per tenant id, and ``"*"`` for every
    tenant without an entry of its own; ``max_bytes`` is ``LEDGER_MAX_SOURCE_BYTES``."""

    roots: Mapping[str, Sequence[str | os.PathLike[str]]] = field(default_factory=dict)
    max_bytes: int = DEFAULT_MAX_SOURCE_BYTES

    @classmethod
    def of(cls, settings: Settings) -> DataRoots:
        """The roots ``settings`` configure (``LEDGER_DATA_ROOTS``, ``LEDGER_MAX_SOURCE_BYTES``)."""
        return cls(settings.data_roots, settings.max_source_bytes)

    def for_tenant(self, tenant_id: str) -> TenantRoots:
        """The tenant's roots, resolved now (a root may itself be a symlink the operator moves)."""
        key = tenant_id if tenant_id in self.roots else EVERY_TENANT
        # A root that resolves to "/" now (a symlink moved since start-up) is no root at all.
        mine = tuple(Path(os.path.normpath(r)) for r in self.roots.get(key, ()) if os.path.realpath(r) != "/")
        owners = tuple(
            (Path(os.path.realpath(r)), owner)
            for owner, listed in self.roots.items()
            for r in listed
            if os.path.realpath(r) != "/"
        )
        return TenantRoots(
            tenant_id=tenant_id,
            key=key,
            roots=mine,
            real_roots=tuple(Path(os.path.realpath(r)) for r in mine),
            owners=owners,
            max_bytes=self.max_bytes,
        )


_DIRECTORY_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _outside(source: DataSource, roots: TenantRoots, why: str) -> SourceLocationError:
    return SourceLocationError(
        f"data source {source.uri!r} must name a regular file under a data root of "
        f"{roots.described()}: {why}."
    )


def _locate(source: DataSource, roots: TenantRoots) -> tuple[Path, PurePosixPath]:
    """The tenant's root (real path) holding the source's real path, and the path below it."""
    assert source.path is not None
    if not roots.roots:
        raise _outside(source, roots, "no data root is configured for it, so only builtin: sources work")
    named = source.path
    if not any(named.is_relative_to(r) for r in roots.roots + roots.real_roots):
        raise _outside(source, roots, "the path is not under any of its roots")
    real = Path(os.path.realpath(named))
    holders = [(root, owner) for root, owner in roots.owners if real.is_relative_to(root)]
    if not holders:  # a symlink on the way leads out of every root
        raise _outside(source, roots, "its real path (symlinks resolved) leaves the data roots")
    depth = max(len(root.parts) for root, _ in holders)
    deepest = [(root, owner) for root, owner in holders if len(root.parts) == depth]
    mine = [root for root, owner in deepest if owner == roots.key]
    if not mine:  # another tenant's root (perhaps nested inside a shared one)
        raise _outside(source, roots, "its real path lies in another tenant's data root")
    relative = PurePosixPath(real.relative_to(mine[0]))
    if not relative.parts:
        raise _outside(source, roots, "it names a data root itself, not a file")
    return mine[0], relative


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _parent_descriptor(source: DataSource, roots: TenantRoots, root: Path, relative: PurePosixPath) -> int:
    """An open descriptor of the directory that holds the file, reached from the root one
    component at a time without following a symlink: a component swapped for a symlink since
    ``realpath`` looked fails here, so the walk never leaves the root."""
    if os.open not in os.supports_dir_fd or os.stat not in os.supports_dir_fd:
        raise _outside(source, roots, "this platform cannot open files relative to a directory")
    try:
        fd = os.open(root, _DIRECTORY_FLAGS)
    except OSError as exc:
        raise _outside(source, roots, f"its data root cannot be opened ({type(exc).__name__})") from None
    try:
        for part in relative.parts[:-1]:
            following = os.open(part, _DIRECTORY_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = following
    except OSError as exc:
        os.close(fd)
        raise _outside(
            source, roots, f"a directory on its path is missing or is a symlink now ({type(exc).__name__})"
        ) from None
    return fd


def _refuse_hard_link(source: DataSource, roots: TenantRoots, found: os.stat_result) -> None:
    """A file with more than one name is refused: a hard link made inside the tenant's root to
    another tenant's (or an unrooted) file has no symlink to resolve, so its real path is the
    tenant's own and only the link count shows that the same inode has a name elsewhere."""
    if found.st_nlink > 1:
        raise _outside(
            source, roots, f"it has {found.st_nlink} hard links (a file with other names may lie elsewhere)"
        )


def _checked_stat(source: DataSource, roots: TenantRoots, parent: int, name: str) -> os.stat_result:
    """``lstat`` of the file in ``parent``: a regular file within the size, or refused."""
    try:
        found = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        raise _outside(source, roots, "there is no such file") from None
    except OSError as exc:
        raise _outside(source, roots, f"it cannot be examined ({type(exc).__name__})") from None
    if not stat.S_ISREG(found.st_mode):
        raise _outside(source, roots, f"it is {_kind(found.st_mode)}")
    _refuse_hard_link(source, roots, found)
    if found.st_size > roots.max_bytes:
        raise _outside(
            source,
            roots,
            f"it holds {found.st_size} bytes, more than LEDGER_MAX_SOURCE_BYTES = {roots.max_bytes}",
        )
    return found


def inspect_file(source: DataSource, roots: TenantRoots) -> int:
    """Check a file source against ``roots`` as it stands now, without opening the file; its
    size in bytes. ``SourceLocationError`` says what is wrong."""
    root, relative = _locate(source, roots)
    parent = _parent_descriptor(source, roots, root, relative)
    try:
        return _checked_stat(source, roots, parent, relative.name).st_size
    finally:
        os.close(parent)


def read_file(source: DataSource, roots: TenantRoots) -> bytes:
    """The bytes of a file source, read from a descriptor checked after it was opened (TOCTOU:
    the admin set the source earlier; the file may have been replaced since)."""
    root, relative = _locate(source, roots)
    parent = _parent_descriptor(source, roots, root, relative)
    try:
        before = _checked_stat(source, roots, parent, relative.name)
        try:
            fd = os.open(relative.name, _FILE_FLAGS, dir_fd=parent)
        except OSError as exc:  # ELOOP: replaced by a symlink after the lstat
            raise _outside(source, roots, f"it cannot be opened ({type(exc).__name__})") from None
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as handle:
        opened = os.fstat(handle.fileno())
        same = (opened.st_dev, opened.st_ino) == (before.st_dev, before.st_ino)
        if not stat.S_ISREG(opened.st_mode) or not same:
            raise _outside(source, roots, "it was replaced while it was being opened")
        _refuse_hard_link(source, roots, opened)  # linked between the lstat and the open
        if opened.st_size > roots.max_bytes:
            raise _outside(
                source,
                roots,
                f"it holds {opened.st_size} bytes, more than LEDGER_MAX_SOURCE_BYTES = {roots.max_bytes}",
            )
        content = handle.read(roots.max_bytes + 1)  # it may grow while read: never past the limit
    if len(content) > roots.max_bytes:
        raise _outside(source, roots, f"it grew past LEDGER_MAX_SOURCE_BYTES = {roots.max_bytes} while read")
    return content
