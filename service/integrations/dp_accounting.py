"""dp-accounting's ``DpEvent`` objects ⇄ the ledger's events, for the kinds both libraries share
(the table in ``accountant.dp_accounting_form``).

::

    import dp_accounting
    from service.integrations.dp_accounting import from_dp_accounting, to_dp_accounting

    step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.1))
    ledger.reserve(dataset_id, dp_accounting.SelfComposedDpEvent(step, 1000), tasks=[task])
    event = from_dp_accounting(dp_accounting.SelfComposedDpEvent(step, 1000))   # a ledger event
    to_dp_accounting(event) == dp_accounting.SelfComposedDpEvent(step, 1000)     # and back

``LedgerClient`` takes a dp_accounting event wherever it takes an event (it converts with
``from_dp_accounting``, so an event the ledger cannot describe is refused before anything is
sent). Reading one needs nothing from dp_accounting but the object's own ``to_named_tuple()``
(``accountant.dp_accounting_form``); building one (``to_dp_accounting``) imports dp_accounting.
"""

from __future__ import annotations

from typing import Any

import dp_accounting

from accountant import dp_accounting_form
from accountant import events as ev
from accountant.dp_accounting_form import dp_accounting_json, from_dp_accounting

__all__ = ["dp_accounting_json", "from_dp_accounting", "to_dp_accounting"]


def to_dp_accounting(event: ev.DpEvent) -> Any:
    """The dp_accounting event of a ledger event; ``ValueError`` for a kind dp_accounting lacks."""

    def build(node: dict[str, Any]) -> Any:
        cls = getattr(dp_accounting.dp_event, node["class_name"])
        fields: dict[str, Any] = {}
        for name, value in node.items():
            if name in ("module_name", "class_name"):
                continue
            if name == "events":
                value = [build(v) for v in value]
            elif name == "event":
                value = build(value)
            fields[name] = value
        return cls(**fields)

    return build(dp_accounting_form.to_dp_accounting_json(event))
