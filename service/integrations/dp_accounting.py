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
sent). Reading one needs nothing from dp_accounting but the object's own ``to_named_tuple()``;
building one (``to_dp_accounting``) imports dp_accounting.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard, runtime_checkable

from accountant import dp_accounting_form
from accountant import events as ev


@runtime_checkable
class DpAccountingEvent(Protocol):
    """A ``dp_accounting.DpEvent``, as far as reading it goes."""

    def to_named_tuple(self) -> Any: ...


def is_dp_accounting_event(obj: object) -> TypeGuard[DpAccountingEvent]:
    """Whether ``obj`` is a dp_accounting ``DpEvent`` (by its module: nothing is imported)."""
    return type(obj).__module__.split(".")[0] == "dp_accounting" and isinstance(obj, DpAccountingEvent)


def _plain(value: Any) -> Any:
    """A named tuple tree (``DpEvent.to_named_tuple()``) as JSON values."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def dp_accounting_json(event: DpAccountingEvent) -> dict[str, Any]:
    """dp_accounting's JSON form of its event: ``to_named_tuple()`` as a JSON object."""
    form = _plain(event.to_named_tuple())
    assert isinstance(form, dict)
    return form


def from_dp_accounting(event: DpAccountingEvent) -> ev.DpEvent:
    """The ledger event of a dp_accounting event; ``EventValidationError`` names the first field
    or class the ledger does not share (``event.event.class_name``)."""
    return ev.from_json(dp_accounting_json(event))


def to_dp_accounting(event: ev.DpEvent) -> Any:
    """The dp_accounting event of a ledger event; ``ValueError`` for a kind dp_accounting lacks."""
    import dp_accounting

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
