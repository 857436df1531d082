"""The sound lifelong learner: the functional mechanism proper on a data-independent encoder.

``l2dp_ml`` with ``perturbation: "functional_mechanism"`` (``FunctionalMechanismParams``). The
paper's idea (lifelong-dp-l2dp-ml.txt: perturb the coefficients of a polynomial objective once per
fixed, disjoint batch, then reuse the perturbed batch for free) with a proof that holds
(docs/ACCOUNTING.md, "The functional mechanism of the lifelong learner"):

* **Encoder** — seeded random features that never see private data: φ(x) = B·u/‖u‖ with
  u = (tanh(R x), 1), R ∈ ℝ^{(p−1)×d} with N(0, ``feature_scale``²) entries drawn from the seed.
  ‖φ‖₂ = B (up to a 10⁻¹² margin kept below it), the bound the sensitivity needs.
* **Objective** — the output layer W (p × K) minimises the 2nd-order Taylor polynomial of the
  per-class logistic loss (Eq. 9; Eq. 12 is its printed, unbounded form):
  Σ_k [w_kᵀ(½Σφ − Σφy_k) + ⅛ w_kᵀ(Σφφᵀ)w_k] + ½λ‖W‖². Its coefficients are (Σφφᵀ, Σφyᵀ) and
  Σφ = Σφyᵀ·1 (one-hot labels sum to 1).
* **Mechanism** — once per ledger batch, Gaussian noise of standard deviation σ·Δ₂ on **every**
  coefficient (``FunctionalMechanismEvent``; Δ₂ = √2(B² + ½) for B² ≥ ½, replace-one). The draw is
  a deterministic function of (seed, batch id), so a second job with the same seed (the same
  ``noise_commitment``, which also names the encoder) replays it for free on a ``lifelong``
  dataset.
* **Learning** — everything after the noise is post-processing: the symmetrised Σφφᵀ is
  projected onto the positive semi-definite cone, and each head is the closed-form minimiser
  (¼M̃ + λI)w_k = C̃_k − ½C̃·1. One shared head sums the perturbed coefficients of the current
  task's batches and of the episodic memory (``memory_per_task`` perturbed batches of every
  learnt task, all by default: then the head is joint training on everything learnt, through
  the noise); ``multi_head`` keeps one head per task, solved from that task's batches and
  predicting among its classes.

Every stage τ reserves the event on task τ's batches only: each record is read by one Gaussian
mechanism in the whole run, so by parallel composition over disjoint batches the run's ε is one
batch's, whatever the number of tasks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import torch

from accountant.events import DpEvent, FunctionalMechanismEvent
from accountant.mechanisms import functional_mechanism_noise_stddev
from service.contract.job_params import FunctionalMechanismParams, InvalidParamsError
from service.training.data import LoadedData
from service.training.lifelong_tasks import LifelongRecord, make_plan
from service.training.stages import LedgerTask, Stage, StageRelease

COMMITMENT_PREFIX: Final = "functional-mechanism:"
# ‖φ‖ is scaled to B·(1 − FEATURE_MARGIN): float rounding of the normalisation never exceeds B.
FEATURE_MARGIN: Final = 1e-12


def random_projection(*, seed: int, input_dim: int, features: int, scale: float) -> np.ndarray:
    """R ((features − 1) × input_dim), N(0, scale²) entries from the seed alone (no data)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x666D]))
    return rng.normal(0.0, scale, (features - 1, input_dim))


def encode(x: np.ndarray, projection: np.ndarray, *, bound: float) -> np.ndarray:
    """φ(x) for each row of ``x``: (tanh(R x), 1) scaled to norm B(1 − 10⁻¹²) (module docstring)."""
    z = np.tanh(np.asarray(x, dtype=np.float64) @ projection.T)
    u = np.concatenate([z, np.ones((z.shape[0], 1))], axis=1)
    norms = np.linalg.norm(u, axis=1, keepdims=True)  # ≥ 1: the bias coordinate
    phi: np.ndarray = u * (bound * (1 - FEATURE_MARGIN) / norms)
    return phi


def batch_coefficients(
    phi: np.ndarray, labels: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """The batch's coefficient vector (Σφφᵀ (p × p), Σφyᵀ (p × K)) for integer ``labels``."""
    one_hot = np.eye(num_classes)[np.asarray(labels, dtype=np.int64)]
    return phi.T @ phi, phi.T @ one_hot


def coefficient_noise(
    seed: int, batch_id: str, *, features: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Standard normal draws for every coefficient of one batch ((p × p), (p × K)): a
    deterministic function of (seed, batch id), so every read of the batch sees the same draw."""
    key = hashlib.sha256(batch_id.encode()).digest()
    words = [int.from_bytes(key[i : i + 4], "little") for i in range(0, 16, 4)]
    rng = np.random.default_rng(np.random.SeedSequence([seed & (2**64 - 1), 0x464D, *words]))
    return rng.standard_normal((features, features)), rng.standard_normal((features, num_classes))


def solve_head(m: np.ndarray, c: np.ndarray, regularization: float) -> np.ndarray:
    """W (p × K) minimising Σ_k [w_kᵀ(½C·1 − C_k) + ⅛w_kᵀMw_k] + ½λ‖W‖² for the PSD projection of
    the symmetrised M (post-processing of the perturbed coefficients)."""
    sym = (m + m.T) / 2
    values, vectors = np.linalg.eigh(sym)
    psd = (vectors * np.clip(values, 0.0, None)) @ vectors.T
    a = 0.25 * psd + regularization * np.eye(m.shape[0])
    rhs = c - 0.5 * c.sum(axis=1, keepdims=True)
    head: np.ndarray = np.linalg.solve(a, rhs)
    return head


def noise_commitment(p: FunctionalMechanismParams) -> str:
    """The commitment of the noise and encoder drawn from the seed: on the same batch (the same
    records, so the same input dimension) a replay with it is the same release (same encoder, same
    draw); the seed itself is not revealed."""
    text = (
        f"functional mechanism seed {p.seed} features {p.features} "
        f"feature_scale {p.feature_scale!r} feature_bound {p.feature_bound!r}"
    )
    return COMMITMENT_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:32]


def functional_event(p: FunctionalMechanismParams, num_classes: int) -> FunctionalMechanismEvent:
    return FunctionalMechanismEvent(
        noise_multiplier=p.noise_multiplier,
        feature_dim=p.features,
        num_classes=num_classes,
        feature_bound=p.feature_bound,
    )


def noise_multiplier_for_budget(
    *,
    epsilon: float,
    delta: float,
    resolution: float = 1e-3,
    admits: Callable[[Sequence[DpEvent]], bool] | None = None,
) -> float:
    """The smallest σ (grid ``resolution``) whose one batch charge the ledger admits: ``admits``
    (default: the Rényi filter of a fresh ``lifelong``/``rdp`` budget (ε, δ) with its placed
    grid, ``accountant.calibration.filter_admission``), so the run spends the budget once
    (``accountant.calibration.smallest_noise``)."""
    from accountant.calibration import filter_admission, smallest_noise

    if admits is None:
        admits = filter_admission(rule="lifelong", epsilon=epsilon, delta=delta)

    def fits(sigma: float) -> bool:
        event = FunctionalMechanismEvent(
            noise_multiplier=sigma, feature_dim=2, num_classes=2, feature_bound=1.0
        )
        return admits([event])

    return smallest_noise(fits, resolution=resolution)


def choose_memory(
    seed: int, task_batches: Sequence[Sequence[str]], per_task: int | None
) -> list[tuple[str, ...]]:
    """For each task (in training order) the perturbed batches that stay in the episodic memory:
    all of them (``per_task`` None) or ``per_task`` drawn from the seed alone."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6D656D]))
    out = []
    for batches in task_batches:
        if per_task is None or per_task >= len(batches):
            out.append(tuple(batches))
        else:
            chosen = sorted(int(i) for i in rng.choice(len(batches), per_task, replace=False))
            out.append(tuple(batches[i] for i in chosen))
    return out


@dataclass
class FunctionalMechanismState:
    params: FunctionalMechanismParams
    order: tuple[LedgerTask, ...]
    memory_plan: list[tuple[str, ...]]
    event: FunctionalMechanismEvent
    stddev: float
    projection: np.ndarray
    num_classes: int
    record: LifelongRecord
    perturbed: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    heads: dict[int, np.ndarray] = field(default_factory=dict)  # source task -> head (multi-head)
    shared: np.ndarray | None = None
    position: int = 0


class FunctionalMechanismTrainer:
    """The functional-mechanism lifelong learner as a staged trainer (module docstring); reached
    through ``service.training.l2dp_ml.L2dpMlTrainer`` for ``perturbation: "functional_mechanism"``."""

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        del device  # closed-form numpy solves: no device

    @staticmethod
    def num_classes(p: FunctionalMechanismParams) -> int:
        # The event names K before any data is read: the params' or the digits' ten.
        return p.num_classes if p.num_classes is not None else 10

    def stages(self, params: FunctionalMechanismParams, tasks: Sequence[LedgerTask]) -> list[Stage]:
        plan = make_plan(tasks, task_order=params.task_order, epochs=1, seed=params.seed)
        event = functional_event(params, self.num_classes(params))
        commitment = noise_commitment(params)
        return [
            Stage(
                index=position + 1,
                name=f"task {task.name}",
                batch_ids=task.batch_ids,
                event=event,
                noise_commitment=commitment,
                info={"task": task.index, "batches": len(task.batch_ids)},
            )
            for position, task in enumerate(plan.order)
        ]

    def start(
        self, params: FunctionalMechanismParams, data: LoadedData, tasks: Sequence[LedgerTask]
    ) -> FunctionalMechanismState:
        num_classes = self.num_classes(params)
        if num_classes < data.num_classes:
            raise InvalidParamsError(
                "params.num_classes",
                f"must cover the data's {data.num_classes} classes. Found {num_classes}.",
            )
        plan = make_plan(tasks, task_order=params.task_order, epochs=1, seed=params.seed)
        event = functional_event(params, num_classes)
        return FunctionalMechanismState(
            params=params,
            order=plan.order,
            memory_plan=choose_memory(params.seed, [t.batch_ids for t in plan.order], params.memory_per_task),
            event=event,
            stddev=functional_mechanism_noise_stddev(event),
            projection=random_projection(
                seed=params.seed,
                input_dim=data.n_features,
                features=params.features,
                scale=params.feature_scale,
            ),
            num_classes=num_classes,
            record=LifelongRecord.of(data),
        )

    def perturb(
        self, state: FunctionalMechanismState, batch_id: str, features: np.ndarray, labels: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The batch's one release: its coefficients plus σ·Δ₂ Gaussian noise on each."""
        p = state.params
        phi = encode(features, state.projection, bound=p.feature_bound)
        m, c = batch_coefficients(phi, labels, state.num_classes)
        noise_m, noise_c = coefficient_noise(
            p.seed, batch_id, features=p.features, num_classes=state.num_classes
        )
        return m + state.stddev * noise_m, c + state.stddev * noise_c

    def predict(self, state: FunctionalMechanismState, task: int, features: np.ndarray) -> np.ndarray:
        phi = encode(features, state.projection, bound=state.params.feature_bound)
        if not state.params.multi_head:
            assert state.shared is not None
            return np.asarray((phi @ state.shared).argmax(axis=1))
        classes = state.record.task_classes(task)
        return np.asarray(classes[(phi @ state.heads[task])[:, classes].argmax(axis=1)])

    def train_stage(
        self,
        state: FunctionalMechanismState,
        stage: Stage,
        data: LoadedData,
        records: Mapping[str, tuple[str, ...]],
    ) -> StageRelease:
        p = state.params
        position = state.position
        task = state.order[position]
        index = {r: (split, i) for split in data.train for i, r in enumerate(split.record_ids)}
        for batch_id in task.batch_ids:
            rows = [index[r] for r in records[batch_id]]
            x = np.stack([split.features[i] for split, i in rows])
            y = np.asarray([split.labels[i] for split, i in rows], dtype=np.int64)
            state.perturbed[batch_id] = self.perturb(state, batch_id, x, y)
        source = state.record.learnt(data, [r for b in task.batch_ids for r in records[b]])
        if p.multi_head:
            used: Sequence[str] = task.batch_ids
        else:
            memory = [b for kept in state.memory_plan[:position] for b in kept]
            used = [*task.batch_ids, *memory]
        m = sum((state.perturbed[b][0] for b in used), np.zeros((p.features, p.features)))
        c = sum((state.perturbed[b][1] for b in used), np.zeros((p.features, state.num_classes)))
        head = solve_head(m, c, p.regularization)
        if p.multi_head:
            state.heads[source] = head
        else:
            state.shared = head
        # Only the memory's perturbed batches stay (what the plan keeps of this task).
        kept = set(state.memory_plan[position]) if not p.multi_head else set()
        for batch_id in task.batch_ids:
            if batch_id not in kept:
                state.perturbed.pop(batch_id, None)
        state.position += 1
        metrics: dict[str, Any] = state.record.evaluate_tasks(lambda t, x: self.predict(state, t, x))
        metrics["noise_stddev"] = state.stddev
        metrics["memory_batches"] = 0 if p.multi_head else len(used) - len(task.batch_ids)
        model_state = {"encoder.projection": torch.from_numpy(state.projection.astype(np.float32))}
        if p.multi_head:
            for t, w in state.heads.items():
                model_state[f"head.{t}.weight"] = torch.from_numpy(w.T.astype(np.float32))
        else:
            assert state.shared is not None
            model_state["classifier.weight"] = torch.from_numpy(state.shared.T.astype(np.float32))
        return StageRelease(model_state, metrics)


__all__ = [
    "FunctionalMechanismState",
    "FunctionalMechanismTrainer",
    "batch_coefficients",
    "choose_memory",
    "coefficient_noise",
    "encode",
    "functional_event",
    "noise_commitment",
    "noise_multiplier_for_budget",
    "random_projection",
    "solve_head",
]
