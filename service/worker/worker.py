"""The worker loop: claim a job, keep its lease with a heartbeat thread, run it through the gate.

``Worker.run_once()`` claims one job (``service.ledger.jobs.leases.claim``) and runs it to its end;
``Worker.run_forever(stop_event)`` does that until ``stop_event`` is set, sleeping ``poll_s``
when the queue is empty. On start it sweeps the staging area left by crashed workers
(``registry.sweep``), and every ``expire_every_s`` it expires reservations past their TTL
(``reservations.expire_due``), so orphaned holds are freed even when no API process runs.

Leases. While a job runs, a heartbeat thread extends its lease every ``heartbeat_s`` (default
``lease_s / 3``) and reads whether a cancel was requested. The worker also keeps a *local*
deadline — the time the last successful heartbeat was sent plus 80% of ``lease_s``, on the
monotonic clock — and stops the job (no further commit) once it passes, even if the database
cannot be reached to say so; another worker can claim the job only after the lease has expired
in the database, which is later. Clocks of workers on different machines are assumed to agree
within the remaining 20% of ``lease_s``. Even then a double run could only waste budget, never
misreport it: each attempt spends through its own reservation and every commit is certified.

Holds. The attempt's reservation is held ``reservation_ttl_s`` (``LEDGER_RESERVATION_TTL_S``, an
hour by default) while a job may run ``max_wall_s`` (a day): the heartbeat renews the hold
(``reservations.extend``, audited ``reservation.extended``) each time half its TTL has passed since
the job was claimed or the hold last renewed, up to ``reservation_max_lifetime_s`` from its
creation. A worker that dies renews nothing, so its orphaned hold still expires one TTL later.

Shutdown (``stop_event`` set while a job runs): the job stops at its next step, the rest of its
reservation is aborted and it goes back to the queue (``jobs.leases.release``).

Limits (``jobs.params.JobLimits``, from ``LEDGER_JOB_MAX_STEPS`` and ``LEDGER_JOB_MAX_WALL_S`` unless
given): the gate refuses a plan of more steps before it reserves anything; an attempt that runs
longer than ``max_wall_s`` (on the monotonic clock, from its claim) is stopped at its next step
like a cancel, the rest of its reservation aborted, what it committed kept, and the job failed
``wall_time_exceeded``. A DP-SGD run stops within one step; a staged run at the end of the stage it
is in (a stage is trained as one unit). The limit is per attempt: a job retried after its worker
died starts a new one.

Training imports torch lazily (``service.worker.gate`` imports the trainers inside ``run_job``),
so an idle in-process worker does not load torch into the API process.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Final

from service.db.session import Database
from service.ledger import jobs, reservations
from service.ledger import model_registry as registry
from service.ledger.errors import LedgerError
from service.ledger.jobs.leases import ClaimedJob, LeaseLost
from service.ledger.jobs.params import JobLimits
from service.worker import gate

logger = logging.getLogger("service.worker")

DEFAULT_LEASE_S: Final = 30.0
DEFAULT_POLL_S: Final = 1.0
DEFAULT_EXPIRE_EVERY_S: Final = 30.0
LOCAL_DEADLINE_FRACTION: Final = 0.8


def new_worker_id() -> str:
    return f"{socket.gethostname()[:100]}:{os.getpid()}:{secrets.token_hex(4)}"


class JobControl:
    """The gate's ``Control`` for one claimed job, fed by the heartbeat thread."""

    def __init__(
        self,
        lease_s: float,
        claimed_at: float,
        stop_event: threading.Event,
        *,
        max_wall_s: float = math.inf,
    ) -> None:
        self._lease_s = lease_s
        self._deadline = claimed_at + LOCAL_DEADLINE_FRACTION * lease_s
        self._wall_deadline = claimed_at + max_wall_s
        self._stop_event = stop_event
        self._lock = threading.Lock()
        self.cancelled = threading.Event()
        self.lost = threading.Event()
        self.overran = threading.Event()
        self.step = 0

    def renewed(self, sent_at: float) -> None:
        with self._lock:
            self._deadline = max(self._deadline, sent_at + LOCAL_DEADLINE_FRACTION * self._lease_s)

    def lease_valid(self) -> bool:
        with self._lock:
            deadline = self._deadline
        return not self.lost.is_set() and time.monotonic() < deadline

    def should_stop(self) -> bool:
        if not self.lease_valid():
            self.lost.set()
        if time.monotonic() >= self._wall_deadline:
            self.overran.set()
        return (
            self.lost.is_set()
            or self.cancelled.is_set()
            or self.overran.is_set()
            or self._stop_event.is_set()
        )

    @property
    def reason(self) -> str | None:
        if self.lost.is_set():
            return "lease_lost"
        if self.cancelled.is_set():
            return "cancelled"
        if self.overran.is_set():  # before shutdown: a job past its limit is failed, not re-queued
            return "wall_time"
        if self._stop_event.is_set():
            return "shutdown"
        return None

    def set_step(self, step: int) -> None:
        self.step = step


class Worker:
    """One training worker against one database (several may share a PostgreSQL database)."""

    def __init__(
        self,
        db: Database,
        *,
        artifact_dir: Path | str,
        reservation_ttl_s: float = reservations.DEFAULT_TTL_S,
        reservation_max_lifetime_s: float = reservations.DEFAULT_MAX_LIFETIME_S,
        worker_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        heartbeat_s: float | None = None,
        poll_s: float = DEFAULT_POLL_S,
        expire_every_s: float = DEFAULT_EXPIRE_EVERY_S,
        device: str | None = None,
        loader: gate.Loader | None = None,
        limits: JobLimits | None = None,
    ) -> None:
        if lease_s <= 0 or poll_s <= 0:
            raise ValueError(f"lease_s and poll_s must be > 0. Found {lease_s}, {poll_s}.")
        self.db = db
        self.artifact_dir = Path(artifact_dir)
        self.reservation_ttl_s = reservation_ttl_s
        self.reservation_max_lifetime_s = reservation_max_lifetime_s
        self.worker_id = worker_id or new_worker_id()
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else lease_s / 3
        self.poll_s = poll_s
        self.expire_every_s = expire_every_s
        self.device = device
        self.loader: gate.Loader = loader if loader is not None else gate.default_loader
        self.limits = limits if limits is not None else JobLimits.from_environment()
        self._last_expiry = 0.0
        self._idle_stop = threading.Event()

    # -- one job -------------------------------------------------------------------------------

    def run_once(self, stop_event: threading.Event | None = None) -> str | None:
        """Claim one job and run it to its end; the job's id, or ``None`` if none was queued."""
        stop = stop_event if stop_event is not None else self._idle_stop
        claimed_at = time.monotonic()
        job = jobs.leases.claim(self.db, self.worker_id, self.lease_s)
        if job is None:
            return None
        logger.info("worker %s claimed job %s (attempt %d)", self.worker_id, job.id, job.attempt)
        control = JobControl(self.lease_s, claimed_at, stop, max_wall_s=self.limits.max_wall_s)
        if job.cancel_requested:
            control.cancelled.set()
        done = threading.Event()
        beat = threading.Thread(
            target=self._heartbeat,
            args=(job, control, done, claimed_at),
            name=f"heartbeat-{job.id}",
            daemon=True,
        )
        beat.start()
        try:
            self._run(job, control)
        finally:
            done.set()
            beat.join()
        return job.id

    def _run(self, job: ClaimedJob, control: JobControl) -> None:
        outcome = gate.run_job(
            self.db,
            job,
            control=control,
            artifact_dir=self.artifact_dir,
            reservation_ttl_s=self.reservation_ttl_s,
            loader=self.loader,
            device=self.device,
            limits=self.limits,
        )
        logger.info("job %s: %s %s", job.id, outcome.status, outcome.error or "")

    def _heartbeat(
        self, job: ClaimedJob, control: JobControl, done: threading.Event, claimed_at: float
    ) -> None:
        # When each hold this attempt made was last renewed (monotonic); one first seen counts
        # from the claim (it was made after it, so it expires no earlier than the claim plus its
        # TTL); ``math.inf`` for a hold that can no longer be renewed.
        renewed_at: dict[str, float] = {}
        while not done.wait(self.heartbeat_s):
            sent = time.monotonic()
            try:
                beat = jobs.leases.heartbeat(self.db, job.lease, self.lease_s, progress_step=control.step)
            except LeaseLost:
                if done.is_set() or jobs.leases.ended_under(self.db, job.lease):
                    return  # the beat raced the end of the job: nothing was lost
                logger.warning("worker %s lost the lease of job %s", self.worker_id, job.id)
                control.lost.set()
                return
            except Exception:  # the database is unreachable: the local deadline decides
                logger.exception("heartbeat of job %s failed; retrying", job.id)
                continue
            control.renewed(sent)
            if beat.cancel_requested:
                control.cancelled.set()
            hold = beat.reservation_id
            last = claimed_at if hold is None else renewed_at.get(hold, claimed_at)
            if hold is not None and sent - last >= self.reservation_ttl_s / 2:
                renewed_at[hold] = self._renew_hold(job, hold, sent, last)

    def _renew_hold(self, job: ClaimedJob, reservation_id: str, sent: float, last: float) -> float:
        """Hold the attempt's reservation another ``reservation_ttl_s`` (module docstring, Holds);
        answers when it was renewed: ``sent``, ``last`` when the database could not be reached
        (the next beat tries again), ``math.inf`` for a hold that cannot be renewed (closed, past
        its lifetime, expired) — left to the gate, whose next commit or abort says what happened."""
        try:
            reservations.extend(
                self.db,
                job.tenant_id,
                reservation_id,
                ttl_s=self.reservation_ttl_s,
                max_lifetime_s=self.reservation_max_lifetime_s,
            )
        except LedgerError as exc:
            logger.warning("job %s: its hold %s was not renewed: %s", job.id, reservation_id, exc)
            return math.inf
        except Exception:  # the database is unreachable
            logger.exception("renewing the hold of job %s failed; retrying", job.id)
            return last
        return sent

    # -- the loop ------------------------------------------------------------------------------

    def sweep(self) -> dict[str, list[str]]:
        """Resolve staged candidates of crashed workers (``registry.sweep``)."""
        return registry.sweep(self.db, self.artifact_dir)

    def _expire(self) -> None:
        now = time.monotonic()
        if now - self._last_expiry < self.expire_every_s:
            return
        self._last_expiry = now
        try:
            reservations.expire_due(self.db)
        except Exception:
            logger.exception("reservation expiry sweep failed")

    def run_forever(self, stop_event: threading.Event) -> None:
        """Claim and run jobs until ``stop_event`` is set."""
        logger.info("worker %s started (artifacts in %s)", self.worker_id, self.artifact_dir)
        try:
            self.sweep()
        except Exception:
            logger.exception("staging sweep failed")
        while not stop_event.is_set():
            self._expire()
            try:
                ran = self.run_once(stop_event)
            except Exception:
                logger.exception("worker %s: job run failed", self.worker_id)
                ran = None
            if ran is None:
                stop_event.wait(self.poll_s)
        logger.info("worker %s stopped", self.worker_id)


def start_thread(worker: Worker, stop_event: threading.Event) -> threading.Thread:
    """Run ``worker.run_forever(stop_event)`` in a daemon thread (the in-process worker)."""
    thread = threading.Thread(
        target=worker.run_forever, args=(stop_event,), name="ledger-worker", daemon=True
    )
    thread.start()
    return thread


__all__ = ["DEFAULT_LEASE_S", "JobControl", "Worker", "new_worker_id", "start_thread"]
