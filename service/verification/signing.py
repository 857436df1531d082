"""Signatures: the server's Ed25519 key vouches for its certificates and its audit-chain heads.

A certificate's content hash (``accountant.certificates.content_hash``) is integrity, not
authenticity: whoever edits a certificate's event, budget and states consistently can recompute
the hash, and ``verify`` then recomputes the same bound from the forged inputs. A signature binds
the hash to the holder of the server's private key, which never leaves the server's secrets
folder (``service.server_secrets``), so a third party holding the server's public key can tell
the ledger's certificates from anyone else's.

What is signed (Ed25519, RFC 8032), each a canonical JSON document whose ``kind`` keeps one
kind of signature from being replayed as another:

* a certificate: ``{"kind": "privacy-ledger/certificate-signature", "content_hash": H}``, where
  ``H`` is the certificate's ``hash``, which covers every field but ``hash`` and ``signature``;
* an audit-chain head: ``{"kind": "privacy-ledger/audit-head-signature", "chain": C,
  "chain_seq": N, "hash": H}``: the server stated that chain ``C`` had ``N`` entries ending in
  ``H``.

A signature is ``{"algorithm": "Ed25519", "key_id": K, "value": base64(64 bytes)}``; ``K`` is
``key_id(public key)``, 16 hex characters of the SHA-256 of the raw 32-byte public key, so a key
names itself and a verifier can look it up in a ``KeyRing`` (the server's: one active key that
signs, any number of retired ones that still verify) or in keys it pinned.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from accountant.canonical import canonical_bytes

ALGORITHM: Final = "Ed25519"
CERTIFICATE_SIGNATURE_KIND: Final = "privacy-ledger/certificate-signature"
HEAD_SIGNATURE_KIND: Final = "privacy-ledger/audit-head-signature"
WELL_KNOWN_PATH: Final = "/.well-known/privacy-ledger/signing-keys"
_RAW_KEY_BYTES: Final = 32
_SIGNATURE_BYTES: Final = 64

KeyStatus = Literal["active", "retired"]


class SigningKeyError(ValueError):
    """A key (file, setting, option or JSON) cannot be read; the message names where it came from."""


def key_id(raw_public_key: bytes) -> str:
    """The public name of a key: 16 hex characters of SHA-256 over its raw 32 bytes."""
    return hashlib.sha256(raw_public_key).hexdigest()[:16]


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object, what: str, length: int) -> bytes:
    if not isinstance(text, str):
        raise SigningKeyError(f"{what} must be a base64 string. Found {text!r}.")
    try:
        data = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SigningKeyError(f"{what} is not base64: {exc}. Found {text[:60]!r}.") from None
    if len(data) != length:
        raise SigningKeyError(f"{what} must decode to {length} bytes. Found {len(data)}.")
    return data


@dataclass(frozen=True, slots=True)
class PublicKey:
    """A key that verifies: its ``key_id``, raw 32 bytes and whether it still signs."""

    key_id: str
    raw: bytes
    status: KeyStatus = "active"

    @classmethod
    def of(cls, raw: bytes, status: KeyStatus = "active") -> PublicKey:
        return cls(key_id(raw), raw, status)

    def verifies(self, message: bytes, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def to_json(self) -> dict[str, str]:
        return {
            "key_id": self.key_id,
            "algorithm": ALGORITHM,
            "public_key": _b64(self.raw),
            "status": self.status,
        }


@dataclass(frozen=True, slots=True)
class SigningKey:
    """The private key that signs, with its public half."""

    private: Ed25519PrivateKey
    public: PublicKey

    @classmethod
    def of(cls, private: Ed25519PrivateKey) -> SigningKey:
        return cls(private, PublicKey.of(_raw(private.public_key())))

    @classmethod
    def generate(cls) -> SigningKey:
        return cls.of(Ed25519PrivateKey.generate())

    def pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM (the file ``service.server_secrets`` writes)."""
        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def sign(self, message: bytes) -> dict[str, str]:
        value = _b64(self.private.sign(message))
        return {"algorithm": ALGORITHM, "key_id": self.public.key_id, "value": value}


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The server's keys: ``active`` signs everything new; ``retired`` keys only verify what they
    signed before a rotation."""

    active: SigningKey
    retired: tuple[PublicKey, ...] = ()

    def public_keys(self) -> dict[str, PublicKey]:
        keys = {k.key_id: PublicKey(k.key_id, k.raw, "retired") for k in self.retired}
        keys[self.active.public.key_id] = self.active.public
        return keys

    def to_json(self) -> dict[str, Any]:
        """The well-known document: ``{"keys": [...]}``, the active key first."""
        keys = self.public_keys()
        ordered = [keys.pop(self.active.public.key_id), *keys.values()]
        return {"keys": [k.to_json() for k in ordered]}


# ---------------------------------------------------------------------------------------------
# Reading keys
# ---------------------------------------------------------------------------------------------


def private_key_from_pem(data: bytes, what: str) -> SigningKey:
    """An Ed25519 private key from unencrypted PEM (PKCS#8), or ``SigningKeyError`` naming ``what``."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{what} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{what} must be an Ed25519 key. Found {type(key).__name__}.")
    return SigningKey.of(key)


def read_private_key(path: Path, what: str) -> SigningKey:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"{what}: cannot read the signing key file {path}: {exc}") from None
    return private_key_from_pem(data, f"{what} ({path})")


def read_public_key(entry: str, what: str) -> PublicKey:
    """A retired key: base64 of the raw public key (as the well-known route lists it), or the
    path of a PEM file holding the public or the private key."""
    text = entry.strip()
    if not text:
        raise SigningKeyError(f"{what} must not be blank.")
    try:
        raw = _unb64(text, what, _RAW_KEY_BYTES)
    except SigningKeyError:
        pass
    else:
        return PublicKey.of(raw, "retired")
    path = Path(text).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(
            f"{what} must be base64 of a raw Ed25519 public key or the path of a PEM key file: "
            f"cannot read {text!r}: {exc}"
        ) from None
    if b"PRIVATE KEY" in data:
        return PublicKey.of(private_key_from_pem(data, f"{what} ({path})").public.raw, "retired")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{what} ({path}) is not a PEM public or private key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{what} ({path}) must be an Ed25519 key. Found {type(key).__name__}.")
    return PublicKey.of(_raw(key), "retired")


def trusted_key(text: str, what: str = "--trusted-key") -> PublicKey:
    """``KEYID:BASE64`` (a key a verifier pins): the id must be the key's own."""
    kid, sep, encoded = text.partition(":")
    if not sep:
        raise SigningKeyError(f"{what} must be KEYID:BASE64. Found {text[:80]!r}.")
    key = PublicKey.of(_unb64(encoded, what, _RAW_KEY_BYTES))
    if kid.strip() != key.key_id:
        raise SigningKeyError(f"{what}: key id {kid.strip()!r} is not this key's; its id is {key.key_id}.")
    return key


def keys_from_json(document: object, what: str) -> dict[str, PublicKey]:
    """The keys of a well-known document ``{"keys": [{key_id, algorithm, public_key, status}]}``;
    every listed id must be its key's own."""
    items = document.get("keys") if isinstance(document, Mapping) else None
    if not isinstance(items, list):
        raise SigningKeyError(f"{what} must be an object with a list 'keys'. Found {str(document)[:80]!r}.")
    keys: dict[str, PublicKey] = {}
    for i, item in enumerate(items):
        where = f"{what}.keys[{i}]"
        if not isinstance(item, Mapping):
            raise SigningKeyError(f"{where} must be an object. Found {item!r}.")
        if item.get("algorithm") != ALGORITHM:
            found = item.get("algorithm")
            raise SigningKeyError(f"{where}.algorithm must be {ALGORITHM!r}. Found {found!r}.")
        status = item.get("status", "active")
        if status not in ("active", "retired"):
            raise SigningKeyError(f"{where}.status must be 'active' or 'retired'. Found {status!r}.")
        key = PublicKey.of(_unb64(item.get("public_key"), f"{where}.public_key", _RAW_KEY_BYTES), status)
        if item.get("key_id") != key.key_id:
            raise SigningKeyError(
                f"{where}.key_id {item.get('key_id')!r} is not this key's; its id is {key.key_id}."
            )
        keys[key.key_id] = key
    return keys


# ---------------------------------------------------------------------------------------------
# Signing and checking
# ---------------------------------------------------------------------------------------------


def certificate_message(content_hash: str) -> bytes:
    return canonical_bytes({"kind": CERTIFICATE_SIGNATURE_KIND, "content_hash": content_hash})


def head_message(chain: str, chain_seq: int, head_hash: str) -> bytes:
    return canonical_bytes(
        {"kind": HEAD_SIGNATURE_KIND, "chain": chain, "chain_seq": chain_seq, "hash": head_hash}
    )


def sign_certificate(certificate: Mapping[str, Any], key: SigningKey) -> dict[str, Any]:
    """``certificate`` with its ``signature`` over its ``hash`` (the hash does not cover it)."""
    return {**certificate, "signature": key.sign(certificate_message(str(certificate["hash"])))}


def signed_head(chain: str, chain_seq: int, head_hash: str, key: SigningKey) -> dict[str, Any]:
    """A chain head ``{chain_seq, hash, signature}`` as the audit routes answer it."""
    return {
        "chain_seq": chain_seq,
        "hash": head_hash,
        "signature": key.sign(head_message(chain, chain_seq, head_hash)),
    }


SignatureStatus = Literal["valid", "invalid", "unsigned", "unknown_key", "malformed"]


@dataclass(frozen=True, slots=True)
class SignatureCheck:
    """Whether a signature is ``valid`` under known keys, and why not: ``status`` is ``valid``,
    ``invalid`` (a known key, a wrong signature), ``unsigned``, ``unknown_key`` or ``malformed``."""

    status: SignatureStatus
    key_id: str | None
    reason: str
    key_status: KeyStatus | None = None

    @property
    def ok(self) -> bool:
        return self.status == "valid"

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "key_id": self.key_id,
            "key_status": self.key_status,
            "reason": self.reason,
        }


def check_signature(
    signature: object, message: bytes, keys: Mapping[str, PublicKey], what: str
) -> SignatureCheck:
    """Check ``signature`` (the object ``SigningKey.sign`` made) over ``message`` under ``keys``."""
    if signature is None:
        return SignatureCheck("unsigned", None, f"{what} is not signed")
    if not isinstance(signature, Mapping):
        return SignatureCheck("malformed", None, f"{what}.signature must be an object. Found {signature!r}.")
    kid = signature.get("key_id")
    if not isinstance(kid, str):
        return SignatureCheck("malformed", None, f"{what}.signature.key_id must be a string. Found {kid!r}.")
    if signature.get("algorithm") != ALGORITHM:
        return SignatureCheck(
            "malformed",
            kid,
            f"{what}.signature.algorithm must be {ALGORITHM!r}. Found {signature.get('algorithm')!r}.",
        )
    key = keys.get(kid)
    if key is None:
        known = ", ".join(sorted(keys)) or "none"
        return SignatureCheck(
            "unknown_key", kid, f"{what}.signature.key_id {kid!r} is not a trusted key (known: {known})"
        )
    try:
        value = _unb64(signature.get("value"), f"{what}.signature.value", _SIGNATURE_BYTES)
    except SigningKeyError as exc:
        return SignatureCheck("malformed", kid, str(exc), key.status)
    if not key.verifies(message, value):
        return SignatureCheck(
            "invalid", kid, f"{what}.signature does not verify under key {kid} (forged or edited)", key.status
        )
    return SignatureCheck("valid", kid, f"signed by key {kid} ({key.status})", key.status)


def check_certificate(certificate: Mapping[str, Any], keys: Mapping[str, PublicKey]) -> SignatureCheck:
    """The signature of ``certificate`` over its stored ``hash``. Whether that hash is the hash of
    its content is ``accountant.certificates.verify``'s to say: check both."""
    content_hash = certificate.get("hash")
    if not isinstance(content_hash, str):
        return SignatureCheck("malformed", None, "certificate.hash must be a string")
    return check_signature(
        certificate.get("signature"), certificate_message(content_hash), keys, "certificate"
    )


def check_head(chain: str, head: Mapping[str, Any], keys: Mapping[str, PublicKey]) -> SignatureCheck:
    seq, digest = head.get("chain_seq"), head.get("hash")
    if not isinstance(seq, int) or not isinstance(digest, str):
        return SignatureCheck("malformed", None, "audit head must have an integer chain_seq and a hash")
    return check_signature(head.get("signature"), head_message(chain, seq, digest), keys, "audit head")


def key_ids(checks: Iterable[SignatureCheck]) -> list[str]:
    return sorted({c.key_id for c in checks if c.key_id is not None})


__all__ = [
    "ALGORITHM",
    "WELL_KNOWN_PATH",
    "KeyRing",
    "PublicKey",
    "SignatureCheck",
    "SigningKey",
    "SigningKeyError",
    "check_certificate",
    "check_head",
    "check_signature",
    "key_id",
    "keys_from_json",
    "private_key_from_pem",
    "read_private_key",
    "read_public_key",
    "sign_certificate",
    "signed_head",
    "trusted_key",
]
