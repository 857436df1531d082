"""The baselines of the lifelong experiment, next to L2DP-ML (``service.training.l2dp_ml``):

* **NaiveGaussian** (DP-SGD + A-gem): Gaussian noise on the task gradient g and on the memory
  gradient g_ref, Poisson sampling; every stage is a charge composed sequentially (the first
  task's memory batch reads every stage). One σ for all stages, calibrated so that the whole
  run — every stage composed — has its own ε at δ by the tight accountant at most
  ``target_epsilon`` (``calibrate_run_noise``: what Opacus users mean, for the record read most),
  or so that all stages fit a ``sequential`` budget's Rényi filter of ``target_budget_epsilon``
  (``calibrate_sequential_noise``).
* **A-gem without noise**, run outside the ledger (``train_noiseless_agem``): no finite ε; its
  episodic memory keeps ``memory_per_task`` batches of every learnt task (1: the paper's).
* **Joint training**, outside the ledger (``train_joint``): the same MLP trained on every task's
  records at once, no privacy and no sequence — the ceiling of every lifelong table (issue 27 §2).

Both share the task plan and the per-task records of L2DP-ML (``service.training.lifelong_tasks``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

from accountant.calibration import calibrate_to_epsilon
from accountant.events import ComposedEvent, DpEvent
from service.contract.job_params import (
    InvalidParamsError,
    NaiveGaussianParams,
)
from service.training.agem import (
    agem_project,
    flatten,
    unflatten,
)
from service.training.data import LoadedData
from service.training.dp_sgd import (
    default_device,
    dp_sgd_event,
    noisy_mean_gradient_flat,
    poisson_sample,
)
from service.training.lifelong_tasks import LifelongRecord, Plan, make_plan
from service.training.nets import MLP
from service.training.per_example_gradients import PerExampleGradients
from service.training.stages import LedgerTask, Stage, StageRelease

# ---------------------------------------------------------------------------------------------
# NaiveGaussian (DP-SGD + A-gem) and the noiseless A-gem baseline
# ---------------------------------------------------------------------------------------------


def naive_steps(epochs: int, sampling_probability: float) -> int:
    """T = ⌈epochs/q⌉ Poisson-sampled steps."""
    return max(1, math.ceil(epochs / sampling_probability - 1e-9))


def naive_run_event(*, sampling_probability: float, noise_multiplier: float, steps: Sequence[int]) -> DpEvent:
    """The whole run as one record of the first task's memory batch meets it: every stage's
    DP-SGD run, composed."""
    return ComposedEvent(
        tuple(
            dp_sgd_event(
                sampling_probability=sampling_probability, noise_multiplier=noise_multiplier, steps=t
            )
            for t in steps
        )
    )


def calibrate_run_noise(
    *, target_epsilon: float, delta: float, sampling_probability: float, steps: Sequence[int]
) -> float:
    """The smallest σ (grid 10⁻⁴) whose whole run (``naive_run_event``) has its own ε at ``delta``
    by the tight accountant at most ``target_epsilon`` (``accountant.calibration.calibrate_to_epsilon``)."""
    return calibrate_to_epsilon(
        lambda sigma: naive_run_event(
            sampling_probability=sampling_probability, noise_multiplier=sigma, steps=steps
        ),
        target_epsilon=target_epsilon,
        delta=delta,
    )


def calibrate_sequential_noise(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: Sequence[int],
    admits: Callable[[Sequence[DpEvent]], bool] | None = None,
) -> float:
    """The smallest σ (grid 10⁻⁴, ``accountant.calibration.smallest_noise``) whose stages, all
    charged to one batch (the first task's memory batch reads every stage), the ledger admits:
    ``admits`` (default: the Rényi filter of a ``sequential``/``rdp`` budget (ε, δ) with its
    placed grid, ``accountant.calibration.filter_admission``): the ledger's admission test."""
    from accountant.calibration import filter_admission, smallest_noise
    from accountant.errors import InvalidArgumentError

    if admits is None:
        admits = filter_admission(rule="sequential", epsilon=target_epsilon, delta=delta)

    def fits(sigma: float) -> bool:
        return admits(
            [
                dp_sgd_event(sampling_probability=sampling_probability, noise_multiplier=sigma, steps=t)
                for t in steps
            ]
        )

    try:
        return smallest_noise(fits)
    except InvalidArgumentError:
        raise InvalidParamsError(
            "params.target_budget_epsilon", f"cannot be reached. Found {target_epsilon}."
        ) from None


@dataclass
class AgemMlp:
    """An MLP trained with A-gem: ``gradient(x, y)`` gives g (noisy or exact); the projection and
    the SGD step are shared."""

    model: nn.Module
    params: dict[str, torch.Tensor]
    learning_rate: float

    @classmethod
    def build(
        cls,
        n_features: int,
        hidden: int,
        num_classes: int,
        seed: int,
        learning_rate: float,
        device: torch.device,
    ) -> AgemMlp:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(np.random.SeedSequence([seed, 1]).generate_state(1)[0]))
            model = MLP(n_features, (hidden,), num_classes)
        model = model.to(device)
        return cls(model, {n: q.detach() for n, q in model.named_parameters()}, learning_rate)

    def step(self, g: torch.Tensor, g_ref: torch.Tensor | None) -> None:
        if g_ref is not None:
            g = agem_project(g, g_ref)
        values = list(self.params.values())
        for tensor, update in zip(values, unflatten(g, values), strict=True):
            tensor.sub_(self.learning_rate * update)

    def scores(self, features: np.ndarray) -> np.ndarray:
        """The logits of each row of ``features``."""
        x = torch.from_numpy(features.astype(np.float32)).to(next(iter(self.params.values())).device)
        with torch.no_grad():
            logits = functional_call(self.model, self.params, (x,))
        out: np.ndarray = logits.cpu().numpy()
        return out

    def predict(self, features: np.ndarray) -> np.ndarray:
        predicted: np.ndarray = self.scores(features).argmax(axis=1)
        return predicted

    def model_state(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().to("cpu", copy=True) for name, value in self.params.items()}


@dataclass
class NaiveGaussianState:
    params: NaiveGaussianParams
    plan: Plan
    noise_multiplier: float
    learner: AgemMlp
    grad_fn: PerExampleGradients
    record: LifelongRecord
    sampler: torch.Generator
    noise: torch.Generator
    heads: LifelongRecord  # the same network read task-aware (multi-head evaluation)
    position: int = 0


class NaiveGaussianTrainer:
    """NaiveGaussian: DP-SGD + A-gem with Gaussian-noised g and g_ref, charged sequentially."""

    algorithm: ClassVar[str] = "naive_gaussian"

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self._sigma: dict[tuple[Any, ...], float] = {}

    def parse_params(self, params: Mapping[str, Any]) -> NaiveGaussianParams:
        return NaiveGaussianParams.read(params)

    def _noise_multiplier(self, p: NaiveGaussianParams, plan: Plan) -> float:
        if p.noise_multiplier is not None:
            return p.noise_multiplier
        if p.delta is None:
            raise InvalidParamsError(
                "params.delta", "is required with a target epsilon (a job's worker uses the budget's delta)."
            )
        steps = tuple(naive_steps(e, p.sampling_probability) for e in plan.epochs)
        own = p.target_epsilon is not None
        target = p.target_epsilon if own else p.target_budget_epsilon
        assert target is not None
        key = (own, target, p.delta, p.sampling_probability, steps)
        if key not in self._sigma:
            calibrate = calibrate_run_noise if own else calibrate_sequential_noise
            self._sigma[key] = calibrate(
                target_epsilon=target, delta=p.delta, sampling_probability=p.sampling_probability, steps=steps
            )
        return self._sigma[key]

    def _plan(self, p: NaiveGaussianParams, tasks: Sequence[LedgerTask]) -> Plan:
        return make_plan(tasks, task_order=p.task_order, epochs=p.epochs, seed=p.seed)

    def stages(self, params: NaiveGaussianParams, tasks: Sequence[LedgerTask]) -> list[Stage]:
        plan = self._plan(params, tasks)
        sigma = self._noise_multiplier(params, plan)
        out = []
        for position, task in enumerate(plan.order):
            memory = plan.memory_before(position)
            steps = naive_steps(plan.epochs[position], params.sampling_probability)
            event: DpEvent = dp_sgd_event(
                sampling_probability=params.sampling_probability, noise_multiplier=sigma, steps=steps
            )
            out.append(
                Stage(
                    index=position + 1,
                    name=f"task {task.name}",
                    batch_ids=(*task.batch_ids, *memory),
                    event=event,
                    info={
                        "task": task.index,
                        "epochs": plan.epochs[position],
                        "steps": steps,
                        "noise_multiplier": sigma,
                        "memory_batches": len(memory),
                    },
                )
            )
        return out

    def start(
        self, params: NaiveGaussianParams, data: LoadedData, tasks: Sequence[LedgerTask]
    ) -> NaiveGaussianState:
        num_classes = params.num_classes if params.num_classes is not None else data.num_classes
        plan = self._plan(params, tasks)
        learner = AgemMlp.build(
            data.n_features, params.hidden, num_classes, params.seed, params.learning_rate, self.device
        )
        seeds = np.random.SeedSequence([params.seed, 4]).generate_state(2, dtype=np.uint64)
        sampler = torch.Generator(device="cpu")
        sampler.manual_seed(int(seeds[0]))
        noise = torch.Generator(device=self.device)
        noise.manual_seed(int(seeds[1]))
        return NaiveGaussianState(
            params,
            plan,
            self._noise_multiplier(params, plan),
            learner,
            PerExampleGradients(learner.model, num_classes),
            LifelongRecord.of(data),
            sampler,
            noise,
            LifelongRecord.of(data),
        )

    def _noisy_gradient(self, state: NaiveGaussianState, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = state.params
        idx = poisson_sample(x.shape[0], p.sampling_probability, state.sampler).to(x.device)
        # Flat, in the learner's parameter order; an empty Poisson sample gives noise only.
        return noisy_mean_gradient_flat(
            state.grad_fn.flat(state.learner.params, x[idx], y[idx]),
            max_grad_norm=p.max_grad_norm,
            noise_multiplier=state.noise_multiplier,
            expected_batch_size=p.sampling_probability * x.shape[0],
            generator=state.noise,
        )

    def train_stage(
        self,
        state: NaiveGaussianState,
        stage: Stage,
        data: LoadedData,
        records: Mapping[str, tuple[str, ...]],
    ) -> StageRelease:
        position = state.position
        task = state.plan.order[position]
        current_ids = {r for b in task.batch_ids for r in records[b]}
        memory_ids = {r for b in state.plan.memory_before(position) for r in records[b]}
        features, labels = data.train_arrays()
        ids = data.record_ids
        cur = np.asarray([r in current_ids for r in ids])
        mem = np.asarray([r in memory_ids for r in ids])
        x = torch.from_numpy(features).to(self.device)
        y = torch.from_numpy(labels).to(self.device)
        x_cur, y_cur = x[torch.from_numpy(cur).to(self.device)], y[torch.from_numpy(cur).to(self.device)]
        x_mem, y_mem = x[torch.from_numpy(mem).to(self.device)], y[torch.from_numpy(mem).to(self.device)]
        steps = naive_steps(state.plan.epochs[position], state.params.sampling_probability)
        for _ in range(steps):
            g = self._noisy_gradient(state, x_cur, y_cur)
            g_ref = self._noisy_gradient(state, x_mem, y_mem) if x_mem.shape[0] else None
            state.learner.step(g, g_ref)
        state.heads.seen.append(state.record.learnt(data, sorted(current_ids)))
        state.position += 1
        metrics = state.record.evaluate(state.learner.predict)
        metrics.update(_multi_head_metrics(state.heads, state.learner))
        metrics["epochs"] = state.plan.epochs[position]
        return StageRelease(state.learner.model_state(), metrics)


def _multi_head_metrics(heads: LifelongRecord, learner: AgemMlp) -> dict[str, Any]:
    """The network's metrics read task-aware (each task's argmax among its own classes): the
    multi-head (task-incremental) numbers, beside the shared-head ones."""
    evaluated = heads.evaluate_heads(learner.scores)
    out = {"multi_head_average_accuracy": evaluated["average_accuracy"]}
    if "average_forgetting" in evaluated:
        out["multi_head_average_forgetting"] = evaluated["average_forgetting"]
    return out


def train_noiseless_agem(
    data: LoadedData,
    *,
    task_order: Sequence[int],
    batch_size: int,
    epochs: Sequence[int],
    hidden: int = 32,
    learning_rate: float = 0.5,
    seed: int = 0,
    memory_per_task: int = 1,
    device: str | torch.device | None = None,
) -> list[dict[str, Any]]:
    """Non-private A-gem (Chaudhry et al. 2019) on the same fixed batches: exact mean gradients,
    ``memory_per_task`` random batches of each task join the memory (g_ref is the gradient on one
    memory batch drawn at random). Returns each task's metrics (``LifelongRecord``), shared-head
    and task-aware (``multi_head_*``). Not a job: it has no finite ε."""
    dev = torch.device(device) if device is not None else default_device()
    splits = {s.task: s for s in data.train}
    learner = AgemMlp.build(data.n_features, hidden, data.num_classes, seed, learning_rate, dev)

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(learner.model, params, (x,)), y)

    gradient = grad(loss)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 5]))
    record = LifelongRecord.of(data)
    heads = LifelongRecord.of(data)
    memory: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = []
    for position, task in enumerate(task_order):
        split = splits[task]
        batches = []
        for start in range(0, len(split), batch_size):
            x = torch.from_numpy(split.features[start : start + batch_size]).to(dev)
            y = torch.from_numpy(split.labels[start : start + batch_size]).to(dev)
            batches.append((x, y))
        for _ in range(epochs[position]):
            for i in rng.permutation(len(batches)):
                x, y = batches[int(i)]
                g_dict = gradient(learner.params, x, y)
                g = flatten([g_dict[n] for n in learner.params])
                g_ref = None
                if memory:
                    xm, ym = memory[int(rng.integers(len(memory)))]
                    r_dict = gradient(learner.params, xm, ym)
                    g_ref = flatten([r_dict[n] for n in learner.params])
                learner.step(g, g_ref)
        kept = rng.choice(len(batches), min(memory_per_task, len(batches)), replace=False)
        memory.extend(batches[int(i)] for i in kept)
        record.seen.append(task)
        heads.seen.append(task)
        metrics = record.evaluate(learner.predict)
        metrics.update(_multi_head_metrics(heads, learner))
        out.append(metrics)
    return out


def train_joint(
    data: LoadedData,
    *,
    epochs: int,
    batch_size: int = 64,
    hidden: int = 32,
    learning_rate: float = 0.5,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Joint training, the ceiling (module docstring): the MLP of A-gem trained by mini-batch SGD
    on all tasks' records shuffled together; its accuracy on each task's test split and their mean
    (the average accuracy after the last task). Not a job: no finite ε, no sequence."""
    dev = torch.device(device) if device is not None else default_device()
    learner = AgemMlp.build(data.n_features, hidden, data.num_classes, seed, learning_rate, dev)
    features, labels = data.train_arrays()
    x = torch.from_numpy(features).to(dev)
    y = torch.from_numpy(labels).to(dev)

    def loss(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(learner.model, params, (xb,)), yb)

    gradient = grad(loss)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 6]))
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(x.shape[0])).to(dev)
        for start in range(0, x.shape[0], batch_size):
            idx = order[start : start + batch_size]
            g = gradient(learner.params, x[idx], y[idx])
            learner.step(flatten([g[n] for n in learner.params]), None)
    accuracies = [
        float(np.mean(learner.predict(split.features) == split.labels)) for split in data.test if len(split)
    ]
    return {"average_accuracy": float(np.mean(accuracies)), "accuracies": accuracies}


__all__ = [
    "AgemMlp",
    "NaiveGaussianParams",
    "NaiveGaussianTrainer",
    "calibrate_sequential_noise",
    "naive_steps",
    "train_joint",
    "train_noiseless_agem",
]
