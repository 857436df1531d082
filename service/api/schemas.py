"""Request and response schemas of HTTP API v1 (docs/ARCHITECTURE.md, "HTTP API v1").

Requests are validated here, field by field, so a 422 names the field and the value
(``"budget.epsilon must be finite and > 0. Found nan."``). Numbers a user sends are kept as the
decimal they wrote (``accountant.exact.as_written``): ``0.01`` is one hundredth, never the float
nearest to it. Events are parsed with ``accountant.events.from_json``, whose errors carry the dotted
path of the bad field (``event.event.noise_multiplier``).

Responses are the domain layer's JSON-ready dicts; the ``*Public`` models document them in the
OpenAPI schema and allow fields added later (``extra="allow"``);
``tests/service/api/test_documented_answers.py`` fails an answer of the routes it drives that has
a field its model does not name, lacks one it requires, or orders them otherwise.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from accountant import events as dp_events
from accountant.exact import as_written
from accountant.rules import MAX_COMMITMENT_LENGTH
from service.api.openapi import (
    DATA_SOURCE_SCHEMA,
    DECIMAL_RE,
    MIN_RDP_DELTA,
    NUMBER_SCHEMAS,
    TEXT_PATTERN,
    VERSION_INTEGER_LIMIT,
    VERSION_SCHEMA,
    budget_schema_extra,
    quote_schema_extra,
    reservation_schema_extra,
    text_or_integer_schema,
)
from service.ledger.batches import MAX_RECORD_ID_LENGTH
from service.ledger.quotes import DEFAULT_CLASSES_PER_PAGE, MAX_CLASSES_PER_PAGE
from service.ledger.reservations import MAX_TTL_S

# ---------------------------------------------------------------------------------------------
# numbers


def _fmt(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _decimal(value: object) -> Decimal:
    """The number as written, or a 422 naming it. Booleans and non-numbers are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise PydanticCustomError("number_type", "must be a number. Found {found}.", {"found": _fmt(value)})
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("number_finite", "must be finite. Found {found}.", {"found": _fmt(value)})
    if isinstance(value, str) and DECIMAL_RE.fullmatch(value) is None:
        # the documented string form (service.api.openapi.DECIMAL_PATTERN), nothing wider
        raise PydanticCustomError("number_type", "must be a number. Found {found}.", {"found": _fmt(value)})
    try:
        number = as_written(value)
    except (ValueError, InvalidOperation) as exc:
        raise PydanticCustomError(
            "number_type", "must be a number. Found {found}.", {"found": _fmt(value)}
        ) from exc
    if not number.is_finite():
        raise PydanticCustomError("number_finite", "must be finite. Found {found}.", {"found": _fmt(value)})
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
        raise PydanticCustomError("delta_range", "must be in [0, 1). Found {found}.", {"found": _fmt(value)})
    return number


def _ratio(value: object) -> Decimal:
    try:
        number = _decimal(value)
    except PydanticCustomError:
        number = None
    if number is None or not 0 < number < 1:
        raise PydanticCustomError("ratio_range", "must be in (0, 1). Found {found}.", {"found": _fmt(value)})
    return number


def _text_or_integer(max_length: int, what: str) -> Any:
    """A validator for ids a client may send as a string or an integer (one error, one field)."""

    def check(value: object) -> str | int:
        if isinstance(value, str) and 1 <= len(value) <= max_length:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            return int(value)  # 5.0 is the integer 5 in JSON (and in the OpenAPI schema)
        raise PydanticCustomError(
            "text_or_integer",
            "must be {what}: a string of 1-{max_length} characters or an integer. Found {found}.",
            {"what": what, "max_length": max_length, "found": _fmt(value)},
        )

    return BeforeValidator(check)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError(
            "not_blank",
            "must hold a character other than whitespace. Found {found}.",
            {"found": _fmt(value)},
        )
    return value


def _version(value: str | int) -> str | int:
    # what the ledger takes: str(version) of 1-100 characters, not all whitespace
    if isinstance(value, str) and not value.strip():
        raise PydanticCustomError(
            "not_blank",
            "must hold a character other than whitespace. Found {found}.",
            {"found": _fmt(value)},
        )
    if isinstance(value, int) and abs(value) > VERSION_INTEGER_LIMIT:
        raise PydanticCustomError(
            "text_or_integer",
            "must be a string version or an integer within ±10^18. Found {found}.",
            {"found": _fmt(value) if len(str(value)) <= 40 else f"an integer of {len(str(value))} digits"},
        )
    return value


# WithJsonSchema: the OpenAPI document states exactly what the validator takes (openapi.py).
Epsilon = Annotated[Decimal, BeforeValidator(_positive), WithJsonSchema(NUMBER_SCHEMAS["positive"])]
Delta = Annotated[Decimal, BeforeValidator(_delta), WithJsonSchema(NUMBER_SCHEMAS["delta"])]
# A plan segment's delta: documented > 0, as the ledger requires (0 was schema-valid, then 422).
SegmentDelta = Annotated[Decimal, BeforeValidator(_delta), WithJsonSchema(NUMBER_SCHEMAS["positive_delta"])]
Ratio = Annotated[Decimal, BeforeValidator(_ratio), WithJsonSchema(NUMBER_SCHEMAS["unit_open"])]
# Names: 1-200 characters, not all whitespace, no control character (the ledger strips nothing,
# but refuses blanks and control characters).
Name = Annotated[
    StrictStr,
    Field(min_length=1, max_length=200, json_schema_extra={"pattern": TEXT_PATTERN}),
    AfterValidator(_not_blank),
]
# Ids travel as strings; a client may send a record id or a version as an integer.
ObjectId = Annotated[
    str | int, _text_or_integer(64, "an id"), WithJsonSchema(text_or_integer_schema(64, "an id"))
]
RecordId = Annotated[
    str | int,
    _text_or_integer(MAX_RECORD_ID_LENGTH, "a record id"),
    WithJsonSchema(text_or_integer_schema(MAX_RECORD_ID_LENGTH, "a record id")),
]
Version = Annotated[
    str | int,
    _text_or_integer(100, "a version"),
    AfterValidator(_version),
    WithJsonSchema(VERSION_SCHEMA),
]
EventJson = Annotated[dict[str, Any], WithJsonSchema({"allOf": [{"$ref": "#/components/schemas/Event"}]})]


def _check_event(obj: object, path: str) -> dp_events.DpEvent:
    """Parse an event so that a bad one is a 422 naming its innermost field. The routes that
    charge or price one hand what was parsed to the ledger (``parsed_event``), which parses
    nothing again."""
    try:
        return dp_events.from_json(obj, path, new=True)
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
    copies: int | None = Field(
        default=None, ge=1, le=64, description="Geometric series side by side (sub-budgets; default 1)."
    )
    single: Epsilon | None = Field(
        default=None, description="One extra level used once, >= first (the sliding window's base: ε/3)."
    )


class BudgetCreate(_Request):
    model_config = ConfigDict(extra="forbid", json_schema_extra=budget_schema_extra)

    rule: Literal["lifelong", "parallel", "sequential", "geometric"]
    epsilon: Epsilon
    delta: Delta = Decimal(0)
    accountant: Literal["basic", "rdp", "prv", "tight"] = Field(
        default="tight",
        description="How charges compose (docs/ACCOUNTING.md). Default `tight`: a charge runs while a "
        "basic-composition filter over each run's tight (PRV) epsilon or a Rényi filter still admits "
        "everything the batch ran; valid under fully adaptive choice. `basic` only when asked for.",
    )
    geometric: GeometricCreate | None = None
    plan: list[EventJson] | None = Field(
        default=None,
        description="Declared plan (a sequence of events fixed in advance); required for "
        "`sequential` on `prv`, which is valid only for a plan (docs/ARCHITECTURE.md, "
        '"Adaptive composition").',
    )
    orders: list[float] | None = Field(
        default=None, description="RDP orders of the Rényi filter (`rdp`); fixed at creation."
    )
    plan_delta: Delta | None = Field(
        default=None,
        description="The share of `delta` the declared `plan` is priced at (default: all of it); "
        "the rest is left for later plan segments (`POST /v1/datasets/{id}/plan-segments`).",
    )

    @model_validator(mode="after")
    def _events_parse(self) -> BudgetCreate:
        for index, event in enumerate(self.plan or ()):
            _check_event(event, f"plan[{index}]")
        if self.accountant in ("rdp", "prv", "tight") and 0 < self.delta < Decimal(repr(MIN_RDP_DELTA)):
            # a smaller δ would underflow to 0 once split over the order grid (it was answered
            # "must be in (0, 1) to convert RDP. Found 0.0." from deep inside the filter)
            raise PydanticCustomError(
                "delta_range",
                "must be >= {minimum} for accountant '{accountant}' (it splits delta over its "
                "order grid in floating point). Found {found}.",
                {
                    "field": "delta",
                    "minimum": repr(MIN_RDP_DELTA),
                    "accountant": self.accountant,
                    "found": f"{self.delta:.6g}",
                },
            )
        return self


# A dataset's data source: a string or null here; its grammar and the data-root checks are the
# ledger's (service.ledger.datasets.check_data_source), whose 422 names ``data_source``.
DataSourceUri = Annotated[StrictStr | None, WithJsonSchema(DATA_SOURCE_SCHEMA)]


class DatasetCreate(_Request):
    name: Name
    budget: BudgetCreate
    data_source: DataSourceUri = None


class DataSourceSet(_Request):
    """``PUT /v1/datasets/{id}/data-source``: the new source, or ``null`` to remove it."""

    data_source: DataSourceUri


class DatasetWarning(_Public):
    code: str = Field(description="`delta_not_below_one_over_n`: the budget's δ is at least 1/N")
    field: str
    message: str


class DatasetPublic(_Public):
    id: Any
    name: str
    budget: dict[str, Any]
    data_source: str | None = Field(
        default=None, description="the URI the worker reads the records from; null: none set yet"
    )
    records: int = Field(default=0, description="records registered (the sum of its batches' sizes)")
    warnings: list[DatasetWarning] = Field(
        default_factory=list,
        description="what to look at: a budget δ ≥ 1/N for the N records registered "
        "(`delta_not_below_one_over_n`, `field: budget.delta`), which lets a mechanism publish "
        "about δ·N records in the clear",
    )
    archived_at: str | None = Field(
        default=None,
        description="when an admin archived the dataset (it takes no new work; its ledger and "
        "certificates stay readable and verifiable); null: active",
    )


class DatasetsPublic(_Public):
    data: list[DatasetPublic]
    count: int


class PlanSegmentCreate(_Request):
    """``POST /v1/datasets/{id}/plan-segments``: the next declared plan of a sequential `prv`
    budget and the share of the budget's δ it is priced at."""

    plan: list[EventJson] = Field(min_length=1, description="The segment's events, run in order.")
    delta: SegmentDelta = Field(description="This segment's share of the budget's delta (> 0).")

    _plan: tuple[dp_events.DpEvent, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _events_parse(self) -> PlanSegmentCreate:
        self._plan = tuple(_check_event(event, f"plan[{index}]") for index, event in enumerate(self.plan))
        return self

    @property
    def parsed_plan(self) -> tuple[dp_events.DpEvent, ...]:
        """``plan`` as the validator parsed it."""
        return self._plan


class PlanSegmentPublic(_Public):
    dataset_id: Any
    index: int
    plan: list[dict[str, Any]]
    delta: str
    epsilon: str
    declared: dict[str, str]
    left: dict[str, str]
    closed_batches: int
    theorem: str


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


class TaskBatchesPublic(_Public):
    """A page of a task's batches, in position order; ``next`` is the ``after`` of the next page
    (the last position of this one; ``null``: the last page)."""

    data: list[BatchPublic]
    count: int = Field(description="the task's batches, over every page")
    next: int | None


# ---------------------------------------------------------------------------------------------
# reservations and commits


class Release(_Request):
    model: Name
    version: Version


class ReleaseCommitted(Release):
    """The release a commit records; ``artifact_sha256`` is stated in its certificate."""

    artifact_sha256: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        default=None,
        description="The SHA-256 (64 lowercase hex digits) of the released artifact's bytes: "
        "stated in the certificate, so its signature binds those bytes to the release "
        "(`service.training.nets.load_model` and `ledger check` compare them). Optional.",
    )


class ReservationCreate(_Request):
    model_config = ConfigDict(extra="forbid", json_schema_extra=reservation_schema_extra)

    batches: list[ObjectId] | None = Field(default=None, min_length=1)
    tasks: list[ObjectId] | None = Field(default=None, min_length=1)
    event: EventJson
    noise_commitment: (
        Annotated[
            StrictStr,
            # printable ASCII: the ledger takes printable text, and JSON Schema has no "printable"
            Field(min_length=1, max_length=MAX_COMMITMENT_LENGTH, pattern=r"^[\x20-\x7e]+$"),
        ]
        | None
    ) = None
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S)] | None = Field(
        default=None,
        description="Seconds until the hold expires unless committed or aborted "
        "(default: the server's LEDGER_RESERVATION_TTL_S).",
    )
    release: Release | None = Field(
        default=None,
        description="The `{model, version}` the run will be committed as: a release that exists "
        "already is refused now (409 `release_exists` naming both), before anything is held or "
        "trained. Not reserved: the commit names it again.",
    )

    _event: dp_events.DpEvent | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _target_and_event(self) -> ReservationCreate:
        if (self.batches is None) == (self.tasks is None):
            raise PydanticCustomError(
                "reservation_target",
                "exactly one of batches or tasks must be given, as a non-empty list of ids.",
                {"field": "batches"},
            )
        self._event = _check_event(self.event, "event")
        return self

    @property
    def parsed_event(self) -> dp_events.DpEvent:
        """``event`` as the validator parsed it."""
        assert self._event is not None
        return self._event


class ReservationExtend(_Request):
    model_config = ConfigDict(extra="forbid")

    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S, strict=True)] = Field(
        description="Hold the reservation until at least this many seconds from now (never "
        "shorter than it is held already), at most LEDGER_RESERVATION_MAX_LIFETIME_S after its "
        "creation (409 `reservation_lifetime_exceeded` with `latest_expires_at` beyond).",
    )


class QuoteCreate(_Request):
    model_config = ConfigDict(extra="forbid", json_schema_extra=quote_schema_extra)

    batches: list[ObjectId] | None = Field(default=None, min_length=1)
    tasks: list[ObjectId] | None = Field(default=None, min_length=1)
    new_batch: Literal[True] | None = Field(
        default=None, description="price on a new, empty batch of the dataset (instead of batches or tasks)"
    )
    event: EventJson
    noise_commitment: (
        Annotated[StrictStr, Field(min_length=1, max_length=MAX_COMMITMENT_LENGTH, pattern=r"^[\x20-\x7e]+$")]
        | None
    ) = None
    limit: int = Field(
        default=DEFAULT_CLASSES_PER_PAGE,
        ge=1,
        le=MAX_CLASSES_PER_PAGE,
        description="how many state classes the answer lists",
    )
    offset: int = Field(default=0, ge=0, description="the first state class listed (`next_offset`)")
    accountants: StrictBool = Field(
        default=True,
        description="false: leave out the informational per-accountant block (`accountants: null`), "
        "e.g. in a calibration that quotes many runs",
    )

    _event: dp_events.DpEvent | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _target_and_event(self) -> QuoteCreate:
        given = [x for x in (self.batches, self.tasks, self.new_batch) if x is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "quote_target",
                "give exactly one of batches, tasks or new_batch: true.",
                {"field": "batches"},
            )
        self._event = _check_event(self.event, "event")
        return self

    @property
    def parsed_event(self) -> dp_events.DpEvent:
        """``event`` as the validator parsed it."""
        assert self._event is not None
        return self._event


class CostPublic(_Public):
    epsilon: str
    delta: str


class ReservationClassPublic(_Public):
    class_: int = Field(alias="class", description="the reservation class: batches reserved from one state")
    batches: int
    epsilon: str
    delta: str
    naive_epsilon: str
    level: int | None = None
    replay: bool | None = None


class ReservationBatchesSummary(_Public):
    count: int = Field(description="how many batches the reservation reads")
    batch_set: str = Field(
        description="sha256 over the lines '<batch id> <class>\\n' in ascending batch id order; "
        "the pairs are paged by GET /v1/reservations/{id}/batches"
    )
    classes: list[ReservationClassPublic]


class ReservationBatchPublic(_Public):
    id: str
    class_: int = Field(alias="class")


class ReservationBatchesPublic(_Public):
    reservation_id: str
    count: int
    batch_set: str
    data: list[ReservationBatchPublic]
    next: str | None = Field(description="pass as `after` for the next page; null on the last")


class QuoteRefusal(_Public):
    code: str
    message: str
    batch_id: str | None = None
    requested: CostPublic | None = None
    remaining: CostPublic | None = None


class QuoteClassPublic(_Public):
    batches: int = Field(description="how many of the quoted batches are in this state")
    batch_id: str | None = Field(description="one of them (the smallest id); null for the new batch")
    admitted: bool
    epsilon: str | None = Field(default=None, description="the charge, or what a refused one asks for")
    delta: str | None = None
    naive_epsilon: str | None = None
    level: int | None = None
    replay: bool | None = None
    refused: QuoteRefusal | None


class QuoteTotals(_Public):
    batches: int
    classes: int = Field(description="distinct batch states: each priced once")
    admitted_batches: int
    refused_batches: int


class QuoteAccountantCost(_Public):
    used: bool = Field(description="whether this dataset's budget uses this accountant")
    available: bool = Field(description="false: this rule does not take it, or it cannot price the event")
    admitted: bool | None = Field(default=None, description="whether a fresh batch would admit the event")
    epsilon: str | None = Field(default=None, description="the charge, or what a refused one asks for")
    delta: str | None = None
    reason: str | None = Field(default=None, description="why it is not available")


class QuoteAccountants(_Public):
    informational: Literal[True] = Field(description="not a charge: nothing here is held or certified")
    uses: str = Field(description="the accountant this dataset's budget uses (it never changes)")
    note: str
    by_accountant: dict[str, QuoteAccountantCost] = Field(
        description="basic, rdp, prv, tight: the event as the first charge on a new batch of a "
        "budget with this rule, epsilon and delta under that accountant"
    )


class QuotePublic(_Public):
    dataset_id: str
    on: Literal["batches", "tasks", "new_batch"] = Field(description="what was priced")
    admitted: bool
    cost: CostPublic
    totals: QuoteTotals
    classes: list[QuoteClassPublic] = Field(description="per state class, by sample batch id")
    next_offset: int | None = Field(description="`offset` of the next page of classes; null on the last")
    refused: QuoteRefusal | None
    accountants: QuoteAccountants | None = Field(
        description="informational: what the event would cost under each accountant choice (null "
        "when the request set `accountants: false`)"
    )


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
    batches: ReservationBatchesSummary


class CommitRequest(_Request):
    release: ReleaseCommitted
    event: EventJson | None = Field(
        default=None,
        description="Progressive commit: the cost of the run so far, as an event (never more "
        "than reserved). Omitted: the whole reservation is committed.",
    )

    _event: dp_events.DpEvent | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _event_parses(self) -> CommitRequest:
        if self.event is not None:
            self._event = _check_event(self.event, "event")
        return self

    @property
    def parsed_event(self) -> dp_events.DpEvent | None:
        """``event`` as the validator parsed it (``None``: not given)."""
        return self._event


class CertificatePublic(_Public):
    """A stored certificate; ``certificate`` is the issued record, re-verifiable offline with
    ``accountant.certificates.verify``. ``outcome``: ``released`` (a commit of ``release``),
    ``aborted`` or ``expired`` (a reservation charged for what could have run, ``release`` null)."""

    id: str
    dataset_id: str
    reservation_id: str
    release: dict[str, Any] | None
    outcome: Literal["released", "aborted", "expired"] = "released"
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


class TaskGuarantee(_Public):
    """The (ε, δ)-DP guarantee of everything released from the task's batches so far."""

    epsilon: str = Field(description="decimal string")
    delta: str = Field(description="decimal string")


class TaskSpend(_Public):
    """What a task has spent: the maxima over its batches, and its own guarantee."""

    id: Any = Field(description="the task's id")
    name: str = Field(description="the task's name")
    epsilon_spent: str = Field(description="the most-spent of its batches' epsilon (decimal string)")
    delta_spent: str = Field(description="the most-spent of its batches' delta (decimal string)")
    naive_sequential_epsilon: str = Field(
        description="the largest of its batches' epsilon summed naively over their charges (decimal "
        "string), for comparison"
    )
    guarantee: TaskGuarantee = Field(description="the guarantee of everything released from its batches")


class GuaranteePublic(_Public):
    """The (ε, δ)-DP guarantee of everything released so far, valid under adaptive stopping
    (``accountant.statements``; also for data charged before pricing version 3, whose stored
    spend may be a prefix), and what it covers under the rule."""

    epsilon: str = Field(description="decimal string")
    delta: str = Field(description="decimal string")
    covers: str = Field(description="what the guarantee covers under the budget's rule and accountant")


class GeometricSpend(_Public):
    """A geometric budget's schedule: the levels ``first · ratio^k`` and their bound."""

    first: str = Field(description="the first level's epsilon (decimal string)")
    ratio: str = Field(description="the ratio between consecutive levels (decimal string)")
    copies: int | None = Field(default=None, description="series side by side; absent when 1")
    single: str | None = Field(default=None, description="the one extra level used once; absent when 0")
    infinite_horizon_bound: str = Field(
        description="what every level of the schedule sums to (decimal string, rounded up)"
    )


class SpendPublic(_Public):
    """A dataset's spend, from its aggregates (decimal strings: exact, as stored)."""

    dataset_id: str = Field(description="the dataset's id")
    rule: str = Field(description="the budget's rule: lifelong, parallel, sequential or geometric")
    accountant: str = Field(description="how the budget composes charges: basic, rdp, prv or tight")
    epsilon_budget: str = Field(description="the budget's epsilon")
    delta_budget: str = Field(description="the budget's delta")
    epsilon_spent: str = Field(description="the most-spent batch's spend; see epsilon_spent_is")
    delta_spent: str = Field(description="the most-spent batch's delta")
    epsilon_remaining: str = Field(
        description="epsilon_budget − epsilon_spent, never below 0: the most-spent batch's headroom"
    )
    naive_sequential_epsilon: str = Field(
        description="the largest of the batches' epsilon summed naively over their charges, for comparison"
    )
    epsilon_held: str = Field(description="the sum of the open reservations' uncommitted epsilon")
    reservations_open: int = Field(description="reservations neither committed, aborted nor expired")
    charges_committed: int = Field(
        description="charges settled so far: each commit (progressive ones too), abort and expiry"
    )
    ledger_version: int = Field(description="how many spend transactions the dataset's ledger has run")
    last_release: dict[str, Any] | None = Field(
        description="the `release` ({model, version[, artifact_sha256]}) of the last commit; null: none yet"
    )
    tasks: list[TaskSpend] = Field(description="each task's spend, in registration order")
    guarantee: GuaranteePublic = Field(description="the guarantee of everything released so far")
    epsilon_spent_is: str = Field(
        description="what epsilon_spent is under the rule: the guarantee, or (Renyi filter) its "
        "progress, a budget share that is not a DP guarantee"
    )
    geometric: GeometricSpend | None = Field(default=None, description="geometric budgets only")


# ---------------------------------------------------------------------------------------------
# the dashboard's views (service.ledger.views): fields in the order the ledger answers them


class GuaranteePair(_Public):
    """An (ε, δ)-DP guarantee, exact decimal strings."""

    epsilon: str
    delta: str


class SpendSummaryPublic(_Public):
    """A dataset in ``GET /v1/spend``: the numbers ``GET /v1/datasets/{id}/spend`` answers."""

    id: str
    name: str
    rule: str
    accountant: str
    epsilon_budget: str
    delta_budget: str
    epsilon_spent: str = Field(description="the most-spent batch's spend; see epsilon_spent_is")
    delta_spent: str
    epsilon_remaining: str = Field(description="epsilon_budget − epsilon_spent, never below 0")
    epsilon_held: str = Field(description="the open reservations' uncommitted ε, summed")
    naive_sequential_epsilon: str = Field(description="every charge counted in sequence (the comparison)")
    guarantee: GuaranteePair = Field(
        description="the (ε, δ)-DP guarantee of everything released from the dataset so far"
    )
    epsilon_spent_is: str = Field(
        description="what epsilon_spent is under the rule: the guarantee, or (Renyi filter) its "
        "progress, a budget share that is not a DP guarantee"
    )
    reservations_open: int
    charges_committed: int
    last_release: dict[str, Any] | None = Field(description="the last commit's release; null: none yet")
    last_release_at: str | None
    created_at: str
    archived_at: str | None = Field(description="when an admin archived the dataset; null: active")
    records: int = Field(description="records registered (the sum of its batches' sizes)")


class SpendSummariesPublic(_Public):
    data: list[SpendSummaryPublic]
    count: int = Field(description="the tenant's datasets, over every page")


class BatchSpendPublic(_Public):
    """A batch with its spend, as its stored state records it."""

    id: str
    name: str
    task_id: str
    task_name: str
    position: int = Field(description="the batch's position in its task")
    size: int = Field(description="its records")
    epsilon_spent: str = Field(description="committed, under the rule")
    epsilon_held: str = Field(description="held by open reservations, not committed")
    delta_spent: str
    naive_sequential_epsilon: str = Field(description="every charge on it counted in sequence")
    reads: int = Field(description="the charges that read it")
    levels: list[int] = Field(description="the geometric levels it uses, held or committed")
    guarantee: GuaranteePair | None = Field(
        description="the (ε, δ) guarantee of what was released from the batch "
        "(`accountant.statements.batch_guarantee`); null: a stored state the ledger did not write"
    )


class GeometricLevelsPublic(_Public):
    """The geometric schedule (``budget.geometric``) and the allowance of each level used on
    the page."""

    first: str
    ratio: str
    copies: int | None = Field(default=None, description="series side by side; absent: 1")
    single: str | None = Field(default=None, description="the one extra level; absent: none")
    infinite_horizon_bound: str = Field(description="the most a block can ever spend")
    allowances: dict[str, str] = Field(description="level → its allowance, for the levels on this page")


class BatchSpendPagePublic(_Public):
    """A page of the dataset's batches with their spend, in task order then batch position."""

    dataset_id: str
    rule: str
    epsilon_budget: str
    epsilon_spent: str
    guarantee: GuaranteePair = Field(description="the dataset's (ε, δ) guarantee so far")
    count: int = Field(description="the dataset's batches, over every page")
    limit: int
    offset: int
    data: list[BatchSpendPublic]
    geometric: GeometricLevelsPublic | None = Field(default=None, description="only under a geometric budget")


class StatedPairPublic(_Public):
    """An (ε, δ) pair as the certificate states it."""

    epsilon: str | None
    delta: str | None


class HeldPublic(_Public):
    epsilon: str


class ReleaseHeadlinePublic(_Public):
    """A release and its certificate's headline; the full certificate is
    ``GET /v1/certificates/{certificate_id}``."""

    certificate_id: str
    release_id: str
    reservation_id: str
    model: str
    version: str
    created_at: str
    content_hash: str
    theorem: str | None
    epsilon: str | None = Field(
        description="the certificate's result: the largest spend over the batches the release "
        "read, after it (for a Renyi filter its progress)"
    )
    delta: str | None
    naive_epsilon: str | None
    charge: StatedPairPublic = Field(description="what the release consumed")
    budget_share: StatedPairPublic = Field(description="= charge: a budget share, not a guarantee")
    guarantee: StatedPairPublic | None = Field(
        description="the release's (ε, δ) guarantee, stated by certificates of version 3 (null before)"
    )
    within_budget: bool | None
    held_at_release: HeldPublic = Field(
        description="what open reservations held (reserved, not committed) when it was certified"
    )


class ReleasesPublic(_Public):
    data: list[ReleaseHeadlinePublic]
    count: int = Field(description="the dataset's releases, over every page")
    limit: int
    offset: int


class HistoryPointPublic(_Public):
    """The dataset right after a task's last release."""

    task_id: str
    task_name: str
    task_index: int = Field(description="1-based among all the dataset's tasks")
    releases: int = Field(description="the task's releases")
    epsilon: str = Field(description="the dataset's epsilon then (what epsilon_is says)")
    naive_sequential_epsilon: str
    guarantee: GuaranteePair = Field(description="of everything released up to then")


class EpsilonHistoryPublic(_Public):
    """The dataset's ε and naive sequential ε as tasks grow: one point per task with releases."""

    dataset_id: str
    rule: str
    epsilon_budget: str
    epsilon_spent: str
    naive_sequential_epsilon: str
    guarantee: GuaranteePair
    epsilon_is: str = Field(description="what a point's epsilon is: the guarantee, or a filter's progress")
    tasks: int = Field(description="the dataset's tasks")
    releases: int = Field(description="the dataset's releases")
    count: int = Field(description="the points, over every page")
    limit: int
    offset: int
    data: list[HistoryPointPublic]


class SignaturePublic(_Public):
    """An Ed25519 signature by the server's key ``key_id`` (``service.verification.signing``)."""

    algorithm: Literal["Ed25519"]
    key_id: str
    value: str = Field(description="base64 of the 64-byte signature")


class SignedHead(_Public):
    chain_seq: int
    hash: str
    signature: SignaturePublic


class AuditEntryPublic(_Public):
    """One entry of a dataset's audit chain, exactly as its hash covers it
    (``service.verification.audit_chain.entry_hash``)."""

    seq: int = Field(description="the entry's place among every chain's entries")
    chain: str = Field(description="the chain it belongs to: the dataset's id")
    chain_seq: int = Field(description="its place in its chain, from 1")
    event_type: str = Field(description="what happened, e.g. `reservation.committed`")
    tenant_id: str | None = Field(description="the tenant whose action it records")
    dataset_id: str | None = Field(description="the dataset it is about")
    payload: dict[str, Any] = Field(description="the event's details, as hashed")
    prev_hash: str = Field(description="the previous entry's hash (64 zeros for the chain's first)")
    hash: str = Field(
        description="SHA-256 of the canonical JSON of the entry (all but `seq` and `hash`) with `prev_hash`"
    )
    created_at: str = Field(
        description="when it was appended, in exactly the form its hash covers (`…T….ffffffZ`)"
    )


class AuditEntriesPublic(_Public):
    """A page of a dataset's audit chain, ordered by ``chain_seq``, up to its signed head."""

    dataset_id: str = Field(description="the dataset whose chain this is")
    head: SignedHead = Field(
        description="the chain head stored on the dataset row, read first, signed by the server; "
        "entries appended after it are left out"
    )
    data: list[AuditEntryPublic] = Field(description="the entries after `after`, oldest first")
    count: int = Field(description="how many entries this page holds")
    next_after: int | None = Field(description="pass as `after` for the next page; null at the head")


class AuditVerification(_Public):
    ok: bool
    entries: int
    head: SignedHead | None = Field(
        default=None, description="with `dataset_id`: the head walked to, signed by the server"
    )


class SigningKeyPublic(_Public):
    key_id: str = Field(description="16 hex characters of the SHA-256 of the raw public key")
    algorithm: Literal["Ed25519"]
    public_key: str = Field(description="base64 of the raw 32-byte public key")
    status: Literal["active", "retired"]


class SigningKeysPublic(_Public):
    keys: list[SigningKeyPublic]


# ---------------------------------------------------------------------------------------------
# jobs and the model registry


class JobProgress(_Public):
    step: int = Field(description="the training steps the job has run")
    total: int | None = Field(description="the steps its plan runs; null until a worker planned it")


class JobVersionPublic(_Public):
    """A model version a job published."""

    name: str = Field(description="the model's registry name")
    version: int = Field(description="the version's number")
    step: int | None = Field(description="the training step it was published at")


class ParamsOmitted(_Public):
    """Why ``params`` is null: the row's params exceed what an answer carries."""

    bytes: int = Field(description="the stored params' size as JSON")
    limit: int = Field(description="the most an answer carries")


class JobPublic(_Public):
    """A training job (``service.ledger.jobs.answers.JobAnswer``)."""

    id: str = Field(description="the job's id")
    dataset_id: str = Field(description="the dataset it trains on")
    algorithm: str = Field(description="what it trains (`dp_sgd`, ...)")
    params: Any = Field(
        description="the params it was submitted with; null with `params_omitted` when too large"
    )
    model_name: str = Field(description="the registry name its versions are published under")
    status: str = Field(description="queued | running | succeeded | failed | cancelled")
    progress: JobProgress = Field(description="how far it has trained")
    epsilon_committed: str = Field(description="the epsilon its commits charged so far (decimal string)")
    delta_committed: str = Field(description="the delta its commits charged so far (decimal string)")
    metrics: Any = Field(description="the metrics its worker reported; null before any")
    error: Any = Field(description="why it failed; null unless it did")
    reservation_id: str | None = Field(description="the reservation its run holds or held; null before")
    attempts: int = Field(description="how many times a worker claimed it")
    max_attempts: int = Field(description="the claims it gets: a worker claiming one past it fails the job")
    cancel_requested: bool = Field(description="a cancel was asked for while it ran")
    plan: Any = Field(description="the training plan a worker computed before reading any data; null before")
    versions: list[JobVersionPublic] = Field(
        description="the versions it published, oldest first (in a list: the newest few)"
    )
    versions_total: int = Field(description="how many versions it published in all")
    created_at: str = Field(description="when it was queued")
    updated_at: str = Field(description="when it last changed")
    started_at: str | None = Field(description="when a worker first claimed it")
    finished_at: str | None = Field(description="when it succeeded, failed or was cancelled")
    params_omitted: ParamsOmitted | None = Field(
        default=None, description="only when `params` is null because it was too large"
    )


class JobDetailPublic(JobPublic):
    """One job (``GET /v1/jobs/{id}``, ``POST /v1/jobs/{id}/cancel``): with its metric history."""

    metric_history: Any = Field(
        description="`{every, points: [{step, checkpoint, test_loss, test_accuracy}]}`, the "
        "iterate's held-out metrics every `every` steps and at each checkpoint (at most 200 points), "
        "stored only once a commit covered those steps; `null` before the first commit (DP-SGD and "
        "AdaDp, one-process runs)",
    )


class JobsPublic(_Public):
    data: list[JobPublic] = Field(description="the page's jobs, newest first")
    count: int = Field(description="how many jobs match, over every page")


class ArtifactPublic(_Public):
    """A version's weights as published."""

    format: str = Field(description="torch, safetensors, onnx or bytes")
    sha256: str = Field(description="the SHA-256 of the bytes `url` serves")
    bytes: int = Field(description="their size")
    url: str = Field(description="the route that serves them")


class ModelVersionPublic(_Public):
    """A published model version (``service.ledger.model_registry.Version``)."""

    id: str = Field(description="the version's id")
    name: str = Field(description="the model's registry name")
    version: int = Field(description="the version's number")
    origin: str = Field(
        description="`job`: trained by the service's worker; `external`: trained outside it and "
        "registered against its release's certificate"
    )
    job_id: str | None = Field(description="the job that trained it; null: trained outside")
    dataset_id: str = Field(description="the dataset it was trained on")
    certificate_id: str = Field(description="the certificate of its release")
    step: int | None = Field(description="the training step it was published at; null: external")
    metrics: dict[str, Any] = Field(description="its metrics (an external one's: as the client stated them)")
    artifact: ArtifactPublic = Field(description="its weights")
    model_spec: dict[str, Any] | None = Field(
        description="architecture and preprocessing (`service.training.nets.load_model` rebuilds the module "
        "from it); null for versions published before it was recorded and staged trainers'",
    )
    created_at: str = Field(description="when it was published")


class ModelVersionListed(ModelVersionPublic):
    """A version in a model's list: with the guarantee its certificate states."""

    guarantee: CostPublic = Field(description="the (epsilon, delta) its certificate states")


class ModelVersionDetail(ModelVersionPublic):
    """One version (``GET /v1/models/{name}/versions/{version}``): its certificate and DP statement."""

    algorithm: str | None = Field(description="the algorithm of the job that trained it; null: external")
    certificate: CertificatePublic = Field(description="its release's certificate, re-verifiable offline")
    dp_statement: dict[str, Any] = Field(
        description="its DP statement (Ponomareva et al. 2023, Section 5.3), derived from its "
        "certificate and its job's plan (`service.ledger.dp_statement`)",
    )
    privacy_audit: dict[str, Any] | None = Field(
        default=None,
        description="an audited run's (`dp_sgd_audit`) empirical epsilon lower bound beside the "
        "certified bound; absent for other versions",
    )


class ModelSummary(_Public):
    name: str = Field(description="the model's registry name")
    versions: int = Field(description="how many versions it has")
    external_versions: int = Field(description="how many of them were trained outside the service")
    latest_version: int = Field(description="its newest version's number")
    latest_created_at: str = Field(description="when its newest version was published")
    dataset_ids: list[str] = Field(description="the datasets its versions were trained on")


class ModelsPublic(_Public):
    data: list[ModelSummary] = Field(description="the page's models, by name")
    count: int = Field(description="how many models the tenant has")


class ModelVersionsPublic(_Public):
    data: list[ModelVersionListed] = Field(description="the page's versions, oldest first")
    count: int = Field(description="how many versions the model has")


class ErrorBody(_Public):
    error: str
    message: str
