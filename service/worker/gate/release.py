"""Where the worker releases a model, and where it refuses to: stage, commit, publish
(``service.worker.gate``, step 3; docs/ARCHITECTURE.md, "Release flow").

Why its own module: this is the one place a model version leaves the worker. The candidate's
weights are staged and hashed first, the ledger commits the release naming those bytes, and only
a committed release is published; a refused commit destroys the candidate. The metrics and the
traced iterates stored with a release are those the commit covers (``checkpoint``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any, Final

from accountant import events as ev
from service.ledger import jobs, reservations
from service.ledger import model_registry as registry
from service.ledger.errors import Conflict, LedgerError
from service.worker.gate.attempt import Run
from service.worker.gate.failures import job_error

if TYPE_CHECKING:
    from service.training.dp_sgd import ModelState

_VERSION_RETRIES: Final = 20  # version numbers a release tries when other jobs took the next ones


def _serializer(model_state: ModelState) -> tuple[str, Callable[[IO[bytes]], None]]:
    """safetensors when installed, else ``torch.save`` of the state dict."""
    try:
        from safetensors.torch import save as save_safetensors  # type: ignore[import-not-found]
    except ImportError:
        import torch

        def write_torch(handle: IO[bytes]) -> None:
            torch.save(model_state, handle)

        return "torch", write_torch

    def write_safetensors(handle: IO[bytes]) -> None:
        handle.write(save_safetensors({k: v.contiguous() for k, v in model_state.items()}))

    return "safetensors", write_safetensors


def checkpoint(run: Run, step: int, model_state: ModelState, event: Any) -> bool:
    """Release the model after ``step`` steps: stage, commit, publish. ``False`` stops training."""
    run.control.set_step(step)
    if run.control.should_stop() or not run.control.lease_valid():
        return False
    final = step == run.plan.steps
    metrics: dict[str, Any] = dict(run.trainer.evaluate(run.data, model_state, run.plan.params))
    metrics["step"] = step
    answer = release(run, step, model_state, metrics, event=None if final else event)
    if answer is None:
        return False
    committed = answer.reservation.committed
    jobs.leases.record_progress(
        run.db,
        run.job.lease,
        step=step,
        epsilon_committed=committed.epsilon,
        delta_committed=committed.delta,
        metrics=metrics,
    )
    if run.trace_every is not None:
        # The commit just made covers steps 1..step, so the iterates traced before it are
        # released (post-processing of the committed noisy steps): only now may they be stored.
        covered = [p for p in run.trace if p["step"] <= step]
        run.trace = [p for p in run.trace if p["step"] > step]
        jobs.leases.record_history(
            run.db,
            run.job.lease,
            [*covered, trace_point(step, metrics, checkpoint=True)],
            every=run.trace_every,
        )
    return True


def trace_point(step: int, metrics: Mapping[str, Any], *, checkpoint: bool = False) -> dict[str, Any]:
    """One point of a job's ``metric_history``: the iterate's numeric metrics after ``step``."""
    point: dict[str, Any] = {"step": step, "checkpoint": checkpoint}
    point.update(
        (k, float(v))
        for k, v in metrics.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    )
    return point


def release(
    run: Run, step: int, model_state: ModelState, metrics: dict[str, Any], *, event: ev.DpEvent | None
) -> reservations.Commit | None:
    """Stage the candidate, commit ``run.reservation_id`` with its release (``event``: the
    run so far for a progressive commit, ``None`` for the whole reservation), then publish it.
    Returns the commit's answer, or ``None`` when the ledger refused (``run.refusal`` says why;
    the candidate is destroyed)."""
    db, job = run.db, run.job
    fmt, write = _serializer(model_state)
    answer: reservations.Commit | None = None
    staged: registry.StagedArtifact | None = None
    for _ in range(_VERSION_RETRIES):
        version = registry.next_version(db, job.tenant_id, job.model_name)
        staged = registry.stage(
            run.artifact_dir,
            tenant_id=job.tenant_id,
            name=job.model_name,
            version=version,
            job_id=job.id,
            attempt=job.attempt,
            dataset_id=job.dataset_id,
            step=step,
            metrics=metrics,
            fmt=fmt,
            write=write,
            model_spec=run.model_spec,
        )
        try:
            answer = reservations.commit(
                db,
                job.tenant_id,
                run.reservation_id or "",
                # The weights' SHA-256, known before the commit: the signed certificate binds it.
                release={"model": job.model_name, "version": version, "artifact_sha256": staged.sha256},
                event=event,
                idempotency_key=f"job:{job.id}:a{job.attempt}:commit:{step}:v{version}",
            )
        except Conflict as exc:
            registry.discard(run.artifact_dir, staged)
            if exc.reason == "release_exists":  # another job took the number
                continue
            run.refusal = exc.to_json()
            return None
        except LedgerError as exc:  # refused: the candidate is destroyed, never published
            registry.discard(run.artifact_dir, staged)
            run.refusal = exc.to_json()
            return None
        except BaseException as exc:
            # Unknown outcome (the database went away mid-commit): leave the candidate staged;
            # the sweep publishes it if the commit landed and deletes it otherwise.
            run.failure = exc
            raise
        break
    if answer is None or staged is None:
        run.refusal = job_error("version_conflict", f"no free version number for {job.model_name!r}.")
        return None
    registry.publish(db, run.artifact_dir, staged, certificate_id=answer.certificate.id)
    run.released.append(staged.version)
    run.released_metrics = metrics
    return answer


__all__ = ["checkpoint", "release", "trace_point"]
