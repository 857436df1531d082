"""The algorithms a job can run: name → trainer class, imported lazily (torch loads only in the
worker, never in the API process).

Two kinds of trainer (``service.worker.gate``): a *one-reservation* run (DP-SGD, AdaDp: the whole
run reserved once, checkpoints committed progressively) and a *staged* run
(``service.training.stages.StagedTrainer``: one reservation, commit and version per task or per
block). The first six names are the HTTP contract (docs/ARCHITECTURE.md, "Jobs and the worker"); the
rest are the baselines the papers compare against, runnable as jobs so that their ledger spend is
shown next to the algorithms'.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

TRAINERS: Final[dict[str, str]] = {
    "dp_sgd": "service.training.dp_sgd:DpSgdTrainer",
    "adadp": "service.training.adadp:AdaDpTrainer",
    "l2dp_ml": "service.training.l2dp_ml:L2dpMlTrainer",
    "continual_release": "service.training.continual_release:ContinualReleaseTrainer",
    "cosine_classifier": "service.training.pretrained:CosineClassifierTrainer",
    "peft_ensemble": "service.training.pretrained:PeftEnsembleTrainer",
    # Baselines
    "naive_gaussian": "service.training.lifelong_baselines:NaiveGaussianTrainer",
    "peft_naive": "service.training.pretrained:PeftNaiveTrainer",
    "peft_full_data": "service.training.pretrained:PeftFullDataTrainer",
    # One-run privacy audit of a DP-SGD run (an ε lower bound beside the certified upper bound)
    "dp_sgd_audit": "service.training.privacy_audit:PrivacyAuditTrainer",
}
"""Each algorithm's trainer class, keyed in the order of ``service.contract.job_params.ALGORITHMS``
(the names a job may take, owned by the server)."""


def trainer_for(algorithm: str, device: str | None) -> Any:
    """A new trainer of ``algorithm`` (imports torch: call only in the worker)."""
    try:
        target = TRAINERS[algorithm]
    except KeyError:
        raise ValueError(f"no trainer for algorithm {algorithm!r}") from None
    module_name, class_name = target.split(":")
    trainer_class = getattr(importlib.import_module(module_name), class_name)
    return trainer_class(device=device)


__all__ = ["TRAINERS", "trainer_for"]
