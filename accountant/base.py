"""The accountant interface and its result type (the registry of accountants by name is
``accountant.registry``, above the accountants; the errors are ``accountant.errors``).

An accountant is a pure consumer of mechanism events (``accountant.events``) behind one small
interface, as in dp_accounting's ``PrivacyAccountant``:

* ``supports(event)`` — the dry run: can this event be accounted here?
* ``compose(event, count=1)`` — the real update; raises ``UnsupportedEventError`` naming the event.
* ``get_epsilon(delta)`` — an ``EpsilonBound(lower, estimate, upper)``; certification uses ``upper``.
* ``get_delta(epsilon)`` — a δ for which the composition so far is (ε, δ)-DP (an upper bound).

Both the dry run and the update go through one recursive dispatcher per accountant, so they cannot
drift apart. A non-private event gives ε = ∞, not an exception.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent


@dataclass(frozen=True, slots=True)
class EpsilonBound:
    """ε for a given δ as bounds: ``lower <= estimate <= upper``. The ledger charges ``upper``.

    ``method`` says how the numbers were obtained (e.g. ``"prv"`` or ``"rdp-fallback"``), and
    ``note`` explains a fallback, so a certificate can state it.
    """

    lower: float
    estimate: float
    upper: float
    delta: float
    method: str = ""
    note: str = ""
    details: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("lower", "estimate", "upper"):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"EpsilonBound.{name} must be >= 0 and not NaN. Found {value}.")
        if not self.lower <= self.estimate <= self.upper:
            raise ValueError(
                f"EpsilonBound needs lower <= estimate <= upper. Found "
                f"{self.lower} <= {self.estimate} <= {self.upper}."
            )

    @classmethod
    def exact(cls, epsilon: float, delta: float, method: str) -> EpsilonBound:
        return cls(epsilon, epsilon, epsilon, delta, method)

    def to_json(self) -> dict[str, object]:
        return {
            "lower": self.lower,
            "estimate": self.estimate,
            "upper": self.upper,
            "delta": self.delta,
            "method": self.method,
            "note": self.note,
        }


def check_delta(delta: float, field_name: str = "delta") -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not math.isfinite(delta):
        raise InvalidArgumentError(field_name, f"must be finite and in [0, 1). Found {delta}.")
    if not 0 <= delta < 1:
        raise InvalidArgumentError(field_name, f"must be in [0, 1). Found {delta}.")


def check_epsilon(epsilon: float, field_name: str = "epsilon") -> None:
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or math.isnan(epsilon):
        raise InvalidArgumentError(field_name, f"must be a number >= 0. Found {epsilon}.")
    if epsilon < 0:
        raise InvalidArgumentError(field_name, f"must be >= 0. Found {epsilon}.")


class PrivacyAccountant(ABC):
    """Accumulates composed events; answers ε for δ and δ for ε. Subclasses set ``name``."""

    name: str = ""

    @abstractmethod
    def supports(self, event: DpEvent) -> bool:
        """Whether ``compose(event)`` would succeed (the dry run of the same dispatcher)."""

    @abstractmethod
    def compose(self, event: DpEvent, count: int = 1) -> PrivacyAccountant:
        """Add ``count`` adaptive runs of ``event``; return ``self`` for chaining."""

    @abstractmethod
    def get_epsilon(self, delta: float) -> EpsilonBound:
        """ε bounds for ``delta`` for everything composed so far."""

    @abstractmethod
    def get_delta(self, epsilon: float) -> float:
        """An upper bound on δ for ``epsilon`` for everything composed so far."""
