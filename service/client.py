"""Python client of HTTP API v1: ``LedgerClient`` (sync) and ``AsyncLedgerClient`` (asyncio).

::

    from service.client import LedgerClient, BudgetExceeded

    with LedgerClient("http://127.0.0.1:8000", api_key) as ledger:
        try:
            with ledger.release_gate(dataset_id, batches, event, model="mlp", version=3) as gate:
                weights = train()                 # runs only once the cost is reserved
            save(weights, gate.certificate)       # reached only after the ledger committed
        except BudgetExceeded as refused:
            print(refused.remaining, refused.requested)

Every v1 call has a typed method returning the JSON answer as a ``dict`` (numbers the ledger
computes are decimal strings, exact as stored). Behaviour a careful caller would otherwise write
by hand:

* **Idempotency.** Every mutating call carries an ``Idempotency-Key`` (a fresh random key, or the
  ``idempotency_key=`` you pass to make a retry from another process safe) and the *same* key on
  every retry of that call, so a retry after a lost response returns the first answer and is
  never charged twice (``service.ledger.idempotency``).
* **Retries** on connection errors, timeouts, 503 (honouring ``Retry-After``) and 409
  ``idempotency_in_progress`` (the first attempt is still being processed), with capped
  exponential backoff and jitter; ``retries`` is how many retries follow the first attempt.
  Other errors are answers, not faults, and are never retried.
* **Typed errors.** A non-2xx answer ``{"error": code, "message": ..., **details}`` raises the
  ``LedgerError`` subclass for its code: ``BudgetExceeded`` (``remaining``, ``requested``),
  ``BatchOverlap`` (``record_id``), ``NotFound``, ``Unauthorized``, ``Forbidden``,
  ``InvalidInput`` (``field``), ``Conflict`` (any other 409: a rule's refusal such as
  ``batch_already_read``, a closed reservation, ...), ``ServerError``; a server that could not be
  reached raises ``LedgerUnavailable``.
* **Events** are ``accountant.events`` objects, dp_accounting ``DpEvent`` objects of the kinds
  both share (``accountant.dp_accounting_form``) or JSON (``{"kind": "gaussian", ...}``).
* **The release gate** (``release_gate``): reserve on enter, commit ``{model, version}`` on a
  clean exit, abort on an exception. Nothing is released without a certificate: code after the
  ``with`` block runs only once the ledger committed. An abort is not free: the data could have
  been read from the moment the reservation was granted, so it charges everything reserved.

The endpoint methods are written once (``_Endpoints``) over an abstract ``_json``/``_artifact``
call, so the sync and async clients cannot drift apart; only the transport loop, the paging
iterators and the gate differ.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar
from urllib.parse import quote

import httpx

from accountant import events as dp_events
from accountant.dp_accounting_form import DpAccountingEvent, from_dp_accounting, is_dp_accounting_event
from accountant.events import DpEvent

JsonObject = dict[str, Any]
EventLike = DpEvent | Mapping[str, Any] | DpAccountingEvent
Number = float | int | str | Decimal
Identifier = str | int

if TYPE_CHECKING:
    from service.verification.signing import PublicKey

DEFAULT_TIMEOUT_S: Final = 30.0
DEFAULT_RETRIES: Final = 3
DEFAULT_BACKOFF_S: Final = 0.2
MAX_BACKOFF_S: Final = 5.0
USER_AGENT: Final = "privacy-ledger-client/1"
# A release gate warns this long before its hold expires (or a tenth of the hold, if shorter).
EXPIRY_WARNING_S: Final = 300.0
logger = logging.getLogger(__name__)
# Transport failures worth a retry; others (a URL without http://, a proxy refusing) are not.
_TRANSIENT: Final = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class LedgerError(Exception):
    """An error answer of the ledger (or no answer at all: ``LedgerUnavailable``).

    ``code``: the answer's ``error`` field; ``status``: the HTTP status (``None`` when no answer
    came back); ``details``: every other field of the answer.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "ledger_error",
        status: int | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.details: dict[str, Any] = dict(details or {})

    def __str__(self) -> str:
        where = f"{self.status} " if self.status is not None else ""
        return f"{where}{self.code}: {self.message}"


class LedgerUnavailable(LedgerError):
    """No usable answer after every retry: connection refused or lost, timeout, 503."""


class Unauthorized(LedgerError):
    """401: missing, unknown or revoked API key."""


class Forbidden(LedgerError):
    """403: the key's ``scope`` is below the call's ``required_scope``."""

    @property
    def scope(self) -> str | None:
        return self.details.get("scope")

    @property
    def required_scope(self) -> str | None:
        return self.details.get("required_scope")


class NotFound(LedgerError):
    """404: an unknown id, or another tenant's (``resource`` names what was looked up)."""

    @property
    def resource(self) -> str | None:
        return self.details.get("resource")


class InvalidInput(LedgerError):
    """422: bad input; ``field`` is the dotted path of the first bad field."""

    @property
    def field(self) -> str | None:
        return self.details.get("field")


class Conflict(LedgerError):
    """409: the request conflicts with the ledger's state; ``code`` says how
    (``batch_already_read``, ``reservation_closed``, ``reservation_expired``, ...)."""


class BudgetExceeded(Conflict):
    """409 ``budget_exceeded``: nothing is held. ``remaining`` and ``requested`` are
    ``{"epsilon": str, "delta": str}`` (decimal strings, exact)."""

    @property
    def remaining(self) -> dict[str, str]:
        value = self.details.get("remaining")
        return dict(value) if isinstance(value, Mapping) else {}

    @property
    def requested(self) -> dict[str, str]:
        value = self.details.get("requested")
        return dict(value) if isinstance(value, Mapping) else {}

    @property
    def batch_id(self) -> str | None:
        return self.details.get("batch_id")

    @property
    def largest_target_epsilon(self) -> float | None:
        """Set when a run calibrated to ``target_epsilon`` does not fit: the largest
        ``target_epsilon`` whose run the budget admits (``None``: none does)."""
        value = self.details.get("largest_target_epsilon")
        return float(value) if isinstance(value, int | float) else None


class BatchOverlap(Conflict):
    """409 ``batch_overlap``: ``record_id`` is already in a batch of the dataset."""

    @property
    def record_id(self) -> str | int | None:
        return self.details.get("record_id")


class ServerError(LedgerError):
    """5xx other than a retried 503 (the server log has the cause)."""


_BY_CODE: Final[dict[str, type[LedgerError]]] = {
    "budget_exceeded": BudgetExceeded,
    "batch_overlap": BatchOverlap,
    "not_found": NotFound,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "invalid_input": InvalidInput,
}
_BY_STATUS: Final[dict[int, type[LedgerError]]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: InvalidInput,
}


def error_from_response(response: httpx.Response) -> LedgerError:
    """The typed error for a non-2xx answer."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        text = response.text.strip()[:200] or response.reason_phrase
        body = {"error": "http_error", "message": text}
    code = str(body.get("error") or "http_error")
    message = str(body.get("message") or response.reason_phrase)
    details = {k: v for k, v in body.items() if k not in ("error", "message")}
    status = response.status_code
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else LedgerError
    if status == 503:
        cls = LedgerUnavailable
    return cls(message, code=code, status=status, details=details)


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def event_json(event: EventLike) -> JsonObject:
    """The JSON of an event: an ``accountant.events`` object, a dp_accounting ``DpEvent`` (of a
    kind both share: ``accountant.dp_accounting_form``), or a mapping taken as it is."""
    if isinstance(event, DpEvent):
        return dp_events.to_json(event)
    if isinstance(event, Mapping):
        return dict(event)
    if is_dp_accounting_event(event):
        return dp_events.to_json(from_dp_accounting(event))
    raise TypeError(
        "event must be an accountant.events.DpEvent, a dp_accounting DpEvent or a JSON object. "
        f"Found {event!r}."
    )


def _json_default(value: object) -> object:
    if isinstance(value, Decimal):
        return str(value)  # a budget as written: the ledger reads it exactly
    if isinstance(value, DpEvent):
        return dp_events.to_json(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable: {value!r}")


def _charge_body(
    event: EventLike,
    batches: Sequence[Identifier] | None,
    tasks: Sequence[Identifier] | None,
    noise_commitment: str | None,
) -> JsonObject:
    """The body of a reservation or a quote: the event and what it is charged on."""
    body: JsonObject = {"event": event_json(event)}
    if batches is not None:
        body["batches"] = list(batches)
    if tasks is not None:
        body["tasks"] = list(tasks)
    if noise_commitment is not None:
        body["noise_commitment"] = noise_commitment
    return body


def _segment(value: Identifier) -> str:
    return quote(str(value), safe="")


def new_idempotency_key() -> str:
    return f"pl-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    body: Any = None
    params: Mapping[str, Any] | None = None
    idempotency_key: str | None = None
    accept: frozenset[int] = frozenset()  # non-2xx statuses answered as JSON, not raised
    raw: bytes | None = None  # a binary body (an artifact upload), sent as it is

    def content(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        if self.body is None:
            return None
        return json.dumps(self.body, default=_json_default).encode()

    def headers(self, api_key: str) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
        if self.raw is not None:
            headers["Content-Type"] = "application/octet-stream"
        elif self.body is not None:
            headers["Content-Type"] = "application/json"
        if self.idempotency_key is not None:
            headers["Idempotency-Key"] = self.idempotency_key
        return headers


@dataclass(frozen=True)
class Artifact:
    """A model version's weights as served, checked against the SHA-256 the registry recorded."""

    content: bytes
    sha256: str
    format: str | None
    certificate_id: str | None
    filename: str | None


class _RetryPolicy:
    def __init__(self, retries: int, backoff_s: float) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0. Found {retries}.")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0. Found {backoff_s}.")
        self.retries = retries
        self.backoff_s = backoff_s

    def delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Seconds before retry ``attempt`` (0-based): ``Retry-After`` if the server sent one
        (capped), else capped exponential backoff with full jitter."""
        if response is not None:
            after = _retry_after_s(response.headers.get("retry-after"))
            if after is not None:
                return min(after, MAX_BACKOFF_S)
        ceiling = min(MAX_BACKOFF_S, self.backoff_s * (2**attempt))
        return random.uniform(ceiling / 2, ceiling)

    def wait(
        self, call: _Call, attempt: int, cause: BaseException | None, response: httpx.Response | None
    ) -> float:
        """Seconds before the retry after failed ``attempt`` (0-based); the call's error when
        that was the last attempt."""
        attempts = self.retries + 1
        if attempt + 1 == attempts:
            raise _unavailable(call, attempts, cause, response) from cause
        return self.delay(attempt, response)

    @staticmethod
    def retryable(response: httpx.Response, call: _Call) -> bool:
        if response.status_code in call.accept:
            return False
        if response.status_code == 503:
            return True
        if response.status_code == 409 and call.idempotency_key is not None:
            try:
                body = response.json()
            except ValueError:
                return False
            return isinstance(body, dict) and body.get("error") == "idempotency_in_progress"
        return False


def _retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, moment.timestamp() - time.time())


def _json_answer(call: _Call, response: httpx.Response) -> JsonObject:
    """The JSON object of a 2xx answer (or of a status ``call`` accepts); else its typed error."""
    if not response.is_success and response.status_code not in call.accept:
        raise error_from_response(response)
    try:
        body = response.json()
    except ValueError as exc:
        raise LedgerError(
            f"expected a JSON answer from {response.request.method} {response.request.url.path}; "
            f"got {response.headers.get('content-type')!r}.",
            code="invalid_answer",
            status=response.status_code,
        ) from exc
    if not isinstance(body, dict):
        raise LedgerError("expected a JSON object.", code="invalid_answer", status=response.status_code)
    return body


def _artifact_answer(response: httpx.Response) -> Artifact:
    if not response.is_success:
        raise error_from_response(response)
    content = response.content
    recorded = response.headers.get("x-artifact-sha256")
    actual = hashlib.sha256(content).hexdigest()
    if recorded is not None and recorded != actual:
        raise LedgerError(
            f"artifact SHA-256 {actual} does not match the recorded {recorded}.",
            code="artifact_mismatch",
            status=response.status_code,
        )
    disposition = response.headers.get("content-disposition", "")
    filename = None
    if "filename=" in disposition:
        filename = disposition.split("filename=", 1)[1].strip().strip('"') or None
    return Artifact(
        content=content,
        sha256=actual,
        format=response.headers.get("x-artifact-format"),
        certificate_id=response.headers.get("x-certificate-id"),
        filename=filename,
    )


def certified_artifact(version: Mapping[str, Any], artifact: Artifact, keys: Mapping[str, PublicKey]) -> None:
    """``LedgerError`` ``artifact_not_certified`` unless ``artifact``'s bytes are the ones the
    model ``version``'s certificate (as ``get_model_version`` answers it) certifies
    (``service.verification.artifacts.artifact_problem``: content hash, signature under ``keys``,
    release and ``artifact_sha256``). The ``X-Artifact-SHA256`` header and the version record come
    from the same server as the bytes, so matching them shows no more than that the server is
    self-consistent."""
    from service.verification.artifacts import artifact_problem

    problem = artifact_problem(version, artifact.sha256, keys)
    if problem is not None:
        label = f"model {version.get('name')!r} version {version.get('version')}"
        raise LedgerError(f"{label}: {problem}.", code="artifact_not_certified")


def _text_answer(response: httpx.Response) -> str:
    if not response.is_success:
        raise error_from_response(response)
    return response.text


def _next_offset(page: JsonObject, offset: int) -> int | None:
    """The offset of the page after ``page`` (read at ``offset``); ``None`` after the last."""
    data = page["data"]
    offset += len(data)
    return None if not data or offset >= int(page["count"]) else offset


def _next_after(page: JsonObject) -> int | None:
    """The ``after`` cursor of the audit page after ``page``; ``None`` at the chain's head."""
    return None if page.get("next_after") is None else int(page["next_after"])


def _offset_pages(fetch: Callable[[int], JsonObject]) -> Iterator[JsonObject]:
    """Every item of an offset-paged list, page by page: ``fetch(offset)`` reads one page."""
    offset: int | None = 0
    while offset is not None:
        page = fetch(offset)
        yield from page["data"]
        offset = _next_offset(page, offset)


def _checked_api_key(api_key: object) -> str:
    """The bearer key, or ``Unauthorized`` said plainly: an empty key used to surface as
    "unavailable ... Illegal header value" on the first call (issue 28 §8)."""
    if not isinstance(api_key, str) or not api_key.strip():
        raise Unauthorized(
            f"no API key: pass the key `ledger keys create` printed (or set LEDGER_API_KEY). "
            f"Found {api_key!r}.",
            code="no_api_key",
            details={"field": "api_key"},
        )
    if api_key != api_key.strip() or any(c in api_key for c in "\r\n"):
        raise Unauthorized(
            "the API key has surrounding whitespace or a line break (copied with the newline?).",
            code="invalid_api_key",
            details={"field": "api_key"},
        )
    return api_key


def _invalid_url(base_url: str, exc: Exception) -> LedgerError:
    return LedgerError(
        f"base_url must be an http:// or https:// URL. Found {base_url!r}: {exc}",
        code="invalid_url",
        details={"field": "base_url"},
    )


def _unavailable(
    call: _Call, attempts: int, cause: BaseException | None, response: httpx.Response | None
) -> LedgerError:
    if response is not None:
        error = error_from_response(response)
        error.details.setdefault("attempts", attempts)
        return error
    return LedgerUnavailable(
        f"{call.method} {call.path}: no answer after {attempts} attempt(s): {type(cause).__name__}: {cause}",
        code="unavailable",
        details={"attempts": attempts},
    )


# ---------------------------------------------------------------------------------------------
# Endpoints (written once for both clients)
# ---------------------------------------------------------------------------------------------

J = TypeVar("J")  # what a JSON call returns: a dict, or an awaitable of one
A = TypeVar("A")  # what an artifact download returns


class _Endpoints(Generic[J, A]):
    """Every HTTP API v1 call, as a method building a ``_Call``."""

    def _json(self, call: _Call) -> J:
        raise NotImplementedError

    def _artifact(self, call: _Call) -> A:
        raise NotImplementedError

    @staticmethod
    def _key(idempotency_key: str | None) -> str:
        return idempotency_key if idempotency_key is not None else new_idempotency_key()

    # operations -----------------------------------------------------------------------------

    def healthz(self) -> J:
        """``GET /healthz``: ``{"status": "ok"|"unavailable", "database": ...}`` (503 is answered,
        not raised: it is the health check's negative answer)."""
        return self._json(_Call("GET", "/healthz", accept=frozenset({503})))

    # datasets, tasks, batches ---------------------------------------------------------------

    def create_dataset(
        self,
        name: str,
        *,
        rule: str,
        epsilon: Number,
        delta: Number,
        accountant: str = "tight",
        geometric: Mapping[str, Number] | None = None,
        orders: Sequence[float] | None = None,
        plan: Sequence[EventLike] | None = None,
        data_source: str | None = None,
        idempotency_key: str | None = None,
        plan_delta: Number | None = None,
    ) -> J:
        """``POST /v1/datasets`` (admin): a dataset with its budget (numbers taken as written)
        and, if given, its ``data_source``.

        ``delta`` has no default: it must be chosen against the number of records (δ well below
        1/N), and 0 (pure DP) refuses every Gaussian charge, DP-SGD's included. ``accountant``
        defaults to ``"tight"`` (the server's default too): a run is charged its tight (PRV) ε,
        and any sequence of charges chosen adaptively is admitted while a basic-composition
        filter over those tight prices or a Rényi filter still admits it (docs/ACCOUNTING.md);
        ``"rdp"`` is the Rényi filter alone, ``"basic"`` prices pure and (ε, δ) events only,
        ``"prv"`` needs a declared ``plan`` (the URI every job on the dataset reads: ``builtin:...``
        or a ``file:///`` path under the server's data roots; ``InvalidInput`` names
        ``data_source`` when the server refuses it)."""
        budget: JsonObject = {"rule": rule, "epsilon": epsilon, "delta": delta, "accountant": accountant}
        if geometric is not None:
            budget["geometric"] = dict(geometric)
        if orders is not None:
            budget["orders"] = list(orders)
        if plan is not None:
            budget["plan"] = [event_json(e) for e in plan]
        if plan_delta is not None:
            budget["plan_delta"] = plan_delta
        body: JsonObject = {"name": name, "budget": budget}
        if data_source is not None:
            body["data_source"] = data_source
        return self._json(_Call("POST", "/v1/datasets", body, idempotency_key=self._key(idempotency_key)))

    def set_data_source(
        self, dataset_id: Identifier, data_source: str | None, *, idempotency_key: str | None = None
    ) -> J:
        """``PUT /v1/datasets/{id}/data-source`` (admin): set, replace or (``None``) remove the
        dataset's data source; answers the dataset. Audited as ``dataset.data_source_set``;
        setting the source it already has changes nothing."""
        return self._json(
            _Call(
                "PUT",
                f"/v1/datasets/{_segment(dataset_id)}/data-source",
                {"data_source": data_source},
                idempotency_key=self._key(idempotency_key),
            )
        )

    def archive_dataset(self, dataset_id: Identifier, *, idempotency_key: str | None = None) -> J:
        """``POST /v1/datasets/{id}/archive`` (admin): the dataset takes no new work (409
        ``dataset_archived``) and leaves the default list; its ledger and certificates stay.
        Audited as ``dataset.archived``; answers the dataset (``archived_at`` set)."""
        path = f"/v1/datasets/{_segment(dataset_id)}/archive"
        return self._json(_Call("POST", path, idempotency_key=self._key(idempotency_key)))

    def unarchive_dataset(self, dataset_id: Identifier, *, idempotency_key: str | None = None) -> J:
        """``POST /v1/datasets/{id}/unarchive`` (admin): active again, exactly as it was
        (``dataset.unarchived``)."""
        path = f"/v1/datasets/{_segment(dataset_id)}/unarchive"
        return self._json(_Call("POST", path, idempotency_key=self._key(idempotency_key)))

    def declare_plan_segment(
        self,
        dataset_id: Identifier,
        plan: Sequence[EventLike],
        *,
        delta: Number,
        idempotency_key: str | None = None,
    ) -> J:
        """``POST /v1/datasets/{id}/plan-segments`` (admin): the next declared plan of a sequential
        ``prv`` budget, priced by PRV at ``delta`` (a share of the budget's δ). Answer ``{index,
        plan, delta, epsilon, declared, left, closed_batches, theorem}``; the open segment closes
        (a batch that ran any of it is charged all of it)."""
        return self._json(
            _Call(
                "POST",
                f"/v1/datasets/{_segment(dataset_id)}/plan-segments",
                {"plan": [event_json(e) for e in plan], "delta": delta},
                idempotency_key=self._key(idempotency_key),
            )
        )

    def list_datasets(
        self, *, limit: int = 100, offset: int = 0, name: str | None = None, archived: str = "false"
    ) -> J:
        """``GET /v1/datasets``: ``{data, count}``; ``archived``: ``"false"`` active datasets only,
        ``"true"`` archived only, ``"all"``. With ``name``, only the dataset of that name, archived
        or not (names are unique per tenant; ``find_dataset`` takes an id or a name)."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if name is not None:
            params["name"] = name
        if archived != "false":
            params["archived"] = archived
        return self._json(_Call("GET", "/v1/datasets", params=params))

    def get_dataset(self, dataset_id: Identifier) -> J:
        """``GET /v1/datasets/{id}``: ``{id, name, budget, data_source, created_at}``."""
        return self._json(_Call("GET", f"/v1/datasets/{_segment(dataset_id)}"))

    def create_task(self, dataset_id: Identifier, name: str, *, idempotency_key: str | None = None) -> J:
        """``POST /v1/datasets/{id}/tasks`` (admin)."""
        return self._json(
            _Call(
                "POST",
                f"/v1/datasets/{_segment(dataset_id)}/tasks",
                {"name": name},
                idempotency_key=self._key(idempotency_key),
            )
        )

    def list_tasks(self, dataset_id: Identifier, *, limit: int = 100, offset: int = 0) -> J:
        """``GET /v1/datasets/{id}/tasks``: a page ``{data, count}`` (``limit`` <= 1000; ``count``:
        every task). ``iter_tasks`` walks the pages."""
        params = {"limit": limit, "offset": offset}
        return self._json(_Call("GET", f"/v1/datasets/{_segment(dataset_id)}/tasks", params=params))

    def create_batches(
        self,
        dataset_id: Identifier,
        task_id: Identifier,
        batches: Sequence[Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
    ) -> J:
        """``POST .../tasks/{task}/batches`` (admin): ``batches = [{name, records: [ids]}]``;
        ``BatchOverlap`` names the first record already in a batch."""
        body = {"batches": [{"name": b["name"], "records": list(b["records"])} for b in batches]}
        return self._json(
            _Call(
                "POST",
                f"/v1/datasets/{_segment(dataset_id)}/tasks/{_segment(task_id)}/batches",
                body,
                idempotency_key=self._key(idempotency_key),
            )
        )

    def list_batches(
        self, dataset_id: Identifier, task_id: Identifier, *, after: int | None = None, limit: int = 1000
    ) -> J:
        """``GET .../tasks/{task}/batches``: a page ``{data, count, next}`` of the task's batches
        with their spend, in position order (``limit`` <= 10 000; pass ``after=next`` for the next
        page, ``next`` is ``None`` on the last). ``iter_batches`` walks the pages."""
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return self._json(
            _Call(
                "GET",
                f"/v1/datasets/{_segment(dataset_id)}/tasks/{_segment(task_id)}/batches",
                params=params,
            )
        )

    # reserve, commit, abort -------------------------------------------------------------------

    def reserve(
        self,
        dataset_id: Identifier,
        event: EventLike,
        *,
        batches: Sequence[Identifier] | None = None,
        tasks: Sequence[Identifier] | None = None,
        noise_commitment: str | None = None,
        ttl_s: float | None = None,
        release: Mapping[str, Identifier] | None = None,
        idempotency_key: str | None = None,
    ) -> J:
        """``POST /v1/datasets/{id}/reservations`` (trainer): certify and hold the charge of
        ``event`` on ``batches`` (or every batch of ``tasks``). ``BudgetExceeded`` when it does
        not fit; ``Conflict`` when the rule refuses it, or (``release_exists``) when ``release``
        (``{model, version}``, the release the run will be committed as) was released before."""
        body = _charge_body(event, batches, tasks, noise_commitment)
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        if release is not None:
            body["release"] = {"model": release["model"], "version": release["version"]}
        return self._json(
            _Call(
                "POST",
                f"/v1/datasets/{_segment(dataset_id)}/reservations",
                body,
                idempotency_key=self._key(idempotency_key),
            )
        )

    def quote(
        self,
        dataset_id: Identifier,
        event: EventLike,
        *,
        batches: Sequence[Identifier] | None = None,
        tasks: Sequence[Identifier] | None = None,
        new_batch: bool = False,
        noise_commitment: str | None = None,
        limit: int | None = None,
        offset: int | None = None,
        accountants: bool = True,
    ) -> J:
        """``POST /v1/datasets/{id}/quote`` (any scope): what ``event`` would cost on exactly one
        of ``batches``, ``tasks`` or a new batch (``new_batch=True``) under the dataset's own
        budget — ``{on, admitted, cost: {epsilon, delta}, totals, classes, next_offset,
        refused, accountants}``, one entry per state class (``limit`` of them from ``offset``);
        ``accountants`` (informational) what it would cost under each accountant choice, left
        out (``null``) with ``accountants=False``. Nothing is held; the reservation decides."""
        body = _charge_body(event, batches, tasks, noise_commitment)
        if new_batch:
            body["new_batch"] = True
        if not accountants:
            body["accountants"] = False
        if limit is not None:
            body["limit"] = limit
        if offset is not None:
            body["offset"] = offset
        return self._json(_Call("POST", f"/v1/datasets/{_segment(dataset_id)}/quote", body))

    def get_reservation(self, reservation_id: str) -> J:
        """``GET /v1/reservations/{id}``."""
        return self._json(_Call("GET", f"/v1/reservations/{_segment(reservation_id)}"))

    def reservation_batches(self, reservation_id: str, *, after: str | None = None, limit: int = 1000) -> J:
        """``GET /v1/reservations/{id}/batches``: a page of ``{id, class}`` in ascending id order."""
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        return self._json(_Call("GET", f"/v1/reservations/{_segment(reservation_id)}/batches", params=params))

    def commit(
        self,
        reservation_id: str,
        *,
        model: str,
        version: Identifier,
        event: EventLike | None = None,
        artifact_sha256: str | None = None,
        idempotency_key: str | None = None,
    ) -> J:
        """``POST /v1/reservations/{id}/commit`` (trainer): release ``{model, version}``;
        ``event`` commits progressively the cost of the run so far (never more than reserved);
        ``artifact_sha256`` (hex SHA-256 of the released weights' bytes) is stated in the signed
        certificate, which then vouches for those bytes (``service.training.nets.load_model`` checks them).
        Answer ``{certificate, reservation}``."""
        release: JsonObject = {"model": model, "version": version}
        if artifact_sha256 is not None:
            release["artifact_sha256"] = artifact_sha256
        body: JsonObject = {"release": release}
        if event is not None:
            body["event"] = event_json(event)
        return self._json(
            _Call(
                "POST",
                f"/v1/reservations/{_segment(reservation_id)}/commit",
                body,
                idempotency_key=self._key(idempotency_key),
            )
        )

    def abort(self, reservation_id: str, *, idempotency_key: str | None = None) -> J:
        """``POST /v1/reservations/{id}/abort`` (trainer): close the reservation without a release.

        It charges everything reserved (the whole reserved event, even after progressive
        commits), with a certificate of ``outcome: "aborted"`` and ``release: null``: the data
        could have been read from the moment the hold was granted. Nothing is returned to the
        budget. A repeat answers the same and charges nothing more."""
        return self._json(
            _Call(
                "POST",
                f"/v1/reservations/{_segment(reservation_id)}/abort",
                idempotency_key=self._key(idempotency_key),
            )
        )

    def extend(self, reservation_id: str, ttl_s: float, *, idempotency_key: str | None = None) -> J:
        """``POST /v1/reservations/{id}/extend`` (trainer): hold the open reservation at least
        ``ttl_s`` seconds from now (a heartbeat: a repeat changes nothing), at most the server's
        ``LEDGER_RESERVATION_MAX_LIFETIME_S`` after it was made (``Conflict``
        ``reservation_lifetime_exceeded`` with ``latest_expires_at`` beyond). A hold past its
        time expires instead (``Conflict`` ``reservation_expired``): an expiry charges
        everything reserved."""
        return self._json(
            _Call(
                "POST",
                f"/v1/reservations/{_segment(reservation_id)}/extend",
                {"ttl_s": ttl_s},
                idempotency_key=self._key(idempotency_key),
            )
        )

    # spend, certificates, audit ---------------------------------------------------------------

    def spend(self, dataset_id: Identifier) -> J:
        """``GET /v1/datasets/{id}/spend``."""
        return self._json(_Call("GET", f"/v1/datasets/{_segment(dataset_id)}/spend"))

    def list_certificates(self, dataset_id: Identifier, *, limit: int = 100, offset: int = 0) -> J:
        """``GET /v1/datasets/{id}/certificates``: ``{data, count}``, oldest first."""
        return self._json(
            _Call(
                "GET",
                f"/v1/datasets/{_segment(dataset_id)}/certificates",
                params={"limit": limit, "offset": offset},
            )
        )

    def get_certificate(self, certificate_id: str) -> J:
        """``GET /v1/certificates/{id}``: its ``certificate`` re-verifies offline with
        ``accountant.certificates.verify``."""
        return self._json(_Call("GET", f"/v1/certificates/{_segment(certificate_id)}"))

    def verify_audit(self, dataset_id: Identifier | None = None) -> J:
        """``GET /v1/audit/verify``: ``{ok, entries, first_broken, chain, chain_seq, reason}``
        (every chain of the server, or one dataset's)."""
        params = None if dataset_id is None else {"dataset_id": str(dataset_id)}
        return self._json(_Call("GET", "/v1/audit/verify", params=params))

    def audit_entries(self, dataset_id: Identifier, *, after: int = 0, limit: int = 1000) -> J:
        """``GET /v1/datasets/{id}/audit``: one page of the dataset's audit chain
        (``{head, data, count, next_after}``)."""
        return self._json(
            _Call(
                "GET",
                f"/v1/datasets/{_segment(dataset_id)}/audit",
                params={"after": after, "limit": limit},
            )
        )

    def signing_keys(self) -> J:
        """``GET /.well-known/privacy-ledger/signing-keys``: ``{keys: [{key_id, algorithm,
        public_key, status}]}``, the keys that verify the server's signatures (no key needed)."""
        return self._json(_Call("GET", "/.well-known/privacy-ledger/signing-keys"))

    # dashboard reads ---------------------------------------------------------------------------

    def list_spend(self, *, limit: int = 100, offset: int = 0) -> J:
        """``GET /v1/spend``: every dataset's spend summary, paged (``{data, count}``)."""
        return self._json(_Call("GET", "/v1/spend", params={"limit": limit, "offset": offset}))

    def batch_spend(self, dataset_id: Identifier, *, limit: int = 500, offset: int = 0) -> J:
        """``GET /v1/datasets/{id}/batch-spend``: per-batch spend (and geometric levels), paged."""
        return self._json(
            _Call(
                "GET",
                f"/v1/datasets/{_segment(dataset_id)}/batch-spend",
                params={"limit": limit, "offset": offset},
            )
        )

    def list_releases(self, dataset_id: Identifier, *, limit: int = 50, offset: int = 0) -> J:
        """``GET /v1/datasets/{id}/releases``: the release timeline, newest first."""
        return self._json(
            _Call(
                "GET",
                f"/v1/datasets/{_segment(dataset_id)}/releases",
                params={"limit": limit, "offset": offset},
            )
        )

    def epsilon_history(self, dataset_id: Identifier, *, limit: int = 1000, offset: int = 0) -> J:
        """``GET /v1/datasets/{id}/epsilon-history``: the ledger's ε against the naive sequential
        ε, task by task."""
        return self._json(
            _Call(
                "GET",
                f"/v1/datasets/{_segment(dataset_id)}/epsilon-history",
                params={"limit": limit, "offset": offset},
            )
        )

    def verify_certificate_on_server(self, certificate_id: str) -> J:
        """``POST /v1/certificates/{id}/verify``: the server re-verifies a stored certificate and
        its signature (``{certificate_id, ok, reason, signature}``). To trust no server, verify the
        certificate of ``get_certificate`` yourself with ``accountant.certificates.verify`` and its
        signature with ``service.verification.signing.check_certificate`` under keys you pinned."""
        return self._json(_Call("POST", f"/v1/certificates/{_segment(certificate_id)}/verify"))

    # jobs ------------------------------------------------------------------------------------

    def create_job(
        self,
        dataset_id: Identifier,
        algorithm: str,
        params: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> J:
        """``POST /v1/jobs`` (trainer): queue a training job for the built-in worker."""
        body = {"dataset_id": str(dataset_id), "algorithm": algorithm, "params": dict(params or {})}
        return self._json(_Call("POST", "/v1/jobs", body, idempotency_key=self._key(idempotency_key)))

    def get_job(self, job_id: str) -> J:
        """``GET /v1/jobs/{id}``: status, progress, ε committed, metrics, versions."""
        return self._json(_Call("GET", f"/v1/jobs/{_segment(job_id)}"))

    def list_jobs(self, *, dataset_id: Identifier | None = None, limit: int = 100, offset: int = 0) -> J:
        """``GET /v1/jobs``: the tenant's jobs, newest first."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if dataset_id is not None:
            params["dataset_id"] = str(dataset_id)
        return self._json(_Call("GET", "/v1/jobs", params=params))

    def cancel_job(self, job_id: str) -> J:
        """``POST /v1/jobs/{id}/cancel`` (trainer)."""
        return self._json(
            _Call("POST", f"/v1/jobs/{_segment(job_id)}/cancel", idempotency_key=new_idempotency_key())
        )

    # model registry --------------------------------------------------------------------------

    def list_models(self, *, limit: int = 100, offset: int = 0) -> J:
        """``GET /v1/models``: the tenant's models by name (versions, latest, datasets)."""
        return self._json(_Call("GET", "/v1/models", params={"limit": limit, "offset": offset}))

    def register_model_version(
        self,
        name: str,
        version: int,
        artifact: bytes | str | os.PathLike[str],
        *,
        certificate_id: str,
        architecture: str,
        preprocessing: str,
        format: str = "torch",
        metrics: Mapping[str, float] | None = None,
    ) -> J:
        """``PUT /v1/models/{name}/versions/{v}`` (trainer): register a version you trained
        outside the service under the certificate of its release (``ReleaseGate.certificate``,
        or the Opacus adapter's ``run.certificate``). ``artifact``: the weights' bytes or a file
        path; their SHA-256 is sent with them and the server refuses them if it computes another.
        ``architecture`` and ``preprocessing``: free text (at most 1000 characters each) saying
        what the weights are and how to feed them; ``format``: ``torch``, ``safetensors``,
        ``onnx`` or ``bytes``; ``metrics``: up to 32 numbers (your evaluation). The version's DP
        statement comes from the certificate, never from these. Registering the same bytes under
        the same certificate again answers the version (a safe retry)."""
        content = artifact if isinstance(artifact, bytes) else Path(artifact).read_bytes()
        params: dict[str, Any] = {
            "certificate_id": certificate_id,
            "sha256": hashlib.sha256(content).hexdigest(),
            "format": format,
            "architecture": architecture,
            "preprocessing": preprocessing,
        }
        if metrics is not None:
            params["metrics"] = json.dumps(dict(metrics), allow_nan=False)
        return self._json(
            _Call("PUT", f"/v1/models/{_segment(name)}/versions/{int(version)}", params=params, raw=content)
        )

    def list_model_versions(self, name: str, *, limit: int = 100, offset: int = 0) -> J:
        """``GET /v1/models/{name}/versions``: released versions, oldest first."""
        return self._json(
            _Call(
                "GET",
                f"/v1/models/{_segment(name)}/versions",
                params={"limit": limit, "offset": offset},
            )
        )

    def get_model_version(self, name: str, version: int) -> J:
        """``GET /v1/models/{name}/versions/{v}``: with its certificate and metrics."""
        return self._json(_Call("GET", f"/v1/models/{_segment(name)}/versions/{int(version)}"))

    def download_artifact(self, name: str, version: int) -> A:
        """``GET /v1/models/{name}/versions/{v}/artifact``: the weights, checked against the
        SHA-256 recorded at publication (``LedgerError`` ``artifact_mismatch`` otherwise)."""
        return self._artifact(_Call("GET", f"/v1/models/{_segment(name)}/versions/{int(version)}/artifact"))


# ---------------------------------------------------------------------------------------------
# The release gate
# ---------------------------------------------------------------------------------------------


@dataclass
class ReleaseGate:
    """What ``release_gate`` yields: the held ``reservation`` while the block runs; after a clean
    exit, the ``certificate`` of the committed release.

    ``commit_event``: set it inside the block to release the model with a certificate of only
    what it trained on (a run stopped early); the rest of the hold is then aborted, which charges
    it: the ledger cannot see what ran in this process. ``artifact_sha256``: set it inside the
    block (the hex SHA-256 of the weights you will publish) to have the signed certificate name
    those bytes. ``withhold()``: release nothing — the exit aborts the reservation instead of
    committing it, and an abort charges **everything reserved** (issue 24 §2: a decision not to
    release, taken after looking, is itself a release).
    """

    dataset_id: str
    model: str
    version: Identifier
    reservation: JsonObject
    certificate: JsonObject | None = None
    commit_answer: JsonObject | None = None
    commit_event: EventLike | None = None
    artifact_sha256: str | None = None
    status: str = "reserved"  # reserved | committed | aborted | withheld
    _withheld: bool = field(default=False, repr=False)
    _extend: Callable[[float], JsonObject] | None = field(default=None, repr=False)
    _warning: threading.Timer | None = field(default=None, repr=False)
    _first_ttl_s: float | None = field(default=None, repr=False)

    @property
    def reservation_id(self) -> str:
        return str(self.reservation["id"])

    @property
    def expires_at(self) -> datetime:
        """When the hold expires unless committed, aborted or extended (the server's clock)."""
        return _instant(self.reservation["expires_at"])

    @property
    def ttl_s(self) -> float:
        """The length of the hold as first granted: what ``extend`` renews by default."""
        return self._ttl()

    def _ttl(self) -> float:
        if self._first_ttl_s is None:
            created = _instant(self.reservation["created_at"])
            self._first_ttl_s = max(1.0, (self.expires_at - created).total_seconds())
        return self._first_ttl_s

    def seconds_left(self) -> float:
        """Seconds until the hold expires, by this machine's clock."""
        return (self.expires_at - datetime.now(UTC)).total_seconds()

    def extend(self, ttl_s: float | None = None) -> None:
        """Hold the reservation ``ttl_s`` (default: the hold's first length) seconds from now
        (``LedgerClient.extend``; audited by the ledger). Sync gates only: an async gate awaits
        ``AsyncLedgerClient.extend(gate.reservation_id, ttl_s)`` and calls ``extended``."""
        if self._extend is None:
            raise RuntimeError("this gate cannot extend its hold itself: await client.extend(...)")
        self.extended(self._extend(self._ttl() if ttl_s is None else ttl_s))

    def extended(self, reservation: JsonObject) -> None:
        """Record the reservation an extension answered, and warn again before its new expiry."""
        self.reservation = reservation
        self._arm_warning()

    def renew_if_due(self) -> bool:
        """Extend the hold by its first length when less than half of it is left (call it from
        the training loop: a cheap clock read otherwise). A ledger that cannot be reached is
        logged and retried at the next call; a refusal (lifetime, expired) raises."""
        if self.status != "reserved" or self.seconds_left() > self._ttl() / 2:
            return False
        try:
            self.extend()
        except LedgerUnavailable as exc:
            logger.warning("could not renew reservation %s (will retry): %s", self.reservation_id, exc)
            return False
        return True

    @property
    def cost(self) -> dict[str, str]:
        return dict(self.reservation.get("cost") or {})

    def withhold(self) -> None:
        """Release nothing: the exit aborts the reservation. That charges everything reserved
        (a certificate of ``outcome: "aborted"``, ``release: null``); nothing is refunded."""
        self._withheld = True

    def _arm_warning(self) -> None:
        """Warn (``ReservationExpiring``, and the log) shortly before the hold expires."""
        self._disarm()
        left = self.seconds_left()
        margin = min(EXPIRY_WARNING_S, self._ttl() / 10)
        timer = threading.Timer(max(0.0, left - margin), self._warn)
        timer.daemon = True
        self._warning = timer
        timer.start()

    def _disarm(self) -> None:
        if self._warning is not None:
            self._warning.cancel()
            self._warning = None

    def _warn(self) -> None:
        if self.status != "reserved":
            return
        text = (
            f"reservation {self.reservation_id} expires at {self.expires_at.isoformat()} "
            f"({max(0.0, self.seconds_left()):.0f} s left): an expiry charges everything reserved "
            "and releases nothing. Extend it (gate.extend(), gate.renew_if_due() in the training "
            "loop, or keep_alive=True), or reserve with a longer ttl_s."
        )
        logger.warning(text)
        warnings.warn(text, ReservationExpiring, stacklevel=1)


class ReservationExpiring(UserWarning):
    """A release gate's hold is about to expire (``ReleaseGate``): extend it or it is charged in
    full and releases nothing."""


def _instant(text: object) -> datetime:
    at = datetime.fromisoformat(str(text))
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


@contextlib.contextmanager
def _heartbeat(gate: ReleaseGate, every_s: float | None) -> Iterator[None]:
    """Renew ``gate``'s hold from a daemon thread while the block runs (``keep_alive``)."""
    if every_s is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                gate.renew_if_due()
            except LedgerError as exc:  # the hold cannot be renewed: the warning will say so
                logger.warning("keep_alive stopped for reservation %s: %s", gate.reservation_id, exc)
                return

    thread = threading.Thread(target=beat, name=f"keep-alive-{gate.reservation_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _record_commit(gate: ReleaseGate, answer: JsonObject) -> None:
    gate.commit_answer = answer
    gate.certificate = answer.get("certificate")
    gate.status = "committed"
    reservation = answer.get("reservation")
    if isinstance(reservation, dict):
        gate.reservation = reservation


def _found_by_name(dataset: Identifier, page: JsonObject) -> JsonObject:
    if page.get("data"):
        found: JsonObject = page["data"][0]
        return found
    raise NotFound(
        f"no dataset of this tenant has the id or the name {str(dataset)!r}.",
        code="not_found",
        status=404,
        details={"resource": "dataset", "looked_up": str(dataset)},
    )


def _check_open(reservation: JsonObject, idempotency_key: str) -> None:
    """A gate re-entered with the key of an earlier attempt must find its hold still open."""
    status = reservation.get("status")
    if status != "reserved":
        raise Conflict(
            f"reservation {reservation.get('id')!r} of an earlier attempt with idempotency key "
            f"{idempotency_key!r} is {status}; start a new attempt with a new key.",
            code="reservation_closed",
            status=409,
            details={"reservation_id": reservation.get("id"), "reservation_status": status},
        )


def _note(error: BaseException, text: str) -> None:
    with contextlib.suppress(AttributeError):  # add_note: Python >= 3.11
        error.add_note(text)


# ---------------------------------------------------------------------------------------------
# The synchronous client
# ---------------------------------------------------------------------------------------------


class LedgerClient(_Endpoints[JsonObject, Artifact]):
    """A synchronous client (httpx). Use it as a context manager, or ``close()`` it.

    ``base_url``: the server root (``http://127.0.0.1:8000``); ``api_key``: a bearer key;
    ``timeout``: seconds per attempt; ``retries``: retries after the first attempt;
    ``transport``: an ``httpx.BaseTransport`` (e.g. to reach an app in-process).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = _checked_api_key(api_key)
        self._policy = _RetryPolicy(retries, backoff_s)
        try:
            self._http = httpx.Client(
                base_url=self.base_url,
                timeout=timeout,
                transport=transport,
                headers={"User-Agent": USER_AGENT},
            )
        except httpx.InvalidURL as exc:
            raise _invalid_url(base_url, exc) from exc

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call) -> httpx.Response:
        headers = call.headers(self._api_key)
        content = call.content()
        for attempt in range(self._policy.retries + 1):
            response: httpx.Response | None = None
            cause: BaseException | None = None
            try:
                response = self._http.request(
                    call.method, call.path, content=content, params=call.params, headers=headers
                )
            except _TRANSIENT as exc:
                cause = exc
            except httpx.TransportError as exc:
                raise _unavailable(call, attempt + 1, exc, None) from exc
            else:
                if response.is_success or not self._policy.retryable(response, call):
                    return response
            time.sleep(self._policy.wait(call, attempt, cause, response))
        raise AssertionError("unreachable")  # pragma: no cover

    def _json(self, call: _Call) -> JsonObject:
        return _json_answer(call, self._send(call))

    def _artifact(self, call: _Call) -> Artifact:
        return _artifact_answer(self._send(call))

    def metrics_text(self) -> str:
        """``GET /metrics``: Prometheus text. The client's key is sent as the bearer token, so
        make this client with the operator's ``LEDGER_METRICS_TOKEN``: API keys get
        ``Unauthorized`` (unless the server sets ``LEDGER_METRICS_PUBLIC``)."""
        return _text_answer(self._send(_Call("GET", "/metrics")))

    def find_dataset(self, dataset: Identifier) -> JsonObject:
        """The dataset whose id — or, failing that, whose name — is ``dataset`` (a name stands
        for one dataset: names are unique per tenant). ``NotFound`` names what was looked up."""
        try:
            return self.get_dataset(dataset)
        except NotFound:
            pass
        return _found_by_name(dataset, self.list_datasets(name=str(dataset), limit=1))

    def calibrate_noise_multiplier(
        self,
        dataset_id: Identifier,
        *,
        sampling_probability: float,
        steps: int,
        target_epsilon: float | None = None,
        target_budget_epsilon: float | None = None,
        delta: float | None = None,
        batches: Sequence[Identifier] | None = None,
        tasks: Sequence[Identifier] | None = None,
        new_batch: bool = False,
    ) -> float:
        """σ (grid 10⁻⁴) for ``steps`` steps of DP-SGD (Poisson sampling at
        ``sampling_probability``) charged to the dataset on exactly one of ``batches``,
        ``tasks`` or a new batch (``new_batch=True``). Give exactly one target:

        * ``target_epsilon``: the run's *own* ε at ``delta`` (default: the budget's δ) by the
          tight engine the ledger prices a run alone with, what Opacus users mean — the smallest σ
          meeting it (``accountant.calibration.calibrate_noise_multiplier(accountant="tight")``). If the
          dataset's quote does not admit that run, ``BudgetExceeded`` before anything is held or
          read, its ``largest_target_epsilon`` the largest target that fits (``None``: none does).
        * ``target_budget_epsilon``: what the *dataset charges* for the run (its quote; a Rényi
          filter charges more than plain RDP) is at most this — the smallest σ whose quote is
          (``accountant.calibration.calibrate_to_price``, searched up from the RDP accountant's σ).

        The reservation decides: the states may change in between."""
        from accountant.calibration import (
            TIGHT_ACCOUNTANT,
            calibrate_noise_multiplier,
            calibrate_to_price,
            largest_fitting_epsilon,
        )

        if (target_epsilon is None) == (target_budget_epsilon is None):
            raise ValueError(
                "give exactly one of target_epsilon (the run's own epsilon) and target_budget_epsilon "
                f"(what the dataset charges). Found {target_epsilon!r} and {target_budget_epsilon!r}."
            )
        budget_delta = float(self.get_dataset(dataset_id)["budget"]["delta"])
        at = budget_delta if delta is None else delta

        def event(sigma: float) -> DpEvent:
            return dp_events.SelfComposedEvent(
                dp_events.PoissonSampledEvent(sampling_probability, dp_events.GaussianEvent(sigma)), steps
            )

        def quoted(run: DpEvent) -> JsonObject:
            return self.quote(
                dataset_id, run, batches=batches, tasks=tasks, new_batch=new_batch, limit=1, accountants=False
            )

        if target_epsilon is not None:
            if not 0 < at < 1:
                raise ValueError(
                    f"delta must be in (0, 1) for target_epsilon; the budget's is {budget_delta}."
                )
            sigma = calibrate_noise_multiplier(
                target_epsilon=target_epsilon,
                delta=at,
                sampling_probability=sampling_probability,
                steps=steps,
                accountant=TIGHT_ACCOUNTANT,
            )
            answer = quoted(event(sigma))
            if answer["admitted"]:
                return sigma
            largest = largest_fitting_epsilon(
                event, admits=lambda run: bool(quoted(run)["admitted"]), delta=at, start=sigma
            )
            fits = f"the largest that fits is {largest}" if largest is not None else "none fits"
            raise BudgetExceeded(
                f"a run of target_epsilon={target_epsilon} (its own epsilon at delta={at}: "
                f"sigma={sigma}) does not fit dataset {dataset_id}'s budget; {fits}. Nothing was held.",
                code="budget_exceeded",
                status=409,
                details={
                    **{
                        k: v for k, v in (answer.get("refused") or {}).items() if k not in ("code", "message")
                    },
                    "field": "target_epsilon",
                    "largest_target_epsilon": largest,
                },
            )
        assert target_budget_epsilon is not None
        start = (
            calibrate_noise_multiplier(
                target_epsilon=target_budget_epsilon,
                delta=at,
                sampling_probability=sampling_probability,
                steps=steps,
            )
            if 0 < at < 1
            else 1.0
        )

        def price(run: DpEvent) -> Decimal:
            return Decimal(quoted(run)["cost"]["epsilon"])

        return calibrate_to_price(event, start=start, target_epsilon=target_budget_epsilon, price=price)

    # paging ---------------------------------------------------------------------------------

    def iter_reservation_batches(
        self, reservation_id: str, *, page_size: int = 10_000
    ) -> Iterator[tuple[str, int]]:
        """Every (batch id, class) of the reservation: what its ``batch_set`` commits to."""
        after: str | None = None
        while True:
            page: JsonObject = self.reservation_batches(reservation_id, after=after, limit=page_size)
            yield from ((b["id"], b["class"]) for b in page["data"])
            after = page["next"]
            if after is None:
                return

    def iter_tasks(self, dataset_id: Identifier, *, page_size: int = 1000) -> Iterator[JsonObject]:
        """Every task of the dataset, oldest first, page by page."""
        return _offset_pages(lambda offset: self.list_tasks(dataset_id, limit=page_size, offset=offset))

    def iter_batches(
        self, dataset_id: Identifier, task_id: Identifier, *, page_size: int = 10_000
    ) -> Iterator[JsonObject]:
        """Every batch of the task with its spend, in position order, page by page."""
        after: int | None = None
        while True:
            page: JsonObject = self.list_batches(dataset_id, task_id, after=after, limit=page_size)
            yield from page["data"]
            after = page["next"]
            if after is None:
                return

    def iter_certificates(self, dataset_id: Identifier, *, page_size: int = 500) -> Iterator[JsonObject]:
        """Every certificate of the dataset, oldest first, page by page."""
        return _offset_pages(
            lambda offset: self.list_certificates(dataset_id, limit=page_size, offset=offset)
        )

    def iter_audit_entries(self, dataset_id: Identifier, *, page_size: int = 1000) -> Iterator[JsonObject]:
        """Every entry of the dataset's audit chain up to its head (read on the first page)."""
        after: int | None = 0
        while after is not None:
            page = self.audit_entries(dataset_id, after=after, limit=page_size)
            yield from page["data"]
            after = _next_after(page)

    def iter_model_versions(self, name: str, *, page_size: int = 500) -> Iterator[JsonObject]:
        """Every released version of the model, oldest first (none: ``NotFound``)."""
        return _offset_pages(lambda offset: self.list_model_versions(name, limit=page_size, offset=offset))

    # the gate --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def release_gate(
        self,
        dataset_id: Identifier,
        batches: Sequence[Identifier] | None,
        event: EventLike,
        *,
        model: str,
        version: Identifier,
        tasks: Sequence[Identifier] | None = None,
        noise_commitment: str | None = None,
        ttl_s: float | None = None,
        keep_alive: bool = False,
        idempotency_key: str | None = None,
    ) -> Iterator[ReleaseGate]:
        """Reserve ``event`` on ``batches`` (or ``tasks``) on enter; commit the release
        ``{model, version}`` on a clean exit; abort on an exception (re-raised) or ``withhold()``
        — an abort charges everything reserved (``ReleaseGate``).

        ``idempotency_key``: a stable name for this release attempt (e.g. a run id): a trainer
        that crashed and runs again with it gets its first reservation back instead of a second
        charge. ``BudgetExceeded`` on enter means nothing ran and nothing is held.

        The hold lasts ``ttl_s`` (default: the server's, an hour) and an expiry charges
        everything reserved and releases nothing. A ``ReservationExpiring`` warning is issued
        (and logged) shortly before it expires; renew it with ``gate.extend()``, with
        ``gate.renew_if_due()`` in the training loop, or with ``keep_alive=True`` (a daemon thread
        renews it while the block runs, up to the server's maximum lifetime of a reservation).
        """
        base = idempotency_key or new_idempotency_key()
        reservation = self.reserve(
            dataset_id,
            event,
            batches=batches,
            tasks=tasks,
            noise_commitment=noise_commitment,
            ttl_s=ttl_s,
            release={"model": model, "version": version},  # a taken release is refused before training
            idempotency_key=f"{base}:reserve",
        )
        if idempotency_key is not None:  # a replayed reserve answers its first answer: look now
            reservation = self.get_reservation(str(reservation["id"]))
            _check_open(reservation, idempotency_key)
        gate = ReleaseGate(str(dataset_id), model, version, reservation)
        gate._extend = lambda ttl: self.extend(gate.reservation_id, ttl)
        gate._arm_warning()
        try:
            with _heartbeat(gate, gate.ttl_s / 4 if keep_alive else None):
                yield gate
        except BaseException as exc:
            gate._disarm()
            self._abort_quietly(gate, f"{base}:abort", exc)
            raise
        gate._disarm()
        if gate._withheld:
            self.abort(gate.reservation_id, idempotency_key=f"{base}:abort")
            gate.status = "withheld"
            return
        try:
            answer = self.commit(
                gate.reservation_id,
                model=model,
                version=version,
                event=gate.commit_event,
                artifact_sha256=gate.artifact_sha256,
                idempotency_key=f"{base}:commit",
            )
        except LedgerError as exc:
            self._abort_quietly(gate, f"{base}:abort", exc)
            raise
        _record_commit(gate, answer)
        if gate.commit_event is not None:
            # a progressive commit keeps the rest held: return it now
            self._abort_quietly(gate, f"{base}:abort-rest", None, keep_status=True)

    def _abort_quietly(
        self, gate: ReleaseGate, key: str, cause: BaseException | None, *, keep_status: bool = False
    ) -> None:
        try:
            answer = self.abort(gate.reservation_id, idempotency_key=key)
        except LedgerError as failure:
            if cause is not None:
                _note(cause, f"the release gate could not abort {gate.reservation_id}: {failure}")
            return
        if not keep_status:
            gate.status = "aborted"
            gate.reservation = answer


# ---------------------------------------------------------------------------------------------
# The asynchronous client
# ---------------------------------------------------------------------------------------------


class AsyncLedgerClient(_Endpoints[Awaitable[JsonObject], Awaitable[Artifact]]):
    """The asyncio twin of ``LedgerClient``: the same methods, awaited.

    ``transport``: an ``httpx.AsyncBaseTransport`` (e.g. ``httpx.ASGITransport(app)``).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        backoff_s: float = DEFAULT_BACKOFF_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = _checked_api_key(api_key)
        self._policy = _RetryPolicy(retries, backoff_s)
        try:
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                timeout=timeout,
                transport=transport,
                headers={"User-Agent": USER_AGENT},
            )
        except httpx.InvalidURL as exc:
            raise _invalid_url(base_url, exc) from exc

    async def __aenter__(self) -> AsyncLedgerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        headers = call.headers(self._api_key)
        content = call.content()
        for attempt in range(self._policy.retries + 1):
            response: httpx.Response | None = None
            cause: BaseException | None = None
            try:
                response = await self._http.request(
                    call.method, call.path, content=content, params=call.params, headers=headers
                )
            except _TRANSIENT as exc:
                cause = exc
            except httpx.TransportError as exc:
                raise _unavailable(call, attempt + 1, exc, None) from exc
            else:
                if response.is_success or not self._policy.retryable(response, call):
                    return response
            await asyncio.sleep(self._policy.wait(call, attempt, cause, response))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _json(self, call: _Call) -> JsonObject:
        return _json_answer(call, await self._send(call))

    async def _artifact(self, call: _Call) -> Artifact:
        return _artifact_answer(await self._send(call))

    async def find_dataset(self, dataset: Identifier) -> JsonObject:
        """``LedgerClient.find_dataset``, awaited."""
        try:
            return await self.get_dataset(dataset)
        except NotFound:
            pass
        return _found_by_name(dataset, await self.list_datasets(name=str(dataset), limit=1))

    async def metrics_text(self) -> str:
        """``GET /metrics``: Prometheus text. The client's key is sent as the bearer token, so
        make this client with the operator's ``LEDGER_METRICS_TOKEN``: API keys get
        ``Unauthorized`` (unless the server sets ``LEDGER_METRICS_PUBLIC``)."""
        return _text_answer(await self._send(_Call("GET", "/metrics")))

    async def iter_certificates(
        self, dataset_id: Identifier, *, page_size: int = 500
    ) -> AsyncIterator[JsonObject]:
        """Every certificate of the dataset, oldest first, page by page."""
        offset: int | None = 0
        while offset is not None:
            page = await self.list_certificates(dataset_id, limit=page_size, offset=offset)
            for item in page["data"]:
                yield item
            offset = _next_offset(page, offset)

    async def iter_audit_entries(
        self, dataset_id: Identifier, *, page_size: int = 1000
    ) -> AsyncIterator[JsonObject]:
        """Every entry of the dataset's audit chain up to its head."""
        after: int | None = 0
        while after is not None:
            page = await self.audit_entries(dataset_id, after=after, limit=page_size)
            for item in page["data"]:
                yield item
            after = _next_after(page)

    @contextlib.asynccontextmanager
    async def release_gate(
        self,
        dataset_id: Identifier,
        batches: Sequence[Identifier] | None,
        event: EventLike,
        *,
        model: str,
        version: Identifier,
        tasks: Sequence[Identifier] | None = None,
        noise_commitment: str | None = None,
        ttl_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncIterator[ReleaseGate]:
        """``LedgerClient.release_gate``, awaited. It warns before the hold expires as the sync
        gate does; renew with ``gate.extended(await client.extend(gate.reservation_id, ttl_s))``."""
        base = idempotency_key or new_idempotency_key()
        reservation = await self.reserve(
            dataset_id,
            event,
            batches=batches,
            tasks=tasks,
            noise_commitment=noise_commitment,
            ttl_s=ttl_s,
            release={"model": model, "version": version},  # a taken release is refused before training
            idempotency_key=f"{base}:reserve",
        )
        if idempotency_key is not None:  # a replayed reserve answers its first answer: look now
            reservation = await self.get_reservation(str(reservation["id"]))
            _check_open(reservation, idempotency_key)
        gate = ReleaseGate(str(dataset_id), model, version, reservation)
        gate._arm_warning()
        try:
            yield gate
        except BaseException as exc:
            gate._disarm()
            await self._abort_quietly(gate, f"{base}:abort", exc)
            raise
        gate._disarm()
        if gate._withheld:
            await self.abort(gate.reservation_id, idempotency_key=f"{base}:abort")
            gate.status = "withheld"
            return
        try:
            answer = await self.commit(
                gate.reservation_id,
                model=model,
                version=version,
                event=gate.commit_event,
                artifact_sha256=gate.artifact_sha256,
                idempotency_key=f"{base}:commit",
            )
        except LedgerError as exc:
            await self._abort_quietly(gate, f"{base}:abort", exc)
            raise
        _record_commit(gate, answer)
        if gate.commit_event is not None:
            await self._abort_quietly(gate, f"{base}:abort-rest", None, keep_status=True)

    async def _abort_quietly(
        self, gate: ReleaseGate, key: str, cause: BaseException | None, *, keep_status: bool = False
    ) -> None:
        try:
            answer = await self.abort(gate.reservation_id, idempotency_key=key)
        except LedgerError as failure:
            if cause is not None:
                _note(cause, f"the release gate could not abort {gate.reservation_id}: {failure}")
            return
        if not keep_status:
            gate.status = "aborted"
            gate.reservation = answer


__all__ = [
    "Artifact",
    "AsyncLedgerClient",
    "BatchOverlap",
    "BudgetExceeded",
    "Conflict",
    "EventLike",
    "Forbidden",
    "InvalidInput",
    "LedgerClient",
    "LedgerError",
    "LedgerUnavailable",
    "NotFound",
    "ReleaseGate",
    "ReservationExpiring",
    "ServerError",
    "Unauthorized",
    "error_from_response",
    "event_json",
    "new_idempotency_key",
]
