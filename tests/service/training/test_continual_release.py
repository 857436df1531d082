"""Continual and sliding-window release (service.training.continual_release) and builtin:stream.

* Noise calibration against each stage's event ε: the paper's noise scales (Alg. 2, 3, 5, 6, 7),
  every event's ε meets its geometric level exactly, and the trainer's released noise, sampled,
  has the norm-Gamma(d, b) law with uniform direction and E‖ν‖ = d·Δ₂/ε.
* Geometric level assignment over a long stream: each stage's event, reserved on each of its
  blocks by the ledger's own rule (``accountant.rules``), lands on the level the trainer expects,
  and no block ever exceeds ε.
* Example 1 of the paper (w₀ = 1, w = 7), step by step.
* Real jobs through the release gate on a SQLite / PostgreSQL ledger: versions, certificates,
  levels; a sliding-window run on a plain-series budget is refused by the ledger.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

torch = pytest.importorskip("torch")

from accountant import events as ev  # noqa: E402
from accountant import rules as R  # noqa: E402
from accountant.certificates import verify  # noqa: E402
from accountant.exact import as_written, exact_sum  # noqa: E402
from accountant.mechanisms import (  # noqa: E402
    amplified_pure_epsilon,
    continual_release_noise_scale,
    continual_release_sampling_probability,
)
from service.contract.data_sources import DataSourceError, parse_source  # noqa: E402
from service.db.session import Database  # noqa: E402
from service.ledger import (  # noqa: E402
    batches,
    certificates,
    datasets,
    jobs,
    reservations,
    spent,
    tenancy,
)
from service.ledger.jobs.answers import JobDetail  # noqa: E402
from service.training.continual_release import (  # noqa: E402
    ContinualReleaseTrainer,
    budget_for,
    fit_biased_logistic,
    parse_params,
    plan_sliding_window,
    schedule_of,
    sliding_window_chain,
)
from service.training.data import load_data  # noqa: E402
from service.training.nets import InvalidParamsError  # noqa: E402
from service.training.stages import LedgerBatch, LedgerTask, Stage  # noqa: E402
from service.worker.worker import Worker  # noqa: E402
from tests.worker.digits_world import versions_of  # noqa: E402

TRAINER = ContinualReleaseTrainer()


def stream_task(n_blocks: int, block_size: int) -> LedgerTask:
    return LedgerTask(
        "task", 0, "t", tuple(LedgerBatch(f"b{i}", "task", i, block_size) for i in range(n_blocks))
    )


def stages_of(n_blocks: int, block_size: int = 10, **params: Any) -> list[Stage]:
    parsed = parse_params({"epsilon": 1.0, **params})
    return TRAINER.stages(parsed, [stream_task(n_blocks, block_size)])


def blocks_of(stage: Stage) -> list[int]:
    return [int(b[1:]) for b in stage.batch_ids]


def levels_of(stage: Stage) -> list[int]:
    info = stage.info
    return list(info["levels"]) if "levels" in info else [info["level"]] * len(stage.batch_ids)


# ---------------------------------------------------------------------------------------------
# builtin:stream
# ---------------------------------------------------------------------------------------------


def test_stream_source_is_seeded_bounded_and_a_prefix_of_longer_streams() -> None:
    data = load_data("builtin:stream?blocks=6&block_size=5&dim=4&seed=3")
    assert data.num_classes == 2 and data.n_features == 4 and len(data.train) == 1
    assert data.record_ids[:2] == ("stream-0000000", "stream-0000001") and data.n_records == 30
    x, y = data.train_arrays()
    assert np.linalg.norm(x.astype(np.float64), axis=1).max() <= 1.0
    assert set(np.unique(y)) <= {0, 1}
    longer = load_data("builtin:stream?blocks=60&block_size=5&dim=4&seed=3")
    assert np.array_equal(longer.train_arrays()[0][:30], x) and np.array_equal(
        longer.train_arrays()[1][:30], y
    )
    assert np.array_equal(longer.test_arrays()[0], data.test_arrays()[0])
    other = load_data("builtin:stream?blocks=6&block_size=5&dim=4&seed=4")
    assert not np.array_equal(other.train_arrays()[0], x)
    # The labels follow the source's logistic model: far better than chance, below certainty.
    big = load_data("builtin:stream?blocks=40&block_size=100&dim=4")
    bx, by = big.train_arrays()
    w = fit_biased_logistic(bx.astype(np.float64), 2.0 * by - 1.0, normaliser=len(by), regularization=1e-3,
                            anchor=np.zeros(4))  # fmt: skip
    tx, ty = big.test_arrays()
    assert 0.75 < np.mean((tx @ w > 0) == (ty == 1)) < 0.99


@pytest.mark.slow
def test_newton_reaches_the_tolerance_where_the_objective_cannot_resolve_the_decrease() -> None:
    # One-vs-rest digits (64 pixels on the sphere), n = 65 536 (the tolerance 10⁻⁶/n is tiny) and a
    # far anchor (a noisy earlier release at a small ε): the last Newton steps decrease the
    # objective by less than its float spacing, where the Armijo search accepted a step of ~0 by
    # rounding luck and stalled ("Newton did not reach the gradient tolerance", found by
    # `ledger experiment continual --source digits --epsilon 0.1`).
    from service.training.continual_release import one_vs_rest, project_to_unit_ball

    data = load_data("builtin:permuted-synthetic-digits?tasks=1&per_task=65536&seed=0")
    x = project_to_unit_ball(data.train[0].features.astype(np.float64))
    s = 2.0 * one_vs_rest(data.train[0].labels, 0) - 1.0
    anchor = np.random.default_rng(0).standard_normal((24, 64))[-1] * 300.0
    w = fit_biased_logistic(x, s, normaliser=len(s), regularization=0.01, anchor=anchor)
    p = 1.0 / (1.0 + np.exp(s * (x @ w)))
    gradient = -(x.T @ (s * p)) / len(s) + 0.01 * (w - anchor)
    assert float(np.linalg.norm(gradient)) <= 1e-6 / len(s)


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("builtin:stream?tasks=2", "unknown query parameter 'tasks'"),
        ("builtin:stream?blocks=0", "blocks must be an integer"),
        ("builtin:stream?dim=1001", "dim must be an integer"),
        ("builtin:stream?blocks=100000&block_size=100", "blocks*block_size must be <="),
    ],
)
def test_stream_source_validation(uri: str, fragment: str) -> None:
    with pytest.raises(DataSourceError, match=fragment.replace("*", r"\*")):
        parse_source(uri)


# ---------------------------------------------------------------------------------------------
# Noise calibration against each stage's event ε
# ---------------------------------------------------------------------------------------------

SLACK = 1 + 1e-6  # the optimisation tolerance added to the sensitivity


def test_params_are_validated() -> None:
    with pytest.raises(InvalidParamsError) as info:
        parse_params({"mode": "cumulative"})
    assert info.value.field == "params.epsilon"
    for bad, field in (
        ({"epsilon": 1, "mode": "binary_tree"}, "params.mode"),
        ({"epsilon": 1, "base_blocks": 3}, "params.base_blocks"),
        ({"epsilon": 1, "regularization": 0}, "params.regularization"),
        ({"epsilon": 1, "windowlevels": 2}, "params.windowlevels"),
    ):
        with pytest.raises(InvalidParamsError) as info:
            parse_params(bad)
        assert info.value.field == field


def test_every_event_meets_its_level_and_its_noise_gives_at_most_that_epsilon() -> None:
    for mode in ("multi_resolution", "cumulative", "sliding_window"):
        for sampling in (False, True):
            params = parse_params({"mode": mode, "epsilon": 0.7, "sampling": sampling, "regularization": 0.3})
            schedule = schedule_of(params)
            for stage in TRAINER.stages(params, [stream_task(40, 12)]):
                allowance = schedule.allowance(levels_of(stage)[0])
                charged = as_written(stage.event.epsilon)  # type: ignore[attr-defined]
                assert charged <= allowance, (mode, stage.name)  # never above its level
                b = Fraction(stage.info["noise_scale"])
                n = 12 * len(stage.batch_ids)
                if isinstance(stage.event, ev.OutputPerturbationEvent):
                    assert "sample_size" not in stage.info
                    # The charge fills its level to float precision, and Δ₂/b is at most the charge.
                    assert allowance * (1 - Decimal("1e-15")) <= charged, (mode, stage.name)
                    assert stage.event.l2_sensitivity == pytest.approx(2 / (0.3 * n) * SLACK, rel=1e-12)
                    assert Fraction(stage.event.l2_sensitivity) / b <= Fraction(charged)
                else:  # sampled: pure_dp of the amplified ε of the inner output perturbation
                    assert sampling and isinstance(stage.event, ev.PureDpEvent)
                    inner = ev.from_json(stage.info["inner_event"])
                    assert isinstance(inner, ev.OutputPerturbationEvent)
                    inner_eps = float(Fraction(inner.l2_sensitivity) / b)
                    assert inner_eps <= float(as_written(inner.epsilon))
                    m = stage.info["sample_size"]
                    amplified = amplified_pure_epsilon(epsilon=inner_eps, sampling_probability=m / n)
                    assert amplified <= float(charged) * (1 + 1e-12)
                    # The sample is the largest that fits the level (⌊p·n⌋ records).
                    more = amplified_pure_epsilon(epsilon=inner_eps, sampling_probability=(m + 1) / n)
                    assert Decimal(more) > allowance


def test_noise_scales_are_the_papers() -> None:
    lam, eps, b0 = 0.5, 2.0, 16
    # Algorithm 2 (B = b0): one scale 4L/(λBε) at every resolution.
    mr = stages_of(64, b0, mode="multi_resolution", epsilon=eps, regularization=lam)
    paper = continual_release_noise_scale(
        lipschitz=1, regularization=lam, level=0, block_size=b0, epsilon=eps
    )
    assert {len(s.batch_ids) for s in mr} == {1, 2, 4, 8, 16, 32, 64}
    for s in mr:
        assert s.info["noise_scale"] == pytest.approx(paper * SLACK, rel=1e-12)
    # Algorithm 4 / 3: 4L/(λ b0 ε) for the bases (on b0-blocks) and every update.
    for s in stages_of(64, b0, mode="cumulative", epsilon=eps, regularization=lam):
        assert s.info["noise_scale"] == pytest.approx(4 / (lam * b0 * eps) * SLACK, rel=1e-12)
    # Algorithm 5: base 6L/(λε2^{J−1}w0), chain updates 12L/(λ w0 ε) (proof of Theorem 7).
    for s in stages_of(40, b0, mode="sliding_window", epsilon=eps, regularization=lam, window_levels=3):
        want = 6 / (lam * eps * 4 * b0) if s.info["role"] == "base" else 12 / (lam * b0 * eps)
        assert s.info["noise_scale"] == pytest.approx(want * SLACK, rel=1e-12)
    # Algorithm 6: scale 4L/(λ2ᵏBε) on a sample of ⌊p_k·2ᵏB⌋, p_k = (e^{ε/2^{k+1}}−1)/(e^{ε/2}−1).
    for s in stages_of(64, b0, mode="multi_resolution", epsilon=eps, regularization=lam, sampling=True):
        k = len(s.batch_ids).bit_length() - 1
        scale = continual_release_noise_scale(
            lipschitz=1, regularization=lam, level=k, block_size=b0, epsilon=eps
        )
        assert s.info["noise_scale"] == pytest.approx(scale * SLACK, rel=1e-12)
        if k > 0:
            p = continual_release_sampling_probability(epsilon=eps, level=k)
            assert s.info["sample_size"] <= p * 2**k * b0
            assert s.info["sample_size"] >= p * 2**k * b0 - 3  # ⌊p·n⌋, at most a record or two less


def _stage_runs(stage: Stage, block_size: int, params: dict[str, Any], draws: int, dim: int) -> np.ndarray:
    """``draws`` releases of one stage by the trainer, minus the exact minimiser: the noise ν."""
    parsed = parse_params(params)
    task = stream_task(8, block_size)
    data = load_data(f"builtin:stream?blocks=8&block_size={block_size}&dim={dim}")
    ids = data.record_ids
    wanted = [ids[i] for b in blocks_of(stage) for i in range(b * block_size, (b + 1) * block_size)]
    restricted = data.restrict(wanted)
    x, y = restricted.train_arrays()
    exact = fit_biased_logistic(
        x.astype(np.float64),
        2.0 * y - 1.0,
        normaliser=len(y),
        regularization=parsed.regularization,
        anchor=np.zeros(x.shape[1]),
    )
    records = {f"b{b}": tuple(ids[b * block_size : (b + 1) * block_size]) for b in blocks_of(stage)}
    state = TRAINER.start(parsed, data.restrict(()), [task])
    out = []
    for _ in range(draws):
        release = TRAINER.train_stage(state, stage, restricted, records)
        out.append(release.model_state["weight"].numpy() - exact)
    return np.asarray(out)


def test_released_noise_is_norm_gamma_with_uniform_direction_at_the_events_epsilon() -> None:
    d, block_size = 4, 8
    params = {"mode": "multi_resolution", "epsilon": 1.5, "regularization": 0.5, "seed": 11}
    stage = TRAINER.stages(parse_params(params), [stream_task(8, block_size)])[2]  # t=2, k=1
    assert len(stage.batch_ids) == 2 and stage.info["level"] == 1
    noise = _stage_runs(stage, block_size, params, draws=1500, dim=d)
    b = stage.info["noise_scale"]
    norms = np.linalg.norm(noise, axis=1)
    # ‖ν‖ ~ Gamma(d, b): Kolmogorov–Smirnov at a fixed seed, and the scale it implies gives the
    # event's ε: Δ₂/b̂ with b̂ = mean‖ν‖/d.
    assert stats.kstest(norms, stats.gamma(a=d, scale=b).cdf).pvalue > 1e-3
    assert isinstance(stage.event, ev.OutputPerturbationEvent)
    b_hat = norms.mean() / d
    assert stage.event.l2_sensitivity / b_hat == pytest.approx(stage.event.epsilon, rel=0.06)
    # Direction uniform on the sphere: mean ≈ 0, second moment ≈ I/d, and E Σuᵢ⁴ = 3/(d+2). The
    # last one tells per-coordinate Laplace noise apart (its directions crowd the axes: ≈ 0.575
    # at d = 4), which a test of the norm alone cannot (its norm law is close to Gamma(d, b)).
    u = noise / norms[:, None]
    assert np.linalg.norm(u.mean(axis=0)) < 4 / math.sqrt(len(u))
    assert np.abs(u.T @ u / len(u) - np.eye(d) / d).max() < 0.04
    assert abs(float(np.mean((u**4).sum(axis=1))) - 3 / (d + 2)) < 0.02
    laplace = np.random.default_rng(0).laplace(size=(1500, d))
    laplace_u = laplace / np.linalg.norm(laplace, axis=1, keepdims=True)
    assert float(np.mean((laplace_u**4).sum(axis=1))) - 3 / (d + 2) > 0.05


def test_sampled_stage_trains_on_a_sample_normalised_by_the_whole_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from service.training import continual_release

    solved: list[tuple[int, int]] = []
    original = continual_release.fit_biased_logistic

    def recording(x: np.ndarray, s: np.ndarray, **kwargs: Any) -> np.ndarray:
        solved.append((len(s), kwargs["normaliser"]))
        return original(x, s, **kwargs)

    monkeypatch.setattr(continual_release, "fit_biased_logistic", recording)
    block_size = 32
    params = {"mode": "multi_resolution", "epsilon": 1.0, "regularization": 0.5, "sampling": True, "seed": 5}
    stages = TRAINER.stages(parse_params(params), [stream_task(8, block_size)])
    stage = stages[2]  # t = 2, resolution 1: two blocks, sampled
    m = stage.info["sample_size"]
    assert 0 < m < 2 * block_size and isinstance(stage.event, ev.PureDpEvent)
    _stage_runs(stage, block_size, params, draws=3, dim=3)
    # Three draws of the sample (m records), each normalised by the window's 2·b0 (the premise
    # of the sensitivity 2L/(λn)).
    assert solved == [(m, 2 * block_size)] * 3


# ---------------------------------------------------------------------------------------------
# Geometric level assignment over a long stream, with the ledger's own rule
# ---------------------------------------------------------------------------------------------


def _ledger_levels(stages: Sequence[Stage], budget: R.Budget, n_blocks: int) -> list[R.BatchState]:
    states = [R.BatchState.empty() for _ in range(n_blocks)]
    for stage in stages:
        charge = R.Charge(stage.event)
        for block, level in zip(blocks_of(stage), levels_of(stage), strict=True):
            admission = R.reserve(budget, states[block], charge)
            assert admission.cost.level == level, (stage.name, block)
            states[block] = R.commit(budget, admission.state, charge, admission.cost, None).state
    return states


@pytest.mark.parametrize("mode", ["multi_resolution", "cumulative", "sliding_window"])
@pytest.mark.parametrize("sampling", [False, True])
def test_levels_over_a_long_stream_match_the_ledger_and_stay_within_epsilon(
    mode: str, sampling: bool
) -> None:
    n_blocks = 1024 if mode != "cumulative" else 512
    params = {"mode": mode, "epsilon": 1.0, "sampling": sampling}
    stages = stages_of(n_blocks, 4, **params)
    assert len(stages) >= 1000 or mode == "cumulative"
    budget = R.Budget.create(**{k: v for k, v in budget_for(mode, 1.0).items()})
    states = _ledger_levels(stages, budget, n_blocks)
    spent = [s.epsilon_spent for s in states]
    assert max(spent) <= budget.epsilon
    assert all(R.within_budget(budget, s) for s in states)
    if mode == "multi_resolution":
        # Block 0 is read at every resolution 0..10: ε(1 − 2⁻¹¹), the geometric series.
        assert states[0].levels == tuple(range(11))
        assert spent[0] == 1 - Decimal(2) ** -11
    if mode == "cumulative":
        # The updates (levels < log₂ t_g) and the bases (levels ≥ log₂ 2t_g) never share a level.
        # Block 300 (t_g = 256, offset 45): the update on itself (level 0), the doubling updates
        # on 64 and 128 blocks (levels 6, 7), the base on 512 blocks (level 9).
        assert states[300].levels == (0, 6, 7, 9)
    if mode == "sliding_window":
        # Theorem 7 allows a block ε/3 (base) and one bucket of each size on each side of a base
        # (≤ ε/3 + 2·(ε/6 + ε/12) for J = 3). Measured: a block's buckets on the two sides have
        # complementary sizes, so the most any block spends is ε/3 + ε/6 + ε/12 = 7ε/12.
        schedule = budget.geometric
        assert schedule is not None
        assert max(spent) == exact_sum(schedule.allowance(k) for k in (0, 1, 3))


def test_a_blocks_buckets_on_the_two_sides_of_a_base_have_complementary_sizes() -> None:
    # Theorem 7 budgets one bucket of each size on *each* side of a base (two series). In fact a
    # block at offset o of its base meets, on the right, the sizes 2ʲ of the highest bit where
    # some s > o differs from o (o has 0 there) and, on the left, where some x < o differs from o
    # (o has 1 there): never the same size twice. So even the plain series ε/2, ε/4, ... admits
    # the sliding window, each charge rounded up to its power-of-two level.
    for window_levels in (2, 3, 4, 5):
        stages = stages_of(8 * 2**window_levels, 4, mode="sliding_window", window_levels=window_levels)
        terms: dict[int, list[int]] = {}
        for stage in stages:
            if stage.info["role"] == "bucket":
                for block in blocks_of(stage):
                    terms.setdefault(block, []).append(len(stage.batch_ids))
        assert all(len(sizes) == len(set(sizes)) for sizes in terms.values())
    stages = stages_of(200, 4, mode="sliding_window", window_levels=3)
    plain = R.Budget.create(**budget_for("multi_resolution", 1.0))
    states = _ledger_states(stages, plain, 200)
    assert max(s.epsilon_spent for s in states) == Decimal("0.875")  # ε/2 + ε/4 + ε/8, not 7ε/12


def _ledger_states(stages: Sequence[Stage], budget: R.Budget, n_blocks: int) -> list[R.BatchState]:
    states = [R.BatchState.empty() for _ in range(n_blocks)]
    for stage in stages:
        charge = R.Charge(stage.event)
        for block in blocks_of(stage):
            admission = R.reserve(budget, states[block], charge)
            states[block] = R.commit(budget, admission.state, charge, admission.cost, None).state
    return states


# ---------------------------------------------------------------------------------------------
# The sliding window: Example 1 step by step, and its invariants
# ---------------------------------------------------------------------------------------------


def _paper(bucket: tuple[int, int]) -> str:
    """The paper's name f_[i:j] (inclusive) of a bucket ``(first, size)``."""
    first, size = bucket
    return f"[{first}]" if size == 1 else f"[{first}:{first + size - 1}]"


def test_example_1_dependency_chains_step_by_step() -> None:
    # w0 = 1, w = 7 (J = 3). "f_[i] ← f_[j]": f_[j] regularises f_[i]; chains listed base first.
    expected = {
        7: ["[3:6]", "[1:2]", "[0]"],  # the first window D[0:6]
        8: ["[3:6]", "[1:2]", "[7]"],  # D[7] arrives, D[0] leaves
        9: ["[3:6]", "[7:8]", "[2]"],  # f_[7:8] and f_[2] are trained
        10: ["[3:6]", "[7:8]", "[9]"],
        11: ["[7:10]", "[5:6]", "[4]"],  # D[3:6] leaves: new buckets
    }
    for t, chain in expected.items():
        base, buckets = sliding_window_chain(t, 3)
        assert [_paper(base)] + [_paper(b) for b in buckets] == chain, t
    # What is trained at each step, and what each new model is regularised by.
    plan = plan_sliding_window(12, 3, sampling=False)
    trained = {}
    for release in plan:
        bucket = (release.blocks[0], len(release.blocks))
        anchor = None if release.anchor is None else plan[release.anchor]
        trained.setdefault(release.t, []).append(
            (_paper(bucket), None if anchor is None else _paper((anchor.blocks[0], len(anchor.blocks))))
        )
    assert trained[7] == [("[3:6]", None), ("[1:2]", "[3:6]"), ("[0]", "[1:2]")]
    assert trained[8] == [("[7]", "[1:2]")]
    assert trained[9] == [("[7:8]", "[3:6]"), ("[2]", "[7:8]")]
    assert trained[10] == [("[9]", "[7:8]")]
    assert trained[11] == [("[7:10]", None), ("[5:6]", "[7:10]"), ("[4]", "[5:6]")]
    # The model released for inference at t is the chain's end.
    assert [(r.t, _paper((r.blocks[0], len(r.blocks)))) for r in plan if r.serves] == [
        (7, "[0]"), (8, "[7]"), (9, "[2]"), (10, "[9]"), (11, "[4]"), (12, "[11]"),
    ]  # fmt: skip


@pytest.mark.parametrize("window_levels", [1, 2, 3, 4, 5])
def test_chains_cover_the_window_and_each_block_sees_each_size_twice_at_most(window_levels: int) -> None:
    w = 2**window_levels - 1
    n_blocks = w + 6 * 2**window_levels
    for t in range(w, n_blocks + 1):
        base, buckets = sliding_window_chain(t, window_levels)
        covered = sorted(b for first, size in [base, *buckets] for b in range(first, first + size))
        assert covered == list(range(t - w, t))  # exactly the window, no overlap
        sizes = [size for _, size in buckets]
        assert sizes == sorted(set(sizes), reverse=True) and all(s < base[1] for s in sizes)
    per_block: dict[int, list[int | None]] = {}
    for release in plan_sliding_window(n_blocks, window_levels, sampling=False):
        for b in release.blocks:
            per_block.setdefault(b, []).append(release.term)
    for terms in per_block.values():
        assert terms.count(None) <= 1  # one base
        assert all(terms.count(j) <= 2 for j in set(terms) if j is not None)


def test_cumulative_plan_follows_algorithm_4() -> None:
    stages = stages_of(12, 5, mode="cumulative")
    roles = [(s.info["t"], s.info["role"], tuple(s.info["blocks"]), s.info["anchor"]) for s in stages]
    assert roles == [
        (1, "base", (0, 1), None),
        (2, "base", (0, 2), None),
        (3, "doubling update", (2, 3), 2),  # t − t_g = 1 = 2⁰: D[t_g:t], biased towards f_g
        (4, "base", (0, 4), None),
        (5, "doubling update", (4, 5), 4),
        (6, "doubling update", (4, 6), 4),
        (7, "update", (6, 7), 6),  # newest block, biased towards f_c (the t=6 model)
        (8, "base", (0, 8), None),
        (9, "doubling update", (8, 9), 8),
        (10, "doubling update", (8, 10), 8),
        (11, "update", (10, 11), 10),
        (12, "doubling update", (8, 12), 8),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Real jobs through the release gate
# ---------------------------------------------------------------------------------------------

SOURCE = "builtin:stream?blocks=12&block_size=8&dim=3&seed=2"


def _stream_dataset(db: Database, budget: dict[str, Any]) -> tuple[str, list[str]]:
    tenancy.create_api_key(db, "acme", "viewer")
    ids = list(load_data(SOURCE).record_ids)
    dataset = datasets.create_dataset(
        db, "acme", name=f"stream-{len(budget)}", budget=budget, data_source=SOURCE
    )
    task = batches.create_task(db, "acme", dataset.id, name="stream")
    created = batches.create_batches(
        db,
        "acme",
        dataset.id,
        task.id,
        batches=[{"name": f"block-{i}", "records": ids[i * 8 : (i + 1) * 8]} for i in range(12)],
    )
    return dataset.id, [b.id for b in created.data]


def _run(db: Database, tmp_path: Path, dataset_id: str, **params: Any) -> JobDetail:
    job = jobs.queue.create_job(
        db,
        "acme",
        dataset_id=dataset_id,
        algorithm="continual_release",
        params={"seed": 1, **params},
    )
    worker = Worker(db, artifact_dir=tmp_path / "artifacts", device="cpu")
    assert worker.run_once() == job.id
    return jobs.queue.get_job(db, "acme", job.id)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "sampling"), [("sliding_window", True), ("cumulative", False)])
def test_a_job_releases_every_stage_at_its_level_within_the_budget(
    db: Database, tmp_path: Path, mode: str, sampling: bool
) -> None:
    dataset_id, block_ids = _stream_dataset(db, budget_for(mode, 1.0))
    job = _run(db, tmp_path, dataset_id, mode=mode, epsilon=1.0, sampling=sampling, window_levels=2)
    assert job.job.status == "succeeded", job.job.error
    expected = stages_of(12, 8, mode=mode, epsilon=1.0, sampling=sampling, window_levels=2)
    versions = versions_of(db, job.job.id)
    assert [v.step for v in versions] == [s.index for s in expected]
    running = Decimal(0)
    for version, stage in zip(versions, expected, strict=True):
        body = certificates.get_certificate(db, "acme", version.certificate_id)["certificate"]
        assert verify(body).ok
        levels = reservations.levels_by_batch(db, "acme", body)
        assert [levels[block_ids[b]] for b in blocks_of(stage)] == levels_of(stage)
        running = max(running, Decimal(body["result"]["epsilon"]))
        assert running <= 1
        assert 0.0 <= version.metrics["test_accuracy"] <= 1.0 and version.metrics["t"] == stage.info["t"]
    answer = spent.get_spend(db, "acme", dataset_id).to_json()
    assert Decimal(answer["epsilon_spent"]) == running <= 1
    assert answer["epsilon_held"] == "0"


def test_a_job_whose_budget_is_smaller_than_its_plan_is_stopped_by_the_ledger(
    db: Database, tmp_path: Path
) -> None:
    dataset_id, _ = _stream_dataset(db, budget_for("cumulative", 0.5))
    job = _run(db, tmp_path, dataset_id, mode="cumulative", epsilon=1.0)  # plans ε/2 at level 0
    assert job.job.status == "failed"
    assert job.job.error["error"] == "budget_exceeded" and job.job.error["stage"] == 1
    assert versions_of(db, job.job.id) == []
    assert spent.get_spend(db, "acme", dataset_id).spent.epsilon_spent == 0
