"""The release gate: no data is read before the ledger holds the run's cost, and no model
version is published before the ledger committed it (docs/ARCHITECTURE.md, "Release flow").

For one claimed job (``run_job``):

1. **Plan and reserve, before any data is read.** The trainer's ``plan(params, n_records)``
   gives the event of the whole run (DP-SGD: ``SelfComposed(PoissonSampled(q, Gaussian(σ)), T)``)
   from the params and the record count of the dataset's batches, which the ledger knows. The
   gate reserves that event on every batch of the dataset, named by its tasks (up to 2 000 000
   batches; a list of batch ids stops at 10 000) (``service.ledger.reservations.reserve``,
   idempotency key ``job:<id>:a<attempt>:reserve``); a batch created while the job planned
   (the reservation holds more batches than planned) aborts it and fails the job. A refusal
   fails the job with the ledger's answer (``budget_exceeded`` with ``remaining`` and
   ``requested``, or the rule's code) and the data source is never opened.
2. **Load and check.** The *dataset's* data source (``datasets.data_source``, set by an admin of
   its tenant; a job's params never name one, and a ``params.data_source`` left by old clients is
   ignored) is read from the dataset row, then loaded through the tenant's data roots, which the
   loader checks again as it opens the file (``service.training.data``, "Data roots"). Its training
   record ids must be exactly the records of the ledger's batches — compared as the ledger stores
   them, HMAC-SHA256 with the dataset's salt. A mismatch aborts the reservation and fails the job
   before any training. No error, log line or metric carries a cell of the source or a record
   id: loading errors name lines, columns and rules; a mismatch gives counts and batch ids; a
   training failure's message has the source's record ids masked, and its log has no locals.
3. **Train and release.** At every checkpoint (``checkpoint_every`` steps, and the last step) the
   candidate is *staged* (weights written and fsynced under ``.staging``, their SHA-256 taken),
   then the release ``{model, version, artifact_sha256}`` is **committed** (so the signed
   certificate names those bytes) with the event of the steps so far (a progressive
   commit; the last one, for the whole run, closes the reservation), and only then *published*
   (``service.ledger.model_registry``). A refused commit destroys the candidate and stops the run.
4. **Stop.** Cancel, a lost lease, a worker shutdown, a refused commit or a failure abort the
   rest of the reservation, saying what ran (``reservations.abort(ran=...)``, in-process only:
   docs/ARCHITECTURE.md, "Threat model"). The worker holds the data and every output, so it
   knows: nothing is charged for a job that stopped before its first DP-SGD step (the source
   loaded and checked against the ledger's record hashes, no mechanism run, nothing shown); a
   job stopped after k steps is charged the k-step prefix ``plan.event_after(k)`` (a step counts
   from the moment it starts: a failure inside it may depend on its sample), with a certificate
   of ``outcome: "aborted"``, and only the steps never started are returned. A staged stage
   whose training began is charged whole (its trainer reports no prefix).
   A transient database error (a terminated connection, a serialization failure, a deadlock:
   ``service.db.session.is_transient_error``) ends the attempt, not the job: what ran is charged
   as above and the job goes back to the queue for its next attempt, as after a shutdown.

Only released numbers leave the run: a version's metrics are those of the committed model, on
the held-out test split; the metrics of a run that stopped early are those of its last release
(evaluating the unreleased model would publish a statistic of steps whose cost was returned).
The same holds for the job's per-step curve (``jobs.metric_history``): the trainer evaluates the
iterate on the test split every ``trace_every(steps)`` steps (``on_trace``), the gate keeps those
points in memory and stores them only once a commit covers their step (``release.checkpoint``); the
points of steps no commit covered go with the run. The unnoised training loss is never kept.

A retried job (its previous worker lost the lease) first resolves the previous attempts: staged
candidates are published if their release was committed, deleted otherwise
(``registry.sweep``), and their reservations are aborted — charged in full: the worker that ran
them is gone, and nothing says how far it got. The retry then plans and reserves anew and trains
from the start; what the earlier attempts were charged stays spent.


Where each part lives (one concept a module; the docstring of each says why):

* ``job`` — ``run_job``: the order above, written once, for the one-reservation run;
* ``targets`` — a run calibrated to a target ε: the budget's δ, a refusal before reserving;
* ``sources`` — the dataset's data source: loaded after the reservation, checked against the
  ledger's batches;
* ``release`` — where the worker releases and where it refuses to: stage, commit, publish;
* ``staged`` — staged runs: one reservation, commit and version per stage;
* ``attempt`` — one attempt's state, and every way it ends (what ran is charged);
* ``failures`` — what a job's error and the worker's log may say (no cell, no record id).

The worker's ledger reads and writes go through ledger functions only (``service.ledger``:
``reservations``, ``jobs.leases``, ``model_registry``, ``quotes``, ``idempotency``): no SQL here.
"""

from service.worker.gate.attempt import Control, Outcome, abort_quietly
from service.worker.gate.failures import failure_message, without_records
from service.worker.gate.job import run_job
from service.worker.gate.sources import (
    SOURCE_FIELD,
    Loader,
    SourceLoader,
    check_source_records,
    check_source_tasks,
    default_loader,
    ledger_tasks,
)

__all__ = [
    "SOURCE_FIELD",
    "Control",
    "Loader",
    "Outcome",
    "SourceLoader",
    "abort_quietly",
    "check_source_records",
    "check_source_tasks",
    "default_loader",
    "failure_message",
    "ledger_tasks",
    "run_job",
    "without_records",
]
