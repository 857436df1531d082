"""Ledger operations: each public function is one database transaction.

Modules, one concept each: ``tenancy`` (tenants, API keys), ``datasets`` (budgets), ``batches``
(tasks and disjoint batches), ``reservations`` (reserve → commit / abort / expire), ``spend``
(aggregate reads), ``certificates``, ``audit`` (hash-chained log), ``idempotency``, ``errors``,
``jobs`` (the job queue: create, claim with a lease, heartbeat, finish) and ``model_registry``
(model versions: stage, publish with a committed certificate, list, sweep).
Functions return JSON-ready dicts exactly as the HTTP API v1 answers them; numbers that are
budgets or spends are decimal strings (exact; see ``service.ledger.spend``).
"""
