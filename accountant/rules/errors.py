"""The rules' refusals: a charge that does not fit (``BudgetExceeded``, answered 409 with
``requested`` and ``remaining``) and one the rule refuses for another reason (``ChargeRefused``
with a stable ``code``)."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from accountant.errors import AccountantError
from accountant.exact import to_text


@dataclass(frozen=True, slots=True)
class Amount:
    """An (ε, δ) pair of exact decimals: what a charge asks for, or what a batch has left
    (``remaining``). ``to_json``: its wire form, ``{"epsilon": str, "delta": str}``."""

    epsilon: Decimal
    delta: Decimal

    def to_json(self) -> dict[str, Any]:
        return {"epsilon": to_text(self.epsilon), "delta": to_text(self.delta)}


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class BudgetExceeded(AccountantError):
    """The charge does not fit: what it asks for (``requested``) and what the batch has left
    (``remaining``), as ``Amount``s; the ledger's 409 carries their ``to_json``."""

    def __init__(self, requested: Amount, remaining: Amount, message: str = "") -> None:
        self.requested = requested
        self.remaining = remaining
        self.message = message or (
            f"requested epsilon={to_text(requested.epsilon)}, "
            f"delta={to_text(requested.delta)} exceeds the remaining "
            f"epsilon={to_text(remaining.epsilon)}, delta={to_text(remaining.delta)}."
        )
        super().__init__(self.message)


class ChargeRefused(AccountantError):
    """The rule refuses the charge whatever the budget. ``code`` is stable (the API's error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
