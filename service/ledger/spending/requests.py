"""What a caller asks of the spend transactions: parsed input and the operations it becomes.

Parsing refuses bad input before anything is locked (``InvalidInput`` names the field and the
value); a ``Request`` is one reserve, commit, abort, expiry or plan segment asked for (frozen),
``Priced`` what pricing it before the transaction found, and an ``Op`` the engine's queue entry
waiting for (or holding) its answer.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent, EventValidationError
from accountant.rules import Charge, PriceMemo
from service.ledger import idempotency, pricing_limits
from service.ledger.datasets import MAX_ID_LENGTH, can_be_id, check_text
from service.ledger.errors import InvalidInput, NotFound
from service.verification.signing import SigningKey

if TYPE_CHECKING:  # answers imports this module
    from service.ledger.spending.answers import Answer

DEFAULT_TTL_S: Final = 3600.0
MAX_TTL_S: Final = 30 * 24 * 3600.0
# How long a reservation may be held from its creation, extensions included (the operator's
# ``LEDGER_RESERVATION_MAX_LIFETIME_S`` is at most this): a hold renewed by a heartbeat still ends.
DEFAULT_MAX_LIFETIME_S: Final = 7 * 24 * 3600.0
MAX_IDS_PER_REQUEST: Final = 10_000  # batch or task ids named in one request
# Batches one reservation may read (its tasks' batches): decided per distinct state, written by
# one statement per state (docs/ARCHITECTURE.md, "Batch state classes").
MAX_BATCHES_PER_RESERVATION: Final = 2_000_000
_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------------------------


def ids(value: object, field_name: str) -> list[str]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise InvalidInput(field_name, "must be a non-empty list of ids.")
    if len(value) > MAX_IDS_PER_REQUEST:
        raise InvalidInput(field_name, f"must hold at most {MAX_IDS_PER_REQUEST} ids. Found {len(value)}.")
    out: list[str] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item or len(item) > MAX_ID_LENGTH:
            raise InvalidInput(f"{field_name}[{i}]", f"must be an id string. Found {item!r}.")
        if item in seen:
            raise InvalidInput(f"{field_name}[{i}]", f"repeats {item!r}.")
        if not can_be_id(item):  # no such batch or task (and PostgreSQL refuses NUL in a query)
            raise NotFound("batch" if field_name == "batches" else "task", item)
        seen.add(item)
        out.append(item)
    return out


def parse_event(obj: object, field_name: str = "event") -> DpEvent:
    """A new mechanism event from its JSON; ``InvalidInput`` names the bad field (``event.scale``,
    ``event.analysis`` for an analysis that is not a valid bound: ``ev.refuse_unproven``)."""
    try:
        return ev.from_json(obj, field_name, new=True)
    except EventValidationError as exc:
        raise InvalidInput(exc.field, exc.message) from None


def new_event(event: object, field_name: str = "event") -> DpEvent:
    """``event`` as a charge to be priced now: a ``DpEvent`` (parsed by ``parse_event`` or by the
    HTTP schema, or built in-process: constructors validate their fields) that also passes what
    ``from_json(..., new=True)`` adds, ``ev.refuse_unproven`` (a walk of the tree, no JSON).
    ``InvalidInput`` names the field."""
    if not isinstance(event, DpEvent):
        raise InvalidInput(field_name, f"must be a mechanism event. Found {type(event).__name__}.")
    try:
        ev.refuse_unproven(event, field_name)
    except EventValidationError as exc:
        raise InvalidInput(exc.field, exc.message) from None
    return event


def charge(event: DpEvent, noise_commitment: object) -> Charge:
    if noise_commitment is not None and not isinstance(noise_commitment, str):
        raise InvalidInput("noise_commitment", f"must be a string. Found {noise_commitment!r}.")
    try:
        return Charge(event, noise_commitment)
    except InvalidArgumentError as exc:
        raise InvalidInput(exc.field, exc.message) from None


def release(release: object) -> tuple[str, str, dict[str, Any]]:
    if not isinstance(release, Mapping):
        raise InvalidInput("release", f"must be an object {{model, version}}. Found {release!r}.")
    model = release.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > 200:
        raise InvalidInput("release.model", f"must be a non-empty string (<= 200). Found {model!r}.")
    check_text(model, "release.model")  # refused before anything is locked: the hold stays open
    version = release.get("version")
    if isinstance(version, bool) or not isinstance(version, str | int):
        raise InvalidInput("release.version", f"must be a string or an integer. Found {version!r}.")
    text = str(version)
    if not text.strip() or len(text) > 100:
        raise InvalidInput("release.version", f"must be 1-100 characters. Found {version!r}.")
    check_text(text, "release.version")
    answer: dict[str, Any] = {"model": model, "version": version}
    # Optional: the SHA-256 of the released artifact's bytes. It goes into the certificate, so
    # the signature binds those bytes to the release (``service.training.nets.load_model`` checks them).
    digest = release.get("artifact_sha256")
    if digest is not None:
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise InvalidInput(
                "release.artifact_sha256",
                f"must be the artifact's SHA-256 as 64 lowercase hex digits. Found {digest!r}.",
            )
        answer["artifact_sha256"] = digest
    return model, text, answer


def ttl(ttl_s: float) -> timedelta:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidInput("ttl_s", f"must be in (0, {MAX_TTL_S:g}] seconds. Found {ttl_s!r}.")
    return timedelta(seconds=float(ttl_s))


# ---------------------------------------------------------------------------------------------
# Operations: what a caller asks for, and its answer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReserveParams:
    selector: str  # "batches" | "tasks"
    ids: list[str]
    charge: Charge
    event_document: dict[str, Any]
    ttl: timedelta


@dataclass(frozen=True)
class CommitParams:
    reservation_id: str
    model: str
    version: str
    release: dict[str, Any]
    partial: DpEvent | None
    partial_document: dict[str, Any] | None  # ``ev.to_json(partial)``, made once (request hash, row)
    signer: SigningKey  # the server's active key: it signs the certificate (service.verification.signing)


@dataclass(frozen=True)
class Ran:
    """What the built-in worker says ran of a reservation it aborts. In-process only: no HTTP
    route and no API key can say it (docs/ARCHITECTURE.md, "Threat model"). ``event``: the prefix
    of the reserved event that ran (``accountant.rules.commit``'s ``partial_event``), or ``None``
    when no data was read."""

    event: DpEvent | None


@dataclass(frozen=True)
class AbortParams:
    reservation_id: str
    ran: Ran | None = None  # None: what ran is unknown, so the whole reserved event is charged


@dataclass(frozen=True)
class ExtendParams:
    """Hold an open reservation ``ttl`` longer from now (never shorter than it is held already),
    at most ``max_lifetime`` from its creation (``decisions.extend``)."""

    reservation_id: str
    ttl: timedelta
    max_lifetime: timedelta


@dataclass(frozen=True)
class ExpireParams:
    reservation_ids: list[str]


@dataclass(frozen=True)
class SegmentParams:
    """Declare the next plan segment of a sequential ``prv`` budget (``decisions.declare_segment``)."""

    plan: tuple[DpEvent, ...]
    plan_document: list[dict[str, Any]]
    delta: Decimal


Params = ReserveParams | CommitParams | AbortParams | ExtendParams | ExpireParams | SegmentParams


@dataclass(frozen=True)
class Request:
    """What a caller asks of the spend transactions, parsed and immutable: the operation, whose
    (tenant) and where (dataset), when, its parameters, and its idempotency key with the hash of
    the request that key stands for (``keyed``)."""

    operation: str
    tenant_id: str
    dataset_id: str
    at: datetime
    params: Params
    key: str | None = None
    digest: str = ""
    policy: pricing_limits.Policy = pricing_limits.DEFAULT_POLICY

    @property
    def status_code(self) -> int:
        """The HTTP status of its first answer: 201 for a new reservation or plan segment, else 200."""
        return 201 if self.operation in ("reserve", "declare_segment") else 200


@dataclass(frozen=True)
class Priced:
    """What pricing a request outside any transaction found (``spending.pre_pricing.prepare``): the
    charge's state-independent prices (``memo``), and for a progressive commit the reservation's
    event as parsed then (``reserved_event``: its document and the event; it never changes)."""

    memo: PriceMemo | None = None
    reserved_event: tuple[dict[str, Any], DpEvent] | None = None


NOT_PRICED: Final = Priced()


@dataclass(eq=False)
class Op:
    """One request queued for the spend transactions (``spending.engine``): the request, its
    prices once prepared, and its answer once decided."""

    request: Request
    priced: Priced | None = None  # set once, before the transaction (``prepare``)
    done: bool = False
    response: Answer | None = None
    error: BaseException | None = None
    wake: threading.Event | None = field(default=None, repr=False)  # a sync caller's (``engine.Combiner``)

    def finish(self, response: Answer | None, error: BaseException | None) -> None:
        self.response, self.error, self.done = response, error, True


def keyed(request: Request, key: str | None, body: Mapping[str, Any]) -> Request:
    """``request`` bound to its idempotency key and the request body that key stands for."""
    checked = idempotency.check_key(key)
    digest = idempotency.request_hash(request.operation, body) if checked is not None else ""
    return replace(request, key=checked, digest=digest)
