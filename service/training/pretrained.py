"""DP continual learning with a pre-trained model: the cosine classifier, the PEFT-head ensemble
and the paper's two baselines, each a staged job behind the release gate.

Paper: Tobaben, Klasson, Li, Solin & Honkela, "Differentially Private Continual Learning using
Pre-Trained Models" (``dp-continual-learning-pretrained.txt``). A frozen extractor f_θ
pre-trained on public data (``service.training.feature_extractor``; here: the source's public split)
turns every image into a unit-norm feature u = f_θ(x)/‖f_θ(x)‖ ∈ ℝᴷ. Tasks arrive one by one; after
each task a model is released (one stage of ``service.training.stages`` per ledger task).

Assumptions (Sec. 3): **S1** the set of classes is known — every release covers all C classes
(all class sums; heads of output width C), so a release does not reveal which classes a task
held; **S2** tasks are disjoint and no record is stored or replayed, so each task is read once
and parallel composition applies. The ledger's ``parallel`` rule *enforces* S2: a second read of
a batch is refused (``batch_already_read``).

Algorithms (``service.training.algorithms``):

* ``cosine_classifier`` (Alg. A4, Eq. 2–3). Stage t reads task t once and releases, for **every**
  class c, s_c ← s_c + Σ_{x∈D_t, y=c} u(x) + N(0, σ²I) (Eq. 2: classes absent from the task get
  noise only). Prediction: argmax_c cos(u(x*), s_c) (Eq. 3). Sensitivity: the released object is
  the C×K matrix of class sums. Under the ledger's neighbouring relation — add/remove one record,
  the relation of its Poisson-sampled Gaussian accounting (``accountant.rdp``) — a record changes
  one row by its unit feature: L2 sensitivity Δ = 1, so the stage is ``GaussianEvent(σ/Δ = σ)``.
  (Under replace-one, Δ would be 2: the same record class twice, ‖u − u′‖ ≤ 2; the event's noise
  multiplier would be σ/2.) σ is the smallest on a 10⁻⁴ grid meeting the job's target (``Calibration``
  below).
* ``peft_ensemble`` (Alg. A5, Eq. 4). Stage t trains a new head g_φt: ℝᴷ → ℝᶜ (a zero-initialised
  linear layer, as App. C and Sec. 4 "trains only a linear layer for each task") with DP-SGD on
  task t's features only, and releases all heads so far. Prediction: the class of the largest
  logit across heads, argmax_{t,c} g_φt(u)_c. The stage's event is
  ``dp_sgd_event(q = B/N_t, σ, T = ⌈epochs/q⌉)``, σ calibrated to the job's target for that
  stage's q and T — a task's charge is the whole run on its records.
* ``peft_naive`` (Alg. A3, lower baseline): one head, trained further with DP-SGD on task t only
  at each stage; the previous head is a released value (post-processing), so stage t reads only
  task t and the rule stays ``parallel``.
* ``peft_full_data`` (Alg. A2, upper baseline): stage t trains a fresh head with DP-SGD on tasks
  1..t — it re-reads every earlier task. Each model is (ε, δ)-DP on its own, but the sequence is
  not: it needs a ``sequential`` dataset (the same records registered as another dataset),
  where task 1 bears t charges after stage t. On a ``parallel`` dataset stage 2 is refused.

Calibration (issue 24: ``target_epsilon`` means what Opacus users mean). Each stage's σ is the
smallest on the 10⁻⁴ grid such that, with ``target_epsilon``, the *stage's run* has its own ε at
``delta`` (the budget's, filled in by the gate) by the tight accountant (PRV upper bound,
``accountant.calibration.tight_epsilon``; for the lone Gaussian of the cosine classifier too: the
project has no exact Balle & Wang profile) at most the target — under parallel composition
(disjoint tasks) the whole run's ε for any record; with ``target_budget_epsilon``, the ledger charges
the stage's event at most the target as one charge under the job's ``accountant``, the budget's
(``gaussian_noise_multiplier``, ``calibrate_to_ledger``). Full-Data re-reads old tasks: each of its
models meets the target, the sequence composes (its ``sequential`` budget charges every re-read).
The gate checks, before any data is read, that the budget admits every stage in turn, and names the
largest ``target_epsilon`` that does when it does not.

DP-SGD is ``service.training.dp_sgd``'s (true Poisson sampling, clipping to C, noise σC, division
by the public q·N — a departure from Alg. A1's |L_t| explained there); this module only calls its
public helpers. Metrics of each release (on the public test splits): per-task accuracy a_{t,i}
for every test task, average accuracy A_t over the tasks seen so far (Eq. A4) and average
forgetting F_t (Eq. A5–A6, with the maximum over the releases since task i was learned, as
Chaudhry et al. 2018 define it).

Randomness: ``seed`` makes a run reproducible (tests, experiments); without one a job draws it
from ``secrets`` and never reports it (see ``service.training.dp_sgd``). ``extractor_seed`` seeds
the public pre-training only: it is public.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, ClassVar, Final

import numpy as np
import torch
from torch import nn

from accountant.calibration import (
    TIGHT_ACCOUNTANT,
    calibrate_noise_multiplier,
    calibrate_to_epsilon,
    calibrate_to_price,
    single_charge_price,
)
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent, GaussianEvent
from service.contract.job_params import (  # noqa: F401  (re-exported: declared in the torch-free module)
    ACCOUNTANTS,
    HEAD_DEFAULTS,
    HeadParams,
    InvalidParamsError,
    PretrainedParams,
)
from service.training.data import LoadedData
from service.training.dp_sgd import (
    TrainingError,
    default_device,
    dp_sgd_event,
    flat_buffer,
    noisy_mean_gradient_flat,
    poisson_sample,
)
from service.training.feature_extractor import (
    FeatureExtractor,
    pretrained_extractor,
    unit_features,
)
from service.training.per_example_gradients import PerExampleGradients
from service.training.stages import LedgerTask, Stage, StageRelease

SUM_SENSITIVITY: Final = 1.0
"""L2 sensitivity of the C×K matrix of per-class sums of unit features under add/remove-one."""
_RESOLUTION: Final = Decimal("0.0001")  # the σ grid, as accountant.calibration's default
MAX_STEPS_PER_STAGE: Final = 1_000_000

ModelState = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Calibration and the mechanisms
# ---------------------------------------------------------------------------------------------


def single_charge_epsilon(event: DpEvent, *, delta: float, accountant: str) -> Decimal:
    """The ε the ledger charges ``event`` as one charge on its own at ``delta`` — what a
    ``parallel`` batch pays (``accountant.calibration.single_charge_price``)."""
    return single_charge_price(delta=delta, accountant=accountant)(event)


def calibrate_to_ledger(
    make_event: Callable[[float], DpEvent],
    *,
    start: float,
    target_epsilon: float,
    price: Callable[[DpEvent], Decimal],
) -> float:
    """The smallest σ = k·10⁻⁴ with ``price(make_event(σ)) ≤ target_epsilon`` — ``price``: what
    the ledger charges (``accountant.calibration.single_charge_price`` for a parallel batch) —
    searching from the accountant's own σ (``accountant.calibration.calibrate_to_price``)."""
    try:
        return calibrate_to_price(
            make_event,
            start=start,
            target_epsilon=target_epsilon,
            price=price,
            resolution=float(_RESOLUTION),
        )
    except InvalidArgumentError as exc:
        raise TrainingError(exc.message) from None


def gaussian_noise_multiplier(*, target_epsilon: float, delta: float, accountant: str = "rdp") -> float:
    """The smallest σ (grid 10⁻⁴) whose ``GaussianEvent(σ)`` the ledger charges ≤ ``target_epsilon``.

    Starts from ``calibrate_noise_multiplier`` at q = 1 and one step (a Poisson sample of
    probability 1 is the whole dataset: the accountants treat that event as the Gaussian
    itself), then meets the ledger's own price (``calibrate_to_ledger``)."""
    start = calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        delta=delta,
        sampling_probability=1.0,
        steps=1,
        accountant=accountant,
    )
    return calibrate_to_ledger(
        GaussianEvent,
        start=start,
        target_epsilon=target_epsilon,
        price=single_charge_price(delta=delta, accountant=accountant),
    )


def _target_delta(p: PretrainedParams) -> float:
    if p.delta is None:
        raise InvalidParamsError(
            "params.delta", "is required with a target epsilon (a job's worker uses the budget's delta)."
        )
    return p.delta


def class_feature_sums(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The C×K matrix of Σ_{y=c} u for every class c (rows of absent classes are zero)."""
    sums = features.new_zeros((num_classes, features.shape[1]))
    return sums.index_add_(0, labels, features)


def noisy_class_sums(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_classes: int,
    noise_multiplier: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Eq. 2: the class sums of unit features plus N(0, (σΔ)²) on every entry of all C rows."""
    norms = torch.linalg.vector_norm(features, dim=1)
    if features.shape[0] and not torch.allclose(norms, torch.ones_like(norms), atol=1e-4):
        raise TrainingError("class sums need unit-norm features: the sensitivity bound assumes it.")
    sums = class_feature_sums(features, labels, num_classes)
    noise = torch.randn(sums.shape, generator=generator, device=sums.device, dtype=sums.dtype)
    return sums + noise * (noise_multiplier * SUM_SENSITIVITY)


def cosine_predict(sums: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Eq. 3: argmax_c cos(u, s_c) (``features`` are unit-norm already)."""
    centroids = sums / torch.linalg.vector_norm(sums, dim=1, keepdim=True).clamp_min(1e-12)
    predicted: torch.Tensor = (features @ centroids.T).argmax(1)
    return predicted


@dataclass(frozen=True, slots=True)
class HeadRun:
    """One DP-SGD run of a head: sampling probability, noise multiplier, steps, record count."""

    sampling_probability: float
    noise_multiplier: float
    steps: int
    n_records: int

    @property
    def event(self) -> DpEvent:
        return dp_sgd_event(
            sampling_probability=self.sampling_probability,
            noise_multiplier=self.noise_multiplier,
            steps=self.steps,
        )


def plan_head_run(p: HeadParams, n_records: int) -> HeadRun:
    """q = min(1, B/N), T = ⌈epochs/q⌉, σ calibrated to the target (or given)."""
    q = min(1.0, p.expected_batch_size / n_records)
    steps = max(1, math.ceil(p.epochs / q))
    if steps > MAX_STEPS_PER_STAGE:
        raise InvalidParamsError("params.epochs", f"give {steps} steps, more than {MAX_STEPS_PER_STAGE}.")
    if p.noise_multiplier is not None:
        sigma = p.noise_multiplier
    elif p.target_epsilon is not None:  # the stage's run's own ε (tight engine), as DP-SGD's target
        sigma = calibrate_noise_multiplier(
            target_epsilon=p.target_epsilon,
            delta=_target_delta(p),
            sampling_probability=q,
            steps=steps,
            accountant=TIGHT_ACCOUNTANT,
        )
    else:
        assert p.target_budget_epsilon is not None
        delta = _target_delta(p)
        start = calibrate_noise_multiplier(
            target_epsilon=p.target_budget_epsilon,
            delta=delta,
            sampling_probability=q,
            steps=steps,
            accountant=p.accountant,
        )
        sigma = calibrate_to_ledger(
            lambda s: dp_sgd_event(sampling_probability=q, noise_multiplier=s, steps=steps),
            start=start,
            target_epsilon=p.target_budget_epsilon,
            price=single_charge_price(delta=delta, accountant=p.accountant),
        )
    return HeadRun(q, sigma, steps, n_records)


def train_head_dp_sgd(
    head: nn.Linear,
    features: torch.Tensor,
    labels: torch.Tensor,
    run: HeadRun,
    p: HeadParams,
    *,
    sampler: torch.Generator,
    noise: torch.Generator,
) -> None:
    """DP-SGD (``service.training.dp_sgd``'s steps) on a linear head over frozen features, in place.

    Each step: a Poisson sample of probability q, per-example gradients, each clipped to C,
    summed, plus N(0, σ²C²), divided by q·N; then SGD (with optional heavy-ball momentum)."""
    if features.shape[0] != run.n_records:
        raise TrainingError(
            f"the run was planned for {run.n_records} records; the stage holds {features.shape[0]}."
        )
    grad_fn = PerExampleGradients(head, head.out_features)
    params = {name: t.detach() for name, t in head.named_parameters()}
    weights = list(params.values())
    update, update_views = flat_buffer(weights)
    buffers: list[torch.Tensor] | None = None
    expected = run.sampling_probability * run.n_records
    for _ in range(run.steps):
        idx = poisson_sample(run.n_records, run.sampling_probability, sampler).to(features.device)
        # An empty Poisson sample is still a step: the update is then noise only.
        noisy_mean_gradient_flat(
            grad_fn.flat(params, features[idx], labels[idx]),
            max_grad_norm=p.max_grad_norm,
            noise_multiplier=run.noise_multiplier,
            expected_batch_size=expected,
            generator=noise,
            out=update,
        )
        updates = update_views
        with torch.no_grad():
            if p.momentum > 0:
                if buffers is None:
                    buffers = [u.clone() for u in updates]
                else:
                    torch._foreach_mul_(buffers, p.momentum)
                    torch._foreach_add_(buffers, updates)
                updates = buffers
            torch._foreach_add_(weights, updates, alpha=-p.learning_rate)


def new_head(feature_dim: int, num_classes: int, device: torch.device) -> nn.Linear:
    """A zero-initialised linear head K → C (App. C: the last layer's weights start at zero)."""
    head = nn.Linear(feature_dim, num_classes).to(device)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    return head


# ---------------------------------------------------------------------------------------------
# Shared trainer machinery
# ---------------------------------------------------------------------------------------------


@dataclass
class PretrainedState:
    """What a run keeps between stages (never leaves the worker but through releases)."""

    params: PretrainedParams
    extractor: FeatureExtractor
    num_classes: int
    seed: int
    test: list[tuple[int, torch.Tensor, torch.Tensor]]  # (source task, unit features, labels)
    seen: list[int] = field(default_factory=list)  # source tasks in the order stages learned them
    history: list[dict[int, float]] = field(default_factory=list)  # a_{k,·} after each stage
    sums: torch.Tensor | None = None  # cosine classifier
    heads: list[nn.Linear] = field(default_factory=list)  # PEFT ensemble / naive / full data


def _stage_generators(seed: int, stage: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    sampler_seed, noise_seed = np.random.SeedSequence([seed, stage]).generate_state(2, dtype=np.uint64)
    sampler = torch.Generator(device="cpu")
    sampler.manual_seed(int(sampler_seed))
    noise = torch.Generator(device=device)
    noise.manual_seed(int(noise_seed))
    return sampler, noise


class _PretrainedTrainer:
    """A staged trainer on a frozen public extractor (subclasses: the four algorithms)."""

    algorithm: ClassVar[str]
    params_type: ClassVar[type[PretrainedParams]] = PretrainedParams

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()

    def parse_params(self, params: Mapping[str, Any]) -> PretrainedParams:
        if isinstance(params, self.params_type):
            return params
        return self.params_type.from_params(params)

    def stages(self, params: PretrainedParams, tasks: Sequence[LedgerTask]) -> list[Stage]:
        raise NotImplementedError

    def start(
        self, params: PretrainedParams, data: LoadedData, tasks: Sequence[LedgerTask]
    ) -> PretrainedState:
        if not data.public or not len(data.public[0]):
            raise TrainingError(
                f"{data.uri}: the pre-trained extractor needs a public split (e.g. "
                "builtin:split-digits?tasks=5&public=400); this source declares none."
            )
        if data.image_shape is None:
            raise TrainingError(f"{data.uri}: the extractor needs image-shaped features.")
        num_classes = params.num_classes if params.num_classes is not None else data.num_classes
        if num_classes < data.num_classes:
            raise InvalidParamsError(
                "params.num_classes",
                f"must cover the data's {data.num_classes} classes. Found {num_classes}.",
            )
        extractor = pretrained_extractor(
            data.public[0],
            image_shape=data.image_shape,
            num_classes=data.num_classes,
            spec=params.extractor,
            device=self.device,
        )
        test = [
            (
                split.task,
                self._features(extractor, split.features),
                torch.from_numpy(split.labels).to(self.device),
            )
            for split in data.test
        ]
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        return PretrainedState(params, extractor, num_classes, seed, test)

    def _features(self, extractor: FeatureExtractor, x: np.ndarray[Any, Any]) -> torch.Tensor:
        return unit_features(extractor, torch.from_numpy(np.ascontiguousarray(x)).to(self.device))

    def _stage_data(
        self, state: PretrainedState, data: LoadedData
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The stage's records as unit features, their labels, and the source tasks they hold."""
        x, y = data.train_arrays()
        features = self._features(state.extractor, x)
        labels = torch.from_numpy(y).to(self.device)
        if labels.numel() and int(labels.max()) >= state.num_classes:
            raise TrainingError(f"a label is >= num_classes={state.num_classes}.")
        return features, labels, [split.task for split in data.train if len(split)]

    def _release(
        self,
        state: PretrainedState,
        predict: Callable[[torch.Tensor], torch.Tensor],
        model_state: ModelState,
        extra: Mapping[str, Any],
    ) -> StageRelease:
        """Evaluate ``predict`` on every public test split and package the release."""
        accuracy = {
            task: float((predict(features) == labels).float().mean().item()) if labels.numel() else 0.0
            for task, features, labels in state.test
        }
        state.history.append(accuracy)
        metrics: dict[str, Any] = {
            "task_accuracy": {str(task): acc for task, acc in accuracy.items()},
            "seen_tasks": list(state.seen),
        }
        seen = [t for t in state.seen if t in accuracy]
        if seen:
            metrics["average_accuracy"] = sum(accuracy[t] for t in seen) / len(seen)
            metrics["test_accuracy"] = metrics["average_accuracy"]
        forgetting = _average_forgetting(state)
        if forgetting is not None:
            metrics["average_forgetting"] = forgetting
        metrics.update(extra)
        extractor_state = {
            f"extractor.{k}": v.detach().to("cpu", copy=True) for k, v in state.extractor.state_dict().items()
        }
        return StageRelease({**extractor_state, **model_state}, metrics)


def _average_forgetting(state: PretrainedState) -> float | None:
    """F_t (Eq. A6): mean over earlier tasks i of max_k (a_{k,i} − a_{t,i}), k over the releases
    from the one that learned task i to the previous one (Eq. A5); ``None`` before two tasks."""
    if len(state.seen) < 2 or len(state.history) != len(state.seen):
        return None
    now = state.history[-1]
    values = []
    for learned_at, task in enumerate(state.seen[:-1]):
        if task not in now:
            continue
        best = max(state.history[k][task] for k in range(learned_at, len(state.history) - 1))
        values.append(best - now[task])
    return sum(values) / len(values) if values else None


def _one_task(stage_tasks: list[int], stage: Stage) -> int:
    if len(stage_tasks) != 1:
        raise TrainingError(f"stage {stage.name!r} should read one task; it holds tasks {stage_tasks}.")
    return stage_tasks[0]


# ---------------------------------------------------------------------------------------------
# The algorithms
# ---------------------------------------------------------------------------------------------


class CosineClassifierTrainer(_PretrainedTrainer):
    """Alg. A4: noisy per-class sums of unit features, all classes every task (module docstring)."""

    algorithm: ClassVar[str] = "cosine_classifier"

    def noise_multiplier(self, p: PretrainedParams) -> float:
        if p.noise_multiplier is not None:
            return p.noise_multiplier
        if p.target_epsilon is not None:  # the release's own ε, tight engine (Δ = 1: σ is the event's)
            return SUM_SENSITIVITY * calibrate_to_epsilon(
                GaussianEvent, target_epsilon=p.target_epsilon, delta=_target_delta(p)
            )
        assert p.target_budget_epsilon is not None
        return gaussian_noise_multiplier(
            target_epsilon=p.target_budget_epsilon, delta=_target_delta(p), accountant=p.accountant
        )

    def stages(self, params: PretrainedParams, tasks: Sequence[LedgerTask]) -> list[Stage]:
        event = GaussianEvent(self.noise_multiplier(params) / SUM_SENSITIVITY)
        return [
            Stage(i + 1, f"task {task.name}", task.batch_ids, event, info={"task": task.index})
            for i, task in enumerate(tasks)
        ]

    def train_stage(
        self, state: PretrainedState, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        assert isinstance(stage.event, GaussianEvent)
        features, labels, stage_tasks = self._stage_data(state, data)
        state.seen.append(_one_task(stage_tasks, stage))
        _, noise = _stage_generators(state.seed, stage.index, self.device)
        released = noisy_class_sums(
            features,
            labels,
            num_classes=state.num_classes,
            noise_multiplier=stage.event.noise_multiplier * SUM_SENSITIVITY,
            generator=noise,
        )
        state.sums = released if state.sums is None else state.sums + released  # Alg. A4, line 9
        sums = state.sums
        return self._release(
            state,
            lambda u: cosine_predict(sums, u),
            {"class_sums": sums.detach().to("cpu", copy=True)},
            {"noise_multiplier": stage.event.noise_multiplier, "sum_sensitivity": SUM_SENSITIVITY},
        )


class _HeadTrainer(_PretrainedTrainer):
    """DP-SGD heads on frozen features; subclasses say which records a stage reads and which
    heads a release holds."""

    params_type: ClassVar[type[PretrainedParams]] = HeadParams

    def _stage_batches(self, tasks: Sequence[LedgerTask], i: int) -> tuple[tuple[str, ...], int]:
        """Stage i+1's batches and their record count: task i only (ensemble, naive)."""
        return tasks[i].batch_ids, tasks[i].size

    def stages(self, params: PretrainedParams, tasks: Sequence[LedgerTask]) -> list[Stage]:
        assert isinstance(params, HeadParams)
        out = []
        for i, task in enumerate(tasks):
            batch_ids, n = self._stage_batches(tasks, i)
            run = plan_head_run(params, n)
            info = {
                "task": task.index,
                "sampling_probability": run.sampling_probability,
                "noise_multiplier": run.noise_multiplier,
                "steps": run.steps,
                "n_records": n,
            }
            out.append(Stage(i + 1, f"task {task.name}", batch_ids, run.event, info=info))
        return out

    def _train(
        self,
        state: PretrainedState,
        stage: Stage,
        head: nn.Linear,
        features: torch.Tensor,
        labels: torch.Tensor,
    ) -> None:
        p = state.params
        assert isinstance(p, HeadParams)
        info = stage.info
        run = HeadRun(
            info["sampling_probability"], info["noise_multiplier"], info["steps"], info["n_records"]
        )
        if run.event != stage.event:
            raise TrainingError(f"stage {stage.name!r}: its info does not match its event.")
        sampler, noise = _stage_generators(state.seed, stage.index, self.device)
        train_head_dp_sgd(head, features, labels, run, p, sampler=sampler, noise=noise)

    @staticmethod
    def _heads_state(heads: Sequence[nn.Linear]) -> ModelState:
        return {
            "heads.weight": torch.stack([h.weight.detach().to("cpu") for h in heads]),
            "heads.bias": torch.stack([h.bias.detach().to("cpu") for h in heads]),
        }


def max_logit_predict(heads: Sequence[nn.Linear], features: torch.Tensor) -> torch.Tensor:
    """Eq. 4: the class of the largest logit over all heads, argmax_{t,c} g_φt(u)_c."""
    with torch.no_grad():
        logits = torch.stack([h(features) for h in heads])  # (heads, n, C)
        return logits.max(dim=0).values.argmax(dim=1)


class PeftEnsembleTrainer(_HeadTrainer):
    """Alg. A5: a new head per task, trained with DP-SGD on that task; predict by Eq. 4."""

    algorithm: ClassVar[str] = "peft_ensemble"

    def train_stage(
        self, state: PretrainedState, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        features, labels, stage_tasks = self._stage_data(state, data)
        state.seen.append(_one_task(stage_tasks, stage))
        head = new_head(state.extractor.feature_dim, state.num_classes, self.device)
        self._train(state, stage, head, features, labels)
        state.heads.append(head)
        heads = list(state.heads)
        return self._release(state, lambda u: max_logit_predict(heads, u), self._heads_state(heads), {})


class PeftNaiveTrainer(_HeadTrainer):
    """Alg. A3 (lower baseline): one head, trained further on each task in turn."""

    algorithm: ClassVar[str] = "peft_naive"

    def train_stage(
        self, state: PretrainedState, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        features, labels, stage_tasks = self._stage_data(state, data)
        state.seen.append(_one_task(stage_tasks, stage))
        if not state.heads:
            state.heads.append(new_head(state.extractor.feature_dim, state.num_classes, self.device))
        head = state.heads[0]
        self._train(state, stage, head, features, labels)
        return self._release(state, lambda u: max_logit_predict([head], u), self._heads_state([head]), {})


class PeftFullDataTrainer(_HeadTrainer):
    """Alg. A2 (upper baseline): a fresh head on tasks 1..t at stage t — re-reads old tasks, so
    it needs a ``sequential`` dataset."""

    algorithm: ClassVar[str] = "peft_full_data"

    def _stage_batches(self, tasks: Sequence[LedgerTask], i: int) -> tuple[tuple[str, ...], int]:
        return tuple(b for task in tasks[: i + 1] for b in task.batch_ids), sum(
            t.size for t in tasks[: i + 1]
        )

    def train_stage(
        self, state: PretrainedState, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        features, labels, stage_tasks = self._stage_data(state, data)
        new = [t for t in stage_tasks if t not in state.seen]
        if len(new) != 1 or len(stage_tasks) != len(state.seen) + 1:
            raise TrainingError(
                f"stage {stage.name!r} should read every task so far plus one; it holds {stage_tasks}."
            )
        state.seen.append(new[0])
        head = new_head(state.extractor.feature_dim, state.num_classes, self.device)
        self._train(state, stage, head, features, labels)
        state.heads = [head]
        return self._release(state, lambda u: max_logit_predict([head], u), self._heads_state([head]), {})


__all__ = [
    "SUM_SENSITIVITY",
    "CosineClassifierTrainer",
    "HeadParams",
    "HeadRun",
    "PeftEnsembleTrainer",
    "PeftFullDataTrainer",
    "PeftNaiveTrainer",
    "PretrainedParams",
    "class_feature_sums",
    "cosine_predict",
    "gaussian_noise_multiplier",
    "max_logit_predict",
    "noisy_class_sums",
    "plan_head_run",
    "train_head_dp_sgd",
]
