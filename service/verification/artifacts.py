"""Whether a model version's bytes are the ones its signed certificate certifies: what a client
checks before it loads downloaded weights (``service.training.nets.load_model``) and what the
``X-Artifact-SHA256`` header and the version record cannot show, since they come from the same
server as the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from accountant.certificates import content_hash
from service.verification.signing import PublicKey, check_certificate


def artifact_problem(version: Mapping[str, Any], sha256: str, keys: Mapping[str, PublicKey]) -> str | None:
    """Why bytes of SHA-256 ``sha256`` are not the ones the model ``version``'s certificate (as
    ``GET /v1/models/{name}/versions/{v}`` answers it) certifies, or ``None`` when they are: the
    certificate's content hash is its content's, its signature verifies under ``keys``, its
    release is this ``{name, version}`` and states ``artifact_sha256`` = ``sha256``."""
    name, number = version.get("name"), version.get("version")
    holder = version.get("certificate")
    certificate = holder.get("certificate") if isinstance(holder, Mapping) else None
    if not isinstance(certificate, Mapping):
        return "the version comes with no certificate"
    if content_hash(certificate) != certificate.get("hash"):
        return "its certificate's content does not match its hash"
    signature = check_certificate(certificate, keys)
    if not signature.ok:
        return f"its certificate's signature is not valid: {signature.reason}"
    release = certificate.get("release") or {}
    certified = release.get("artifact_sha256")
    if (release.get("model"), str(release.get("version"))) != (name, str(number)):
        return f"its certificate certifies release {release.get('model')}/{release.get('version')}"
    if certified is None:
        return (
            "its certificate names no artifact (published before releases stated their "
            "artifact's SHA-256): nothing signed vouches for these bytes; download_artifact "
            "checks them against the server's record only"
        )
    if certified != sha256:
        return f"its bytes have SHA-256 {sha256}, its signed certificate states {certified}"
    return None


__all__ = ["artifact_problem"]
