"""The Opacus adapter under DDP (issue 30 §1): two real ``gloo`` processes, Opacus's ``DPDDP``,
``DistributedDPOptimizer`` and distributed Poisson sampler, and a real ledger over HTTP that only
rank 0 talks to. One reservation and one commit for the run, the certificate on rank 0 only, the
two ranks' models identical at the end."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("opacus", reason="the Opacus adapter needs opacus (the dev extra installs it)")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opacus import PrivacyEngine
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DistributedDPOptimizer
from sqlalchemy.engine import URL

from service.client import LedgerClient
from service.db.session import Database
from service.integrations.opacus import make_private_with_epsilon
from service.ledger import tenancy
from tests.service.live_server import serve, settings_for

RECORDS, BATCH = 400, 40  # q = 1/10, 10 steps; each rank's local batch is 20 on average


def _records() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)  # the same dataset on every rank
    x = torch.randn(RECORDS, 4, generator=generator)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def _rank(rank: int, world_size: int, store: str, url: str, key: str, dataset_id: str, out: str) -> None:
    """One rank of the DDP run; writes what it saw to ``out/rank<r>.json``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.manual_seed(rank)  # different initial weights: DPDDP makes them rank 0's
    module = DPDDP(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_records(), batch_size=BATCH)
    client = LedgerClient(url, key) if rank == 0 else None  # the other rank never sees the key
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus: secure RNG
        with make_private_with_epsilon(
            client,
            PrivacyEngine(accountant="rdp"),
            dataset_id=dataset_id,
            module=module,
            optimizer=optimizer,
            data_loader=loader,
            target_epsilon=1.0,
            epochs=1,
            max_grad_norm=1.0,
            model="linear-ddp",
            version="1",
        ) as run:
            optimizer_type = type(run.optimizer).__name__
            for x, y in run.data_loader:
                run.optimizer.zero_grad()
                torch.nn.functional.cross_entropy(run.module(x), y).backward()
                run.optimizer.step()
                steps += 1
    if client is not None:
        client.close()
    weights = [p.detach().flatten().tolist() for p in module.parameters()]
    seen = {"steps": steps, "optimizer": optimizer_type, "certificate": run.certificate, "weights": weights}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.fixture
def ledger(database_url: URL, db: Database, tmp_path: Path) -> Iterator[tuple[str, str]]:
    key = tenancy.create_api_key(db, "acme", "admin")
    with serve(settings_for(database_url, tmp_path / "artifacts"), db) as url:
        yield url, key


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"])
def test_opacus_under_ddp_is_one_reservation_and_one_commit_by_rank_0(
    ledger: tuple[str, str], tmp_path: Path
) -> None:
    url, key = ledger
    with LedgerClient(url, key) as client:
        dataset = client.create_dataset("ddp", rule="sequential", epsilon="2", delta="1e-5", accountant="rdp")
        task = client.create_task(dataset["id"], "all")
        per = RECORDS // 4
        records = [[f"r{j}" for j in range(i * per, (i + 1) * per)] for i in range(4)]
        client.create_batches(
            dataset["id"], task["id"], [{"name": f"b{i}", "records": r} for i, r in enumerate(records)]
        )
        args = (2, str(tmp_path / "store"), url, key, dataset["id"], str(tmp_path))
        mp.spawn(_rank, args=args, nprocs=2, join=True)
        first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
        assert first["optimizer"] == second["optimizer"] == DistributedDPOptimizer.__name__
        assert first["steps"] == second["steps"] == 10
        assert second["certificate"] is None  # rank 1 holds no gate
        certificate = first["certificate"]["certificate"]
        assert certificate["release"] == {"model": "linear-ddp", "version": "1"}
        event = certificate["inputs"]["charge"]["event"]
        assert (event["count"], event["event"]["sampling_probability"]) == (10, 0.1)
        spent = client.spend(dataset["id"])  # committed whole: nothing held
        assert (
            spent["epsilon_held"] == "0"
            and spent["epsilon_spent"] == certificate["result"]["charge"]["epsilon"]
        )
        assert first["weights"] == second["weights"]  # one noisy all-reduced gradient per step
