"""The accountants by name, above their implementations (as Opacus's ``accountants/registry``):
``make_accountant("rdp")``. This module imports the accountants; none of them imports it, so the
package's imports form a DAG: ``errors`` ← ``events`` ← ``base`` ← ``basic`` / ``rdp`` / ``prv``
← ``registry``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from accountant.base import PrivacyAccountant
from accountant.basic import NAME as BASIC
from accountant.basic import BasicAccountant
from accountant.errors import InvalidArgumentError
from accountant.prv import NAME as PRV
from accountant.prv import PrvAccountant
from accountant.rdp import NAME as RDP
from accountant.rdp import RdpAccountant

_REGISTRY: Final[dict[str, Callable[[], PrivacyAccountant]]] = {
    BASIC: BasicAccountant,
    RDP: RdpAccountant,
    PRV: PrvAccountant,
}


def register(name: str, factory: Callable[[], PrivacyAccountant]) -> None:
    """Add an accountant under ``name`` (a plug-in; the built-in three are registered above)."""
    _REGISTRY[name] = factory


def accountant_names() -> list[str]:
    return sorted(_REGISTRY)


def make_accountant(name: str) -> PrivacyAccountant:
    """A fresh accountant by registry name (``basic``, ``rdp``, ``prv``)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise InvalidArgumentError(
            "accountant", f"must be one of {sorted(_REGISTRY)}. Found {name!r}."
        ) from None
    return factory()


__all__ = ["accountant_names", "make_accountant", "register"]
