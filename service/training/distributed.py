"""One DP-SGD run over several processes: ``torch.distributed`` (``gloo`` on CPU, ``nccl`` on CUDA).

A job with ``params.world_size = W > 1`` (DP-SGD and its one-run audit) is trained by W ranks on
the worker's host. The worker process is rank 0: it holds the job's lease, talks to the ledger
(reserve, progressive commits, abort) and runs the gate's callbacks. ``train_distributed`` starts
ranks 1..W-1 with ``torch.multiprocessing`` (the ``spawn`` start method); all W join one process
group through a ``TCPStore`` that rank 0 hosts on a port the kernel picks (no port to
configure, none to race for). The other ranks receive their shard of the records, the plan and
the run's seed: never the database, the API key or the job.

The mechanism is the one the event describes, ``PoissonSampled(q, Gaussian(σ))`` per step:

* **Shards fixed by record index.** Rank r holds the records at positions r, r + W, r + 2W, ...
  of the loaded training records (``shard``): a partition fixed before any random draw, each
  record in exactly one shard.
* **Poisson sampling per shard, same q.** Each rank includes each record of its shard
  independently with probability q, from a generator of its own (seeded independently). So every
  record of the dataset is included independently with probability q: the union of the W local
  samples *is* one Poisson sample of the whole dataset, with the distribution a one-process run
  draws. What would break it: a shard assignment that depends on the draws (rebalancing shards
  by the sizes drawn), a record in two shards or in none, a different q per shard, or a rank
  that skips a step whose local sample is empty (every rank takes every step, empty or not).
* **Clip per rank, sum across ranks, noise once.** Each rank clips its sampled records'
  per-example gradients to C and sums them; rank 0 alone adds N(0, σ²C²I) (as Opacus's
  ``DistributedDPOptimizer`` does); ``all_reduce(SUM)`` forms Σᵢ clip(gᵢ) + N(0, σ²C²I) over
  the global sample, divided by the public q·N on every rank. Every rank applies the same update
  to the same initial model (broadcast from rank 0), so the models stay identical.

Hence the run's event, its charge, its certificate and its DP statement are those of a
one-process run of the same (q, σ, T): ``world_size`` is an execution detail the plan ignores.

Control. Before every step rank 0 asks the gate whether to stop (counting the step begun, as in a
one-process run) and broadcasts the answer; after every release it broadcasts whether the ledger
accepted it. A rank that dies fails the run: rank 0 sees its process gone before the next
collective, or the collective fails (``gloo`` closes the connection; ``nccl`` times out after
``LEDGER_DISTRIBUTED_TIMEOUT_S``), and raises ``RankFailure``. The gate then fails the job
without a release and charges the steps begun, as for any failure inside a step. If rank 0 dies
the worker is gone: the lease expires, and the retry aborts the reservation, charged in full.

A job spans the processes (GPUs) of one worker host. CUDA: rank r uses GPU r (``world_size``
at most the GPUs the worker sees, checked by the plan). CPU: each child rank takes
``cpu_count // W`` intra-op threads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.training.data import LoadedData, TaskSplit

if TYPE_CHECKING:
    from service.training.dp_sgd import (
        CheckpointCallback,
        DpSgdTrainer,
        StopCallback,
        TrainingPlan,
        TrainingResult,
    )

DEFAULT_TIMEOUT_S: Final = 300.0
"""How long a collective may wait for a rank (``LEDGER_DISTRIBUTED_TIMEOUT_S``): longer than
rank 0's slowest release (evaluate, stage, commit), after which a silent rank fails the run."""
_JOIN_S: Final = 10.0


class RankFailure(RuntimeError):
    """A rank of a distributed run stopped or could not be reached; the run cannot go on."""


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("LEDGER_DISTRIBUTED_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA tensors, ``gloo`` for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class Ranks:
    """This process's place in a run: ``rank`` of ``world_size``, the collectives it takes part
    in (on ``device``, in ``group``: ``None`` is the default process group) and, on rank 0, the
    local processes of the other ranks (``watch``), checked before every collective."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None
    watch: Sequence[BaseProcess] = ()

    @property
    def adds_noise(self) -> bool:
        """Rank 0 alone draws the Gaussian noise: the sum across ranks holds it once."""
        return self.rank == 0

    def _check(self) -> None:
        for index, process in enumerate(self.watch, start=1):
            if process.exitcode is not None:
                raise RankFailure(
                    f"rank {index} of {self.world_size} stopped (exit code {process.exitcode}); "
                    "the run cannot go on."
                )

    def _collective(self, collective: Any, *args: Any, **kwargs: Any) -> None:
        self._check()
        try:
            collective(*args, group=self.group, **kwargs)
        except RankFailure:
            raise
        except RuntimeError as exc:  # gloo: a peer closed its connection; nccl: timed out
            self._check()
            raise RankFailure(
                f"a collective of the {self.world_size}-process run failed ({type(exc).__name__}); "
                "a rank stopped or could not be reached."
            ) from exc

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank (one broadcast)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self._collective(dist.broadcast, value, src=0)
        return bool(value.item())

    def sum_(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` on every rank by its sum over the ranks (``all_reduce``)."""
        if self.world_size > 1:
            self._collective(dist.all_reduce, tensor, op=dist.ReduceOp.SUM)

    def sync_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank (the initial model)."""
        if self.world_size > 1:
            for tensor in tensors:
                self._collective(dist.broadcast, tensor, src=0)


SOLO: Final = Ranks()
"""A one-process run: every collective is the identity."""


def shard(data: LoadedData, rank: int, world_size: int, *, with_test: bool = False) -> LoadedData:
    """Rank ``rank``'s records: positions rank, rank + W, ... of ``data.train_arrays()`` (fixed
    by index, before any draw), as one split whose ids are those positions. ``with_test``: keep
    the held-out split (rank 0 evaluates; the other ranks need none)."""
    features, labels = data.train_arrays()
    rows = np.arange(rank, len(labels), world_size)
    split = TaskSplit(0, tuple(str(int(i)) for i in rows), features[rows], labels[rows])
    return replace(data, train=(split,), test=data.test if with_test else (), public=())


def train_distributed(
    trainer: DpSgdTrainer,
    data: LoadedData,
    plan: TrainingPlan,
    seed: int,
    *,
    on_checkpoint: CheckpointCallback,
    should_stop: StopCallback,
) -> TrainingResult:
    """``trainer.train`` over ``plan.params.world_size`` processes, this one rank 0 (module
    docstring). Raises ``RankFailure`` when another rank stops before the run ends."""
    world_size = plan.params.world_size
    backend = backend_for(trainer.device)
    if trainer.device.type == "cuda":
        torch.cuda.set_device(trainer.device.index or 0)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=_timeout(), wait_for_workers=False)
    context = mp.get_context("spawn")
    children = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, backend, trainer, shard(data, rank, world_size), plan, seed),
            name=f"dp-sgd-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, world_size)
    ]
    for child in children:
        child.start()
    ranks = Ranks(0, world_size, trainer.device, None, tuple(children))
    try:
        try:
            dist.init_process_group(backend, store=store, rank=0, world_size=world_size, timeout=_timeout())
        except RuntimeError as exc:
            ranks._check()
            raise RankFailure(f"the {world_size} ranks could not meet ({type(exc).__name__}).") from exc
        try:
            return trainer.train_rank(
                shard(data, 0, world_size, with_test=True),
                plan,
                seed,
                ranks,
                on_checkpoint=on_checkpoint,
                should_stop=should_stop,
            )
        finally:
            dist.destroy_process_group()
    finally:
        for child in children:
            child.join(_JOIN_S)
            if child.is_alive():
                child.kill()
                child.join()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    trainer: DpSgdTrainer,
    data: LoadedData,
    plan: TrainingPlan,
    seed: int,
) -> None:
    """A child rank: join rank 0's store and train its shard."""
    if trainer.device.type == "cuda":
        trainer.device = torch.device("cuda", rank)
        torch.cuda.set_device(trainer.device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=_timeout())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_timeout())
    try:
        trainer.train_rank(data, plan, seed, Ranks(rank, world_size, trainer.device))
    finally:
        dist.destroy_process_group()


__all__ = ["DEFAULT_TIMEOUT_S", "SOLO", "RankFailure", "Ranks", "backend_for", "shard", "train_distributed"]
