"""Server secrets: what the ledger keeps *outside* its database, in one place.

Today one secret: the **key-hash secret**, the HMAC-SHA256 key under which API keys are hashed
(``service.ledger.tenancy``). The database holds ``HMAC(secret, key)`` only, so a dump of it
alone lets nobody test a guessed key offline, however the key was chosen: the guess needs the
secret too. (The certificate-signing key planned next belongs beside it, in ``secrets_dir``.)

Where the secret comes from, first match wins (settings in ``service.settings``):

1. ``LEDGER_KEY_HASH_SECRET`` (32+ characters): for deployments where several hosts or
   containers share one database and none shares a folder.
2. The file ``key-hash.secret`` in ``LEDGER_SECRETS_DIR``.
3. The file ``key-hash.secret`` beside the SQLite database file; for a server database
   (PostgreSQL) in the user's data folder, ``$XDG_DATA_HOME/privacy-ledger`` (default
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
from pathlib import Path
from typing import TYPE_CHECKING, Final

from sqlalchemy.engine import URL, make_url

from service.settings import MIN_SECRET_LENGTH, Settings

if TYPE_CHECKING:
    from service.db.session import Database

logger = logging.getLogger("service.server_secrets")

KEY_HASH_SECRET_FILE: Final = "key-hash.secret"
_SECRET_ID_LABEL: Final = b"privacy-ledger key-hash secret id v1"


class SecretError(RuntimeError):
    """A server secret cannot be read or made; the message names the setting or the file."""


def default_secrets_dir(database_url: str | URL) -> Path:
    """The folder of ``key-hash.secret`` when ``LEDGER_SECRETS_DIR`` is unset (rule 3 above)."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        return Path(str(url.database)).expanduser().resolve().parent
    data_home = os.environ.get("XDG_DATA_HOME", "").strip()
    base = Path(data_home) if data_home else Path.home() / ".local" / "share"
    return base / "privacy-ledger"


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
    if path.exists():
        return _read(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w", encoding="ascii") as handle:
                handle.write(secrets.token_hex(32) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(temporary, path)  # atomic, and fails if another process got there first
            except FileExistsError:
                pass
            else:
                logger.warning(
                    "created the key-hash secret %s (API keys are hashed with it; back it up with "
                    "the database, but not inside it)",
                    path,
                )
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        raise SecretError(
            f"cannot create the key-hash secret file {path}: {exc}. Set LEDGER_SECRETS_DIR to a "
            "folder this process can write, or LEDGER_KEY_HASH_SECRET."
        ) from exc
    return _read(path)


_settings: weakref.WeakKeyDictionary[Database, Settings] = weakref.WeakKeyDictionary()
_secrets: weakref.WeakKeyDictionary[Database, bytes] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def configure(db: Database, settings: Settings) -> None:
    """Resolve ``db``'s secrets from ``settings`` (the app's) rather than from the environment.

    Nothing is read yet: an app must start even where the secret cannot be made (its first key
    lookup then fails, 500, and every key is refused); ``ledger serve`` calls ``bind`` first.
    """
    with _lock:
        _settings[db] = settings
        _secrets.pop(db, None)


def bind(db: Database, settings: Settings) -> bytes:
    """``configure``, and read (or make) the key-hash secret now: ``ledger serve`` does so at
    start, so that a secret that cannot be read fails the start and not the first request."""
    secret = load_key_hash_secret(settings, db.url)
    with _lock:
        _settings[db] = settings
        _secrets[db] = secret
    return secret


def key_hash_secret(db: Database) -> bytes:
    """``db``'s key-hash secret, from its ``configure``'d settings, else the environment's."""
    secret = _secrets.get(db)
    if secret is None:
        with _lock:
            secret = _secrets.get(db)
            if secret is None:
                secret = load_key_hash_secret(_settings.get(db) or Settings(), db.url)
                _secrets[db] = secret
    return secret


__all__ = [
    "KEY_HASH_SECRET_FILE",
    "SecretError",
    "bind",
    "configure",
    "default_secrets_dir",
    "key_hash_secret",
    "load_key_hash_secret",
    "secret_id",
]
