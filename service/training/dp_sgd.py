"""DP-SGD with true Poisson sampling and ``torch.func`` per-example gradients.

The algorithm is Abadi et al. (2016), as Alg. A1 of the DP continual-learning paper
(``dp-continual-learning-pretrained.txt``) states it, with two deliberate differences:

* **Poisson sampling, for real.** Every step includes each record independently with probability
  q, so the batch size varies, and an empty batch is still a step (the update is noise only). Only
  then is the run the mechanism ``PoissonSampled(q, Gaussian(σ))`` the accountant charges —
  shuffled fixed-size batches would be a different mechanism (docs/ARCHITECTURE.md, "The DP-SGD
  step"; issue 4).
* **Normalise by the expected batch size q·N**, not by the drawn size |Lₜ| as Alg. A1's line 8
  does: |Lₜ| depends on the data, so dividing by it would leak outside the Gaussian mechanism
  (add/remove-one neighbours change it by one). q·N is public.

One step: per-example gradients by ``torch.func`` (``functional_call`` + ``vmap`` + ``grad``),
each clipped to L2 norm C, summed, plus Gaussian noise of standard deviation σC on every
coordinate, divided by q·N, then an SGD (optionally momentum) update. Learning rate and momentum
are post-processing and cost nothing.

Accounting. A run of T steps is the event
``SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(σ)), T)``. ``DpSgdTrainer.plan`` builds
it from the job params and the record count alone — before any data is read — so the worker can
reserve the whole run first. ``target_epsilon`` (ε at δ) is turned into σ by
``accountant.calibration.calibrate_noise_multiplier`` with the tight engine the ledger prices a
run alone with (``TIGHT_ACCOUNTANT``): the smallest σ on its grid whose run has its own ε upper
bound ≤ the target, as Opacus's ``get_noise_multiplier(accountant="prv")`` means it (its PRV
bound is looser: up to 2% more noise). ``target_budget_epsilon`` instead searches
σ against what the dataset charges (``price``: the gate's quote). ``train`` calls
``on_checkpoint(step, model_state, event_so_far)`` every ``checkpoint_every`` steps and at the
end, where ``event_so_far`` has ``count = step``: the caller commits that cost to the ledger and
publishes the version only when the commit succeeds; returning ``False`` (a refused commit) stops
training.

Randomness. ``seed`` makes a run reproducible (tests, benchmarks). It seeds model initialisation,
the Poisson sampling and the noise. The privacy guarantee assumes the sampling and the noise are
unknown to an adversary: anyone who knows the seed can regenerate them. A job without a ``seed``
draws one from ``secrets`` and never reports it; a production job should not set one. torch's
generators are not cryptographically secure (Opacus's ``secure_mode`` addresses that with
torchcsprng); this is the usual trade-off of research DP-SGD implementations.

Device: CUDA when available, else CPU (``default_device``).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from accountant.events import DpEvent, GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from accountant.events import to_json as event_to_json
from service.contract.job_params import (  # noqa: F401  (re-exported: declared in the torch-free module)
    ACCOUNTANTS,
    MAX_STEPS,
    DpSgdParams,
    InvalidParamsError,
    JobParams,
    ModelSpec,
)
from service.training.data import LoadedData
from service.training.distributed import SOLO, Ranks
from service.training.nets import build_model
from service.training.per_example_gradients import PerExampleGradients

ModelState = dict[str, torch.Tensor]
Params = dict[str, torch.Tensor]
CheckpointCallback = Callable[[int, ModelState, DpEvent], bool]
StopCallback = Callable[[], bool]
TraceCallback = Callable[[int, dict[str, float]], None]
TRACE_POINTS = 50
"""How many evaluations of the iterate ``train`` makes for ``on_trace`` at most (every
``trace_every(steps)`` steps), besides those of the checkpoints."""
Status = Literal["completed", "stopped", "refused"]


class TrainingError(RuntimeError):
    """Training cannot proceed (the data does not fit the plan, a privacy check failed, ...)."""


def default_device() -> torch.device:
    """``cuda`` when a GPU is available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _never() -> bool:
    return False


def _accept(step: int, model_state: ModelState, event: DpEvent) -> bool:
    return True


def trace_every(steps: int) -> int:
    """The step interval of ``on_trace``: at most ``TRACE_POINTS`` evaluations in a run."""
    return max(1, math.ceil(steps / TRACE_POINTS))


# ---------------------------------------------------------------------------------------------
# The plan (params: service.contract.job_params.DpSgdParams)
# ---------------------------------------------------------------------------------------------


def dp_sgd_event(*, sampling_probability: float, noise_multiplier: float, steps: int) -> DpEvent:
    """``SelfComposed(PoissonSampled(q, Gaussian(σ)), steps)``: T steps of Poisson-sampled DP-SGD."""
    return SelfComposedEvent(
        PoissonSampledEvent(sampling_probability, GaussianEvent(noise_multiplier)), steps
    )


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    """What a run will cost, known before any data is read.

    ``event`` covers all ``steps``; ``event_after(k)`` is the cost of the first k steps (what a
    checkpoint release commits).
    """

    algorithm: str
    event: DpEvent
    steps: int
    noise_multiplier: float
    sampling_probability: float
    n_records: int
    params: DpSgdParams

    @property
    def expected_batch_size(self) -> float:
        """q·N: the public normaliser of the noisy gradient sum."""
        return self.sampling_probability * self.n_records

    def to_json(self) -> dict[str, Any]:
        """JSON for the job row: the event (stable ``kind`` form) and the validated params."""
        return {
            "algorithm": self.algorithm,
            "event": event_to_json(self.event),
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sampling_probability": self.sampling_probability,
            "n_records": self.n_records,
            "params": self.params.to_json(),
        }

    def event_after(self, steps_done: int) -> DpEvent:
        if not 0 <= steps_done <= self.steps:
            raise ValueError(f"steps_done must be in [0, {self.steps}]. Found {steps_done}.")
        return dp_sgd_event(
            sampling_probability=self.sampling_probability,
            noise_multiplier=self.noise_multiplier,
            steps=steps_done,
        )


@dataclass(frozen=True, slots=True)
class TrainingResult:
    """How a run ended.

    ``status``: ``completed`` (all steps, final checkpoint accepted), ``stopped`` (``should_stop``
    said so), ``refused`` (``on_checkpoint`` returned ``False``). ``steps``: steps done.
    ``event``: the cost of the steps done — what touched the data, released or not.
    ``last_release_step``: the step of the last checkpoint ``on_checkpoint`` accepted (``None``
    if none). ``metrics``: on the held-out test split (``test_accuracy``, ``test_loss``) plus
    ``steps``; never a statistic of the private training records, which would be a release
    outside the mechanism.
    """

    status: Status
    steps: int
    event: DpEvent
    metrics: dict[str, float]
    last_release_step: int | None


# ---------------------------------------------------------------------------------------------
# The private-gradient building blocks (public for tests and the benchmark)
# ---------------------------------------------------------------------------------------------


def per_example_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each example's whole gradient (all parameters together), shape (B,)."""
    per_tensor = [torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()]  # B = 0 too
    norms: torch.Tensor = torch.linalg.vector_norm(torch.stack(per_tensor), dim=0)
    return norms


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """min(1, C/‖g‖): scaling each example's gradient by it bounds its norm by C."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def clipped_sum(grads: Mapping[str, torch.Tensor], factors: torch.Tensor) -> Params:
    """Σᵢ factorᵢ·gᵢ per parameter, without materialising the clipped per-example gradients."""
    return {name: torch.tensordot(factors, g, dims=1) for name, g in grads.items()}


def noisy_mean_gradient_flat(
    per_example: torch.Tensor,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """DP-SGD's released gradient, (Σ clip_C(gᵢ) + N(0, σ²C²I)) / (q·N), from the ``(B, P)``
    matrix of per-example gradients (``PerExampleGradients.flat``); returns ``(P,)``.

    Four ops whatever the model: the per-example norms, the clip factors, the noise z ~ N(0, I)
    drawn in place into ``out`` (a preallocated ``(P,)`` buffer, or a new one), and one
    ``addmv`` that forms (σC·z + Σᵢ factorᵢ·gᵢ)/(q·N) without materialising the clipped
    gradients. B may be 0 (an empty Poisson batch): the result is then noise only.
    """
    factors = clip_factors(torch.linalg.vector_norm(per_example, dim=1), max_grad_norm)
    noise = per_example.new_empty(per_example.shape[1]) if out is None else out
    if noise_multiplier == 0:  # (a rank other than 0 of a distributed run: the sum holds it once)
        noise.zero_()
    else:
        noise.normal_(generator=generator)
    return noise.addmv_(
        per_example.t(),
        factors,
        beta=noise_multiplier * max_grad_norm / expected_batch_size,
        alpha=1.0 / expected_batch_size,
    )


def noisy_mean_gradient_of_ranks(
    per_example: torch.Tensor,
    *,
    ranks: Ranks,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``noisy_mean_gradient_flat`` of a run over ``ranks``: each rank's ``per_example`` rows are
    its shard's sample, clipped there; rank 0 alone adds N(0, σ²C²I); the sum across ranks
    (``all_reduce``) is (Σ clip_C(gᵢ) + N(0, σ²C²I)) / (q·N) over the global sample, on every
    rank (``service.training.distributed``). ``SOLO``: ``noisy_mean_gradient_flat`` itself."""
    released = noisy_mean_gradient_flat(
        per_example,
        max_grad_norm=max_grad_norm,
        noise_multiplier=noise_multiplier if ranks.adds_noise else 0.0,
        expected_batch_size=expected_batch_size,
        generator=generator,
        out=out,
    )
    ranks.sum_(released)
    return released


def gaussian_like(tensors: Mapping[str, torch.Tensor], generator: torch.Generator) -> Params:
    """Standard normal noise shaped like ``tensors``, drawn in one call (fewer small kernels)."""
    first = next(iter(tensors.values()))
    total = sum(t.numel() for t in tensors.values())
    flat = torch.randn(total, generator=generator, device=first.device, dtype=first.dtype)
    out: Params = {}
    offset = 0
    for name, t in tensors.items():
        out[name] = flat[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    return out


def poisson_sample(n_records: int, sampling_probability: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of one Poisson sample: each of ``n_records`` included independently w.p. q."""
    mask = torch.rand(n_records, generator=generator) < sampling_probability
    return mask.nonzero().squeeze(1)


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """The mutable state of one training run (on the trainer's device).

    ``params`` share storage with the model's parameters. ``update`` is one preallocated flat
    buffer the size of all of them and ``update_views`` its views shaped like ``params``: a
    step writes the noisy gradient into it and applies it with one ``_foreach_add_``.
    """

    model: nn.Module
    params: Params
    grad_fn: PerExampleGradients
    features: torch.Tensor
    labels: torch.Tensor
    sampler: torch.Generator
    noise: torch.Generator
    ranks: Ranks = SOLO
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    param_list: list[torch.Tensor] = field(init=False)
    update: torch.Tensor = field(init=False)
    update_views: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.param_list = list(self.params.values())
        self.update, self.update_views = flat_buffer(self.param_list)


def flat_buffer(like: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat zero buffer as large as ``like`` together, and its views shaped like each tensor."""
    flat = like[0].new_zeros(sum(t.numel() for t in like))
    views = torch.split(flat, [t.numel() for t in like])
    return flat, [view.view_as(t) for view, t in zip(views, like, strict=True)]


class DpSgdTrainer:
    """DP-SGD: ``plan`` before reading data, then ``train`` with checkpoint releases."""

    traces_iterates: ClassVar[bool] = True  # train takes on_trace (service.worker.gate)

    algorithm: ClassVar[str] = "dp_sgd"
    params_type: ClassVar[type[DpSgdParams]] = DpSgdParams

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()

    # -- planning ------------------------------------------------------------------------------

    def parse_params(self, params: Mapping[str, Any] | DpSgdParams) -> DpSgdParams:
        if isinstance(params, self.params_type):
            return params
        if isinstance(params, DpSgdParams):
            raise InvalidParamsError(
                "params", f"are {type(params).__name__}, not {self.params_type.__name__}."
            )
        return self.params_type.from_params(params)

    def plan(
        self,
        params: Mapping[str, Any] | DpSgdParams,
        n_records: int,
        price: Callable[[DpEvent], Decimal] | None = None,
    ) -> TrainingPlan:
        """The run's cost from its params and the record count alone; reads no data.

        With ``target_epsilon``, σ is calibrated so that the run's own ε at ``delta`` by the
        tight accountant (PRV upper bound) is at most the target (whether the budget admits it is
        the gate's question). With ``target_budget_epsilon``, so that ``price`` — what the
        dataset's ledger would charge the run (the gate passes a quote on the job's batches) — is
        at most the target; without ``price``, so that the params' ``accountant`` gives at most
        the target."""
        p = self.parse_params(params)
        if isinstance(n_records, bool) or not isinstance(n_records, int) or n_records < 1:
            raise InvalidParamsError("n_records", f"must be an integer >= 1. Found {n_records!r}.")
        if p.sampling_probability is not None:
            q = p.sampling_probability
        else:
            q = min(1.0, (p.expected_batch_size or 64) / n_records)
        if p.steps is not None:
            steps = p.steps
        else:
            steps = max(1, math.ceil((p.epochs if p.epochs is not None else 10.0) / q))
        if steps > MAX_STEPS:
            raise InvalidParamsError("params.epochs", f"give {steps} steps, more than {MAX_STEPS}.")
        if p.world_size > 1 and self.device.type == "cuda" and p.world_size > torch.cuda.device_count():
            raise InvalidParamsError(
                "params.world_size",
                f"asks for {p.world_size} processes, one per GPU; this worker sees "
                f"{torch.cuda.device_count()} GPU(s). Found {p.world_size}.",
            )
        if p.noise_multiplier is not None:
            sigma = p.noise_multiplier
        elif p.delta is None:
            raise InvalidParamsError(
                "params.delta", "is required with a target epsilon (a job's worker uses the budget's delta)."
            )
        elif p.target_epsilon is not None:
            from accountant.calibration import TIGHT_ACCOUNTANT, calibrate_noise_multiplier

            sigma = calibrate_noise_multiplier(
                target_epsilon=p.target_epsilon,
                delta=p.delta,
                sampling_probability=q,
                steps=steps,
                accountant=TIGHT_ACCOUNTANT,
            )
        else:
            assert p.target_budget_epsilon is not None
            sigma = _calibrate(
                target_epsilon=p.target_budget_epsilon,
                delta=p.delta,
                sampling_probability=q,
                steps=steps,
                accountant=p.accountant,
                price=price,
            )
        event = dp_sgd_event(sampling_probability=q, noise_multiplier=sigma, steps=steps)
        return TrainingPlan(self.algorithm, event, steps, sigma, q, n_records, p)

    # -- training ------------------------------------------------------------------------------

    def train(
        self,
        data: LoadedData,
        plan: TrainingPlan,
        *,
        on_checkpoint: CheckpointCallback = _accept,
        should_stop: StopCallback = _never,
        on_trace: TraceCallback | None = None,
    ) -> TrainingResult:
        """Run ``plan`` on ``data``; release through ``on_checkpoint`` (see the module docstring).

        ``on_trace(step, metrics)``: every ``trace_every(plan.steps)`` steps that are not a
        checkpoint, the iterate's ``evaluate`` metrics (held-out test split). They describe
        steps not yet committed: the caller must keep them until a checkpoint at or after
        ``step`` is accepted, and drop them otherwise (``service.worker.gate``). One-process
        runs only (a distributed run traces nothing).

        Trains on every training record of ``data`` (all its tasks; ``LoadedData.restrict``
        selects the reserved batches first). ``on_checkpoint`` defaults to accepting every
        release — right for tests and benchmarks only; the worker passes its commit. The result's
        metrics describe the final in-memory model whether or not it was released.
        """
        if plan.algorithm != self.algorithm:
            raise TrainingError(f"plan is for {plan.algorithm!r}; this trainer runs {self.algorithm!r}.")
        if data.n_records != plan.n_records:
            raise TrainingError(
                f"the plan was made for {plan.n_records} records; the data holds {data.n_records}."
            )
        seed = plan.params.seed if plan.params.seed is not None else secrets.randbits(62)
        if plan.params.world_size > 1:
            from service.training.distributed import train_distributed

            return train_distributed(
                self, data, plan, seed, on_checkpoint=on_checkpoint, should_stop=should_stop
            )
        return self.train_rank(
            data, plan, seed, SOLO, on_checkpoint=on_checkpoint, should_stop=should_stop, on_trace=on_trace
        )

    def train_rank(
        self,
        data: LoadedData,
        plan: TrainingPlan,
        seed: int,
        ranks: Ranks,
        *,
        on_checkpoint: CheckpointCallback = _accept,
        should_stop: StopCallback = _never,
        on_trace: TraceCallback | None = None,
    ) -> TrainingResult:
        """``train`` as rank ``ranks.rank`` of ``ranks.world_size`` (``service.training.distributed``).

        ``data`` holds this rank's shard of the training records (all of them for ``SOLO``).
        Rank 0 alone asks ``should_stop``, calls ``on_checkpoint`` and adds the noise; every step
        it tells the others whether to go on (``ranks.agree``), and after every release whether
        it was accepted, so that all ranks take the same steps and stop together. Only rank 0's
        result carries metrics."""
        lead = ranks.rank == 0
        run = self._start(data, plan.params, seed, ranks)
        every = plan.params.checkpoint_every
        traced = trace_every(plan.steps) if lead and on_trace is not None else None
        status: Status = "completed"
        last_release: int | None = None
        done = 0
        for step in range(1, plan.steps + 1):
            if ranks.agree(lead and should_stop()):
                status = "stopped"
                break
            idx = poisson_sample(len(run.labels), plan.sampling_probability, run.sampler).to(self.device)
            self._step(run, plan, step, run.features[idx], run.labels[idx])
            done = step
            release = step == plan.steps or (every is not None and step % every == 0)
            if release:
                state = self._model_state(run.model) if lead else {}
                refused = lead and not on_checkpoint(step, state, plan.event_after(step))
                if ranks.agree(refused):
                    status = "refused"
                    break
                last_release = step
            elif traced is not None and on_trace is not None and step % traced == 0:
                on_trace(step, self.evaluate(data, run.model))
        metrics: dict[str, float] = {}
        if lead:
            metrics = self.evaluate(data, run.model)
            metrics.update(self._extra_metrics(run))
            metrics["steps"] = float(done)
        return TrainingResult(status, done, plan.event_after(done), metrics, last_release)

    def evaluate(
        self, data: LoadedData, model: nn.Module | ModelState, params: DpSgdParams | None = None
    ) -> dict[str, float]:
        """Accuracy and mean cross-entropy on the held-out test split (empty dict without one).

        ``model`` is a module, or a state dict from ``on_checkpoint`` (then ``params`` names the
        architecture).
        """
        if not isinstance(model, nn.Module):
            if params is None:
                raise ValueError("params are needed to rebuild a model from its state dict.")
            module = self._build_model(data, params)
            module.load_state_dict(model)
            model = module.to(self.device)
        features, labels = data.test_arrays()
        if len(labels) == 0:
            return {}
        x = torch.from_numpy(features).to(self.device)
        y = torch.from_numpy(labels).to(self.device)
        with torch.no_grad():
            logits = model(x)
            loss = F.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(1) == y).float().mean().item()
        return {"test_accuracy": accuracy, "test_loss": loss}

    # -- hooks for subclasses -----------------------------------------------------------------

    @staticmethod
    def _num_classes(data: LoadedData, p: DpSgdParams) -> int:
        num_classes = p.num_classes if p.num_classes is not None else data.num_classes
        if num_classes < data.num_classes:
            raise InvalidParamsError(
                "params.num_classes",
                f"must cover the data's {data.num_classes} classes. Found {num_classes}.",
            )
        return num_classes

    def _build_model(self, data: LoadedData, p: DpSgdParams) -> nn.Module:
        return build_model(
            p.model,
            n_features=data.n_features,
            num_classes=self._num_classes(data, p),
            image_shape=data.image_shape,
        )

    def model_spec(self, data: LoadedData, p: DpSgdParams) -> dict[str, Any]:
        """What a released state dict is, recorded with every version: the arguments of
        ``service.training.nets.build_model`` and the source's ``preprocessing`` — what
        ``service.training.nets.load_model`` rebuilds the module from."""
        return {
            "builder": "service.training.nets.build_model",
            "model": p.model.kind,
            "hidden": list(p.model.hidden),
            "n_features": data.n_features,
            "num_classes": self._num_classes(data, p),
            "image_shape": None if data.image_shape is None else list(data.image_shape),
            "input_dtype": "float32",
            "output": "class logits",
            "preprocessing": dict(data.preprocessing),
            "data_source": data.uri,
        }

    def initial_model(self, data: LoadedData, params: DpSgdParams, seed: int) -> nn.Module:
        """The model a run with ``seed`` starts from (on this trainer's device).

        Its initialisation uses a stream derived from ``seed`` that the sampling and the noise do
        not use, and leaves torch's global generator untouched.
        """
        init_seed = np.random.SeedSequence(seed).generate_state(3, dtype=np.uint64)[0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(init_seed))
            model = self._build_model(data, params)
        return model.to(self.device)

    def _start(self, data: LoadedData, p: DpSgdParams, seed: int, ranks: Ranks = SOLO) -> _Run:
        seeds = np.random.SeedSequence(seed).generate_state(3, dtype=np.uint64)
        model = self.initial_model(data, p, seed)
        ranks.sync_(list(model.parameters()))
        features, labels = data.train_arrays()
        sampler = torch.Generator(device="cpu")
        if ranks.rank > 0:  # its own stream: the shards' Poisson draws are independent
            own = np.random.SeedSequence(seed, spawn_key=(ranks.rank,))
            seeds[1] = own.generate_state(1, dtype=np.uint64)[0]
        sampler.manual_seed(int(seeds[1]))
        noise = torch.Generator(device=self.device)
        noise.manual_seed(int(seeds[2]))
        params = {name: q.detach() for name, q in model.named_parameters()}
        return _Run(
            model=model,
            params=params,
            grad_fn=PerExampleGradients(model, self._num_classes(data, p)),
            features=torch.from_numpy(features).to(self.device),
            labels=torch.from_numpy(labels).to(self.device),
            sampler=sampler,
            noise=noise,
            ranks=ranks,
        )

    def _private_gradient(self, run: _Run, plan: TrainingPlan, x: torch.Tensor, y: torch.Tensor) -> None:
        """The whole private gradient in the flat buffer ``run.update``: (B, P) per-example
        matrix → norms → clip factors → noise drawn in place → one addmv
        (``noisy_mean_gradient_flat``). The privacy audit adds its canaries' rows here.

        Distributed: ``noisy_mean_gradient_of_ranks`` (noise on rank 0, sums all-reduced)."""
        noisy_mean_gradient_of_ranks(
            run.grad_fn.flat(run.params, x, y),
            ranks=run.ranks,
            max_grad_norm=plan.params.max_grad_norm,
            noise_multiplier=plan.noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            generator=run.noise,
            out=run.update,
        )

    def _step(self, run: _Run, plan: TrainingPlan, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        p = plan.params
        self._private_gradient(run, plan, x, y)
        updates = run.update_views
        with torch.no_grad():
            if p.momentum > 0:  # heavy-ball momentum, as torch.optim.SGD (post-processing)
                momentum: tuple[torch.Tensor, list[torch.Tensor]] | None = run.optimizer_state.get("momentum")
                if momentum is None:
                    momentum = flat_buffer(run.param_list)
                    momentum[0].copy_(run.update)
                    run.optimizer_state["momentum"] = momentum
                else:
                    momentum[0].mul_(p.momentum).add_(run.update)
                updates = momentum[1]
            torch._foreach_add_(run.param_list, updates, alpha=-p.learning_rate)

    def _extra_metrics(self, run: _Run) -> dict[str, float]:
        return {}

    @staticmethod
    def _model_state(model: nn.Module) -> ModelState:
        return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}


def _calibrate(
    *,
    target_epsilon: float,
    delta: float,
    sampling_probability: float,
    steps: int,
    accountant: str,
    price: Callable[[DpEvent], Decimal] | None,
) -> float:
    from accountant.calibration import calibrate_noise_multiplier, calibrate_to_price

    sigma = calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        delta=delta,
        sampling_probability=sampling_probability,
        steps=steps,
        accountant=accountant,
    )
    if price is None:
        return float(sigma)
    # The ledger may charge more than the accountant's ε (a Rényi filter splits δ over its
    # orders): search up from the accountant's σ for one the dataset's price meets.
    return calibrate_to_price(
        lambda s: dp_sgd_event(sampling_probability=sampling_probability, noise_multiplier=s, steps=steps),
        start=sigma,
        target_epsilon=target_epsilon,
        price=price,
    )
