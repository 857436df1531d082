"""Pure privacy mathematics: events, accountants, composition rules, certificates.

No I/O, no database, no web: numpy, scipy, prv-accountant and dp-accounting only (a test
enforces it). The public surface below is importable from ``accountant`` itself
(``from accountant import GaussianEvent, make_accountant``); each name is loaded from its module
on first use, so ``import accountant.events`` (the client's need) does not load the accountants,
scipy or the rules. Where each concept lives: docs/ARCHITECTURE.md, "Where to find things".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

# name → the module that defines it (the one place the surface is listed; the imports below
# repeat it for type checkers, and a test keeps the two equal).
_EXPORTS: Final[dict[str, str]] = {
    name: module
    for module, names in {
        "accountant.events": (
            "AdaptiveGaussianEvent",
            "ApproxDpEvent",
            "ComposedEvent",
            "DpEvent",
            "FunctionalMechanismEvent",
            "FunctionalMechanismL2DPEvent",
            "GaussianEvent",
            "LaplaceEvent",
            "NoOpEvent",
            "NonPrivateEvent",
            "OutputPerturbationEvent",
            "PoissonSampledEvent",
            "PureDpEvent",
            "SampledWithoutReplacementEvent",
            "SelfComposedEvent",
            "from_json",
            "to_json",
        ),
        "accountant.errors": (
            "AccountantError",
            "EventValidationError",
            "InvalidArgumentError",
            "InvalidFieldError",
            "UnsupportedEventError",
        ),
        "accountant.base": ("EpsilonBound", "PrivacyAccountant"),
        "accountant.basic": ("BasicAccountant",),
        "accountant.rdp": ("RdpAccountant",),
        "accountant.prv": ("PrvAccountant",),
        "accountant.registry": ("accountant_names", "make_accountant"),
        "accountant.calibration": ("calibrate_noise_multiplier", "calibrate_to_epsilon"),
        "accountant.rules": ("BatchState", "Budget", "BudgetExceeded", "Charge", "ChargeRefused"),
    }.items()
    for name in names
}

if TYPE_CHECKING:
    from accountant.base import EpsilonBound, PrivacyAccountant
    from accountant.basic import BasicAccountant
    from accountant.calibration import calibrate_noise_multiplier, calibrate_to_epsilon
    from accountant.errors import (
        AccountantError,
        EventValidationError,
        InvalidArgumentError,
        InvalidFieldError,
        UnsupportedEventError,
    )
    from accountant.events import (
        AdaptiveGaussianEvent,
        ApproxDpEvent,
        ComposedEvent,
        DpEvent,
        FunctionalMechanismEvent,
        FunctionalMechanismL2DPEvent,
        GaussianEvent,
        LaplaceEvent,
        NonPrivateEvent,
        NoOpEvent,
        OutputPerturbationEvent,
        PoissonSampledEvent,
        PureDpEvent,
        SampledWithoutReplacementEvent,
        SelfComposedEvent,
        from_json,
        to_json,
    )
    from accountant.prv import PrvAccountant
    from accountant.rdp import RdpAccountant
    from accountant.registry import accountant_names, make_accountant
    from accountant.rules import BatchState, Budget, BudgetExceeded, Charge, ChargeRefused
else:

    def __getattr__(name: str) -> Any:
        """PEP 562: a public name, imported from its module on first use (then cached here)."""
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'accountant' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AccountantError",
    "AdaptiveGaussianEvent",
    "ApproxDpEvent",
    "BasicAccountant",
    "BatchState",
    "Budget",
    "BudgetExceeded",
    "Charge",
    "ChargeRefused",
    "ComposedEvent",
    "DpEvent",
    "EpsilonBound",
    "EventValidationError",
    "FunctionalMechanismEvent",
    "FunctionalMechanismL2DPEvent",
    "GaussianEvent",
    "InvalidArgumentError",
    "InvalidFieldError",
    "LaplaceEvent",
    "NoOpEvent",
    "NonPrivateEvent",
    "OutputPerturbationEvent",
    "PoissonSampledEvent",
    "PrivacyAccountant",
    "PrvAccountant",
    "PureDpEvent",
    "RdpAccountant",
    "SampledWithoutReplacementEvent",
    "SelfComposedEvent",
    "UnsupportedEventError",
    "accountant_names",
    "calibrate_noise_multiplier",
    "calibrate_to_epsilon",
    "from_json",
    "make_accountant",
    "to_json",
]
