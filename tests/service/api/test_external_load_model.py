"""``service.training.nets.load_model`` for a version trained outside the service and registered with its
weights (``PUT /v1/models/{name}/versions/{v}``), end to end over real HTTP (uvicorn on TCP):
a real torch module trained a few steps, saved as a state dict, released through the gate with
its SHA-256 in the signed certificate, registered, then loaded back — as a state dict, into the
caller's module (same predictions), and refused when the bytes on the server are swapped, when the
certificate names no bytes (unless the caller waives it), or when a non-state-dict artifact is
asked into a module."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.engine import URL
from torch import nn

from service.client import LedgerClient, LedgerError
from service.db.session import Database
from service.ledger import tenancy
from service.training.nets import load_model
from tests.service.live_server import serve, settings_for

DPSGD = {
    "kind": "self_composed",
    "count": 20,
    "event": {
        "kind": "poisson_sampled",
        "sampling_probability": 0.1,
        "event": {"kind": "gaussian", "noise_multiplier": 2.0},
    },
}
SPEC = {"architecture": "nn.Sequential(Linear(8, 16), ReLU, Linear(16, 3))", "preprocessing": "none"}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _trained() -> tuple[nn.Module, bytes]:
    """A real (tiny) training run, and its state dict as ``torch.save`` writes it."""
    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    model = _net()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        optimiser.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return model.eval(), buffer.getvalue()


@pytest.fixture
def world(database_url: URL, db: Database, tmp_path: Path) -> Iterator[dict[str, Any]]:
    keys = {
        "admin": tenancy.create_api_key(db, "acme", "admin"),
        "viewer": tenancy.create_api_key(db, "acme", "viewer"),
    }
    artifacts = tmp_path / "artifacts"
    with (
        serve(settings_for(database_url, artifacts), db) as url,
        LedgerClient(url, keys["admin"], retries=0) as ledger,
    ):
        dataset = ledger.create_dataset(
            "ext-load", rule="sequential", epsilon="8", delta="1e-5", accountant="rdp"
        )
        task = ledger.create_task(dataset["id"], "t")
        ledger.create_batches(
            dataset["id"], task["id"], [{"name": "b", "records": [f"r{i}" for i in range(64)]}]
        )
        yield {
            "url": url,
            "keys": keys,
            "ledger": ledger,
            "dataset": dataset,
            "task": task,
            "artifacts": artifacts,
        }


def _release(world: dict[str, Any], version: int, sha256: str | None) -> str:
    ledger: LedgerClient = world["ledger"]
    with ledger.release_gate(
        world["dataset"]["id"], None, DPSGD, tasks=[world["task"]["id"]], model="ext-net", version=version
    ) as gate:
        gate.artifact_sha256 = sha256
    return str(gate.certificate["id"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_an_external_version_loads_only_its_certified_bytes(world: dict[str, Any]) -> None:
    ledger: LedgerClient = world["ledger"]
    model, weights = _trained()
    certificate = _release(world, 1, hashlib.sha256(weights).hexdigest())
    ledger.register_model_version("ext-net", 1, weights, certificate_id=certificate, **SPEC)

    with LedgerClient(world["url"], world["keys"]["viewer"], retries=0) as viewer:
        state = load_model(viewer, "ext-net", 1)
        assert set(state) == set(model.state_dict())
        for name, tensor in model.state_dict().items():
            assert torch.equal(state[name], tensor), name
        loaded = load_model(viewer, "ext-net", 1, module=_net())
        assert not loaded.training and loaded.model_spec == {"kind": "external", **SPEC}
        probe = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(loaded(probe), model(probe))
        # another architecture than the weights': torch's strict load refuses it
        with pytest.raises(RuntimeError, match=r"size mismatch|Missing key|Unexpected key"):
            load_model(
                viewer, "ext-net", 1, module=nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
            )

        # the bytes on disk swapped: the registry's SHA-256 no longer matches, nothing loads
        (path,) = [p for p in world["artifacts"].rglob("*") if p.is_file() and "ext-net" in str(p)]
        original = path.read_bytes()
        _, other = _trained_other()
        path.write_bytes(other)
        with pytest.raises(LedgerError) as refused:
            load_model(viewer, "ext-net", 1)
        assert refused.value.code == "artifact_mismatch", refused.value
        path.write_bytes(original)
        assert torch.equal(load_model(viewer, "ext-net", 1)["0.weight"], model.state_dict()["0.weight"])


@pytest.mark.parametrize("backend", ["sqlite"])
def test_a_registration_whose_certificate_names_no_bytes_loads_only_when_waived(
    world: dict[str, Any],
) -> None:
    ledger: LedgerClient = world["ledger"]
    model, weights = _trained()
    certificate = _release(world, 1, None)  # the trainer did not bind the bytes in the certificate
    ledger.register_model_version("ext-net", 1, weights, certificate_id=certificate, **SPEC)
    with pytest.raises(LedgerError) as refused:
        load_model(ledger, "ext-net", 1)
    assert refused.value.code == "artifact_not_certified" and "names no artifact" in str(refused.value)
    state = load_model(ledger, "ext-net", 1, require_certified=False)  # the registry's SHA-256 only
    assert torch.equal(state["2.bias"], model.state_dict()["2.bias"])

    # a "bytes" artifact answers its checked bytes; asked into a module, it is refused
    raw = b"an ONNX file, say" * 4
    ledger.register_model_version(
        "ext-net",
        2,
        raw,
        certificate_id=_release(world, 2, hashlib.sha256(raw).hexdigest()),
        format="bytes",
        **SPEC,
    )
    assert load_model(ledger, "ext-net", 2) == raw
    with pytest.raises(LedgerError) as refused:
        load_model(ledger, "ext-net", 2, module=_net())
    assert refused.value.code == "model_not_loadable" and "'bytes'" in str(refused.value)


def _trained_other() -> tuple[nn.Module, bytes]:
    model = _net()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return model, buffer.getvalue()
