"""Opacus behind the ledger's gate: the event of a ``PrivacyEngine`` run, read from what Opacus
built, and ``make_private_with_epsilon`` calibrated against the dataset's own quote.

::

    from opacus import PrivacyEngine
    from service.integrations.opacus import make_private_with_epsilon

    with make_private_with_epsilon(
        ledger, PrivacyEngine(), dataset_id=ds, module=net, optimizer=sgd, data_loader=loader,
        target_epsilon=1.0, epochs=2, max_grad_norm=1.0, model="mlp", version="3",
    ) as run:                                    # reserved: no batch has been read yet
        for _ in range(2):
            for x, y in run.data_loader: ...     # run.module, run.optimizer
    save(run.module, run.certificate)            # only after the ledger committed

What it charges for: ``self_composed(poisson_sampled(gaussian(σ), q), steps)`` — ``steps``
DP-SGD steps, each a Gaussian mechanism of noise multiplier σ (``DPOptimizer.noise_multiplier``,
noise σ·C for per-sample gradients clipped to C) on a Poisson sample in which every record is
included independently with probability q (Opacus's ``UniformWithReplacementSampler``, the
``batch_sampler`` of a ``DPDataLoader``). That is the only sampler the event describes. A plain
``DataLoader`` (``RandomSampler`` or ``SequentialSampler`` with a fixed batch size: shuffled or
fixed batches) is refused: Opacus's accountant charges it as if it were Poisson sampled with
q = batch_size/n, which under-reports ε (Opacus issues #813, #819; shuffling amplifies less than
Poisson sampling), and the ledger has no event for shuffling. Adaptive clipping
(``AdaClipDPOptimizer``, whose noise is split with the clipping quantile) is refused too, by name.

**Under DDP** (``torch.distributed`` initialised, the module wrapped in Opacus's ``DPDDP``): every
rank calls ``make_private_with_epsilon`` with the same arguments, rank 0 with the ledger client and
the others with ``client=None`` (they never see the key). Rank 0 calibrates, reserves and
broadcasts σ (or that nothing was reserved); every rank then builds Opacus's
``DistributedDPOptimizer`` (noise added once, on rank 0, to the all-reduced clipped sum) and
``DistributedUniformWithReplacementSampler`` (each rank Poisson-samples its fixed shard of the
dataset with the same q: the union is one Poisson sample of the whole dataset). On exit the
ranks' step and batch counts are gathered; rank 0 commits only when every rank ran the same steps,
one batch each. Opacus's distributed sampler skips a step whose *local* sample is empty, which
desynchronises the ranks (their counts then differ and nothing is released, or DDP waits on a
rank forever): keep q·N/W, the local expected batch, well above 10 (P(empty) = (1−q)^(N/W)).

``target_epsilon`` means what it means to Opacus: the run's own ε at the budget's δ by the tight
engine the ledger prices a run alone with (as ``get_noise_multiplier(accountant="prv")``, whose
PRV bound is looser), σ the smallest that meets it;
before anything is reserved or read, the dataset's quote must admit that run, else
``BudgetExceeded`` names the largest ``target_epsilon`` that fits. A Rényi-filter budget charges
such a run more than its own ε; to calibrate to what the *dataset charges* instead, pass
``target_budget_epsilon`` (``LedgerClient.calibrate_noise_multiplier``). The reservation is made
before ``make_private`` (which reads one record for its shapes), so no record is read unreserved;
the event Opacus then built is checked to be the one reserved. On a clean exit the gate
commits what Opacus's accountant recorded as run (``engine.accountant.history``): all the
reserved steps, or fewer (a progressive commit of the run so far). More steps than reserved,
or steps at another σ or q, raise instead: nothing is released.

**What an exit costs** (issue 24 §2; docs/ARCHITECTURE.md, "Threat model"). The gate runs in the
trainer's process and never sees the data, so the ledger charges the whole reservation from the
moment it is granted: a run stopped early releases its prefix and the abort of the rest charges
the rest; an exception, a refusal below or ``withhold()`` aborts, which charges everything
reserved. Nothing is refunded for an external trainer.

**Batches drawn against steps taken.** ``run.data_loader`` is Opacus's Poisson ``DPDataLoader``
behind a counter (``CountedLoader``). On exit the gate refuses to commit (``UndescribedRun``: the
reservation is then aborted, and charged) unless the batches drawn from it equal the DP-SGD steps
Opacus's accountant recorded. That catches a run that iterated its original (shuffled) loader
instead — Opacus would record Poisson steps that never sampled as Poisson — and a batch drawn and
looked at without a private step. What it **cannot** detect, because it sees neither the records
nor the gradients: a loader wrapped to feed one record (or any fixed subset) to every step while
``run.data_loader`` is drawn in step; data read outside the loader (``run.data_loader.dataset``,
the original tensors); a model, loss or metric computed on the data without the optimizer; a
non-private optimizer step beside the private one. A trainer that needs more assurance than this
runs as a job on the built-in worker, which holds the data itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from opacus import PrivacyEngine
from opacus.optimizers import (
    DistributedDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
    DPPerLayerOptimizer,
)
from opacus.utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)

from accountant.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from service.client import Identifier, JsonObject, LedgerClient, ReleaseGate

# The optimizers whose step is one Gaussian mechanism of ``noise_multiplier`` on the clipped sum:
# exact types, since subclasses (AdaClip) change that. ``DistributedDPOptimizer`` adds the noise
# on rank 0 only, before the all-reduce: one Gaussian mechanism on the global clipped sum.
_GAUSSIAN_STEP: Final = (
    DPOptimizer,
    DPPerLayerOptimizer,
    DPOptimizerFastGradientClipping,
    DistributedDPOptimizer,
)
OPACUS_ISSUES: Final = "Opacus issues #813 and #819"

logger = logging.getLogger(__name__)


class UndescribedRun(ValueError):
    """An Opacus run whose privacy loss the ledger's events cannot state; the message says why
    and what to change. Raised before reserving, or inside the gate, which then aborts: nothing
    is released either way."""


def _sampler_name(data_loader: torch.utils.data.DataLoader[Any]) -> str:
    batch_sampler = data_loader.batch_sampler
    inner = getattr(batch_sampler, "sampler", None)
    name = type(batch_sampler).__name__
    return f"{name}({type(inner).__name__})" if inner is not None else name


def poisson_sampling(data_loader: torch.utils.data.DataLoader[Any]) -> tuple[float, int]:
    """``(q, steps per epoch)`` of a loader that samples as Poisson: its ``batch_sampler`` is
    exactly Opacus's ``UniformWithReplacementSampler``, or under DDP its
    ``DistributedUniformWithReplacementSampler`` (each rank's fixed shard sampled with the same
    q). Any other sampler: ``UndescribedRun``."""
    batch_sampler: Any = data_loader.batch_sampler
    if type(batch_sampler) is DistributedUniformWithReplacementSampler:
        return float(batch_sampler.sample_rate), len(batch_sampler)
    if type(batch_sampler) is not UniformWithReplacementSampler:
        raise UndescribedRun(
            f"data_loader samples with {_sampler_name(data_loader)}, not Poisson sampling: each "
            "record in exactly one batch of a fixed size per epoch. Accounting that as Poisson "
            f"sampling with q = batch_size/n under-reports epsilon ({OPACUS_ISSUES}), and the "
            "ledger has no event for shuffled batches, so it is refused. Make the loader private "
            "with Poisson sampling: PrivacyEngine.make_private(..., poisson_sampling=True) or "
            "opacus.data_loader.DPDataLoader.from_data_loader(loader)."
        )
    return float(batch_sampler.sample_rate), len(batch_sampler)


def charging_for(event: SelfComposedEvent) -> str:
    """``event_from_opacus``'s event in words: what the ledger charges for."""
    step = event.event
    assert isinstance(step, PoissonSampledEvent) and isinstance(step.event, GaussianEvent)
    return (
        f"{event.count} DP-SGD steps, each the Gaussian mechanism with noise multiplier "
        f"{step.event.noise_multiplier} on a Poisson sample of the records (each included with "
        f"probability {step.sampling_probability}, Opacus's UniformWithReplacementSampler)"
    )


def event_from_opacus(
    optimizer: torch.optim.Optimizer, data_loader: torch.utils.data.DataLoader[Any], epochs: int
) -> SelfComposedEvent:
    """The event of ``epochs`` epochs of Opacus DP-SGD with ``optimizer`` (what
    ``make_private`` returned) over ``data_loader`` (its ``DPDataLoader``):
    ``self_composed(poisson_sampled(gaussian(σ), q), epochs · steps_per_epoch)``.
    ``UndescribedRun`` for what the event cannot describe (see the module docstring)."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise UndescribedRun(f"epochs must be an integer >= 1. Found {epochs!r}.")
    if type(optimizer) not in _GAUSSIAN_STEP:
        raise UndescribedRun(
            f"optimizer is a {type(optimizer).__name__}, not one of "
            f"{', '.join(c.__name__ for c in _GAUSSIAN_STEP)}: its step is not one Gaussian "
            "mechanism of optimizer.noise_multiplier that the ledger can charge (a plain torch "
            "optimizer adds no noise; adaptive clipping is not described)."
        )
    assert isinstance(optimizer, DPOptimizer)  # every type in _GAUSSIAN_STEP is one
    sigma = float(optimizer.noise_multiplier)
    if not math.isfinite(sigma) or sigma <= 0:
        raise UndescribedRun(
            f"optimizer.noise_multiplier must be finite and > 0 (else the run is not private). Found {sigma}."
        )
    q, steps_per_epoch = poisson_sampling(data_loader)
    return SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(sigma)), epochs * steps_per_epoch)


class CountedLoader:
    """``run.data_loader``: Opacus's Poisson ``DPDataLoader``, counting the batches drawn from it
    (``drawn``: batches handed to the trainer). Iterate it as the loader; any other attribute is
    the loader's."""

    def __init__(
        self, loader: torch.utils.data.DataLoader[Any], on_batch: Callable[[], object] | None = None
    ) -> None:
        self.loader = loader
        self.drawn = 0
        self.on_batch = on_batch

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.drawn += 1
            if self.on_batch is not None:
                self.on_batch()
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@dataclass
class OpacusRun:
    """What ``make_private_with_epsilon`` yields: Opacus's private ``module``, ``optimizer`` and
    ``data_loader`` (behind a ``CountedLoader``), the reserved ``event``, and the ledger's
    ``gate`` (its ``certificate`` after a clean exit)."""

    engine: PrivacyEngine
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    data_loader: CountedLoader
    event: SelfComposedEvent
    gate: ReleaseGate | None
    """``None`` on a rank other than 0 of a DDP run (rank 0 holds the gate)."""

    @property
    def certificate(self) -> JsonObject | None:
        return None if self.gate is None else self.gate.certificate

    @property
    def charging_for(self) -> str:
        """What the reservation charges for, in words."""
        return charging_for(self.event)

    def steps_run(self) -> int:
        """DP-SGD steps Opacus's accountant recorded (the engine was fresh), checked to be the
        reserved step (σ, q): a change of either inside the run is not the reserved event."""
        step = self.event.event
        assert isinstance(step, PoissonSampledEvent) and isinstance(step.event, GaussianEvent)
        steps = 0
        for sigma, q, count in self.engine.accountant.history:
            if float(sigma) != step.event.noise_multiplier or float(q) != step.sampling_probability:
                raise UndescribedRun(
                    f"Opacus ran steps with noise_multiplier={sigma}, sample_rate={q}; the ledger "
                    f"reserved noise_multiplier={step.event.noise_multiplier}, "
                    f"sample_rate={step.sampling_probability}. Nothing is released."
                )
            steps += int(count)
        return steps


def _ledger_records(
    client: LedgerClient,
    dataset_id: Identifier,
    batches: Sequence[Identifier] | None,
    tasks: Sequence[Identifier] | None,
) -> tuple[list[Identifier], int]:
    """The charged tasks (``tasks``, or every task of the dataset) and how many records the
    charged batches hold, from the ledger alone."""
    task_ids: list[Identifier] = (
        list(tasks) if tasks is not None else [t["id"] for t in client.iter_tasks(dataset_id)]
    )
    wanted = None if batches is None else {str(b) for b in batches}
    sizes = {
        b["id"]: int(b["size"])
        for t in task_ids
        for b in client.iter_batches(dataset_id, t)
        if wanted is None or b["id"] in wanted
    }
    return task_ids, sum(sizes.values())


def _ddp() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised ``torch.distributed`` group, ``(0, 1)`` without."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _from_rank_0(value: float | None, world_size: int) -> float | None:
    """Rank 0's σ (``None``: it reserved nothing) on every rank."""
    if world_size == 1:
        return value
    box: list[float | None] = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _check_ranks_ran_alike(run: OpacusRun, steps: int, world_size: int) -> None:
    """Every rank ran ``steps`` private steps, one batch drawn each: else ``UndescribedRun``."""
    if world_size == 1:
        return
    counts: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(counts, (steps, run.data_loader.drawn))
    if any(tuple(c) != (steps, steps) for c in counts):
        raise UndescribedRun(
            f"the ranks ran (steps, batches drawn) = {counts}: not the same steps on every rank, one "
            "batch each (Opacus's distributed sampler skips a step whose local sample is empty), so "
            "the reserved event does not describe the run. Nothing is released."
        )


@contextlib.contextmanager
def make_private_with_epsilon(
    client: LedgerClient | None,
    engine: PrivacyEngine,
    *,
    dataset_id: Identifier,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: torch.utils.data.DataLoader[Any],
    target_epsilon: float | None = None,
    epochs: int,
    max_grad_norm: float,
    model: str,
    version: Identifier,
    target_budget_epsilon: float | None = None,
    batches: Sequence[Identifier] | None = None,
    tasks: Sequence[Identifier] | None = None,
    idempotency_key: str | None = None,
    ttl_s: float | None = None,
    renew: bool = True,
) -> Iterator[OpacusRun]:
    """``PrivacyEngine.make_private_with_epsilon`` behind the ledger's gate (module docstring):
    σ calibrated so that the run of ``epochs`` epochs has its own ε ≤ ``target_epsilon`` at the
    budget's δ (PRV), or — the separate option — so that the dataset *charges* at most
    ``target_budget_epsilon`` for it; exactly one. On ``batches`` (or every batch of ``tasks``;
    neither: every task of the dataset); Poisson
    sampling with Opacus's q = 1/len(data_loader); the reservation made before the block runs,
    the release ``{model, version}`` committed on a clean exit (``BudgetExceeded`` on enter:
    nothing ran). The data loader's dataset must hold exactly the records of those batches.

    ``ttl_s``: how long the hold lasts before it must be renewed (default: the server's, an
    hour). With ``renew`` (default) the hold is renewed while training draws batches: each batch
    drawn from ``run.data_loader`` renews it when less than half of ``ttl_s`` is left
    (``ReleaseGate.renew_if_due``; audited by the ledger), up to the server's maximum lifetime of
    a reservation. A run that stops drawing batches (hung, or crashed) stops renewing, and its
    hold expires: charged in full, nothing released. Before an expiry the gate warns
    (``service.client.ReservationExpiring``).

    Under DDP, ``client`` on rank 0 only (``None`` on the others)."""
    rank, world_size = _ddp()
    if (client is None) != (rank > 0):
        raise UndescribedRun(
            f"client must be given on rank 0 and only there (this is rank {rank} of {world_size}): "
            "rank 0 alone talks to the ledger."
        )
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise UndescribedRun(f"epochs must be an integer >= 1. Found {epochs!r}.")
    if engine.accountant.history:
        # the steps of this release are read from the engine's accountant: it must hold no others
        raise UndescribedRun("engine has accounted steps already: make a new PrivacyEngine per release.")
    steps_per_epoch = len(data_loader)
    if steps_per_epoch < 1:
        raise UndescribedRun("data_loader has no batches.")
    q = 1.0 / steps_per_epoch  # what Opacus's DPDataLoader.from_data_loader samples with
    if client is None:  # a rank > 0: rank 0 reserves, these train with its σ
        sigma = _from_rank_0(None, world_size)
        if sigma is None:
            raise UndescribedRun("rank 0 reserved nothing (see its error): nothing ran.")
        planned = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(sigma)), epochs * steps_per_epoch)
        yield from _private_run(engine, None, planned, module, optimizer, data_loader, max_grad_norm, epochs)
        return
    shared = False
    try:
        records = len(data_loader.dataset)  # type: ignore[arg-type]
        task_ids, charged = _ledger_records(client, dataset_id, batches, tasks)
        if records != charged:
            raise UndescribedRun(
                f"data_loader.dataset holds {records} records but the charged batches of dataset "
                f"{dataset_id} hold {charged}: the reservation would not cover the records read."
            )
        sigma = client.calibrate_noise_multiplier(
            dataset_id,
            target_epsilon=target_epsilon,
            target_budget_epsilon=target_budget_epsilon,
            sampling_probability=q,
            steps=epochs * steps_per_epoch,
            batches=batches,
            tasks=task_ids if batches is None else None,
        )
        planned = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(sigma)), epochs * steps_per_epoch)
        # Reserve first: make_private itself reads a record (DPDataLoader takes the shapes of
        # dataset[0] for empty Poisson batches).
        with client.release_gate(
            dataset_id,
            batches,
            planned,
            tasks=task_ids if batches is None else None,
            model=model,
            version=version,
            ttl_s=ttl_s,
            idempotency_key=idempotency_key,
        ) as gate:
            _from_rank_0(sigma, world_size)
            shared = True
            yield from _private_run(
                engine, gate, planned, module, optimizer, data_loader, max_grad_norm, epochs, renew=renew
            )
    except BaseException:
        if not shared:  # the other ranks wait for σ: tell them nothing was reserved
            _from_rank_0(None, world_size)
        raise


def _private_run(
    engine: PrivacyEngine,
    gate: ReleaseGate | None,
    planned: SelfComposedEvent,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: torch.utils.data.DataLoader[Any],
    max_grad_norm: float,
    epochs: int,
    *,
    renew: bool = False,
) -> Iterator[OpacusRun]:
    """Inside the gate (rank 0) or beside it (the other ranks): Opacus made private with the
    reserved σ, the run yielded, then what ran checked (and, on rank 0, committed)."""
    _, world_size = _ddp()
    private_module, private_optimizer, private_loader = engine.make_private(
        module=module,
        optimizer=optimizer,
        data_loader=data_loader,
        noise_multiplier=planned.event.event.noise_multiplier,  # type: ignore[attr-defined]
        max_grad_norm=max_grad_norm,
        poisson_sampling=True,
    )
    event = event_from_opacus(private_optimizer, private_loader, epochs)
    if event != planned:
        raise UndescribedRun(f"Opacus built {event}, the ledger reserved {planned}: nothing is released.")
    loader = CountedLoader(private_loader, gate.renew_if_due if gate is not None and renew else None)
    run = OpacusRun(engine, private_module, private_optimizer, loader, event, gate)
    if gate is not None:
        logger.info("reserved %s: %s", gate.reservation_id, run.charging_for)
    yield run
    steps = run.steps_run()
    _check_ranks_ran_alike(run, steps, world_size)
    if steps > event.count:
        raise UndescribedRun(
            f"Opacus ran {steps} steps, the ledger reserved {event.count}: nothing is released."
        )
    if run.data_loader.drawn != steps:
        raise UndescribedRun(
            f"{run.data_loader.drawn} batch(es) were drawn from run.data_loader but Opacus's "
            f"optimizer took {steps} private step(s): the steps did not train on the gate's "
            "Poisson samples one batch each (another loader iterated, or a batch drawn without "
            "a step), so the reserved event does not describe the run. Nothing is released; the "
            "reservation is aborted and charged in full."
        )
    if gate is not None and steps < event.count:  # release what ran; the abort of the rest charges it
        gate.commit_event = SelfComposedEvent(event.event, steps)
