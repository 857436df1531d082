"""Request and response schemas of HTTP API v1 (DESIGN.md, "HTTP API v1").

Requests are validated here, field by field, so a 422 names the field and the value
(``"budget.epsilon must be finite and > 0. Found nan."``). Numbers a user sends are kept as the
decimal they wrote (``accountant.exact.as_written``): ``0.01`` is one hundredth, never the float
nearest to it. Events are parsed with ``accountant.events.from_json``, whose errors carry the dotted
path of the bad field (``event.event.noise_multiplier``).

Responses are the domain layer's JSON-ready dicts; the ``*Public`` models document them in the
OpenAPI schema and allow fields added later (``extra="allow"``).
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    model_validator,
)
from pydantic_core import PydanticCustomError

from accountant import events as dp_events
from accountant.exact import as_written
from accountant.rules import MAX_COMMITMENT_LENGTH
from service.ledger.batches import MAX_RECORD_ID_LENGTH
from service.ledger.reservations import MAX_TTL_S

# ---------------------------------------------------------------------------------------------
# numbers


def _fmt(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _decimal(value: object) -> Decimal:
    """The number as written, or a 422 naming it. Booleans and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise PydanticCustomError(
            "number_type", "must be a number. Found {found}.", {"found": _fmt(value)}
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError(
            "number_finite", "must be finite. Found {found}.", {"found": _fmt(value)}
        )
    try:
        number = as_written(value)
    except (ValueError, InvalidOperation) as exc:
        raise PydanticCustomError(
            "number_type", "must be a number. Found {found}.", {"found": _fmt(value)}
        ) from exc
    if not number.is_finite():
        raise PydanticCustomError(
            "number_finite", "must be finite. Found {found}.", {"found": _fmt(value)}
        )
    return number


def _positive(value: object) -> Decimal:
    try:
        number = _decimal(value)
    except PydanticCustomError:
        number = None
    if number is None or number <= 0:
        raise PydanticCustomError(
            "positive_number", "must be finite and > 0. Found {found}.", {"found": _fmt(value)}
        )
    return number


def _delta(value: object) -> Decimal:
    try:
        number = _decimal(value)
    except PydanticCustomError:
        number = None
    if number is None or not 0 <= number < 1:
        raise PydanticCustomError(
            "delta_range", "must be in [0, 1). Found {found}.", {"found": _fmt(value)}
        )
    return number


def _ratio(value: object) -> Decimal:
    try:
        number = _decimal(value)
    except PydanticCustomError:
        number = None
    if number is None or not 0 < number < 1:
        raise PydanticCustomError(
            "ratio_range", "must be in (0, 1). Found {found}.", {"found": _fmt(value)}
        )
    return number


def _text_or_integer(max_length: int, what: str) -> Any:
    """A validator for ids a client may send as a string or an integer (one error, one field)."""

    def check(value: object) -> str | int:
        if isinstance(value, str) and 1 <= len(value) <= max_length:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise PydanticCustomError(
            "text_or_integer",
            "must be {what}: a string of 1-{max_length} characters or an integer. Found {found}.",
            {"what": what, "max_length": max_length, "found": _fmt(value)},
        )

    return BeforeValidator(check)


Epsilon = Annotated[Decimal, BeforeValidator(_positive)]
Delta = Annotated[Decimal, BeforeValidator(_delta)]
Ratio = Annotated[Decimal, BeforeValidator(_ratio)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=200)]
# Ids travel as strings; a client may send a record id or a version as an integer.
ObjectId = Annotated[str | int, _text_or_integer(64, "an id")]
RecordId = Annotated[str | int, _text_or_integer(MAX_RECORD_ID_LENGTH, "a record id")]
Version = Annotated[str | int, _text_or_integer(100, "a version")]
EventJson = dict[str, Any]


def _check_event(obj: object, path: str) -> None:
    """Parse an event so that a bad one is a 422 naming its innermost field."""
    try:
        dp_events.from_json(obj, path)
    except dp_events.EventValidationError as exc:
        raise PydanticCustomError(
            "invalid_event", "{message}", {"field": exc.field, "message": exc.message}
        ) from exc


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Public(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------
# datasets


class GeometricCreate(_Request):
    first: Epsilon
    ratio: Ratio


class BudgetCreate(_Request):
    rule: Literal["lifelong", "parallel", "sequential", "geometric"]
    epsilon: Epsilon
    delta: Delta = Decimal(0)
    accountant: Literal["basic", "rdp", "prv"] = "basic"
    geometric: GeometricCreate | None = None
    plan: list[EventJson] | None = Field(
        default=None,
        description="Declared plan (a sequence of events fixed in advance); required for "
        "`prv`, which is valid only for a plan (DESIGN.md, adaptive composition).",
    )
    orders: list[float] | None = Field(
        default=None, description="RDP orders of the Rényi filter (`rdp`); fixed at creation."
    )

    @model_validator(mode="after")
    def _events_parse(self) -> BudgetCreate:
        for index, event in enumerate(self.plan or ()):
            _check_event(event, f"plan[{index}]")
        return self


class DatasetCreate(_Request):
    name: Name
    budget: BudgetCreate


class DatasetPublic(_Public):
    id: Any
    name: str
    budget: dict[str, Any]


class DatasetsPublic(_Public):
    data: list[DatasetPublic]
    count: int


# ---------------------------------------------------------------------------------------------
# tasks and batches


class TaskCreate(_Request):
    name: Name


class TaskPublic(_Public):
    id: Any
    name: str


class TasksPublic(_Public):
    data: list[TaskPublic]
    count: int


class BatchCreate(_Request):
    name: Name
    records: list[RecordId] = Field(min_length=1)


class BatchesCreate(_Request):
    batches: list[BatchCreate] = Field(min_length=1)


class BatchPublic(_Public):
    id: Any
    name: str
    size: int


class BatchesPublic(_Public):
    data: list[BatchPublic]


# ---------------------------------------------------------------------------------------------
# reservations and commits


class ReservationCreate(_Request):
    batches: list[ObjectId] | None = Field(default=None, min_length=1)
    tasks: list[ObjectId] | None = Field(default=None, min_length=1)
    event: EventJson
    noise_commitment: (
        Annotated[StrictStr, Field(min_length=1, max_length=MAX_COMMITMENT_LENGTH)] | None
    ) = None
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S)] | None = Field(
        default=None,
        description="Seconds until the hold expires unless committed or aborted "
        "(default: the server's LEDGER_RESERVATION_TTL_S).",
    )

    @model_validator(mode="after")
    def _target_and_event(self) -> ReservationCreate:
        if (self.batches is None) == (self.tasks is None):
            raise PydanticCustomError(
                "reservation_target",
                "exactly one of batches or tasks must be given, as a non-empty list of ids.",
                {"field": "batches"},
            )
        _check_event(self.event, "event")
        return self


class CostPublic(_Public):
    epsilon: str
    delta: str


class BatchCostPublic(_Public):
    id: str
    epsilon: str
    delta: str
    naive_epsilon: str
    level: int | None = None
    replay: bool | None = None


class ReservationPublic(_Public):
    id: str
    dataset_id: str
    status: str
    cost: CostPublic
    committed: CostPublic
    commits: int
    noise_commitment: str | None
    expires_at: str
    created_at: str
    closed_at: str | None
    batches: list[BatchCostPublic]


class Release(_Request):
    model: Name
    version: Version


class CommitRequest(_Request):
    release: Release
    event: EventJson | None = Field(
        default=None,
        description="Progressive commit: the cost of the run so far, as an event (never more "
        "than reserved). Omitted: the whole reservation is committed.",
    )

    @model_validator(mode="after")
    def _event_parses(self) -> CommitRequest:
        if self.event is not None:
            _check_event(self.event, "event")
        return self


class CertificatePublic(_Public):
    """A stored certificate; ``certificate`` is the issued record, re-verifiable offline with
    ``accountant.certificates.verify``."""

    id: str
    dataset_id: str
    reservation_id: str
    release: dict[str, Any]
    content_hash: str
    created_at: str
    certificate: dict[str, Any]


class CertificatesPublic(_Public):
    data: list[CertificatePublic]
    count: int


class CommitPublic(_Public):
    certificate: CertificatePublic
    reservation: ReservationPublic


# ---------------------------------------------------------------------------------------------
# spend, audit, health


class TaskSpend(_Public):
    id: Any
    name: str
    epsilon_spent: str


class SpendPublic(_Public):
    rule: str
    epsilon_budget: str
    delta_budget: str
    epsilon_spent: str
    delta_spent: str
    epsilon_remaining: str
    naive_sequential_epsilon: str
    tasks: list[TaskSpend]


class AuditVerification(_Public):
    ok: bool
    entries: int


class ErrorBody(_Public):
    error: str
    message: str
