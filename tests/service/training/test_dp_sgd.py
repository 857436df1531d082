"""DP-SGD (service.training.dp_sgd): per-example gradients, Poisson sampling, clipping, noise, plan, train."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from torch import nn  # noqa: E402

from accountant.events import DpEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent  # noqa: E402
from accountant.events import from_json as event_from_json  # noqa: E402
from service.training.data import LoadedData, TaskSplit, load_data  # noqa: E402
from service.training.dp_sgd import (  # noqa: E402
    DpSgdParams,
    DpSgdTrainer,
    ModelState,
    TrainingError,
    clip_factors,
    clipped_sum,
    noisy_mean_gradient_flat,
    per_example_norms,
    poisson_sample,
)
from service.training.nets import InvalidParamsError, ModelSpec, build_model  # noqa: E402
from service.training.per_example_gradients import (  # noqa: E402
    PerExampleGradients,
    flatten_per_example,
)

CPU = torch.device("cpu")


def _toy_data(n: int = 40, n_features: int = 16, seed: int = 0) -> LoadedData:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, n_features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    train = TaskSplit(0, tuple(f"r{i}" for i in range(n)), x, y)
    test = TaskSplit(0, tuple(f"t{i}" for i in range(10)), x[:10], y[:10])
    return LoadedData(
        "memory:toy", (train,), (test,), num_classes=2, n_features=n_features, image_shape=(1, 4, 4)
    )


# ---------------------------------------------------------------------------------------------
# Per-example gradients, clipping, noise, sampling
# ---------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
@pytest.mark.parametrize(("kind", "hidden"), [("mlp", (32,)), ("cnn", (4, 8))])
def test_per_example_gradients_match_opacus_grad_samples(kind: str, hidden: tuple[int, ...]) -> None:
    """An independent oracle: Opacus's hook-based per-sample gradients (a dev dependency)."""
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(1)
    model = build_model(ModelSpec(kind, hidden), n_features=64, num_classes=10, image_shape=(1, 8, 8))
    x = torch.rand(9, 64)
    y = torch.randint(0, 10, (9,))
    ours = PerExampleGradients(model, 10)({k: v.detach() for k, v in model.named_parameters()}, x, y)
    wrapped = opacus.GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(x), y, reduction="sum").backward()
    for name, p in wrapped.named_parameters():
        torch.testing.assert_close(ours[name.removeprefix("_module.")], p.grad_sample, atol=1e-6, rtol=1e-5)


def test_the_flat_per_example_matrix_and_noisy_mean_equal_the_per_parameter_forms() -> None:
    torch.manual_seed(2)
    model = build_model(ModelSpec("mlp", (16,)), n_features=64, num_classes=10)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.rand(11, 64), torch.randint(0, 10, (11,))
    gradients = PerExampleGradients(model, 10)
    by_name = gradients(params, x, y)
    flat = gradients.flat(params, x, y)
    assert flat.shape == (11, sum(p.numel() for p in params.values()))
    torch.testing.assert_close(flat, torch.cat([g.reshape(11, -1) for g in by_name.values()], 1))
    assert gradients.flat(params, x[:0], y[:0]).shape == (0, flat.shape[1])
    # The released gradient from the matrix equals the per-parameter clip, sum and noise.
    kwargs = {"max_grad_norm": 0.3, "noise_multiplier": 1.1, "expected_batch_size": 9.0}
    out = torch.empty(flat.shape[1])
    noisy_flat = noisy_mean_gradient_flat(flat, generator=torch.Generator().manual_seed(3), out=out, **kwargs)
    assert noisy_flat is out
    factors = clip_factors(per_example_norms(by_name), 0.3)
    clipped = {k: v / 9.0 for k, v in clipped_sum(by_name, factors).items()}
    noise = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(3)) * 1.1 * 0.3 / 9.0
    expected = flatten_per_example({k: v[None] for k, v in clipped.items()})[0] + noise
    torch.testing.assert_close(noisy_flat, expected)


def test_poisson_sampling_gives_variable_batches_with_the_right_mean() -> None:
    n, q, draws = 1000, 0.05, 2000
    gen = torch.Generator().manual_seed(1234)
    sizes = np.empty(draws)
    counts = np.zeros(n)
    for d in range(draws):
        idx = poisson_sample(n, q, gen)
        assert idx.unique().numel() == idx.numel()  # without replacement within a step
        sizes[d] = idx.numel()
        counts[idx.numpy()] += 1
    mean_se = math.sqrt(n * q * (1 - q) / draws)
    assert abs(sizes.mean() - n * q) < 4 * mean_se
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.15)  # Binomial(n, q), not fixed
    # every record is included with probability q (binomial over draws)
    assert abs(counts.mean() / draws - q) < 4 * math.sqrt(q * (1 - q) / draws / n)
    assert counts.std() / draws == pytest.approx(math.sqrt(q * (1 - q) / draws), rel=0.15)


def test_small_sampling_probability_draws_empty_batches() -> None:
    gen = torch.Generator().manual_seed(5)
    empty = sum(poisson_sample(100, 0.005, gen).numel() == 0 for _ in range(400))
    assert 0.45 < empty / 400 < 0.75  # P(empty) = 0.995^100 ≈ 0.61


def test_clipping_bounds_each_per_example_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 0.5, 1.0, 3.0, 100.0]).reshape(5, 1, 1)
    grads = {"w": torch.randn(5, 3, 4, generator=gen) * scales, "b": torch.randn(5, 3, generator=gen)}
    norms = per_example_norms(grads)
    expected = torch.sqrt(grads["w"].reshape(5, -1).pow(2).sum(1) + grads["b"].pow(2).sum(1))
    torch.testing.assert_close(norms, expected)
    c = 1.5
    factors = clip_factors(norms, c)
    clipped_norms = per_example_norms(
        {k: g * factors.reshape(-1, *[1] * (g.dim() - 1)) for k, g in grads.items()}
    )
    assert bool((clipped_norms <= c * (1 + 1e-6)).all())
    small = norms < c
    torch.testing.assert_close(factors[small], torch.ones_like(factors[small]), atol=1e-5, rtol=0)
    summed = clipped_sum(grads, factors)
    torch.testing.assert_close(summed["w"], (grads["w"] * factors.reshape(5, 1, 1)).sum(0))


def test_noise_std_is_sigma_times_c_over_expected_batch_size_even_for_an_empty_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    sigma, c, expected = 1.3, 0.7, 25.0
    empty = torch.zeros(0, 300 * 200 + 200)
    values = noisy_mean_gradient_flat(
        empty, max_grad_norm=c, noise_multiplier=sigma, expected_batch_size=expected, generator=gen
    ).double()
    target = sigma * c / expected
    # 60,200 draws: the sample std is within ~1% of the truth (se ≈ 0.29%)
    assert values.std().item() == pytest.approx(target, rel=0.015)
    assert abs(values.mean().item()) < 4 * target / math.sqrt(values.numel())


def test_noise_is_added_around_the_clipped_sum() -> None:
    gen = torch.Generator().manual_seed(8)
    grads = torch.full((4, 50_000), 0.001)  # norms 0.2236 < C: unclipped
    noisy = noisy_mean_gradient_flat(
        grads, max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=2.0, generator=gen
    )
    residual = noisy * 2.0 - 0.004
    assert residual.mean().item() == pytest.approx(0.0, abs=0.02)
    assert residual.std().item() == pytest.approx(0.5, rel=0.02)


# ---------------------------------------------------------------------------------------------
# Plan: before any data
# ---------------------------------------------------------------------------------------------


class RecordingLoader:
    """A data loader that records whether (and when) it was called."""

    def __init__(self, data: LoadedData, log: list[str]) -> None:
        self.data = data
        self.log = log
        self.calls = 0

    def __call__(self) -> LoadedData:
        self.calls += 1
        self.log.append("load")
        return self.data


def test_plan_needs_only_the_record_count_and_builds_the_dp_sgd_event() -> None:
    log: list[str] = []
    loader = RecordingLoader(_toy_data(), log)
    plan = DpSgdTrainer(device=CPU).plan(
        {"noise_multiplier": 1.1, "expected_batch_size": 8, "epochs": 2}, n_records=40
    )
    assert loader.calls == 0
    assert plan.sampling_probability == pytest.approx(0.2) and plan.steps == 10
    assert plan.event == SelfComposedEvent(PoissonSampledEvent(0.2, GaussianEvent(1.1)), 10)
    assert plan.event_after(4) == SelfComposedEvent(PoissonSampledEvent(0.2, GaussianEvent(1.1)), 4)
    row = plan.to_json()
    assert event_from_json(row["event"]) == plan.event
    assert DpSgdParams.from_params(row["params"]) == plan.params  # the job row round-trips


def test_params_are_validated_naming_the_field() -> None:
    trainer = DpSgdTrainer(device=CPU)
    cases: list[tuple[dict[str, object], str]] = [
        ({"noise_multiplier": 1.0, "epoch": 3}, "params.epoch"),
        ({}, "params.target_epsilon"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0, "delta": 1e-5}, "params.target_epsilon"),
        ({"target_epsilon": 1.0}, "params.delta"),  # a job's worker gives the budget's
        ({"target_budget_epsilon": 1.0}, "params.delta"),
        ({"target_budget_epsilon": 1.0, "target_epsilon": 1.0, "delta": 1e-5}, "params.target_epsilon"),
        ({"noise_multiplier": 1.0, "learning_rate": -1}, "params.learning_rate"),
        ({"noise_multiplier": float("nan")}, "params.noise_multiplier"),
        ({"noise_multiplier": 1.0, "model": "resnet"}, "params.model"),
        ({"noise_multiplier": 1.0, "model": "cnn", "hidden": [8]}, "params.hidden"),
        ({"noise_multiplier": 1.0, "steps": 3, "epochs": 2}, "params.steps"),
    ]
    for params, field in cases:
        with pytest.raises(InvalidParamsError) as info:
            trainer.plan(params, 100)
        assert info.value.field == field, params
    with pytest.raises(InvalidParamsError, match="n_records"):
        trainer.plan({"noise_multiplier": 1.0}, 0)


# ---------------------------------------------------------------------------------------------
# Train: checkpoints, stop, refusal, reproducibility
# ---------------------------------------------------------------------------------------------


def _recorder(
    accept_until: int | None = None,
) -> tuple[list[tuple[int, DpEvent]], Callable[[int, ModelState, DpEvent], bool]]:
    seen: list[tuple[int, DpEvent]] = []

    def on_checkpoint(step: int, state: ModelState, event: DpEvent) -> bool:
        assert all(t.device.type == "cpu" for t in state.values())
        seen.append((step, event))
        return accept_until is None or step <= accept_until

    return seen, on_checkpoint


def test_checkpoints_every_k_steps_and_at_the_end_with_the_cost_so_far() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan(
        {"noise_multiplier": 1.0, "steps": 10, "checkpoint_every": 3, "seed": 1}, data.n_records
    )
    seen, on_checkpoint = _recorder()
    result = trainer.train(data, plan, on_checkpoint=on_checkpoint)
    assert [s for s, _ in seen] == [3, 6, 9, 10]
    assert [e for _, e in seen] == [plan.event_after(s) for s in (3, 6, 9, 10)]
    assert seen[-1][1] == plan.event
    assert result.status == "completed" and result.steps == 10 and result.last_release_step == 10
    assert set(result.metrics) >= {"test_accuracy", "test_loss", "steps"}


def test_a_refused_commit_stops_training() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan(
        {"noise_multiplier": 1.0, "steps": 10, "checkpoint_every": 3, "seed": 1}, data.n_records
    )
    seen, on_checkpoint = _recorder(accept_until=3)
    result = trainer.train(data, plan, on_checkpoint=on_checkpoint)
    assert [s for s, _ in seen] == [3, 6]
    assert result.status == "refused" and result.steps == 6 and result.last_release_step == 3
    assert result.event == plan.event_after(6)  # what touched the data, released or not


def test_should_stop_cancels_before_the_next_step_without_a_release() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan({"noise_multiplier": 1.0, "steps": 10, "seed": 1}, data.n_records)
    seen, on_checkpoint = _recorder()
    calls = iter(range(100))
    result = trainer.train(data, plan, on_checkpoint=on_checkpoint, should_stop=lambda: next(calls) >= 4)
    assert (
        result.status == "stopped" and result.steps == 4 and seen == [] and result.last_release_step is None
    )


def test_empty_poisson_batches_are_noise_only_steps() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan({"noise_multiplier": 1.0, "steps": 20, "sampling_probability": 0.005, "seed": 2}, 40)
    states: list[ModelState] = []
    result = trainer.train(data, plan, on_checkpoint=lambda s, m, e: states.append(m) is None)
    assert result.status == "completed" and result.steps == 20  # most batches are empty: 0.995^40 ≈ 0.82 each
    assert plan.event == SelfComposedEvent(PoissonSampledEvent(0.005, GaussianEvent(1.0)), 20)


def test_train_refuses_data_the_plan_was_not_made_for() -> None:
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan({"noise_multiplier": 1.0, "steps": 2}, 41)
    with pytest.raises(TrainingError, match="41 records"):
        trainer.train(_toy_data(), plan)


def test_a_seed_makes_runs_reproducible() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    states: list[ModelState] = []

    def keep(step: int, state: ModelState, event: DpEvent) -> bool:
        states.append(state)
        return True

    for seed in (3, 3, 4):
        plan = trainer.plan({"noise_multiplier": 1.0, "steps": 5, "seed": seed, "expected_batch_size": 8}, 40)
        trainer.train(data, plan, on_checkpoint=keep)
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=0, atol=0)
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0])


@pytest.mark.slow
def test_the_cnn_trains_on_image_shaped_inputs() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan(
        {"noise_multiplier": 1.0, "steps": 3, "model": "cnn", "hidden": [2, 4], "seed": 0}, 40
    )
    result = trainer.train(data, plan)
    assert result.status == "completed" and 0 <= result.metrics["test_accuracy"] <= 1


def test_evaluate_rebuilds_a_checkpointed_state() -> None:
    data = _toy_data()
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan({"noise_multiplier": 1.0, "steps": 3, "seed": 0}, 40)
    states: list[ModelState] = []
    result = trainer.train(data, plan, on_checkpoint=lambda s, m, e: states.append(m) is None)
    assert trainer.evaluate(data, states[-1], plan.params)["test_accuracy"] == result.metrics["test_accuracy"]


# ---------------------------------------------------------------------------------------------
# End to end on builtin:digits at a planned ε = 2, δ = 1e-5
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dp_sgd_on_digits_at_epsilon_2_learns_and_its_event_costs_at_most_2() -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("accountant.calibration")
    rdp = pytest.importorskip("accountant.rdp")
    data = load_data("builtin:digits")
    trainer = DpSgdTrainer(device=CPU)
    plan = trainer.plan(
        {"target_epsilon": 2.0, "delta": 1e-5, "epochs": 15, "expected_batch_size": 64, "seed": 0},
        data.n_records,
    )
    # target_epsilon is the run's own ε by the ledger's tight engine, as Opacus means it; the
    # looser RDP conversion of the same run is above it.
    from accountant.calibration import tight_epsilon

    assert 1.99 <= tight_epsilon(plan.event, 1e-5) <= 2.0
    assert rdp.RdpAccountant().compose(plan.event).get_epsilon(1e-5).upper > 2.0
    budget_plan = trainer.plan(
        {"target_budget_epsilon": 2.0, "delta": 1e-5, "epochs": 15, "expected_batch_size": 64, "seed": 0},
        data.n_records,
    )
    assert rdp.RdpAccountant().compose(budget_plan.event).get_epsilon(1e-5).upper <= 2.0  # no price: rdp
    released: list[DpEvent] = []
    result = trainer.train(data, plan, on_checkpoint=lambda s, m, e: released.append(e) is None)
    assert released == [plan.event]
    assert result.status == "completed"
    assert result.metrics["test_accuracy"] >= 0.75  # chance is 0.10; ~0.92 with the defaults
