"""AdaDp, sound variant (service.training.adadp): Lemma 1 at every step, the event, training."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

from accountant.events import DpEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent  # noqa: E402
from service.training import adadp  # noqa: E402
from service.training.adadp import AdaDpParams, AdaDpTrainer, Lemma1Violation, check_lemma1  # noqa: E402
from service.training.data import LoadedData, TaskSplit, load_data  # noqa: E402
from service.training.dp_sgd import DpSgdTrainer, dp_sgd_event  # noqa: E402
from service.training.nets import InvalidParamsError  # noqa: E402

CPU = torch.device("cpu")


def _toy_data(n: int = 60) -> LoadedData:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    train = TaskSplit(0, tuple(f"r{i}" for i in range(n)), x, y)
    return LoadedData("memory:toy", (train,), (TaskSplit(0, ("t",), x[:1], y[:1]),), 2, 8)


def test_check_lemma1_accepts_the_papers_example_and_refuses_a_violation() -> None:
    # Lemma 1's worked example: s = (12, 6), σ = (17, 8.5) with σ* = 1.
    s = {"w": torch.tensor([12.0, 6.0])}
    assert check_lemma1(s, {"w": torch.tensor([17.0, 8.5])}, 1.0) == pytest.approx(144 / 289 + 36 / 72.25)
    with pytest.raises(Lemma1Violation) as info:
        check_lemma1(s, {"w": torch.tensor([12.0, 8.5])}, 1.0, step=7)
    assert info.value.step == 7 and info.value.ratio > info.value.limit == 1.0


def test_zero_sensitivity_coordinates_add_nothing_and_noiseless_ones_are_refused() -> None:
    ratio = check_lemma1({"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([1.0, 2.0])}, 2.0)
    assert ratio == pytest.approx(0.25)
    assert check_lemma1({"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([0.0, 2.0])}, 2.0) == 0.25
    with pytest.raises(Lemma1Violation):
        check_lemma1({"w": torch.tensor([1e-9, 1.0])}, {"w": torch.tensor([0.0, 2.0])}, 2.0)


@pytest.mark.slow
def test_lemma1_holds_at_every_step_and_the_event_is_dp_sgds() -> None:
    data = _toy_data()
    trainer = AdaDpTrainer(device=CPU)
    plan = trainer.plan(
        {"noise_multiplier": 1.3, "steps": 40, "warmup_steps": 5, "expected_batch_size": 12, "seed": 0},
        data.n_records,
    )
    assert plan.event == SelfComposedEvent(PoissonSampledEvent(0.2, GaussianEvent(1.3)), 40)
    result = trainer.train(data, plan)
    m = result.metrics
    limit = 1 / 1.3**2
    assert m["lemma1_limit"] == pytest.approx(limit)
    assert m["lemma1_checked_steps"] == 40  # checked at every step, warm-up included
    assert m["local_clipping_steps"] >= 30  # the adaptive phase really ran
    assert m["lemma1_max_ratio"] <= limit * (1 + 1e-12)
    assert m["lemma1_max_ratio"] == pytest.approx(limit, rel=1e-4)  # tight, not vacuous


def test_a_violation_fails_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # Break the noise calibration (σᵢ 50% too small): the per-step check must catch it.
    monkeypatch.setattr(adadp, "LEMMA1_SAFETY", -0.5)
    data = _toy_data()
    trainer = AdaDpTrainer(device=CPU)
    plan = trainer.plan({"noise_multiplier": 1.0, "steps": 10, "warmup_steps": 2, "seed": 0}, data.n_records)
    released: list[int] = []
    with pytest.raises(Lemma1Violation) as info:
        trainer.train(data, plan, on_checkpoint=lambda s, m, e: released.append(s) is None)
    assert info.value.step == 3 and released == []


def test_adadp_params_are_validated() -> None:
    trainer = AdaDpTrainer(device=CPU)
    with pytest.raises(InvalidParamsError) as info:
        trainer.plan({"noise_multiplier": 1.0, "momentum": 0.9}, 10)
    assert info.value.field == "params.momentum"
    with pytest.raises(InvalidParamsError) as info:
        trainer.plan({"noise_multiplier": 1.0, "beta": 0}, 10)
    assert info.value.field == "params.beta"
    params = AdaDpParams.from_params({"noise_multiplier": 1.0})
    assert params.beta == 2.0 and params.debias_second_moment and params.cap_total_sensitivity
    assert AdaDpParams.from_params(params.to_json()) == params  # the job row round-trips
    with pytest.raises(InvalidParamsError, match="AdaDpParams"):
        AdaDpTrainer(device=CPU).plan(DpSgdTrainer().parse_params({"noise_multiplier": 1.0}), 10)


@pytest.mark.slow
def test_adadp_trains_on_digits_at_the_same_epsilon_as_dp_sgd() -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("accountant.calibration")
    data = load_data("builtin:digits")
    trainer = AdaDpTrainer(device=CPU)
    plan = trainer.plan({"target_epsilon": 2.0, "delta": 1e-5, "epochs": 12, "seed": 1}, data.n_records)
    # accounted exactly as DP-SGD with noise multiplier σ*
    assert plan.event == dp_sgd_event(
        sampling_probability=plan.sampling_probability,
        noise_multiplier=plan.noise_multiplier,
        steps=plan.steps,
    )
    events: list[DpEvent] = []
    result = trainer.train(data, plan, on_checkpoint=lambda s, m, e: events.append(e) is None)
    assert events == [plan.event]
    assert result.metrics["lemma1_max_ratio"] <= 1 / plan.noise_multiplier**2 * (1 + 1e-12)
    assert result.metrics["test_accuracy"] >= 0.4  # chance is 0.10; ~0.7 with the defaults
    assert math.isfinite(result.metrics["test_loss"])
