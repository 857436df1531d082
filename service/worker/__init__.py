"""The training worker: the orchestration around the trainers (procrastinate's split: the job rows
belong to ``service.ledger.jobs``, this package is only the loop and the gate).

* ``service.worker.worker`` — the loop: claim a job (``service.ledger.jobs``), heartbeat, run the
  gate, finish.
* ``service.worker.gate`` — the release gate: plan and reserve before reading data, commit before
  publishing each version (``service.ledger.model_registry``), abort the rest on cancel or crash;
  a package with one concept a module (``job``, ``targets``, ``sources``, ``release``, ``staged``,
  ``attempt``, ``failures``: its docstring lists them).

The trainers themselves (DP-SGD, AdaDp, L2DP-ML, continual release, pre-trained models, data
sources, networks) are ``service.training``, which imports neither the database nor the API.
Only the worker and ``service.training`` import torch, so the API runs without it.
"""
