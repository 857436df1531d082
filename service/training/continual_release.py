"""Continual and sliding-window release of private L2-regularised logistic regression.

Paper: ``continual-sliding-window-release.txt`` (Watson, Ghosh, Rozemberczki & Sarkar). A stream
of blocks of b₀ records arrives; the ledger holds one batch per block (the batches of the
dataset's tasks, in task and position order, are the blocks in arrival order), and the dataset's
budget uses the ``geometric`` rule. Every release is a *stage* of a staged run
(``service.training.stages``): the gate reserves the stage's event on exactly the blocks the
release reads, hands the trainer their records, commits and publishes one model version.

The private ERM (every mode)
----------------------------
Each model is the exact minimiser of a λ-strongly convex objective, released with output
perturbation (PSGD / PBERM, Algorithms 1, 3, 7):

    w = argmin (1/n) Σᵢ∈S log(1 + exp(−yᵢ wᵀxᵢ)) + (λ/2)‖w − w_g‖²,   release w + ν,

with y ∈ {−1, +1}, features projected onto the unit ball (‖x‖ ≤ 1, so the logistic loss is
L = 1-Lipschitz), w_g = 0 for a model from scratch (Algorithm 1) or the released model it is
biased towards (Algorithm 3 / 7). Its L2 sensitivity is 2L/(λn) (Lemma .1; Chaudhuri, Monteleoni
& Sarwate 2011, Cor. 8) for the normaliser n (the records of the window, also when only a sample
S of it is used). ν has density ∝ exp(−‖ν‖₂/b) — norm Gamma(d, b), uniform direction
(``accountant.mechanisms.sample_output_perturbation_noise``), *not* per-coordinate Laplace — and
the release is Δ₂/b-DP (``OutputPerturbationEvent``). The solver is Newton's method run until
‖∇J(ŵ)‖ ≤ τ = 10⁻⁶·L/n; by λ-strong convexity ‖ŵ − w*‖ ≤ τ/λ, so the declared sensitivity is
2L/(λn) + 2τ/λ (the paper assumes the exact minimiser).

Each release's ε is the allowance of the ledger level it is meant to occupy (the paper's noise
scales, expressed as costs):

* ``multi_resolution`` (Algorithm 2): at t = 2ᵏ·q·B, a model on the last 2ᵏB records for every
  k ≤ ``max_level`` with 2ᵏ | t/B. Noise scale 4L/(λBε) for every k, i.e. ε/2ᵏ⁺¹ on a window of
  2ᵏB: level k of the series ε/2, ε/4, … (Theorem 1). B = ``base_blocks``·b₀.
* ``cumulative`` (Algorithm 4, its base models by Algorithm 2): at t = 2ᵏB the base f_g is
  trained from scratch on D[0:t]; at t − t_g = 2ʲb₀ a model on D[t_g:t] biased towards f_g
  becomes f_c; otherwise a model on the newest block biased towards f_c. Every call uses the noise
  scale 4L/(λb₀ε), so a call on 2ᵐ blocks costs ε/2ᵐ⁺¹ (level m). Theorem 4 bounds the updates by
  ε and the bases (Algorithm 2) by another ε ("2ε together"). With the bases' windows counted in
  blocks the two level sets of a block are disjoint: a block in (t_g, 2t_g] is read by updates on
  fewer than t_g blocks (levels < log₂ t_g) and by bases on ≥ 2t_g blocks (levels ≥ log₂ 2t_g), so
  both fit one series ε/2, ε/4, … and the whole run costs ε, not 2ε.
* ``sliding_window`` (Algorithm 5, Example 1): a window of w = 2ᴶ − 1 blocks (J =
  ``window_levels``); the newest 2ᴶ⁻¹ blocks of a refreshed window form the base (Algorithm 1,
  scale 6L/(λε2ᴶ⁻¹b₀): ε/3); the blocks before and after it are cut into buckets of distinct
  power-of-two sizes, the larger nearer the base, and each bucket's model is biased towards the
  next larger one in the dependency chain (Algorithm 3, scale 12L/(λb₀ε): ε/(6·2ʲ) on 2ʲ blocks).
  When a block enters, only the buckets it changes are retrained; when the base's oldest block
  leaves, the window is refreshed. The chain's end (the smallest bucket) is the released model for
  inference. Per block: the base once (ε/3) and at most one bucket of each size on each side of a
  base (Theorem 7), the budget's sub-budgets ``{"single": ε/3, "copies": 2, "ratio": 1/2}``.

``sampling`` (Algorithms 6 and 8, and the sliding window's fine-tuning sampling): a call whose
level is the series' term m ≥ 1 trains on a uniform sample of ⌊p·n⌋ of its n records, drawn
without replacement, p = (e^{ε_s/2ᵐ} − 1)/(e^{ε_s} − 1) for the series' first term ε_s
(``continual_release_sampling_probability``), with noise for sensitivity 2L/(λn) at ε_s, so the
amplified cost ln(1 + (m/n)(e^{ε_s} − 1)) (Balle, Barthe & Gaboardi 2018, Thm. 9) is the level's
ε_s/2ᵐ (``amplified_pure_epsilon``). The basic accountant prices no sampled event, so such a stage
declares ``pure_dp`` of the amplified ε and its ``info`` names the inner output perturbation and
the sample.

Params (``parse_params``): ``mode``, ``epsilon`` (the geometric budget's ε; ``budget_for`` builds
that budget), ``regularization`` (λ), ``sampling``, ``base_blocks`` (B/b₀, a power of two),
``max_level`` (K of Algorithm 2), ``window_levels`` (J), ``max_blocks`` (use only the first blocks),
``seed`` (experiments only: a seeded job's noise is reproducible by whoever knows the seed),
``positive_class`` (one-vs-rest on a multi-class source: label 1 for that class, 0 for the rest; a
function of each record alone, so the sensitivity 2L/(λn) is unchanged; without it the source must
have two classes).
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from accountant import events as ev
from accountant.exact import as_written, to_text
from accountant.mechanisms import (
    amplified_pure_epsilon,
    continual_release_sampling_probability,
    float_up,
    output_perturbation_l2_sensitivity,
    sample_output_perturbation_noise,
)
from accountant.rules import Budget, GeometricSchedule
from service.contract.job_params import (  # noqa: F401  (re-exported: declared in the torch-free module)
    MAX_LEVEL,
    MAX_WINDOW_LEVELS,
    MODES,
    ContinualParams,
    InvalidParamsError,
)
from service.training.data import LoadedData
from service.training.stages import LedgerTask, Stage, StageRelease

LIPSCHITZ: Final = 1.0  # logistic loss with features in the unit ball
OPTIMISATION_TOLERANCE: Final = 1e-6  # τ = 1e-6·L/n: the Newton stop, added to the sensitivity
MAX_NEWTON_STEPS: Final = 100
_FLOOR_60: Final = decimal.Context(prec=60, rounding=decimal.ROUND_FLOOR)

FloatArray = npt.NDArray[np.float64]


# ---------------------------------------------------------------------------------------------
# The budget the params expect (params: service.contract.job_params.ContinualParams)
# ---------------------------------------------------------------------------------------------


def geometric_schedule(mode: str, epsilon: float | Decimal | str) -> dict[str, Any]:
    """The ``geometric`` object of the budget a ``mode`` run expects (sub-budgets of Thm. 7 for
    the sliding window: one ε/3 level and two series ε/6, ε/12, …; one series ε/2, ε/4, …
    otherwise). Numbers are decimal strings, rounded down to 60 digits by the ledger's rules."""
    eps = epsilon if isinstance(epsilon, Decimal) else as_written(epsilon)
    if mode == "sliding_window":
        # ε/3 rounded down to 60 digits; the ledger derives first = (ε − single)(1 − ratio)/2.
        return {"single": to_text(_FLOOR_60.divide(eps, Decimal(3))), "copies": 2, "ratio": "0.5"}
    return {"first": to_text(_FLOOR_60.multiply(eps, Decimal("0.5"))), "ratio": "0.5"}


def budget_for(mode: str, epsilon: float | str) -> dict[str, Any]:
    """The dataset budget (``{rule: geometric, ...}``) a ``mode`` run at ``epsilon`` fits."""
    return {
        "rule": "geometric",
        "epsilon": str(epsilon),
        "delta": "0",
        "accountant": "basic",
        "geometric": geometric_schedule(mode, str(epsilon)),
    }


def schedule_of(params: ContinualParams) -> GeometricSchedule:
    budget = Budget.create(
        rule="geometric",
        epsilon=params.epsilon,
        delta=0,
        accountant="basic",
        geometric=geometric_schedule(params.mode, params.epsilon),
    )
    assert budget.geometric is not None
    return budget.geometric


def parse_params(params: Mapping[str, Any]) -> ContinualParams:
    """The job's params, validated (``service.contract.job_params.ContinualParams.read``)."""
    return ContinualParams.read(params)


# ---------------------------------------------------------------------------------------------
# The release plan (ledger view only: block indices, no data)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """One model release of the plan. ``blocks``: 0-based block indices read; ``term``: the series
    term m whose allowance it costs (``None``: the single level, the sliding window's base);
    ``anchor``: the release (0-based index into the plan) it is biased towards (``None``: trained
    from scratch); ``serves``: the model for inference at time ``t`` (blocks arrived)."""

    t: int
    role: str
    blocks: tuple[int, ...]
    term: int | None
    anchor: int | None
    serves: bool
    sampled: bool = False


def _span(start: int, stop: int) -> tuple[int, ...]:
    return tuple(range(start, stop))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def plan_multi_resolution(n_blocks: int, base_blocks: int, max_level: int, sampling: bool) -> list[Release]:
    """Algorithm 2 (Algorithm 6 with sampling): at t = 2ᵏ·q·B, a model on the last 2ᵏB for each k."""
    plan: list[Release] = []
    for t in range(base_blocks, n_blocks + 1, base_blocks):
        q = t // base_blocks
        ks = [k for k in range(max_level + 1) if q % 2**k == 0]
        for k in ks:
            size = 2**k * base_blocks
            plan.append(
                Release(t, f"resolution {k}", _span(t - size, t), k, None, k == ks[-1], sampling and k > 0)
            )
    return plan


def plan_cumulative(n_blocks: int, base_blocks: int, sampling: bool) -> list[Release]:
    """Algorithm 4 (Algorithm 8 with sampling), its bases by Algorithm 2 on D[0:t]."""
    plan: list[Release] = []
    t_g = 0
    f_g = f_c = -1
    for t in range(base_blocks, n_blocks + 1):
        if t % base_blocks == 0 and _is_power_of_two(t // base_blocks):
            plan.append(Release(t, "base", _span(0, t), t.bit_length() - 1, None, True))
            t_g, f_g = t, len(plan) - 1
            f_c = f_g
        elif _is_power_of_two(t - t_g):
            j = (t - t_g).bit_length() - 1
            plan.append(Release(t, "doubling update", _span(t_g, t), j, f_g, True, sampling and j > 0))
            f_c = len(plan) - 1
        else:
            plan.append(Release(t, "update", _span(t - 1, t), 0, f_c, True))
    return plan


def _buckets(start: int, count: int, *, outward: int) -> list[tuple[int, int]]:
    """Buckets ``(first block, size)`` of ``count`` blocks in distinct powers of two, the largest
    adjacent to the base. ``outward`` −1: the blocks end at ``start`` (left of the base);
    +1: they begin at ``start`` (right of it)."""
    out = []
    edge = start
    for j in range(count.bit_length() - 1, -1, -1):
        if count >> j & 1:
            size = 2**j
            if outward < 0:
                out.append((edge - size, size))
                edge -= size
            else:
                out.append((edge, size))
                edge += size
    return out


def sliding_window_chain(t: int, window_levels: int) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The dependency chain of Algorithm 5 at time t ≥ w (Example 1): ``(base, buckets)``, each
    ``(first block, size)``; ``buckets`` in chain order (sizes strictly decreasing)."""
    half = 2 ** (window_levels - 1)
    w = 2 * half - 1
    s = (t - w) % half  # blocks since the last refresh
    refreshed = t - s
    base = (refreshed - half, half)
    left = _buckets(refreshed - half, half - 1 - s, outward=-1)
    right = _buckets(refreshed, s, outward=+1)
    return base, sorted(left + right, key=lambda bucket: -bucket[1])


def plan_sliding_window(n_blocks: int, window_levels: int, sampling: bool) -> list[Release]:
    """Algorithm 5: a release per new block once the first window is full; only new buckets of
    the chain are trained, each biased towards its predecessor in the chain."""
    plan: list[Release] = []
    trained: dict[tuple[int, int], int] = {}  # bucket → release index, for the current base
    w = 2**window_levels - 1
    current_base: tuple[int, int] | None = None
    for t in range(w, n_blocks + 1):
        base, buckets = sliding_window_chain(t, window_levels)
        if base != current_base:
            current_base = base
            trained = {}
            plan.append(Release(t, "base", _span(base[0], base[0] + base[1]), None, None, not buckets))
            trained[base] = len(plan) - 1
        previous = trained[base]
        new = [b for b in buckets if b not in trained]
        for bucket in buckets:
            if bucket not in trained:
                first, size = bucket
                j = size.bit_length() - 1
                serves = bucket == new[-1]
                plan.append(
                    Release(t, "bucket", _span(first, first + size), j, previous, serves, sampling and j > 0)
                )
                trained[bucket] = len(plan) - 1
            previous = trained[bucket]
    return plan


def plan_releases(params: ContinualParams, n_blocks: int) -> list[Release]:
    if params.mode == "multi_resolution":
        return plan_multi_resolution(n_blocks, params.base_blocks, params.max_level, params.sampling)
    if params.mode == "cumulative":
        return plan_cumulative(n_blocks, params.base_blocks, params.sampling)
    return plan_sliding_window(n_blocks, params.window_levels, params.sampling)


# ---------------------------------------------------------------------------------------------
# Costs: each release's ε is the allowance of its level
# ---------------------------------------------------------------------------------------------


def float_at_most(limit: Decimal) -> float:
    """The largest float whose decimal as the ledger reads it (``as_written``) is ≤ ``limit``:
    a charge declared with it fits a level of allowance ``limit`` exactly."""
    value = float(limit)
    while value > 0 and as_written(value) > limit:
        value = math.nextafter(value, 0.0)
    return value


def _noise_scale(l2_sensitivity: float, epsilon: float) -> float:
    """b ≥ Δ₂/ε for ε read as the ledger reads it, so the release is at most as private-costly
    as the charged ε (Chaudhuri et al. 2011, Theorem 6)."""
    return float_up(Fraction(l2_sensitivity) / Fraction(as_written(epsilon)))


def l2_sensitivity(*, regularization: float, normaliser: int) -> float:
    """2L/(λn) (Lemma .1) plus 2τ/λ for the optimisation tolerance τ = 10⁻⁶·L/n."""
    exact = output_perturbation_l2_sensitivity(
        lipschitz=LIPSCHITZ, regularization=regularization, dataset_size=normaliser
    )
    slack = Fraction(2) * Fraction(OPTIMISATION_TOLERANCE) * Fraction(LIPSCHITZ) / normaliser
    return float_up(Fraction(exact) + slack / Fraction(regularization))


@dataclass(frozen=True)
class Calibration:
    """What a release declares and draws: ``event`` (charged on each block), the noise scale b of
    ν, the normaliser n and, when sampled, the sample size."""

    event: ev.DpEvent
    noise_scale: float
    normaliser: int
    sample_size: int | None = None
    inner_event: ev.OutputPerturbationEvent | None = None


def level_of_term(schedule: GeometricSchedule, term: int | None) -> int:
    """The first (shallowest) level of ``term`` (``None``: the single level 0)."""
    if term is None:
        return 0
    return (1 if schedule.single > 0 else 0) + term * schedule.copies


def calibrate(
    release: Release, params: ContinualParams, schedule: GeometricSchedule, block_size: int
) -> Calibration:
    n = block_size * len(release.blocks)
    sens = l2_sensitivity(regularization=params.regularization, normaliser=n)
    allowance = schedule.allowance(level_of_term(schedule, release.term))
    if not release.sampled or release.term is None or release.term == 0:
        eps = float_at_most(allowance)
        event = ev.OutputPerturbationEvent(l2_sensitivity=sens, epsilon=eps)
        return Calibration(event, _noise_scale(sens, eps), n)
    # Sampling: the inner call is calibrated to the series' first term ε_s, the sample of
    # ⌊p·n⌋ records amplifies it to ε_s/2ᵐ (Balle et al. 2018, Thm. 9).
    inner_eps = float_at_most(schedule.first)
    inner = ev.OutputPerturbationEvent(l2_sensitivity=sens, epsilon=inner_eps)
    scale = _noise_scale(sens, inner_eps)
    inner_cost = float_up(Fraction(sens) / Fraction(scale))
    p = continual_release_sampling_probability(epsilon=2 * float(schedule.first), level=release.term)
    m = max(1, math.floor(p * n))
    while True:
        amplified = amplified_pure_epsilon(epsilon=inner_cost, sampling_probability=m / n)
        if as_written(amplified) <= allowance:
            break
        if m == 1:
            raise ValueError(f"no sample fits level allowance {allowance} at n={n}")
        m -= 1
    return Calibration(ev.PureDpEvent(epsilon=amplified), scale, n, m, inner)


def expected_levels(
    plan: Sequence[Release], schedule: GeometricSchedule, n_blocks: int
) -> list[tuple[int, ...]]:
    """The level each release should occupy on each of its blocks under the ledger's best fit
    (the deepest free level of its term: ``copies`` levels share one allowance)."""
    used: list[set[int]] = [set() for _ in range(n_blocks)]
    out: list[tuple[int, ...]] = []
    for release in plan:
        first = level_of_term(schedule, release.term)
        width = 1 if release.term is None else schedule.copies
        levels = []
        for block in release.blocks:
            free = [k for k in range(first + width - 1, first - 1, -1) if k not in used[block]]
            if not free:
                raise ValueError(f"block {block} has no free level for term {release.term}")
            used[block].add(free[0])
            levels.append(free[0])
        out.append(tuple(levels))
    return out


# ---------------------------------------------------------------------------------------------
# Private ERM: exact minimiser (Newton), output perturbation
# ---------------------------------------------------------------------------------------------


def _objective(w: FloatArray, x: FloatArray, s: FloatArray, n: int, lam: float, anchor: FloatArray) -> float:
    margins = s * (x @ w)
    diff = w - anchor
    return float(np.logaddexp(0.0, -margins).sum() / n + 0.5 * lam * float(diff @ diff))


def fit_biased_logistic(
    x: FloatArray, s: FloatArray, *, normaliser: int, regularization: float, anchor: FloatArray
) -> FloatArray:
    """argmin (1/n) Σ log(1 + e^{−sᵢwᵀxᵢ}) + (λ/2)‖w − anchor‖² by damped Newton, to
    ‖∇‖ ≤ 10⁻⁶·L/n (the tolerance the declared sensitivity includes). Raises if not reached."""
    from scipy.special import expit

    n, lam = normaliser, regularization
    tolerance = OPTIMISATION_TOLERANCE * LIPSCHITZ / n
    w = anchor.copy()
    d = w.size
    for _ in range(MAX_NEWTON_STEPS):
        margins = s * (x @ w)
        p = expit(-margins)  # σ(−sᵢwᵀxᵢ)
        grad = -(x.T @ (s * p)) / n + lam * (w - anchor)
        if float(np.linalg.norm(grad)) <= tolerance:
            return w
        hessian = (x.T * (p * (1.0 - p))) @ x / n + lam * np.eye(d)
        step = np.linalg.solve(hessian, grad)
        current = _objective(w, x, s, n, lam, anchor)
        slope = float(grad @ step)
        size = 1.0
        # Near the minimum the decrease Armijo asks for (¼·slope) is below what the objective's
        # floating value resolves, and the search would accept a step of ~0 by rounding luck and
        # stall: take the full Newton step there (the Hessian is λ-strongly convex; the gradient
        # tolerance above still decides when to stop).
        resolvable = slope > 64 * np.finfo(np.float64).eps * max(1.0, abs(current))
        while resolvable and size > 1e-12:
            candidate = w - size * step
            if _objective(candidate, x, s, n, lam, anchor) <= current - 0.25 * size * slope:
                break
            size *= 0.5
        w = w - size * step
    raise ArithmeticError(
        f"Newton did not reach the gradient tolerance {tolerance:.3g} in {MAX_NEWTON_STEPS} steps"
    )


def project_to_unit_ball(x: FloatArray) -> FloatArray:
    """Rows with ‖x‖ > 1 scaled onto the sphere (record by record: the loss stays 1-Lipschitz)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    out: FloatArray = x / np.maximum(norms, 1.0)
    return out


def evaluate(w: FloatArray, x: FloatArray, labels: npt.NDArray[np.int64]) -> dict[str, float]:
    if len(labels) == 0:
        return {}
    s = 2.0 * labels - 1.0
    margins = s * (x @ w)
    return {
        "test_accuracy": float(np.mean(margins > 0)),
        "test_loss": float(np.mean(np.logaddexp(0.0, -margins))),
    }


# ---------------------------------------------------------------------------------------------
# The staged trainer
# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    params: ContinualParams
    plan: list[Release]
    calibrations: list[Calibration]
    block_of: dict[str, int]
    last_use: list[int]  # per release: the last release index that uses it as anchor
    dimension: int
    test: tuple[FloatArray, npt.NDArray[np.int64]]
    rng: np.random.Generator
    models: dict[int, FloatArray] = field(default_factory=dict)


def one_vs_rest(labels: npt.NDArray[np.int64], positive_class: int | None) -> npt.NDArray[np.int64]:
    """1 for ``positive_class``, 0 for every other class; the labels unchanged without one."""
    if positive_class is None:
        return labels
    return (np.asarray(labels) == positive_class).astype(np.int64)


def stream_blocks(tasks: Sequence[LedgerTask], max_blocks: int | None) -> tuple[list[str], int]:
    """The blocks (batch ids in task and position order) and their size b₀; a smaller last block
    is left out. Blocks of unequal sizes elsewhere are refused (the levels assume equal blocks)."""
    batches = [b for task in tasks for b in task.batches]
    if not batches:
        return [], 0
    block_size = batches[0].size
    if block_size < 1:
        raise InvalidParamsError("params.data_source", "the first block holds no records.")
    if batches[-1].size != block_size:
        batches = batches[:-1]
    unequal = [b.id for b in batches if b.size != block_size]
    if unequal:
        raise InvalidParamsError(
            "params.data_source",
            f"every block (ledger batch) must hold {block_size} records, as the first does; "
            f"batch {unequal[0]!r} does not.",
        )
    if max_blocks is not None:
        batches = batches[:max_blocks]
    return [b.id for b in batches], block_size


class ContinualReleaseTrainer:
    """``continual_release``: a staged trainer (``service.training.stages.StagedTrainer``)."""

    def __init__(self, device: str | None = None) -> None:
        self.device = device  # numpy only: the device is not used

    def parse_params(self, params: Mapping[str, Any]) -> ContinualParams:
        return parse_params(params)

    def _planned(
        self, params: ContinualParams, tasks: Sequence[LedgerTask]
    ) -> tuple[list[str], list[Release], list[Calibration], list[tuple[int, ...]]]:
        block_ids, block_size = stream_blocks(tasks, params.max_blocks)
        plan = plan_releases(params, len(block_ids))
        schedule = schedule_of(params)
        calibrations = [calibrate(r, params, schedule, block_size) for r in plan]
        levels = expected_levels(plan, schedule, len(block_ids))
        return block_ids, plan, calibrations, levels

    def stages(self, params: ContinualParams, tasks: Sequence[LedgerTask]) -> list[Stage]:
        block_ids, plan, calibrations, levels = self._planned(params, tasks)
        stages = []
        for i, (release, calibration, level) in enumerate(zip(plan, calibrations, levels, strict=True)):
            info: dict[str, Any] = {
                "mode": params.mode,
                "t": release.t,
                "role": release.role,
                "blocks": [release.blocks[0], release.blocks[-1] + 1],
                "serves": release.serves,
                "anchor": None if release.anchor is None else release.anchor + 1,
                "noise_scale": calibration.noise_scale,
            }
            if len(set(level)) == 1:
                info["level"] = level[0]
            else:
                info["levels"] = list(level)
            if calibration.sample_size is not None:
                assert calibration.inner_event is not None
                info["sample_size"] = calibration.sample_size
                info["inner_event"] = ev.to_json(calibration.inner_event)
            name = f"t={release.t} {release.role} blocks {release.blocks[0]}..{release.blocks[-1]}"
            stages.append(
                Stage(i + 1, name, tuple(block_ids[b] for b in release.blocks), calibration.event, info=info)
            )
        return stages

    def start(self, params: ContinualParams, data: LoadedData, tasks: Sequence[LedgerTask]) -> _State:
        if params.positive_class is not None and params.positive_class >= data.num_classes:
            raise InvalidParamsError(
                "params.positive_class",
                f"must name one of the source's {data.num_classes} classes. Found {params.positive_class}.",
            )
        if params.positive_class is None and data.num_classes != 2:
            raise ValueError(
                f"continual_release needs binary labels; the source has {data.num_classes} classes "
                "(params.positive_class makes it one-vs-rest)."
            )
        block_ids, plan, calibrations, _ = self._planned(params, tasks)
        last_use = list(range(len(plan)))
        for i, release in enumerate(plan):
            if release.anchor is not None:
                last_use[release.anchor] = max(last_use[release.anchor], i)
        test_x, test_y = data.test_arrays()
        rng = np.random.default_rng(params.seed)  # None: fresh entropy from the OS
        return _State(
            params,
            plan,
            calibrations,
            {b: i for i, b in enumerate(block_ids)},
            last_use,
            data.n_features,
            (project_to_unit_ball(test_x.astype(np.float64)), one_vs_rest(test_y, params.positive_class)),
            rng,
        )

    def train_stage(
        self, state: _State, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        import torch

        index = stage.index - 1
        release, calibration = state.plan[index], state.calibrations[index]
        if sorted(state.block_of[b] for b in stage.batch_ids) != list(release.blocks):
            raise ValueError(f"stage {stage.index} reads blocks other than its plan's")
        x32, labels = data.train_arrays()
        labels = one_vs_rest(labels, state.params.positive_class)
        if len(labels) != calibration.normaliser:
            raise ValueError(f"stage {stage.index}: {len(labels)} records, expected {calibration.normaliser}")
        if labels.size and (labels.min() < 0 or labels.max() > 1):
            raise ValueError("continual_release needs binary labels 0/1")
        x = project_to_unit_ball(x32.astype(np.float64))
        s = 2.0 * labels.astype(np.float64) - 1.0
        if calibration.sample_size is not None:
            # A uniform sample without replacement, from the trainer's own randomness.
            keep = state.rng.choice(len(labels), size=calibration.sample_size, replace=False)
            x, s = x[keep], s[keep]
        anchor = state.models[release.anchor] if release.anchor is not None else np.zeros(state.dimension)
        w = fit_biased_logistic(
            x, s, normaliser=calibration.normaliser, regularization=state.params.regularization, anchor=anchor
        )
        released = w + sample_output_perturbation_noise(
            rng=state.rng, dimension=state.dimension, noise_scale=calibration.noise_scale
        )
        state.models[index] = released
        for done in [k for k in state.models if state.last_use[k] <= index]:
            del state.models[done]
        metrics = evaluate(released, *state.test)
        return StageRelease({"weight": torch.from_numpy(released.copy())}, metrics)


__all__ = [
    "MODES",
    "Calibration",
    "ContinualParams",
    "ContinualReleaseTrainer",
    "Release",
    "budget_for",
    "calibrate",
    "expected_levels",
    "fit_biased_logistic",
    "geometric_schedule",
    "one_vs_rest",
    "parse_params",
    "plan_releases",
    "sliding_window_chain",
]
