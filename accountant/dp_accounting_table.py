"""The classes the ledger shares with dp_accounting, their field names, and one dp_accounting
JSON node read into ledger JSON (the table and the form are documented in
``accountant.dp_accounting_form``).

Below ``accountant.events``, which reads either form with ``to_ledger_json``: this module imports
no event, so the two never import each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from accountant.errors import EventValidationError

MODULE_NAME: Final = "dp_accounting.dp_event"

# class name → (ledger kind, {dp_accounting field: ledger field}); nested events keep their names.
SHARED: Final[Mapping[str, tuple[str, Mapping[str, str]]]] = {
    "NoOpDpEvent": ("no_op", {}),
    "NonPrivateDpEvent": ("non_private", {}),
    "GaussianDpEvent": ("gaussian", {"noise_multiplier": "noise_multiplier"}),
    "LaplaceDpEvent": ("laplace", {"noise_multiplier": "scale"}),
    "PoissonSampledDpEvent": ("poisson_sampled", {"sampling_probability": "sampling_probability"}),
    "SampledWithoutReplacementDpEvent": (
        "sampled_without_replacement",
        {"source_dataset_size": "population_size", "sample_size": "sample_size"},
    ),
    "SelfComposedDpEvent": ("self_composed", {"count": "count"}),
    "ComposedDpEvent": ("composed", {}),
}
NESTED: Final[Mapping[str, str]] = {
    "PoissonSampledDpEvent": "event",
    "SampledWithoutReplacementDpEvent": "event",
    "SelfComposedDpEvent": "event",
    "ComposedDpEvent": "events",
}
# ledger kind → class name
CLASS_OF_KIND: Final[Mapping[str, str]] = {kind: name for name, (kind, _) in SHARED.items()}


def to_ledger_json(obj: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The ledger JSON of one dp_accounting node; nested events are passed on as they are (the
    caller, ``accountant.events.from_json``, parses them in whichever form they are written).
    ``EventValidationError`` names the dp_accounting field's dotted path."""
    name = obj.get("class_name")
    if not isinstance(name, str) or name not in SHARED:
        raise EventValidationError(
            f"{path}.class_name",
            f"must be a dp_accounting event the ledger shares: one of {sorted(SHARED)}. Found "
            f"{name!r} (other dp_accounting events have no ledger kind and are refused, not "
            "approximated).",
        )
    module = obj.get("module_name", MODULE_NAME)
    if module != MODULE_NAME:
        raise EventValidationError(
            f"{path}.module_name", f"must be {MODULE_NAME!r} (or left out). Found {module!r}."
        )
    kind, renames = SHARED[name]
    nested = NESTED.get(name)
    allowed = {"class_name", "module_name", *renames, *([nested] if nested else [])}
    unknown = sorted((key for key in obj if key not in allowed), key=repr)
    if unknown:
        raise EventValidationError(
            f"{path}.{unknown[0]}",
            f"is not a field of dp_accounting's {name} (its fields: {', '.join(sorted(allowed))}); "
            "it is refused, not ignored, since it could change what ran.",
        )
    for field in (*renames, *([nested] if nested else [])):
        if field not in obj:
            raise EventValidationError(f"{path}.{field}", "is required.")
    out: dict[str, Any] = {"kind": kind, **{ours: obj[theirs] for theirs, ours in renames.items()}}
    if nested is not None:
        out[nested] = obj[nested]
    return out


def dp_accounting_field(kind: str, field: str) -> str:
    """The dp_accounting name of a ledger field of ``kind`` (to name a bad value in its words)."""
    name = CLASS_OF_KIND.get(kind)
    if name is None:
        return field
    for theirs, ours in SHARED[name][1].items():
        if ours == field:
            return theirs
    return field


__all__ = ["CLASS_OF_KIND", "MODULE_NAME", "NESTED", "SHARED", "dp_accounting_field", "to_ledger_json"]
