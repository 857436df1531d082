"""``ledger experiment adadp --quick`` end to end: the tables' structure, and every reported private
number traced back to what the ledger recorded (job plan, released version, its metrics)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("dp_accounting")

import dp_accounting

from service.cli import main
from service.experiments.adadp import (
    Checkpoint,
    GridPoint,
    _choose_for_accuracy,
    _choose_for_epsilon,
    at_epsilon,
    checkpoint_epsilon,
    to_accuracy,
)
from service.experiments.embedded import TENANT
from service.ledger import jobs
from service.ledger import model_registry as registry


def _trajectory(*points: tuple[float, float]) -> list[Checkpoint]:
    return [Checkpoint(step=10 * (i + 1), epsilon=e, accuracy=a) for i, (e, a) in enumerate(points)]


def test_the_reading_rules_take_the_last_release_within_epsilon_and_the_first_at_the_level() -> None:
    run = _trajectory((0.4, 0.5), (0.9, 0.8), (1.0, 0.7), (1.6, 0.9))
    assert at_epsilon(run, 1.0) == run[2]  # the last within ε (not the best: no peeking)
    assert at_epsilon(run, 0.3) is None
    assert to_accuracy(run, 0.75) == run[1]  # the first at the level, whatever comes later
    assert to_accuracy(run, 0.95) is None


def test_tuning_chooses_on_the_mean_over_tuning_seeds_and_skips_points_that_fail_on_one() -> None:
    a, b, c = (GridPoint("dp_sgd", lr, 1.0, 1.0) for lr in (0.1, 0.2, 0.3))
    tuned = {
        a: [_trajectory((0.5, 0.80)), _trajectory((0.5, 0.60))],  # mean 0.70 at ε 0.5
        b: [_trajectory((0.5, 0.72)), _trajectory((0.5, 0.70))],  # mean 0.71: chosen
        c: [_trajectory((0.5, 0.99)), _trajectory((0.6, 0.99))],  # one seed has no release ≤ 0.5
    }
    assert _choose_for_epsilon(tuned, 0.5) == (b, pytest.approx(0.71))
    assert _choose_for_accuracy(tuned, 0.75) == (c, pytest.approx(0.55))  # a fails on seed 2
    assert _choose_for_accuracy(tuned, 1.0) is None


def _dp_accounting_epsilon(q: float, sigma: float, steps: int) -> float:
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return float(accountant.get_epsilon(1e-5))


def _versions(db: Any, model: str) -> list[registry.Version]:
    return list(registry.list_versions(db, TENANT, model, limit=registry.MAX_PAGE, offset=0).data)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    import torch

    out = tmp_path_factory.mktemp("adadp")
    before = torch.get_num_threads()
    try:
        code = main(["experiment", "adadp", "--quick", "--out", str(out), "--device", "cpu"])
    finally:
        torch.set_num_threads(before)
    assert code == 0
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out


@pytest.mark.slow
def test_tables_have_both_shapes_every_method_and_the_papers_columns(
    quick: tuple[dict[str, Any], str, Path],
) -> None:
    report, markdown, out = quick
    assert [r["accuracy"] for r in report["rows_accuracy_levels"]] == ["0.5", "0.7"]
    assert report["seeds"] == [0] and report["tuning_seeds"] == [10_000]  # evaluated on fresh seeds
    assert [r["eps <="] for r in report["rows_epsilon_targets"]] == ["1", "2"]
    for method in ("dp_sgd", "adadp", "adadp_global", "adadp_raw*"):
        assert f"eps {method}" in report["rows_accuracy_levels"][0]
        assert f"acc {method}" in report["rows_epsilon_targets"][0]
    assert report["methods"]["adadp_raw"]["private"] is False
    assert report["rows_accuracy_levels"][0]["paper MNIST: acc eps_D/eps_A"] == "0.92: 1.1/0.75 (0.68)"
    assert report["paper"]["table_1_mnist_delta_1e-4"]["0.95"] == {"dp_sgd": 1.96, "adadp": 0.8}
    # the same search budget for every method
    assert len(set(report["grid"]["size_per_method"].values())) == 1
    assert "NOT PRIVATE" in markdown and "| accuracy |" in markdown and "machine:" in markdown
    for name in ("accuracy_at_epsilon.png", "epsilon_to_accuracy.png"):
        assert (out / name).stat().st_size > 1000


@pytest.mark.slow
def test_every_reported_number_is_the_ledgers_and_its_epsilon_the_accountants(
    quick: tuple[dict[str, Any], str, Path],
) -> None:
    from service.db.session import Database

    report, _, _ = quick
    db = Database(report["ledger"]["url"])
    checked = 0
    try:
        for kind, cells in (("target", report["epsilon_targets"]), ("level", report["accuracy_levels"])):
            for cell in cells:
                assert cell["point"] is not None  # the quick grid serves every target
                for run in cell["runs"]:
                    if not cell["private"]:
                        assert run["job_id"] is None  # the ablation never touches the ledger
                        continue
                    job = jobs.queue.get_job(db, TENANT, run["job_id"])
                    assert job.job.status == "succeeded"
                    sigma = float(job.job.plan["noise_multiplier"])
                    q = float(job.job.plan["sampling_probability"])
                    assert sigma == cell["point"]["noise_multiplier"]
                    released = _versions(db, run["model"])
                    steps = [v.metrics["step"] for v in released]
                    accuracy = [v.metrics["test_accuracy"] for v in released]
                    epsilon = [checkpoint_epsilon(q, sigma, s) for s in steps]
                    if run["version"] is None:  # not reached: no release reached the level
                        assert kind == "level" and max(accuracy) < cell["accuracy_level"]
                        continue
                    i = [v.version for v in released].index(run["version"])
                    assert (run["step"], run["accuracy"]) == (steps[i], accuracy[i])
                    assert run["epsilon"] == epsilon[i]
                    # the project's accountant against an independent one (finer orders: ≤, close)
                    independent = _dp_accounting_epsilon(q, sigma, steps[i])
                    assert independent * 0.99 <= run["epsilon"] <= independent * (1 + 1e-9)
                    if kind == "target":  # the last release within the target
                        assert epsilon[i] <= cell["target_epsilon"]
                        assert all(e > cell["target_epsilon"] for e in epsilon[i + 1 :])
                    else:  # the first release at the level
                        assert accuracy[i] >= cell["accuracy_level"]
                        assert all(a < cell["accuracy_level"] for a in accuracy[:i])
                    checked += 1
    finally:
        db.dispose()
    assert checked >= 2 * 2 * 3 - 3  # nearly every private cell names a release
