"""The accountant's typed errors: a leaf module every other module may import.

``AccountantError`` is the base; ``InvalidArgumentError`` names the bad non-event argument
(``field``), ``UnsupportedEventError`` the accountant and the event it cannot account for.
``InvalidFieldError`` (a ``ValueError`` naming a field's dotted path) and its
``EventValidationError`` (a bad event or event JSON) live here too, below ``accountant.events``
and ``accountant.dp_accounting_table``, which both raise them (``accountant.events`` re-exports
them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accountant.events import DpEvent


class InvalidFieldError(ValueError):
    """A named input field is invalid: ``field`` is its dotted path, ``message`` what is wrong,
    and ``str()`` is ``"{field} {message}"``. The base of errors that name the bad field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message


class EventValidationError(InvalidFieldError):
    """An event (or its JSON form) is invalid. ``field`` is the dotted path of the bad field."""


class AccountantError(Exception):
    """Base class of the accountant's typed errors."""


class UnsupportedEventError(AccountantError):
    """The accountant cannot account for ``event`` (the innermost unsupported event)."""

    def __init__(self, accountant: str, event: DpEvent, reason: str = "") -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(f"accountant {accountant!r} does not support event kind {event.kind!r}{detail}")
        self.accountant = accountant
        self.event = event
        self.reason = reason


class InvalidArgumentError(AccountantError, ValueError):
    """A non-event argument (δ, ε, orders, ...) is invalid. ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.message = message


__all__ = [
    "AccountantError",
    "EventValidationError",
    "InvalidArgumentError",
    "InvalidFieldError",
    "UnsupportedEventError",
]
