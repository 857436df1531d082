"""Issue 30 §1: one DP-SGD job over several processes (``service.training.distributed``).

Real ``torch.distributed`` (``gloo``) across real spawned processes, the real gate and ledger:

* the released gradient of a W-rank step holds the Gaussian noise once — its variance over many
  steps is σ²C²/(q·N)² per coordinate with 2 and 3 ranks (noise on every rank would give W
  times that), its mean is the sum of every rank's clipped rows, and every rank gets the same;
* a ``world_size = 2`` job through the gate is one reservation and one commit whose certificate
  and DP statement equal those of the same (q, σ, T) run in one process;
* a rank that dies mid-run fails the job with no release, and the steps begun are charged.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.db.session import Database
from service.ledger import certificates, jobs, model_registry, quotes, spent
from service.ledger.reservations import parse_event
from service.training.distributed import Ranks
from service.training.dp_sgd import noisy_mean_gradient_of_ranks
from service.worker import gate
from service.worker.worker import Worker
from tests.worker.digits_world import CountingLoader, digits_dataset, reservation, versions_of

SIGMA, CLIP, EXPECTED_BATCH = 1.3, 0.7, 5.0
STEPS, COORDINATES = 150, 1000


def _noise_rank(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """One of 3 ranks: STEPS released gradients over all 3 ranks, then over ranks {0, 1}. Each
    rank holds one row 3·C·e₀ (clipped to C·e₀) and draws from a generator of its own."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    generator = torch.Generator().manual_seed(1000 + rank)
    row = torch.zeros(1, COORDINATES)
    row[0, 0] = 3 * CLIP
    for group, members in ((None, 3), (pair, 2)):
        if rank >= members:
            continue
        ranks = Ranks(rank, members, torch.device("cpu"), group)
        released = torch.stack(
            [
                noisy_mean_gradient_of_ranks(
                    row,
                    ranks=ranks,
                    max_grad_norm=CLIP,
                    noise_multiplier=SIGMA,
                    expected_batch_size=EXPECTED_BATCH,
                    generator=generator,
                )
                for _ in range(STEPS)
            ]
        )
        np.save(Path(out_dir) / f"w{members}-r{rank}.npy", released.numpy())
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_summed_noise_has_variance_sigma_squared_c_squared_once_with_2_and_3_ranks(
    tmp_path: Path,
) -> None:
    mp.spawn(_noise_rank, args=(3, str(tmp_path / "store"), str(tmp_path)), nprocs=3, join=True)
    n = STEPS * (COORDINATES - 1)
    for world_size in (2, 3):
        released = [np.load(tmp_path / f"w{world_size}-r{r}.npy") for r in range(world_size)]
        for other in released[1:]:  # one all_reduce: bit-identical updates, models in sync
            assert np.array_equal(other, released[0])
        noise = released[0][:, 1:].astype(np.float64)
        expected = (SIGMA * CLIP / EXPECTED_BATCH) ** 2
        # The sample variance of n normals has relative s.d. sqrt(2/n) (0.37% here): 6 of them.
        # Noise added on every rank would read W times too much (σ²C² / W each: just as much).
        ratio = float(noise.var()) / expected
        assert abs(ratio - 1) < 6 * np.sqrt(2 / n), (world_size, ratio)
        assert abs(float(noise.mean())) < 6 * np.sqrt(expected / n)
        # coordinate 0: every rank's clipped row, C each, summed once: W·C/(q·N) plus the noise
        first = released[0][:, 0].astype(np.float64)
        mean_error = abs(first.mean() - world_size * CLIP / EXPECTED_BATCH)
        assert mean_error < 6 * np.sqrt(expected / STEPS), (world_size, first.mean())


PARAMS: dict[str, Any] = {"noise_multiplier": 1.5, "steps": 6, "seed": 3, "expected_batch_size": 64}


def _certified(db: Database, job_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DP content of a job's only version: its certificate's inputs and result, and its DP
    statement, less what names this dataset and this certificate (ids, hashes, times)."""
    (version,) = versions_of(db, job_id)
    answer = model_registry.get_version(db, "acme", version.name, version.version)
    body = answer.certificate["certificate"]
    inputs = {k: v for k, v in body["inputs"].items() if k not in ("release", "dataset_id", "reservation_id")}
    inputs["batch_set"] = inputs["batch_set"]["count"]  # (its hash is of this dataset's batch ids)
    result = {k: v for k, v in body["result"].items() if k != "release"}
    statement = {k: v for k, v in answer.dp_statement.items() if k != "certificate"}
    return {"inputs": inputs, "result": result, "accountant": body["accountant"]}, statement


SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])  # the ledger's side is tested on both elsewhere


@pytest.mark.slow
@SQLITE_ONLY
def test_a_two_process_job_is_certified_as_the_same_run_in_one_process(db: Database, tmp_path: Path) -> None:
    answers = {}
    for world_size in (2, 1):
        world = digits_dataset(db, epsilon="10")
        params = {**PARAMS, "world_size": world_size}
        created = jobs.queue.create_job(
            db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd", params=params
        )
        Worker(db, artifact_dir=tmp_path / "artifacts", loader=CountingLoader(), device="cpu").run_once()
        job = jobs.queue.get_job(db, "acme", created.id)
        assert job.job.status == "succeeded", job
        assert job.job.plan["params"].get("world_size", 1) == world_size
        held = reservation(db, job.job.reservation_id)  # one reservation, committed whole
        assert held.status == "committed" and held.committed_epsilon == held.epsilon
        assert certificates.list_certificates(db, "acme", world.dataset_id)["count"] == 1  # one commit
        assert job.job.metrics["test_accuracy"] > 0.15  # trained: 10 classes (0.1 by chance), 6 steps
        answers[world_size] = _certified(db, job.job.id)
    differences = _differences(answers[2], answers[1])
    assert differences == [], "\n".join(differences)
    assert answers[2][0]["inputs"]["charge"]["event"]["count"] == PARAMS["steps"]


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON documents differ (paths), for a failure that says which field."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(a.keys() | b.keys())
        return [d for k in keys for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@dataclass
class KillRankOne:
    """A ``Control`` that kills rank 1's process (SIGKILL) once ``at`` steps are done."""

    at: int
    step: int = 0
    killed: int | None = None

    def should_stop(self) -> bool:
        return False

    @property
    def reason(self) -> str | None:
        return None

    def lease_valid(self) -> bool:
        return True

    def set_step(self, step: int) -> None:
        self.step = step
        if step == self.at and self.killed is None:
            (child,) = multiprocessing.active_children()
            assert child.pid is not None
            os.kill(child.pid, signal.SIGKILL)
            child.join(5)
            self.killed = child.pid


@pytest.mark.slow
@SQLITE_ONLY
def test_a_rank_that_dies_fails_the_job_without_a_release_and_what_ran_is_charged(
    db: Database, tmp_path: Path
) -> None:
    world = digits_dataset(db, epsilon="10")
    params = {**PARAMS, "steps": 20, "world_size": 2}
    created = jobs.queue.create_job(
        db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd", params=params
    )
    claimed = jobs.leases.claim(db, "w1", 60.0)
    assert claimed is not None
    control = KillRankOne(at=3)
    outcome = gate.run_job(
        db,
        claimed,
        control=control,
        artifact_dir=tmp_path / "artifacts",
        reservation_ttl_s=60.0,
        loader=CountingLoader(),
    )
    assert control.killed is not None
    job = jobs.queue.get_job(db, "acme", created.id)
    assert outcome.status == job.job.status == "failed" and not outcome.versions, job
    assert job.job.error["error"] == "training_failed" and "RankFailure" in job.job.error["message"], job
    assert versions_of(db, created.id) == []
    held = reservation(db, job.job.reservation_id)
    assert held.status == "aborted"
    # Steps 1-3 ran on both ranks and step 4 was begun (rank 0 asked to go on): 4 are charged.
    prefix = {**held.event, "count": 4}
    priced = quotes.quote(db, "acme", world.dataset_id, event=parse_event(prefix), new_batch=True).quote
    assert held.committed_epsilon == priced.epsilon
    assert held.committed_delta == priced.delta
    assert spent.get_spend(db, "acme", world.dataset_id).to_json()["epsilon_held"] == "0"
    (stored,) = certificates.list_certificates(db, "acme", world.dataset_id)["data"]
    assert stored["outcome"] == "aborted" and stored["release"] is None


@pytest.mark.slow
@SQLITE_ONLY
def test_a_two_process_audit_job_is_charged_once_and_states_its_audit(db: Database, tmp_path: Path) -> None:
    """The one-run audit job over 2 ranks (the canaries live on rank 0): one reservation, one
    commit of the whole run, and its version carries the audit's bounds, the lower below the
    certified upper."""
    world = digits_dataset(db, epsilon="10")
    params = {**PARAMS, "world_size": 2, "canaries": 200, "delta": 1e-5, "model_name": "audit-2"}
    created = jobs.queue.create_job(
        db, "acme", dataset_id=world.dataset_id, algorithm="dp_sgd_audit", params=params
    )
    Worker(db, artifact_dir=tmp_path / "artifacts", loader=CountingLoader(), device="cpu").run_once()
    job = jobs.queue.get_job(db, "acme", created.id)
    assert job.job.status == "succeeded", job
    held = reservation(db, job.job.reservation_id)
    assert held.status == "committed" and held.committed_epsilon == held.epsilon
    assert certificates.list_certificates(db, "acme", world.dataset_id)["count"] == 1
    (version,) = versions_of(db, job.job.id)
    audit = version.metrics["privacy_audit"]
    assert audit["canaries"] == 200 and job.job.metrics["privacy_audit"] == audit
    answer = model_registry.get_version(db, "acme", "audit-2", version.version)
    assert answer.privacy_audit is not None
    certified = answer.privacy_audit["certified"]
    assert certified["consistent"] is True and certified["epsilon_lower"] < certified["epsilon_upper"]
