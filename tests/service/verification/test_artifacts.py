"""``artifact_problem``: a model version's bytes against its signed certificate, with a real
Ed25519 key (``tests/worker/test_certified_artifacts.py`` runs it through ``load_model`` on a
trained model and a server)."""

from __future__ import annotations

from typing import Any

from accountant.certificates import content_hash
from service.verification.artifacts import artifact_problem
from service.verification.signing import SigningKey, sign_certificate

SHA = "ab" * 32


def _version(key: SigningKey, **release: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "dataset_id": "ds_1",
        "release": {"model": "m", "version": 2, "artifact_sha256": SHA, **release},
    }
    body["hash"] = content_hash(body)
    return {"name": "m", "version": 2, "certificate": {"certificate": sign_certificate(body, key)}}


def test_only_the_certified_bytes_of_this_release_under_a_trusted_key_pass() -> None:
    key = SigningKey.generate()
    keys = {key.public.key_id: key.public}
    version = _version(key)
    assert artifact_problem(version, SHA, keys) is None
    assert "its signed certificate states " + SHA in str(artifact_problem(version, "cd" * 32, keys))
    assert "signature is not valid" in str(artifact_problem(version, SHA, {}))
    other = _version(key, version=3)
    assert artifact_problem(other, SHA, keys) == "its certificate certifies release m/3"
    unnamed = _version(key, artifact_sha256=None)
    assert "names no artifact" in str(artifact_problem(unnamed, SHA, keys))
    edited = _version(key)
    edited["certificate"]["certificate"]["dataset_id"] = "ds_2"
    assert artifact_problem(edited, SHA, keys) == "its certificate's content does not match its hash"
    assert artifact_problem({"name": "m", "version": 2}, SHA, keys) == "the version comes with no certificate"
