"""dp-accounting's form of an event, and the ledger's kinds it shares (docs/DESIGN-NOTES.md,
note "Opacus, dp-accounting, MLflow, Prometheus").

Google's dp_accounting has no JSON form of its ``DpEvent``; what it offers for "serialization"
(its docstring's word) is ``DpEvent.to_named_tuple()`` / ``DpEvent.from_named_tuple()``: a named
tuple of ``module_name``, ``class_name`` and the attrs fields, nested events as named tuples. The
JSON form accepted here is that named tuple written as a JSON object, recursively::

    {"module_name": "dp_accounting.dp_event", "class_name": "PoissonSampledDpEvent",
     "sampling_probability": 0.01,
     "event": {"module_name": "dp_accounting.dp_event", "class_name": "GaussianDpEvent",
               "noise_multiplier": 1.1}}

It is recognised by ``class_name`` (a ledger event has ``kind`` instead); ``module_name`` may be
left out, and when given must be ``dp_accounting.dp_event`` (``from_named_tuple`` would import
whatever module it names: this parser imports nothing). Parsing is as strict as
``accountant.events.from_json``: a key that is not a field of the class is refused, naming its
dotted path, and a class without a ledger kind is refused by name, never approximated.

The classes both libraries share and what they mean here (same parameters, same neighbouring
relation as dp_accounting's own accountants use for them):

==================================  ====================================================
dp_accounting                       ledger
==================================  ====================================================
``NoOpDpEvent``                     ``no_op``
``NonPrivateDpEvent``               ``non_private``
``GaussianDpEvent(noise_multiplier)``  ``gaussian(noise_multiplier)``
``LaplaceDpEvent(noise_multiplier)``   ``laplace(scale)``: both are b / (L1 sensitivity)
``PoissonSampledDpEvent(q, e)``     ``poisson_sampled(q, e)``
``SampledWithoutReplacementDpEvent(n, m, e)``  ``sampled_without_replacement(m, n, e)`` (both
                                    replace-one, Wang, Balle & Kasiviswanathan 2019)
``SelfComposedDpEvent(e, k)``       ``self_composed(e, k)``
``ComposedDpEvent(events)``         ``composed(events)``
==================================  ====================================================

Every shared event makes the round trip unchanged. dp_accounting's source (after its 0.6.0
release, the newest on PyPI) adds ``EpsilonDeltaDpEvent``, the ledger's ``approx_dp``; it is not
mapped until a released dp-accounting has it to test the round trip against.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard, runtime_checkable

from accountant import events as ev
from accountant.dp_accounting_table import CLASS_OF_KIND, MODULE_NAME, NESTED, SHARED


def to_dp_accounting_json(event: ev.DpEvent) -> dict[str, Any]:
    """dp_accounting's form of ``event`` (``DpEvent.from_named_tuple`` of it rebuilds the object).
    ``ValueError`` naming the first ledger kind dp_accounting
    lacks (``pure_dp``, ``approx_dp``, ``l2dp_ml_functional``, ``output_perturbation``,
    ``adaptive_gaussian``)."""
    name = CLASS_OF_KIND.get(event.kind)
    if name is None:
        raise ValueError(
            f"a {event.kind!r} event has no dp_accounting class (shared kinds: "
            f"{', '.join(sorted(CLASS_OF_KIND))})."
        )
    out: dict[str, Any] = {"module_name": MODULE_NAME, "class_name": name}
    for theirs, ours in SHARED[name][1].items():
        out[theirs] = getattr(event, ours)
    if isinstance(event, ev.ComposedEvent):
        out["events"] = [to_dp_accounting_json(e) for e in event.events]
    elif name in NESTED:
        out["event"] = to_dp_accounting_json(event.children()[0])
    return out


# ---------------------------------------------------------------------------------------------
# dp_accounting's objects, read without importing dp_accounting
# ---------------------------------------------------------------------------------------------


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
    if not isinstance(form, dict):
        raise ev.EventValidationError("event", f"must be a dp_accounting DpEvent. Found {event!r}.")
    return form


def from_dp_accounting(event: DpAccountingEvent) -> ev.DpEvent:
    """The ledger event of a dp_accounting event; ``EventValidationError`` names the first field
    or class the ledger does not share (``event.event.class_name``)."""
    return ev.from_json(dp_accounting_json(event))


__all__ = [
    "MODULE_NAME",
    "SHARED",
    "DpAccountingEvent",
    "dp_accounting_json",
    "from_dp_accounting",
    "is_dp_accounting_event",
    "to_dp_accounting_json",
]
