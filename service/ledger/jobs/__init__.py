"""Training jobs: the one package that does all database work for them (procrastinate's shape:
one manager touches the job rows), one concept a module.

* ``params`` — what a job may ask, checked at submit: the algorithm, the model name, the params
  document against the algorithm's declaration (``service.contract.job_params``), ``JobLimits``;
* ``answers`` — jobs as the API answers them, with their versions;
* ``queue`` — the API's operations: ``create_job``, ``get_job``, ``list_jobs``, ``cancel_job``;
* ``leases`` — the worker's: ``claim`` (one statement, fair between tenants), ``heartbeat``,
  ``record_plan`` / ``record_reservation`` / ``record_progress``, ``finish``, ``release``.

A job is created ``queued``, claimed by one worker with a lease, kept by heartbeats and ended by
the worker that holds the lease: ``succeeded``, ``failed`` or ``cancelled``.
"""

from service.ledger.jobs import answers, leases, params, queue

__all__ = ["answers", "leases", "params", "queue"]
