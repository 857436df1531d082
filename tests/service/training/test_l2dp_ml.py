"""L2DP-ML's mechanism and the A-gem projection (``service.training.l2dp_ml``, ``agem``), and both
lifelong trainers as staged jobs behind the gate on a real ledger (SQLite and PostgreSQL)."""

from __future__ import annotations

import math
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from accountant.mechanisms import l2dp_ml_event_epsilon  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import (  # noqa: E402
    jobs,
    spent,
)
from service.ledger.jobs.answers import JobDetail  # noqa: E402
from service.training.agem import agem_project, average_accuracy, average_forgetting  # noqa: E402
from service.training.l2dp_ml import (  # noqa: E402
    L2dpMlParams,
    L2dpMlTrainer,
    batch_noise,
    epsilon1_for,
    l2dp_ml_event,
    noise_commitment,
    noise_scales,
    project_theta1,
    record_input_noise,
    theta1_norm,
)
from service.training.nets import InvalidParamsError  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.worker.digits_world import source_tasks, task_dataset, versions_of  # noqa: E402

SOURCE = "builtin:permuted-digits?tasks=3&seed=1"


def _event(
    eps1: float = 2.0,
    eps2: float = 1.0,
    h1: int = 4,
    batch: int = 72,
    bound: float = 2.0,
    analysis: str = "paper",
):  # type: ignore[no-untyped-def]
    params = L2dpMlParams.read(
        {
            "epsilon1": eps1,
            "epsilon2": eps2,
            "input_dim": 64,
            "hidden_units": h1,
            "theta1_norm_bound": bound,
            "analysis": analysis,
        }
    )
    return l2dp_ml_event(params, batch)


# -- noise calibration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("eps1", "eps2", "h1", "batch", "bound"), [(2.0, 1.0, 4, 72, 2.0), (0.5, 3.0, 16, 500, 1.0)]
)
def test_noise_scales_spend_exactly_the_event_epsilon(
    eps1: float, eps2: float, h1: int, batch: int, bound: float
) -> None:
    """Each Thm. 2 term is one Laplace mechanism's sensitivity/scale; their sum is the ε the
    accountant charges for the event (so the trainer's noise is neither too small nor too large)."""
    event = _event(eps1, eps2, h1, batch, bound)
    s = noise_scales(event)
    assert s.sensitivity_r == 64 * (h1 + 2) and s.sensitivity_l == 2 * h1
    terms = [
        s.sensitivity_r / (s.sensitivity_r / eps1),  # ε1: the coefficients, Lap(Δ_R/ε1)
        1 / s.input,  # ε1/γx, γx = Δ_R/|B|
        bound / s.hidden,  # ε1/γ, γ = 2Δ_R/(|B|·bound)
        s.sensitivity_l / s.labels,  # ε2
    ]
    assert math.isclose(math.fsum(terms), l2dp_ml_event_epsilon(event), rel_tol=1e-12)
    assert s.input == pytest.approx(64 * (h1 + 2) / (eps1 * batch))


@pytest.mark.parametrize(
    ("eps1", "eps2", "h1", "batch", "bound"), [(2.0, 1.0, 4, 72, 2.0), (0.5, 3.0, 16, 500, 1.0)]
)
def test_sound_noise_scales_spend_exactly_the_sound_event_epsilon(
    eps1: float, eps2: float, h1: int, batch: int, bound: float
) -> None:
    """The default analysis, "sound": the input term is d/scale = ε1|B|/(|h1| + 2), d times the
    paper's (DESIGN-NOTES note 21); the other terms are the paper's."""
    event = _event(eps1, eps2, h1, batch, bound, analysis="sound")
    assert event.analysis == "sound"
    s = noise_scales(event)
    assert s.sensitivity_input == 64
    terms = [eps1, s.sensitivity_input / s.input, bound / s.hidden, s.sensitivity_l / s.labels]
    assert math.isclose(terms[1], eps1 * batch / (h1 + 2), rel_tol=1e-12)
    assert math.isclose(math.fsum(terms), l2dp_ml_event_epsilon(event), rel_tol=1e-12)
    assert l2dp_ml_event_epsilon(_event(eps1, eps2, h1, batch, bound)) < l2dp_ml_event_epsilon(event)


def test_the_worker_requests_the_sound_analysis_by_default() -> None:
    params = L2dpMlParams.read({"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64})
    assert params.analysis == "sound" and l2dp_ml_event(params, 10).analysis == "sound"
    with pytest.raises(InvalidParamsError, match=r"params\.analysis"):
        L2dpMlParams.read({"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64, "analysis": "tight"})


def test_sound_input_noise_is_independent_per_record_and_fixed_per_record() -> None:
    """The "sound" analysis needs an independent χ1_r per record (a shared one publishes
    x̄_r − x̄_s = x_r − x_s); a replay, in any record order, sees the same rows."""
    ids = [f"r{i}" for i in range(300)]
    a = record_input_noise(7, "batch-0", ids, input_dim=64)
    again = record_input_noise(7, "batch-0", list(reversed(ids)), input_dim=64)
    assert np.array_equal(a, again[::-1])
    assert not np.array_equal(a, record_input_noise(8, "batch-0", ids, input_dim=64))
    assert not np.array_equal(a, record_input_noise(7, "batch-1", ids, input_dim=64))
    # Rows are independent standard Laplace draws: no two rows alike, and the pooled law is Lap(1).
    assert len({row.tobytes() for row in a}) == len(ids)
    from scipy import stats

    assert stats.kstest(a.ravel(), "laplace").statistic < 0.012
    correlation = np.corrcoef(a[:, 0], a[:, 1])[0, 1]
    assert abs(correlation) < 0.25


def test_sampled_noise_has_the_calibrated_laplace_law_and_is_fixed_per_batch() -> None:
    event = _event()
    s = noise_scales(event)
    draws = np.stack(
        [batch_noise(7, f"batch-{i}", input_dim=64, hidden_units=4, num_classes=10)[0] for i in range(400)]
    ).ravel()
    scaled = s.input * draws
    # Laplace(b): E|X| = b and the CDF; 25 600 draws: a KS distance above 0.012 is p < 1e-3.
    assert abs(float(np.mean(np.abs(scaled))) / s.input - 1) < 0.03
    from scipy import stats

    assert stats.kstest(scaled, "laplace", args=(0, s.input)).statistic < 0.012
    # One draw per (seed, batch): a replay sees the same noise; another batch or seed does not.
    a = batch_noise(7, "batch-0", input_dim=64, hidden_units=4, num_classes=10)
    b = batch_noise(7, "batch-0", input_dim=64, hidden_units=4, num_classes=10)
    c = batch_noise(8, "batch-0", input_dim=64, hidden_units=4, num_classes=10)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])


def test_label_coefficient_mechanism_loses_exactly_epsilon2_on_neighbouring_batches() -> None:
    """Sample the output-layer mechanism on two neighbouring batches (one record's hπ·y term moved
    by the whole sensitivity Δ_L along one coefficient) and estimate the privacy loss from the
    histograms: it reaches ε2 and does not exceed it."""
    event = _event(eps2=1.5)
    s = noise_scales(event)
    rng = np.random.default_rng(3)
    n = 400_000
    base = rng.laplace(0.0, 1.0, n) * s.labels
    neighbour = rng.laplace(0.0, 1.0, n) * s.labels + s.sensitivity_l
    edges = np.linspace(-3 * s.labels, 3 * s.labels + s.sensitivity_l, 41)
    p, _ = np.histogram(base, edges)
    q, _ = np.histogram(neighbour, edges)
    enough = (p > 2000) & (q > 2000)
    loss = np.abs(np.log(p[enough] / q[enough]))
    assert loss.max() == pytest.approx(event.epsilon2, abs=0.12)


@pytest.mark.parametrize("analysis", ["paper", "sound"])
def test_epsilon1_for_meets_the_target_and_no_more(analysis: str) -> None:
    eps1 = epsilon1_for(
        target_epsilon=10.0,
        epsilon2=4.0,
        input_dim=64,
        hidden_units=4,
        batch_size=72,
        theta1_norm_bound=2.0,
        analysis=analysis,
    )
    event = _event(eps1, 4.0, analysis=analysis)
    assert l2dp_ml_event_epsilon(event) <= 10.0 + 1e-12
    assert l2dp_ml_event_epsilon(_event(eps1 * 1.001, 4.0, analysis=analysis)) > 10.0


def test_theta1_projection_enforces_the_declared_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen, dtype=torch.float64) * 3
    projected = project_theta1(w, 2.0)
    assert theta1_norm(projected) <= 2.0 + 1e-9
    assert float(projected.abs().sum(dim=1).max()) == pytest.approx(2.0)  # on the ball, not inside
    inside = w / (theta1_norm(w) * 2)
    assert torch.equal(project_theta1(inside, 2.0), inside)


def test_commitment_names_the_seed_without_revealing_it() -> None:
    assert noise_commitment(5) == noise_commitment(5) != noise_commitment(6)
    assert noise_commitment(5).startswith("l2dp-ml:")
    assert "123456789" not in noise_commitment(123456789)


# -- A-gem --------------------------------------------------------------------------------------


def test_agem_projection_removes_the_conflicting_component() -> None:
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g_ref = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)  # gᵀg_ref = -1.5 < 0
    projected = agem_project(g, g_ref)
    assert torch.dot(projected, g_ref).item() == pytest.approx(0.0, abs=1e-12)
    expected = g - (torch.dot(g, g_ref) / torch.dot(g_ref, g_ref)) * g_ref
    assert torch.allclose(projected, expected)
    aligned = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    assert torch.equal(agem_project(aligned, g_ref), aligned)  # no conflict: unchanged
    assert torch.dot(agem_project(aligned, g_ref, always=True), g_ref).item() == pytest.approx(0.0, abs=1e-12)
    assert torch.equal(agem_project(g, torch.zeros(3, dtype=torch.float64)), g)


def test_metrics_follow_the_paper() -> None:
    acc = [{1: 0.9}, {1: 0.7, 2: 0.8}, {1: 0.6, 2: 0.85, 3: 0.5}]
    assert average_accuracy(acc, 3) == pytest.approx((0.6 + 0.85 + 0.5) / 3)
    assert average_forgetting(acc, 1) is None
    # f_1 = max(0.9, 0.7) - 0.6 = 0.3; f_2 = 0.8 - 0.85 = -0.05
    assert average_forgetting(acc, 3) == pytest.approx((0.3 - 0.05) / 2)


def test_the_network_learns_without_noise_with_the_default_step() -> None:
    """What the architecture can learn at all: the worker's trainer with every noise scale set to
    0, default params, on one task of generated digits (a linear model reaches ≈ 0.86 there). The
    plain gradient step on L̄ crawled (curvature ¼|hπ|² ≈ 10⁻³) and stayed near chance."""
    from dataclasses import replace

    from service.training.data import load_data
    from service.training.stages import LedgerBatch, LedgerTask

    data = load_data("builtin:permuted-synthetic-digits?tasks=1&per_task=3000&seed=5")
    ids = data.train[0].record_ids
    records = {f"b{i}": ids[i * 500 : (i + 1) * 500] for i in range(6)}
    task = LedgerTask("t0", 0, "task-0", tuple(LedgerBatch(b, "t0", i, 500) for i, b in enumerate(records)))
    trainer = L2dpMlTrainer(device="cpu")
    params = trainer.parse_params({"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64, "epochs": 3, "seed": 5})
    state = trainer.start(params, data, [task])
    state.scales = replace(state.scales, input=0.0, hidden=0.0, labels=0.0)
    (stage,) = trainer.stages(params, [task])
    initial = state.w1.clone()
    metrics = trainer.train_stage(state, stage, data, records).metrics
    assert metrics["test_accuracy"] > 0.55
    # "sound": θ1 stays at its seeded value, so every read computes the same label coefficients
    assert torch.equal(state.w1, initial)


def test_the_sound_analysis_keeps_theta1_fixed_so_chi3_is_used_once() -> None:
    sound = {"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64}
    assert L2dpMlParams.read(sound).encoder_learning_rate == 0.0
    assert L2dpMlParams.read({**sound, "analysis": "paper"}).encoder_learning_rate == 0.001
    with pytest.raises(InvalidParamsError) as info:
        L2dpMlParams.read({**sound, "encoder_learning_rate": 0.001})
    assert info.value.field == "params.encoder_learning_rate"
    assert "must be 0 under analysis 'sound'" in info.value.message


def test_params_name_the_bad_field() -> None:
    with pytest.raises(InvalidParamsError) as info:
        L2dpMlTrainer(device="cpu").parse_params({"epsilon1": 1.0, "epsilon2": 1.0})
    assert info.value.field == "params.input_dim"
    with pytest.raises(InvalidParamsError) as info:
        L2dpMlTrainer(device="cpu").parse_params(
            {"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64, "epoch": 2}
        )
    assert info.value.field == "params.epoch"


# -- through the gate -------------------------------------------------------------------------


def _dataset(db: Database, budget: dict[str, str]) -> tuple[str, list[list[str]]]:
    per_task = source_tasks(SOURCE)
    dataset_id, _ = task_dataset(db, budget, per_task, batch_size=80, name="permuted", source=SOURCE)
    return dataset_id, per_task


def _job(
    db: Database, tmp_path: Path, dataset_id: str, algorithm: str, params: dict[str, object]
) -> JobDetail:
    job = jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm=algorithm, params=params)
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", device="cpu")
    assert worker.run_once() == job.id
    return jobs.queue.get_job(db, "acme", job.id)


L2DP = {
    # The worker's default analysis is "sound" (input term d·ε1/γx): ε1 = 0.4 costs ≈ 7.8 a batch.
    "epsilon1": 0.4,
    "epsilon2": 2.0,
    "input_dim": 64,
    "hidden_units": 4,
    "theta1_norm_bound": 2.0,
    "seed": 11,
    # the accounting on 80-record batches, not the model: its noise would be refused otherwise
    "noise_check": False,
}


def test_a_job_whose_noise_would_swamp_the_model_is_refused_at_submission(db: Database) -> None:
    """Batches of 80 records: 2Δ_R/(ε1|B|) ≤ 0.5 needs ε1 ≥ 2·64·34/(0.5·80) = 108.8 with the
    default |h1| = 32. Below it: 422 naming params.epsilon1 and the batch size it needs, no job."""
    from service.ledger.errors import InvalidInput

    dataset_id, _ = _dataset(db, {"rule": "lifelong", "epsilon": "1000", "delta": "0", "accountant": "basic"})
    params = {"epsilon1": 1.0, "epsilon2": 1.0, "input_dim": 64, "seed": 1}
    with pytest.raises(InvalidInput) as info:
        jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="l2dp_ml", params=params)
    assert info.value.field == "params.epsilon1"
    assert "batches of >= 8704 records at ε1 = 1" in str(info.value)
    assert "ε1 >= 108.8 at |B| = 80" in str(info.value)
    assert jobs.queue.list_jobs(db, "acme", dataset_id=dataset_id).count == 0
    enough = {**params, "epsilon1": 108.8}
    jobs.queue.create_job(db, "acme", dataset_id=dataset_id, algorithm="l2dp_ml", params=enough)
    jobs.queue.create_job(
        db, "acme", dataset_id=dataset_id, algorithm="l2dp_ml", params={**params, "noise_check": False}
    )
    assert jobs.queue.list_jobs(db, "acme", dataset_id=dataset_id).count == 2


@pytest.mark.slow
def test_l2dp_ml_epsilon_stays_one_batch_epsilon_and_replays_are_free(db: Database, tmp_path: Path) -> None:
    dataset_id, _ = _dataset(
        db, {"rule": "lifelong", "epsilon": "30", "delta": "1e-5", "accountant": "basic"}
    )
    job = _job(db, tmp_path, dataset_id, "l2dp_ml", {**L2DP, "epochs": 2})
    assert job.job.status == "succeeded", job.job.error
    versions = versions_of(db, str(job.job.id))
    assert [v.step for v in versions] == [1, 2, 3]
    assert [v.metrics["memory_batches"] for v in versions] == [0, 1, 2]
    assert all(v.metrics["theta1_norm"] <= 2.0 + 1e-6 for v in versions)
    assert all(0.0 <= v.metrics["average_accuracy"] <= 1.0 for v in versions)
    assert "average_forgetting" in versions[-1].metrics
    one_batch = Decimal(repr(l2dp_ml_event_epsilon(_event(0.4, 2.0, 4, 80, 2.0, analysis="sound"))))
    from service.ledger import certificates

    certificate = certificates.get_certificate(db, "acme", versions[0].certificate_id)["certificate"]
    assert certificate["inputs"]["charge"]["event"]["analysis"] == "sound"
    assert "analysis 'sound'" in certificate["analyses"][0]
    answer = spent.get_spend(db, "acme", dataset_id).spent
    assert answer.epsilon_spent == pytest.approx(one_batch, rel=Decimal("1e-15"))
    # Task 1's memory batch was read by all three stages: the naive count is 3× one batch.
    assert answer.naive_sequential_epsilon == pytest.approx(3 * one_batch, rel=Decimal("1e-15"))

    # Same seed, other epochs and task order: every read replays committed noise, ε unchanged.
    again = _job(db, tmp_path, dataset_id, "l2dp_ml", {**L2DP, "epochs": [1, 3, 2], "task_order": [2, 0, 1]})
    assert again.job.status == "succeeded", again.job.error
    assert spent.get_spend(db, "acme", dataset_id).spent.epsilon_spent == answer.epsilon_spent

    # Another seed is fresh noise on spent batches: charged sequentially, refused past the budget.
    fresh = _job(db, tmp_path, dataset_id, "l2dp_ml", {**L2DP, "seed": 12, "epsilon1": 20.0})
    assert fresh.job.status == "failed" and fresh.job.error["error"] == "budget_exceeded"  # type: ignore[index]


@pytest.mark.slow
def test_naive_gaussian_epsilon_grows_with_tasks(db: Database, tmp_path: Path) -> None:
    dataset_id, _ = _dataset(db, {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"})
    # target_budget_epsilon: the stages fit the sequential budget of 8 (target_epsilon before issue 24)
    params = {"target_budget_epsilon": 8.0, "delta": 1e-5, "seed": 3}
    job = _job(db, tmp_path, dataset_id, "naive_gaussian", params)
    assert job.job.status == "succeeded", job.job.error
    versions = versions_of(db, str(job.job.id))
    from service.ledger import certificates

    eps = [
        Decimal(
            certificates.get_certificate(db, "acme", v.certificate_id)["certificate"]["result"]["epsilon"]
        )
        for v in versions
    ]
    assert eps[0] < eps[1] < eps[2] <= Decimal(8)
    assert eps[2] > Decimal(6)  # calibrated to use the budget, not a tiny part of it


@pytest.mark.slow
def test_naive_gaussian_target_epsilon_is_the_whole_runs_own_epsilon(db: Database, tmp_path: Path) -> None:
    """``target_epsilon``: the whole run (every stage composed: task 1's memory batch is read by
    all) has its own PRV ε at the budget's δ at most the target. At the budget's ε its RDP
    charge does not fit: refused before anything is reserved or read, naming the largest
    target that fits; a job at that target runs within the budget."""
    from sqlalchemy import select

    from accountant.calibration import tight_epsilon
    from service.db.models import Reservation
    from service.training.lifelong_baselines import naive_run_event

    dataset_id, _ = _dataset(db, {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"})
    refused = _job(db, tmp_path, dataset_id, "naive_gaussian", {"target_epsilon": 8.0, "seed": 3})
    assert refused.job.status == "failed"
    error = refused.job.error
    assert isinstance(error, dict)
    assert error["error"] == "budget_exceeded" and error["field"] == "params.target_epsilon"
    largest = error["largest_target_epsilon"]
    assert 4 < largest < 8
    with db.session(readonly=True) as session:
        held = session.scalars(select(Reservation.id).where(Reservation.dataset_id == dataset_id)).all()
    assert held == [] and spent.get_spend(db, "acme", dataset_id).to_json()["epsilon_spent"] == "0"

    job = _job(db, tmp_path, dataset_id, "naive_gaussian", {"target_epsilon": largest, "seed": 3})
    assert job.job.status == "succeeded", job.job.error
    metrics = [v.metrics for v in versions_of(db, str(job.job.id))]
    assert len(metrics) == 3
    run = naive_run_event(
        sampling_probability=0.2,
        noise_multiplier=metrics[0]["noise_multiplier"],
        steps=[m["steps"] for m in metrics],
    )
    own = tight_epsilon(run, 1e-5)
    assert own <= largest
    assert own > 0.99 * largest  # the smallest σ that meets it, not a far larger one
    assert spent.get_spend(db, "acme", dataset_id).spent.epsilon_spent <= Decimal(8)
