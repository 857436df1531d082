"""The training worker: data sources, models and the private training algorithms.

Only ``service.worker.*`` imports torch; the API, ledger and database packages never import the
training modules, so the service runs (and its tests pass) without torch installed.

* ``service.worker.data`` — data sources named by URI (``file://….npz``, ``file://….csv``,
  ``builtin:digits``, ``builtin:permuted-digits?tasks=N``, ``builtin:split-digits?tasks=N``),
  parsed without reading anything and loaded only when called; the check that a source's record
  ids are exactly the ledger's batches. numpy only, no torch.
* ``service.worker.nets`` — the MLP and the small CNN, chosen by job params.
* ``service.worker.dp_sgd`` — DP-SGD with true Poisson sampling and ``torch.func`` per-example
  gradients: ``DpSgdTrainer.plan`` (the cost of the whole run, before any data is read) and
  ``DpSgdTrainer.train`` (checkpoint callbacks that commit before each release).
* ``service.worker.adadp`` — AdaDp (Xu, Shi, Liu, Zhao & Chen), the sound variant, same interface.
* ``service.worker.jobs`` — the one place that does database work for jobs: create, claim with a
  lease (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), heartbeat,
  progress, cancel, finish.
* ``service.worker.gate`` — the release gate: plan and reserve before reading data, commit before
  publishing each version, abort the rest on cancel or crash.
* ``service.worker.registry`` — model versions: stage, publish (only with a committed
  certificate), list, artifact files, and the crash-recovery sweep.
* ``service.worker.worker`` — the loop: claim, heartbeat, run the gate, finish.
"""
