"""Server secrets: what the ledger keeps *outside* its database, in one place.

Two secrets. The **key-hash secret**, the HMAC-SHA256 key under which API keys are hashed
(``service.ledger.tenancy``). The database holds ``HMAC(secret, key)`` only, so a dump of it
alone lets nobody test a guessed key offline, however the key was chosen: the guess needs the
secret too. The **signing key**, the Ed25519 key that signs certificates and audit-chain heads
(``service.verification.signing``): ``LEDGER_SIGNING_KEY`` (a PEM file), else ``signing-key.pem`` in
the same folder as the key-hash secret (rules 2 and 3 below), created the same way on first use;
``LEDGER_SIGNING_KEYS_RETIRED`` lists the keys rotated out, which still verify. A key ring is
admitted by the database's key custody before it signs (``service.ledger.signing_custody``): a
process whose keys would orphan what an earlier key signed refuses to start, unless that key is
declared lost (``LEDGER_SIGNING_KEYS_LOST``, audited).

Where the secret comes from, first match wins (settings in ``service.settings``):

1. ``LEDGER_KEY_HASH_SECRET`` (32+ characters): for deployments where several hosts or
   containers share one database and none shares a folder.
2. The file ``key-hash.secret`` in ``LEDGER_SECRETS_DIR``.
3. The file ``key-hash.secret`` beside the SQLite database file; for a server database
   (PostgreSQL) in the ledger's home, ``LEDGER_HOME`` (default ``$XDG_DATA_HOME/privacy-ledger``,
   ``~/.local/share/privacy-ledger``).

A missing file is created on first use: 32 random bytes, hex, mode 0600, written to a temporary
file and hard-linked into place, so processes starting together all end up reading the one that
won. An existing file that is empty or short is an error, never replaced: a new secret would
silently make every stored key unusable.

Each secret has a public ``secret_id`` (an HMAC of a fixed label: it says nothing about any key)
stored with each key it hashed, so that a process with the wrong secret (another user's data
folder, a lost file) is told so at start-up instead of answering 401 to every key
(``tenancy.check_key_hash_secret``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from sqlalchemy.engine import URL, make_url

from service.settings import MIN_SECRET_LENGTH, Settings, ledger_home
from service.verification import signing
from service.verification.signing import KeyRing

if TYPE_CHECKING:
    from service.db.session import Database

logger = logging.getLogger("service.server_secrets")

KEY_HASH_SECRET_FILE: Final = "key-hash.secret"
SIGNING_KEY_FILE: Final = "signing-key.pem"
_SECRET_ID_LABEL: Final = b"privacy-ledger key-hash secret id v1"


class SecretError(RuntimeError):
    """A server secret cannot be read or made; the message names the setting or the file."""


def default_secrets_dir(database_url: str | URL) -> Path:
    """The folder of ``key-hash.secret`` when ``LEDGER_SECRETS_DIR`` is unset (rule 3 above)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(str(url.database)).expanduser().resolve().parent
    return ledger_home()


def load_key_hash_secret(settings: Settings, database_url: str | URL) -> bytes:
    """The key-hash secret ``settings`` name for the database at ``database_url``."""
    if settings.key_hash_secret is not None:
        return settings.key_hash_secret.get_secret_value().encode()
    folder = settings.secrets_dir if settings.secrets_dir is not None else default_secrets_dir(database_url)
    return _read_or_create(Path(folder).expanduser() / KEY_HASH_SECRET_FILE)


def secret_id(secret: bytes) -> str:
    """A public name for ``secret`` (16 hex characters): equal ids, equal secrets."""
    return hmac.new(secret, _SECRET_ID_LABEL, hashlib.sha256).hexdigest()[:16]


def _read(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"cannot read the key-hash secret file {path}: {exc}") from exc
    if len(text) < MIN_SECRET_LENGTH:
        raise SecretError(
            f"the key-hash secret file {path} holds {len(text)} characters, fewer than "
            f"{MIN_SECRET_LENGTH}: restore it from a backup (a new secret would make every stored key "
            "unusable), or set LEDGER_KEY_HASH_SECRET."
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "the key-hash secret file %s can be read by other users (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    return text.encode()


def _read_or_create(path: Path) -> bytes:
    if not path.exists():
        _create_once(
            path,
            (secrets.token_hex(32) + "\n").encode("ascii"),
            "key-hash secret",
            "API keys are hashed with it",
            "LEDGER_KEY_HASH_SECRET",
        )
    return _read(path)


def _create_once(path: Path, content: bytes, what: str, why: str, setting: str) -> None:
    """Write ``content`` to ``path`` (0600) unless a file is there already: to a temporary file
    first, then hard-linked into place, so processes starting together all read the one that won."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(content)
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, path)  # atomic, and fails if another process got there first
            except FileExistsError:
                pass
            else:
                logger.warning(
                    "created the %s %s (%s; back it up with the database, but not inside it)",
                    what,
                    path,
                    why,
                )
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        raise SecretError(
            f"cannot create the {what} file {path}: {exc}. Set LEDGER_SECRETS_DIR to a "
            f"folder this process can write, or {setting}."
        ) from exc


def load_signing_keys(settings: Settings, database_url: str | URL) -> KeyRing:
    """The signing key ``settings`` name (``LEDGER_SIGNING_KEY``, else ``signing-key.pem`` in the
    secrets folder, created on first use) and the retired keys that still verify
    (``LEDGER_SIGNING_KEYS_RETIRED``). A configured file that cannot be read is an error, never
    replaced: a new key would leave every certificate signed so far unverifiable."""
    try:
        if settings.signing_key is not None:
            path = Path(settings.signing_key).expanduser()
            active = signing.read_private_key(path, "LEDGER_SIGNING_KEY")
        else:
            folder = settings.secrets_dir
            path = Path(folder or default_secrets_dir(database_url)).expanduser() / SIGNING_KEY_FILE
            if not path.exists():
                _create_once(
                    path,
                    signing.SigningKey.generate().pem(),
                    "certificate-signing key",
                    "certificates and audit heads are signed with it; without it, or its public "
                    "key in LEDGER_SIGNING_KEYS_RETIRED, they no longer verify",
                    "LEDGER_SIGNING_KEY",
                )
            active = signing.read_private_key(path, "the signing key file")
        _warn_if_shared(path, "signing key")
        retired = tuple(
            signing.read_public_key(entry, f"LEDGER_SIGNING_KEYS_RETIRED[{i}]")
            for i, entry in enumerate(settings.signing_keys_retired)
        )
    except signing.SigningKeyError as exc:
        raise SecretError(str(exc)) from exc
    return signing.KeyRing(active, tuple(k for k in retired if k.key_id != active.public.key_id))


def _warn_if_shared(path: Path, what: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "the %s file %s can be read by other users (mode %o); chmod 600 it",
            what,
            path,
            stat.S_IMODE(mode),
        )


_settings: weakref.WeakKeyDictionary[Database, Settings] = weakref.WeakKeyDictionary()
_secrets: weakref.WeakKeyDictionary[Database, bytes] = weakref.WeakKeyDictionary()
_key_rings: weakref.WeakKeyDictionary[Database, KeyRing] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def configure(db: Database, settings: Settings) -> None:
    """Resolve ``db``'s secrets from ``settings`` (the app's) rather than from the environment.

    Nothing is read yet: an app must start even where the secret cannot be made (its first key
    lookup then fails, 500, and every key is refused); ``ledger serve`` calls ``bind`` first.
    """
    with _lock:
        _settings[db] = settings
        _secrets.pop(db, None)
        _key_rings.pop(db, None)


def admitted_signing_keys(settings: Settings, db: Database) -> KeyRing:
    """``load_signing_keys``, admitted by the database's key custody before anything is signed
    with it (``service.ledger.signing_custody.admit``): ``SecretError`` while the database records
    a key that is neither active nor retired here and not declared lost
    (``LEDGER_SIGNING_KEYS_LOST``). This is what stops a lost key file from being replaced by a
    new key silently."""
    from service.ledger.signing_custody import UnknownSigningKeys, admit

    ring = load_signing_keys(settings, db.url)
    try:
        admit(db, ring, lost=settings.signing_keys_lost)
    except UnknownSigningKeys as exc:
        raise SecretError(str(exc)) from exc
    return ring


def bind(db: Database, settings: Settings) -> bytes:
    """``configure``, and read (or make) the key-hash secret and the signing key now: ``ledger
    serve`` does so at start, so that a secret that cannot be read, or a signing key that would
    orphan what earlier keys signed (``admitted_signing_keys``), fails the start and not the
    first request."""
    secret = load_key_hash_secret(settings, db.url)
    ring = admitted_signing_keys(settings, db)
    with _lock:
        _settings[db] = settings
        _secrets[db] = secret
        _key_rings[db] = ring
    return secret


def bind_signing_keys(db: Database, settings: Settings) -> KeyRing:
    """``configure``, and read (or make) the signing key now. The app's start does so: a
    configured key that cannot be read stops the server rather than the first commit."""
    ring = admitted_signing_keys(settings, db)
    with _lock:
        _settings[db] = settings
        _secrets.pop(db, None)
        _key_rings[db] = ring
    return ring


_T = TypeVar("_T")


def _loaded(cache: MutableMapping[Database, _T], db: Database, load: Callable[[Settings, Any], _T]) -> _T:
    """``cache[db]``, loaded once (under the lock) from ``db``'s ``configure``'d settings, else
    the environment's."""
    value = cache.get(db)
    if value is None:
        with _lock:
            value = cache.get(db)
            if value is None:
                value = load(_settings.get(db) or Settings(), db.url)
                cache[db] = value
    return value


def signing_keys(db: Database) -> KeyRing:
    """``db``'s signing keys, from its ``configure``'d settings, else the environment's, admitted
    by the database's key custody when first loaded (``admitted_signing_keys``)."""
    return _loaded(_key_rings, db, lambda settings, _: admitted_signing_keys(settings, db))


def key_hash_secret(db: Database) -> bytes:
    """``db``'s key-hash secret, from its ``configure``'d settings, else the environment's."""
    return _loaded(_secrets, db, load_key_hash_secret)


__all__ = [
    "KEY_HASH_SECRET_FILE",
    "SIGNING_KEY_FILE",
    "SecretError",
    "admitted_signing_keys",
    "bind",
    "bind_signing_keys",
    "configure",
    "default_secrets_dir",
    "key_hash_secret",
    "load_key_hash_secret",
    "load_signing_keys",
    "secret_id",
    "signing_keys",
]
