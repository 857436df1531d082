"""The rules' refusals: a charge that does not fit (``BudgetExceeded``, answered 409 with
``requested`` and ``remaining``) and one the rule refuses for another reason (``ChargeRefused``
with a stable ``code``)."""

from __future__ import annotations

from collections.abc import Mapping

from accountant.errors import AccountantError

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class BudgetExceeded(AccountantError):
    """The charge does not fit. ``requested`` / ``remaining``: ``{"epsilon": str, "delta": str}``."""

    def __init__(self, requested: Mapping[str, str], remaining: Mapping[str, str], message: str = "") -> None:
        self.requested: dict[str, str] = dict(requested)
        self.remaining: dict[str, str] = dict(remaining)
        self.message = message or (
            f"requested epsilon={self.requested.get('epsilon')}, "
            f"delta={self.requested.get('delta')} exceeds the remaining "
            f"epsilon={self.remaining.get('epsilon')}, delta={self.remaining.get('delta')}."
        )
        super().__init__(self.message)


class ChargeRefused(AccountantError):
    """The rule refuses the charge whatever the budget. ``code`` is stable (the API's error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
