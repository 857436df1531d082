"""Dry-run quotes: what a charge *would* cost on a dataset's batches, nothing held or written.

``POST /v1/datasets/{id}/quote`` answers the cost the ledger would certify for an event on the
named batches, on the named tasks' batches, or — only when asked with ``new_batch: true`` — on
a new, empty batch of the dataset, under the dataset's own budget: the same rule, accountant,
grid and δ split a reservation meets (``accountant.rules.reserve`` on the batches' current
states). A quote names what it priced (``on``): a quote without a target used to price a new
batch silently, and an analyst read "admitted" for batches that then answered 409 (issue 25).

Priced per state class, as a reservation decides: batches in the same state are charged the
same, so the batches are read as one aggregate row per (state, task)
(``spending.store.state_groups``) and the charge is priced once per distinct state, never once
per batch. The answer lists the classes (batch count, a sample batch id, cost, admitted or the
409 it would get), a page of at most ``MAX_CLASSES_PER_PAGE`` of them, and the totals; its size
and its pricing grow with the distinct states, not with the batches.

A quote is advisory: the states may change before a reservation arrives, and the reservation
decides. It is bounded and metered by its work (``service.ledger.pricing_limits``: the event's nodes ×
the budget's orders, plus the budget's orders per class priced), and it reads only the tenant's
own dataset (another tenant's is ``NotFound``). Clients calibrate to it: a σ chosen so that the
*dataset's* price fits (``target_budget_epsilon``), and a run calibrated on its own
(``target_epsilon``) checked against it before any data is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from typing import Any, Final

from sqlalchemy import bindparam, select

from accountant import rules
from accountant.errors import AccountantError
from accountant.events import DpEvent
from accountant.exact import ZERO, to_text
from accountant.rules import BatchState, Budget, Charge, Cost, PriceMemo
from service.db.models import Batch, Dataset, Task
from service.db.session import Database
from service.ledger import pricing_limits
from service.ledger.datasets import refuse_archived
from service.ledger.errors import InvalidInput, LedgerError, NotFound
from service.ledger.spending import requests
from service.ledger.spending.answers import cost_json
from service.ledger.spending.decisions import rule_error
from service.ledger.spending.store import (
    EFFECTIVE_STATE,
    StateGroup,
    dataset_budget,
    read_states,
    state_groups,
    state_groups_query,
)

DEFAULT_CLASSES_PER_PAGE: Final = 100
MAX_CLASSES_PER_PAGE: Final = 1_000
TARGETS: Final = ("batches", "tasks", "new_batch")


@dataclass(frozen=True, slots=True)
class ClassQuote:
    """One state class of a quote: ``batches`` in one state (``example``: the smallest batch id
    among them; ``None`` for the new batch), priced once. ``cost`` when admitted; otherwise
    ``refusal`` (the 409 a reservation would get) and ``requested`` when the budget is what
    refuses it."""

    batches: int
    example: str | None
    cost: Cost | None
    refusal: LedgerError | None = None
    requested: tuple[Decimal, Decimal] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batches": self.batches,
            "batch_id": self.example,
            "admitted": self.refusal is None,
        }
        if self.cost is not None:
            out.update(
                epsilon=to_text(self.cost.epsilon),
                delta=to_text(self.cost.delta),
                naive_epsilon=to_text(self.cost.naive_epsilon),
            )
            if self.cost.level is not None:
                out["level"] = self.cost.level
            if self.cost.replay:
                out["replay"] = True
        elif self.requested is not None:
            out.update(epsilon=to_text(self.requested[0]), delta=to_text(self.requested[1]))
        out["refused"] = None if self.refusal is None else _refusal_json(self.refusal)
        return out


@dataclass(frozen=True, slots=True)
class Quote:
    """What a reservation of one event on one target would be charged now, per state class
    (ordered by sample batch id)."""

    dataset_id: str
    on: str  # "batches", "tasks" or "new_batch"
    classes: tuple[ClassQuote, ...]

    @property
    def admitted(self) -> bool:
        return all(c.refusal is None for c in self.classes)

    @property
    def epsilon(self) -> Decimal:
        """The most any class is charged (what a reservation holds), or asks for when refused."""
        return max((_asked(c)[0] for c in self.classes), default=ZERO)

    @property
    def delta(self) -> Decimal:
        return max((_asked(c)[1] for c in self.classes), default=ZERO)

    @property
    def refused(self) -> ClassQuote | None:
        return next((c for c in self.classes if c.refusal is not None), None)

    def to_json(self, *, limit: int = DEFAULT_CLASSES_PER_PAGE, offset: int = 0) -> dict[str, Any]:
        """The answer of ``POST /v1/datasets/{id}/quote``: the totals, and the classes
        ``[offset, offset + limit)`` (``next_offset``: where the next page starts, or ``None``)."""
        page = self.classes[offset : offset + limit]
        refused = self.refused
        admitted_batches = sum(c.batches for c in self.classes if c.refusal is None)
        total = sum(c.batches for c in self.classes)
        return {
            "dataset_id": self.dataset_id,
            "on": self.on,
            "admitted": self.admitted,
            "cost": cost_json(self.epsilon, self.delta),
            "totals": {
                "batches": total,
                "classes": len(self.classes),
                "admitted_batches": admitted_batches,
                "refused_batches": total - admitted_batches,
            },
            "classes": [c.to_json() for c in page],
            "next_offset": offset + limit if offset + limit < len(self.classes) else None,
            "refused": None if refused is None or refused.refusal is None else _refusal_json(refused.refusal),
        }


@dataclass(frozen=True, slots=True)
class QuoteAnswer:
    """What ``quote`` answers: the ``Quote``, the page of its classes asked for (``limit`` from
    ``offset``), and the informational ``accountants`` block (``accountant_costs``; ``None``: not
    asked for). ``to_json`` is the answer of ``POST /v1/datasets/{id}/quote``."""

    quote: Quote
    limit: int
    offset: int
    accountants: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        answer = self.quote.to_json(limit=self.limit, offset=self.offset)
        answer["accountants"] = self.accountants
        return answer


def _asked(c: ClassQuote) -> tuple[Decimal, Decimal]:
    if c.cost is not None:
        return c.cost.epsilon, c.cost.delta
    return c.requested or (ZERO, ZERO)


def _refusal_json(error: LedgerError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, **error.details}


@dataclass(frozen=True, slots=True)
class _Target:
    on: str
    ids: tuple[str, ...] = ()


def quote(
    db: Database,
    tenant_id: str,
    dataset_id: str,
    *,
    event: DpEvent,
    batch_ids: Sequence[str] | None = None,
    task_ids: Sequence[str] | None = None,
    new_batch: bool = False,
    noise_commitment: str | None = None,
    policy: pricing_limits.Policy | None = None,
    limit: int = DEFAULT_CLASSES_PER_PAGE,
    offset: int = 0,
    accountants: bool = True,
) -> QuoteAnswer:
    """The ``Quote`` of ``event`` (parsed: ``reservations.parse_event``, or by the HTTP schema)
    on exactly one of ``batch_ids``, ``task_ids`` or a new batch (``new_batch=True``), the page
    of its classes asked for, and the informational ``accountants`` block (``accountant_costs``;
    ``None`` when ``accountants`` is false): a ``QuoteAnswer``, whose ``to_json`` is the route's.

    Raises ``InvalidInput`` (no target or two, bad event, ids, page, or pricing above
    ``policy.max_work``) and ``NotFound`` (dataset, batch or task; also another tenant's)."""
    target = _target(batch_ids, task_ids, new_batch)
    _check_page(limit, offset)
    charge = requests.charge(requests.new_event(event), noise_commitment)
    budget = _own_budget(db, tenant_id, dataset_id)
    groups = _groups(db, dataset_id, target)
    policy = policy or pricing_limits.DEFAULT_POLICY
    priced = _priced(dataset_id, target.on, budget, charge, groups, policy)
    block = accountant_costs(budget, charge.event, policy) if accountants else None
    return QuoteAnswer(priced, limit, offset, block)


# ---------------------------------------------------------------------------------------------
# What each accountant choice would cost (informational)
# ---------------------------------------------------------------------------------------------

ACCOUNTANTS_NOTE: Final = (
    "Informational, not a charge: what this event would cost as the first charge on a new, empty "
    "batch of a budget with this dataset's rule, epsilon and delta under each accountant (prv on "
    "a sequential rule: as a declared plan of this event alone). This dataset's budget uses "
    "'{uses}' and keeps it; what a reservation here is charged is 'cost' and 'classes' above."
)


def accountant_costs(budget: Budget, event: DpEvent, policy: pricing_limits.Policy) -> dict[str, Any]:
    """The quote's ``accountants`` block: the event's price on a fresh batch of the same rule,
    ε and δ under ``basic``, ``rdp``, ``prv`` and ``tight`` (``by_accountant``), which one the
    budget uses (``uses``) and a note saying the block is informational. An accountant the rule
    does not take, or whose pricing would exceed ``policy.max_work``, says why instead. Each
    figure is memoized per (budget, event, pricing version)."""
    by: dict[str, dict[str, Any]] = {}
    alternatives: list[tuple[str, Budget]] = []
    for name in rules.ACCOUNTANTS:
        try:
            alternative = _alternative(budget, name, event)
        except AccountantError as exc:
            by[name] = {"available": False, "reason": str(exc)}
            continue
        units = pricing_limits.work(alternative, [event])
        if units > policy.max_work:
            by[name] = {
                "available": False,
                "reason": f"pricing it would take {units} units of work, above this server's limit "
                f"of {policy.max_work} per request",
            }
            continue
        alternatives.append((name, alternative))
    with policy.metered(sum(pricing_limits.work(b, [event]) for _, b in alternatives)):
        for name, alternative in alternatives:
            by[name] = _fresh_cost(alternative, event, rules.active_pricing())
    return {
        "informational": True,
        "uses": budget.accountant,
        "note": ACCOUNTANTS_NOTE.format(uses=budget.accountant),
        "by_accountant": {
            name: {"used": name == budget.accountant, **by[name]} for name in rules.ACCOUNTANTS
        },
    }


def _alternative(budget: Budget, accountant: str, event: DpEvent) -> Budget:
    """A fresh budget like ``budget`` under ``accountant`` (a declared plan of ``event`` alone for
    ``prv`` on ``sequential``); ``AccountantError`` where that budget cannot exist."""
    if accountant == "prv" and budget.rule == "sequential":
        return _fresh_budget(
            budget.rule, budget.epsilon, budget.delta, accountant, budget.geometric, (event,)
        )
    if accountant == budget.accountant:
        return budget
    return _fresh_budget(budget.rule, budget.epsilon, budget.delta, accountant, budget.geometric, None)


@lru_cache(maxsize=256)
def _fresh_budget(
    rule: str,
    epsilon: Decimal,
    delta: Decimal,
    accountant: str,
    geometric: rules.GeometricSchedule | None,
    plan: tuple[DpEvent, ...] | None,
) -> Budget:
    return Budget.create(
        rule=rule,
        epsilon=epsilon,
        delta=delta,
        accountant=accountant,
        geometric=geometric,
        plan=None if plan is None else list(plan),
    )


@lru_cache(maxsize=256)
def _fresh_cost(budget: Budget, event: DpEvent, version: int) -> dict[str, Any]:
    """The event's reservation on an empty batch of ``budget`` under pricing ``version``: its
    (ε, δ) and whether it would be admitted (refused: what it asks for), or why it cannot be
    priced. Shared between requests: callers copy it, never change it."""
    try:
        with rules.pricing(PriceMemo(budget)), rules.pricing_version(version):
            cost = rules.reserve(budget, BatchState.empty(), Charge(event)).cost
        return {"available": True, "admitted": True, **cost_json(cost.epsilon, cost.delta)}
    except rules.BudgetExceeded as exc:
        return {"available": True, "admitted": False, **exc.requested.to_json()}
    except AccountantError as exc:
        return {"available": False, "reason": str(exc)}


class DatasetPrices:
    """Quotes of many events on the same batches, for a calibration that tries many σ: the budget
    and the batches' state classes are read once, on the first call, and each event is priced
    once per class (the reservation decides on the states it reads under the lock).
    ``batch_ids=None``: every batch of the dataset."""

    def __init__(
        self, db: Database, tenant_id: str, dataset_id: str, batch_ids: Sequence[str] | None = None
    ) -> None:
        self._db, self._tenant_id, self._dataset_id = db, tenant_id, dataset_id
        self._target = _Target("dataset") if batch_ids is None else _Target("batches", tuple(batch_ids))
        self._loaded: tuple[Budget, list[tuple[StateGroup, BatchState]]] | None = None

    def quote(self, event: DpEvent) -> Quote:
        if self._loaded is None:
            budget = _own_budget(self._db, self._tenant_id, self._dataset_id)
            self._loaded = (budget, _groups(self._db, self._dataset_id, self._target))
        budget, groups = self._loaded
        charge = requests.charge(event, None)
        return _priced(
            self._dataset_id, self._target.on, budget, charge, groups, pricing_limits.DEFAULT_POLICY
        )

    def price(self, event: DpEvent) -> Decimal:
        """What a reservation of ``event`` would hold (``Quote.epsilon``)."""
        return self.quote(event).epsilon

    def admits(self, event: DpEvent) -> bool:
        """Whether a reservation of ``event`` would be admitted now."""
        return self.quote(event).admitted


@dataclass(frozen=True, slots=True)
class StageRefusal:
    """The first charge of a sequence the ledger would refuse: its place (0, 1, ...) and the
    409 its reservation would get (naming a batch)."""

    index: int
    refusal: LedgerError


class StagedPrices:
    """Whether a staged run's charges — one per stage, each on the stage's batches, reserved and
    committed in turn, as ``service.worker.gate`` runs the stages — would all be admitted from the
    batches' current states: a later charge meets the states the earlier ones leave (a batch
    re-read by a ``sequential`` budget composes; a ``parallel`` one refuses the re-read). Decided
    as the ledger decides (``accountant.rules.reserve`` then ``commit``), once per class of
    batches in one state read by the same stages. ``stage_batches``: each stage's batch ids,
    fixed; the budget, the states and the classes are read and formed once, on the first call, so
    a calibration may ask about many runs (their events) on them. Advisory, as a quote is."""

    def __init__(
        self, db: Database, tenant_id: str, dataset_id: str, stage_batches: Sequence[Sequence[str]]
    ) -> None:
        self._db, self._tenant_id, self._dataset_id = db, tenant_id, dataset_id
        self._stage_batches = stage_batches
        self._loaded: tuple[Budget, list[tuple[BatchState, tuple[int, ...], str]]] | None = None

    def _load(self) -> tuple[Budget, list[tuple[BatchState, tuple[int, ...], str]]]:
        if self._loaded is None:
            budget = _own_budget(self._db, self._tenant_id, self._dataset_id)
            rows = self._db.read_all(
                select(Batch.id, EFFECTIVE_STATE.label("state_id")).where(
                    Batch.dataset_id == self._dataset_id
                )
            )
            state_of = {r.id: r.state_id for r in rows}
            reads: dict[str, list[int]] = {}
            for index, batch_ids in enumerate(self._stage_batches):
                for batch_id in batch_ids:
                    reads.setdefault(batch_id, []).append(index)
            classes: dict[tuple[str, tuple[int, ...]], str] = {}  # (state, stages) -> smallest batch id
            for batch_id, read_by in reads.items():
                if batch_id not in state_of:
                    raise NotFound("batch", batch_id)
                key = (state_of[batch_id], tuple(read_by))
                classes[key] = min(classes.get(key, batch_id), batch_id)
            states = read_states(self._db, (state_id for state_id, _ in classes))
            ordered = sorted(classes.items(), key=lambda kv: kv[1])
            self._loaded = (budget, [(states[sid], stages, example) for (sid, stages), example in ordered])
        return self._loaded

    def refusal(self, charges: Sequence[Charge]) -> StageRefusal | None:
        """``None`` when every stage's charge (in the order of ``stage_batches``) would be
        admitted in turn; else the earliest refused one. ``NotFound`` for a batch the dataset
        does not hold, ``InvalidInput`` for an event the accountant cannot price."""
        if len(charges) != len(self._stage_batches):
            raise ValueError(f"{len(charges)} charges for {len(self._stage_batches)} stages.")
        budget, classes = self._load()
        for charge in charges:  # each bounded as its reservation will be
            pricing_limits.check_work(budget, [charge.event], pricing_limits.DEFAULT_POLICY.max_work)
        first: StageRefusal | None = None
        with rules.pricing(PriceMemo(budget)):
            for state, stages, example in classes:
                for index in stages:
                    if first is not None and index >= first.index:
                        break
                    try:
                        admission = rules.reserve(budget, state, charges[index])
                        state = rules.commit(
                            budget, admission.state, charges[index], admission.cost, None
                        ).state
                    except AccountantError as exc:
                        error = rule_error(exc, example)
                        if not isinstance(exc, rules.BudgetExceeded | rules.ChargeRefused):
                            raise error from exc
                        first = StageRefusal(index, error)
                        break
        return first


def _target(batch_ids: Sequence[str] | None, task_ids: Sequence[str] | None, new_batch: bool) -> _Target:
    values = (batch_ids, task_ids, new_batch or None)
    given = [name for name, v in zip(TARGETS, values, strict=True) if v is not None]
    if len(given) != 1:
        raise InvalidInput(
            "batches",
            "give exactly one of batches, tasks or new_batch: true (a quote without a target "
            f"prices nothing). Found {given or 'none'}.",
        )
    if new_batch is not True and new_batch is not False:
        raise InvalidInput("new_batch", f"must be true when given. Found {new_batch!r}.")
    if batch_ids is not None:
        return _Target("batches", tuple(requests.ids(batch_ids, "batches")))
    if task_ids is not None:
        return _Target("tasks", tuple(requests.ids(task_ids, "tasks")))
    return _Target("new_batch")


def _check_page(limit: int, offset: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_CLASSES_PER_PAGE:
        raise InvalidInput("limit", f"must be an integer in [1, {MAX_CLASSES_PER_PAGE}]. Found {limit!r}.")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidInput("offset", f"must be an integer >= 0. Found {offset!r}.")


_ARCHIVED: Final = select(Dataset.archived_at).where(Dataset.id == bindparam("dataset_id"))


def _own_budget(db: Database, tenant_id: str, dataset_id: str) -> Budget:
    """The tenant's dataset's budget; ``NotFound`` (also another tenant's), ``Conflict``
    ``dataset_archived`` (an archived dataset takes no reservation, so nothing to quote)."""
    tenant, budget = dataset_budget(db, dataset_id)
    if tenant != tenant_id:
        raise NotFound("dataset", dataset_id)
    for row in db.read_all(_ARCHIVED, {"dataset_id": dataset_id}):
        refuse_archived(dataset_id, row.archived_at)
    return budget


def _groups(db: Database, dataset_id: str, target: _Target) -> list[tuple[StateGroup, BatchState]]:
    """The target's batches as state classes, with their states: one aggregate read (one row per
    state and task) and one read of the distinct states; the new batch is one empty class."""
    if target.on == "new_batch":
        return [(StateGroup("", 1, frozenset(), ""), BatchState.empty())]
    ids = list(target.ids)
    where = {"batches": Batch.id.in_(ids), "tasks": Batch.task_id.in_(ids), "dataset": None}[target.on]
    groups = state_groups(db.read_all(*state_groups_query(dataset_id, where)))
    if target.on == "batches" and sum(g.batches for g in groups) != len(ids):
        in_ids = Batch.id.in_(ids)  # target "batches": where is this clause
        found = {r.id for r in db.read_all(select(Batch.id).where(Batch.dataset_id == dataset_id, in_ids))}
        raise NotFound("batch", next(i for i in ids if i not in found))
    if target.on == "tasks":
        query = select(Task.id).where(Task.dataset_id == dataset_id, Task.id.in_(ids))
        found = {r.id for r in db.read_all(query)}
        missing = [i for i in ids if i not in found]
        if missing:
            raise NotFound("task", missing[0])
    if not groups:
        raise InvalidInput("tasks" if target.on == "tasks" else "batches", "the target has no batches.")
    states = read_states(db, (g.state_id for g in groups))
    return sorted(((g, states[g.state_id]) for g in groups), key=lambda gs: gs[0].example)


def _priced(
    dataset_id: str,
    on: str,
    budget: Budget,
    charge: Charge,
    groups: Sequence[tuple[StateGroup, BatchState]],
    policy: pricing_limits.Policy,
) -> Quote:
    """The charge priced once per class (``rules.reserve``, as the reservation decides). Work:
    the event's (checked against ``policy.max_work``) plus the budget's orders per class."""
    units = pricing_limits.check_work(budget, [charge.event], policy.max_work)
    units += len(groups) * pricing_limits.orders_of(budget)
    classes: list[ClassQuote] = []
    with policy.metered(units), rules.pricing(PriceMemo(budget)):
        for group, state in groups:
            example = None if on == "new_batch" else group.example
            try:
                cost = rules.reserve(budget, state, charge).cost
            except AccountantError as exc:
                error = rule_error(exc, example)
                if not isinstance(exc, rules.BudgetExceeded | rules.ChargeRefused):
                    raise error from exc
                requested = None
                if isinstance(exc, rules.BudgetExceeded):
                    requested = (exc.requested.epsilon, exc.requested.delta)
                classes.append(ClassQuote(group.batches, example, None, error, requested))
                continue
            classes.append(ClassQuote(group.batches, example, cost))
    return Quote(dataset_id, "batches" if on == "dataset" else on, tuple(classes))


__all__ = [
    "DEFAULT_CLASSES_PER_PAGE",
    "MAX_CLASSES_PER_PAGE",
    "ClassQuote",
    "DatasetPrices",
    "Quote",
    "QuoteAnswer",
    "StageRefusal",
    "StagedPrices",
    "accountant_costs",
    "quote",
]
