"""Ledger operations: each public function is one database transaction.

Modules, one concept each: ``tenancy`` (tenants, API keys), ``datasets`` (budgets), ``batches``
(tasks and disjoint batches), ``reservations`` (reserve → commit / abort / expire), ``spent``
(what a dataset has spent: aggregate reads), ``views`` (the dashboard's reads),
``certificates``, ``audit`` (hash-chained log), ``idempotency``, ``errors``, ``jobs`` (the job
queue: ``params`` checked at submit, ``answers``, ``queue`` operations, the worker's ``leases``)
and ``model_registry`` (model versions: stage, publish with a committed certificate, list, sweep).
The spend operations (``reservations``, ``plan_segments``), the spend read (``spent``), the
registrations (``datasets``, ``batches``' tasks and batch creation), the job queue (``jobs``) and
the model registry return frozen typed answers (``Decimal`` amounts, datetimes) with one
``to_json``, their wire form, called at the edge (the routers, the stored idempotent answer).
The others (``views``, ``batches``' spend pages) return JSON-ready dicts exactly as the HTTP API
v1 answers them; numbers that are budgets or spends are decimal strings there (exact, as
stored).

Importing the package registers the ledger's errors for the schema's named constraints with the
database layer (``service.db.session.register_constraint_errors``), which imports nothing above
it: a unique violation leaves any ledger transaction as the domain error.
"""

from service.db.session import register_constraint_errors
from service.ledger.errors import CONSTRAINT_ERRORS

register_constraint_errors(CONSTRAINT_ERRORS)
