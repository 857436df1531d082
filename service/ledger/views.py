"""Read views for the dashboard: spend summaries, per-batch spend, release timeline, ε history.

Every view reads what the spend transactions already maintain (``service.ledger.reservations``):
the dataset row's maxima over its batches, each batch row's ``BatchState``, the stored
certificates. The headline numbers (``spend_summaries``, ``batch_spend``) come from aggregates
only — never from a scan of charges — and every list is paged (``limit`` / ``offset``), so a
dataset with a million batches or releases is read one page at a time.

``epsilon_history`` is the one view that walks history: the lifelong curve needs the dataset's ε
and naive sequential ε *as they were* after each task, which no aggregate keeps. It streams the
dataset's certificates in commit order and reads a few numbers from each (``result.epsilon``,
``result.naive_epsilon`` and ``result.guarantee``, extracted by the database, not by loading the
certificate; a certificate issued before version 3 states no guarantee and is loaded to derive it,
``dp_statement.guarantee_of``). Because
batches are disjoint and a batch's spend and naive ε never decrease (INTERFACES.md,
``BatchState``), the dataset's value after a commit is the running maximum of those numbers over
the commits so far: parallel composition over batches, applied through time.

Each view answers a frozen typed value (``SpendSummaries``, ``BatchSpendPage``, ``ReleasesPage``,
``EpsilonHistory``: ``Decimal`` amounts, datetimes) whose one ``to_json`` is its wire form, made
at the edge (issue 29 §1). There numbers are decimal strings, exact, as the ledger stores them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from accountant.errors import InvalidArgumentError
from accountant.exact import ZERO, exact_add, exact_sub, to_text
from accountant.rules import BatchState, Budget
from accountant.statements import Reserved, batch_guarantee
from service.db.models import (
    Batch,
    BatchStateRow,
    Certificate,
    Dataset,
    Release,
    Reservation,
    Task,
)
from service.db.session import Database
from service.ledger.batches import StoredSpend
from service.ledger.datasets import MAX_PAGE, budget_of, check_page, dataset_page, load_dataset, records_of
from service.ledger.dp_statement import guarantee_of
from service.ledger.spending.answers import EpsilonDelta
from service.ledger.spending.store import EFFECTIVE_STATE, reservation_members
from service.ledger.spent import Spent, max_pair, reserved_of_batches, spent_of

MAX_BATCH_PAGE: Final = 5000
_STREAM_CHUNK: Final = 1000


@dataclass(frozen=True, slots=True)
class SpendSummary:
    """A dataset in the dashboard's list: what it has ``spent`` (the numbers ``GET
    /v1/datasets/{id}/spend`` answers, from the same read) and how many records it registered."""

    spent: Spent
    records: int

    def to_json(self) -> dict[str, Any]:
        spent = self.spent
        return {
            "id": spent.dataset_id,
            "name": spent.name,
            **spent.budget_json(),
            "epsilon_held": to_text(spent.epsilon_held),
            "naive_sequential_epsilon": to_text(spent.naive_sequential_epsilon),
            "guarantee": spent.guarantee.to_json(),
            "epsilon_spent_is": spent.epsilon_spent_is,
            "reservations_open": spent.reservations_open,
            "charges_committed": spent.charges_committed,
            "last_release": spent.last_release,
            "last_release_at": spent.last_release_at.isoformat() if spent.last_release_at else None,
            "created_at": spent.created_at.isoformat(),
            "archived_at": spent.archived_at.isoformat() if spent.archived_at else None,
            "records": self.records,
        }


@dataclass(frozen=True, slots=True)
class SpendSummaries:
    """A page of the tenant's datasets with their spend, and how many datasets it has."""

    data: tuple[SpendSummary, ...]
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"data": [s.to_json() for s in self.data], "count": self.count}


def _summaries(session: Session, rows: Sequence[Dataset]) -> tuple[SpendSummary, ...]:
    records = records_of(session, [r.id for r in rows])
    return tuple(SpendSummary(s, records.get(s.dataset_id, 0)) for s in spent_of(session, rows))


def spend_summaries(db: Database, tenant_id: str, *, limit: int = 100, offset: int = 0) -> SpendSummaries:
    """Each of the tenant's datasets with its spend, oldest first.

    One query on the dataset rows (the ledger heads): the same numbers ``GET
    /v1/datasets/{id}/spend`` answers, for a page of datasets at once.
    """
    check_page(limit, offset)
    with db.session(readonly=True) as session:
        rows, count = dataset_page(session, [Dataset.tenant_id == tenant_id], limit=limit, offset=offset)
        return SpendSummaries(_summaries(session, rows), count)


@dataclass(frozen=True, slots=True)
class BatchSpend:
    """A batch in the per-batch view: its task, the spend its state records, how many charges
    ``reads`` it, the geometric ``levels`` it uses (held or committed) and the (ε, δ)
    ``guarantee`` of what was released from it (``accountant.statements.batch_guarantee``;
    ``None`` for a state the ledger did not write: shown, not interpreted)."""

    id: str
    name: str
    task_id: str
    task_name: str
    position: int
    size: int
    spend: StoredSpend
    reads: int
    levels: tuple[int, ...]
    guarantee: EpsilonDelta | None

    @classmethod
    def of(
        cls, budget: Budget, row: Batch, task_name: str, stored_state: Any, reserved: Reserved | None
    ) -> BatchSpend:
        state = stored_state if isinstance(stored_state, dict) else {}
        levels = state.get("levels", [])
        try:
            guarantee: EpsilonDelta | None = EpsilonDelta(
                *batch_guarantee(budget, BatchState.from_json(state), reserved)
            )
        except InvalidArgumentError:  # a state the ledger did not write: shown, not interpreted
            guarantee = None
        return cls(
            row.id,
            row.name,
            row.task_id,
            task_name,
            row.position,
            row.size,
            StoredSpend.of(state),
            int(state.get("reads", 0)),
            tuple(int(k) for k in levels) if isinstance(levels, list) else (),
            guarantee,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "task_id": self.task_id,
            "task_name": self.task_name,
            "position": self.position,
            "size": self.size,
            **self.spend.to_json(),
            "reads": self.reads,
            "levels": list(self.levels),
            "guarantee": None if self.guarantee is None else self.guarantee.to_json(),
        }


@dataclass(frozen=True, slots=True)
class BatchSpendPage:
    """A page of the dataset's batches with their spend (``batch_spend``), under the dataset's
    ``spent`` head; ``count`` is every batch of the dataset."""

    spent: Spent
    count: int
    limit: int
    offset: int
    data: tuple[BatchSpend, ...]

    @property
    def allowances(self) -> dict[int, Decimal]:
        """Under a geometric budget, the allowance first·ratioᵏ of each level ``k`` this page's
        batches use, by level (empty under any other rule)."""
        schedule = self.spent.budget.geometric
        if schedule is None:
            return {}
        return {k: schedule.allowance(k) for k in sorted({k for b in self.data for k in b.levels})}

    def to_json(self) -> dict[str, Any]:
        spent = self.spent
        answer: dict[str, Any] = {
            "dataset_id": spent.dataset_id,
            "rule": spent.rule,
            "epsilon_budget": to_text(spent.epsilon_budget),
            "epsilon_spent": to_text(spent.epsilon_spent),
            "guarantee": spent.guarantee.to_json(),
            "count": self.count,
            "limit": self.limit,
            "offset": self.offset,
            "data": [b.to_json() for b in self.data],
        }
        schedule = spent.budget.geometric
        if schedule is not None:
            answer["geometric"] = {
                **schedule.to_json(),
                "infinite_horizon_bound": to_text(schedule.infinite_horizon_bound()),
                "allowances": {str(k): to_text(v) for k, v in self.allowances.items()},
            }
        return answer


def batch_spend(
    db: Database, tenant_id: str, dataset_id: str, *, limit: int = 500, offset: int = 0
) -> BatchSpendPage:
    """A page of the dataset's batches with their spend, in task order then batch position.

    Its wire form: ``{dataset_id, rule, epsilon_budget, epsilon_spent, count, limit, offset, data:
    [{id, name, task_id, task_name, position, size, epsilon_spent, epsilon_held, delta_spent,
    naive_sequential_epsilon, reads, levels, guarantee: {epsilon, delta}}], guarantee,
    geometric?: {first, ratio, infinite_horizon_bound, allowances: {level: ε}}}``. ``levels``: the
    geometric levels the block (batch) uses, held or committed; ``allowances`` covers the levels
    on this page. ``guarantee``: the (ε, δ) guarantee of what was released from the batch
    (``accountant.statements.batch_guarantee``: a plan segment that ran whole, a Rényi filter's
    budget — whose ``epsilon_spent`` is its progress, not a guarantee).
    """
    check_page(limit, offset, MAX_BATCH_PAGE)
    with db.session(readonly=True) as session:
        dataset = load_dataset(session, tenant_id, dataset_id)
        rows = session.execute(
            select(Batch, Task.name, BatchStateRow.state)
            .join(Task, Task.id == Batch.task_id)
            .join(BatchStateRow, BatchStateRow.id == EFFECTIVE_STATE)
            .where(Batch.dataset_id == dataset_id)
            .order_by(Task.created_at, Task.id, Batch.position)
            .limit(limit)
            .offset(offset)
        ).all()
        count = session.scalar(select(func.count()).select_from(Batch).where(Batch.dataset_id == dataset_id))
        budget = budget_of(dataset)
        runs = budget.rule == "parallel" and budget.accountant != "basic"
        reserved = reserved_of_batches(session, [batch.id for batch, _, _ in rows]) if runs else {}
        data = tuple(
            BatchSpend.of(budget, batch, task_name, state, reserved.get(batch.id))
            for batch, task_name, state in rows
        )
        (spent,) = spent_of(session, [dataset])
    return BatchSpendPage(spent, count or 0, limit, offset, data)


# Fields of a stored certificate the timeline shows, extracted by the database (the certificate
# itself, with every batch history it carries, stays on disk until one is opened).
_RESULT_EPSILON = Certificate.body[("result", "epsilon")].as_string()
_RESULT_DELTA = Certificate.body[("result", "delta")].as_string()
_RESULT_NAIVE = Certificate.body[("result", "naive_epsilon")].as_string()
_CHARGE_EPSILON = Certificate.body[("result", "charge", "epsilon")].as_string()
_CHARGE_DELTA = Certificate.body[("result", "charge", "delta")].as_string()
_GUARANTEE_EPSILON = Certificate.body[("result", "guarantee", "epsilon")].as_string()
_GUARANTEE_DELTA = Certificate.body[("result", "guarantee", "delta")].as_string()
_WITHIN_BUDGET = Certificate.body[("result", "within_budget")].as_boolean()
_THEOREM = Certificate.body["theorem"].as_string()


@dataclass(frozen=True, slots=True)
class StatedPair:
    """An (ε, δ) pair as a certificate states it: its decimal text, quoted."""

    epsilon: str | None
    delta: str | None

    def to_json(self) -> dict[str, str | None]:
        return {"epsilon": self.epsilon, "delta": self.delta}


@dataclass(frozen=True, slots=True)
class ReleaseHeadline:
    """A release in the timeline with its certificate's headline. The certificate's own numbers
    (``epsilon``, ``delta``, ``naive_epsilon``, the ``charge`` and the ``guarantee`` it states)
    are quoted as its text, read from the stored certificate by the database; ``held_at_release``
    is what open reservations held the moment it was certified (``held_at``)."""

    certificate_id: str
    release_id: str
    reservation_id: str
    model: str
    version: str
    created_at: datetime
    content_hash: str
    theorem: str | None
    epsilon: str | None
    delta: str | None
    naive_epsilon: str | None
    charge: StatedPair
    guarantee: StatedPair | None
    within_budget: bool | None
    held_at_release: Decimal

    def to_json(self) -> dict[str, Any]:
        return {
            "certificate_id": self.certificate_id,
            "release_id": self.release_id,
            "reservation_id": self.reservation_id,
            "model": self.model,
            "version": self.version,
            "created_at": self.created_at.isoformat(),
            "content_hash": self.content_hash,
            "theorem": self.theorem,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "naive_epsilon": self.naive_epsilon,
            "charge": self.charge.to_json(),
            "budget_share": self.charge.to_json(),
            "guarantee": None if self.guarantee is None else self.guarantee.to_json(),
            "within_budget": self.within_budget,
            "held_at_release": {"epsilon": to_text(self.held_at_release)},
        }


@dataclass(frozen=True, slots=True)
class ReleasesPage:
    """A page of the dataset's releases, newest first; ``count`` is every release."""

    data: tuple[ReleaseHeadline, ...]
    count: int
    limit: int
    offset: int

    def to_json(self) -> dict[str, Any]:
        return {
            "data": [r.to_json() for r in self.data],
            "count": self.count,
            "limit": self.limit,
            "offset": self.offset,
        }


def releases(
    db: Database, tenant_id: str, dataset_id: str, *, limit: int = 50, offset: int = 0
) -> ReleasesPage:
    """The dataset's releases with their certificates' headline, newest first.

    Each item's wire form: ``{certificate_id, release_id, reservation_id, model, version,
    created_at, content_hash, theorem, epsilon, delta, naive_epsilon, charge: {epsilon, delta},
    budget_share: {epsilon, delta}, guarantee: {epsilon, delta} | null, within_budget}`` —
    ``epsilon`` / ``naive_epsilon`` are the certificate's result (the largest spend over the
    batches the release read, after it; for a Rényi filter its progress); ``guarantee`` the
    release's (ε, δ) guarantee, stated by certificates of version 3 (``null`` before: the
    version's ``dp_statement`` derives it); ``budget_share`` (= ``charge``) what the release
    consumed, not a guarantee. The full certificate is ``GET /v1/certificates/{certificate_id}``.
    ``held_at_release: {epsilon}`` is what open reservations held (reserved, not yet committed)
    the moment the release was certified (``held_at``).
    """
    check_page(limit, offset)
    with db.session(readonly=True) as session:
        load_dataset(session, tenant_id, dataset_id)
        rows = session.execute(
            select(
                Certificate.id,
                Certificate.reservation_id,
                Certificate.content_hash,
                Certificate.created_at,
                Release.id.label("release_id"),
                Release.model,
                Release.version,
                _THEOREM.label("theorem"),
                _RESULT_EPSILON.label("epsilon"),
                _RESULT_DELTA.label("delta"),
                _RESULT_NAIVE.label("naive_epsilon"),
                _CHARGE_EPSILON.label("charge_epsilon"),
                _CHARGE_DELTA.label("charge_delta"),
                _GUARANTEE_EPSILON.label("guarantee_epsilon"),
                _GUARANTEE_DELTA.label("guarantee_delta"),
                _WITHIN_BUDGET.label("within_budget"),
            )
            .join(Release, Release.id == Certificate.release_id)
            .where(Certificate.dataset_id == dataset_id)
            .order_by(Certificate.created_at.desc(), Certificate.id.desc())
            .limit(limit)
            .offset(offset)
        ).all()
        count = session.scalar(
            select(func.count()).select_from(Certificate).where(Certificate.dataset_id == dataset_id)
        )
        held = held_at(session, dataset_id, [r.created_at for r in rows])
    return ReleasesPage(
        tuple(
            ReleaseHeadline(
                r.id,
                r.release_id,
                r.reservation_id,
                r.model,
                r.version,
                r.created_at,
                r.content_hash,
                r.theorem,
                r.epsilon,
                r.delta,
                r.naive_epsilon,
                StatedPair(r.charge_epsilon, r.charge_delta),
                None if r.guarantee_epsilon is None else StatedPair(r.guarantee_epsilon, r.guarantee_delta),
                None if r.within_budget is None else bool(r.within_budget),
                held[r.created_at],
            )
            for r in rows
        ),
        count or 0,
        limit,
        offset,
    )


def held_at(session: Session, dataset_id: str, instants: Sequence[datetime]) -> dict[datetime, Decimal]:
    """ε held by the dataset's open reservations at each of ``instants``: the dataset head's
    ``epsilon_held`` as it was then, rebuilt from history (the head keeps only the present).

    The head adds a reservation's reserved ε when it is made, subtracts each commit's charge as
    the commit lands, and the rest when the reservation closes (committed, aborted, expired;
    ``service.ledger.spending``). So at ``t`` a reservation made at or before ``t`` and open
    after it (neither closed nor past its expiry — an extension only moves an open one's expiry
    later) holds its reserved ε less the charges of its certificates issued by ``t``. Replayed in
    one sweep over those events in time order: two queries (the reservations open somewhere in
    ``[min, max]`` of ``instants``, and their certificates up to ``max``), then
    O((reservations + certificates + instants) · log) work."""
    if not instants:
        return {}
    first, last = min(instants), max(instants)
    window = (
        Reservation.dataset_id == dataset_id,
        Reservation.created_at <= last,
        Reservation.expires_at > first,
        or_(Reservation.closed_at.is_(None), Reservation.closed_at > first),
    )
    rows = session.execute(
        select(
            Reservation.id,
            Reservation.epsilon,
            Reservation.created_at,
            Reservation.expires_at,
            Reservation.closed_at,
        ).where(*window)
    ).all()
    # (time, order, reservation, amount): at one instant a start (0) and a charge (1) count,
    # and an end (2) too — a reservation that closed at t holds nothing at t.
    events: list[tuple[datetime, int, str, Decimal]] = []
    ends: dict[str, datetime] = {}
    for r in rows:
        end = r.expires_at if r.closed_at is None else min(r.closed_at, r.expires_at)
        ends[r.id] = end
        events.append((r.created_at, 0, r.id, r.epsilon))
        events.append((end, 2, r.id, ZERO))
    if rows:
        for reservation_id, at, charge in session.execute(
            select(Certificate.reservation_id, Certificate.created_at, _CHARGE_EPSILON).where(
                Certificate.dataset_id == dataset_id,
                Certificate.created_at <= last,
                Certificate.reservation_id.in_(select(Reservation.id).where(*window)),
            )
        ):
            if at < ends[reservation_id]:
                events.append((at, 1, reservation_id, Decimal(charge or "0")))
    events.sort(key=lambda e: (e[0], e[1]))
    holding: dict[str, Decimal] = {}  # each open reservation's uncommitted ε
    total = ZERO
    out: dict[datetime, Decimal] = {}
    position = 0
    for t in sorted(set(instants)):
        while position < len(events) and events[position][0] <= t:
            _, kind, reservation_id, amount = events[position]
            position += 1
            before = holding.get(reservation_id, ZERO)
            if kind == 0:
                holding[reservation_id] = amount
            elif kind == 1:
                holding[reservation_id] = max(ZERO, exact_sub(before, amount))
            else:
                holding.pop(reservation_id, None)
            total = exact_add(exact_sub(total, before), holding.get(reservation_id, ZERO))
        out[t] = total
    return out


@dataclass(frozen=True, slots=True)
class HistoryPoint:
    """The dataset right after a task's last release: the task (``task_index`` 1-based among
    all the dataset's tasks), its ``releases``, the dataset's ``epsilon`` and naive sequential ε
    then, and the (ε, δ) ``guarantee`` of everything released up to then."""

    task_id: str
    task_name: str
    task_index: int
    releases: int
    epsilon: Decimal
    naive_sequential_epsilon: Decimal
    guarantee: EpsilonDelta

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "task_name": self.task_name,
            "task_index": self.task_index,
            "releases": self.releases,
            "epsilon": to_text(self.epsilon),
            "naive_sequential_epsilon": to_text(self.naive_sequential_epsilon),
            "guarantee": self.guarantee.to_json(),
        }


@dataclass(frozen=True, slots=True)
class EpsilonHistory:
    """A page of the dataset's history points (``epsilon_history``) under its ``spent`` head:
    how many ``tasks`` it has, how many ``releases`` in all, and ``count`` points."""

    spent: Spent
    tasks: int
    releases: int
    count: int
    limit: int
    offset: int
    data: tuple[HistoryPoint, ...]

    def to_json(self) -> dict[str, Any]:
        spent = self.spent
        return {
            "dataset_id": spent.dataset_id,
            "rule": spent.rule,
            "epsilon_budget": to_text(spent.epsilon_budget),
            "epsilon_spent": to_text(spent.epsilon_spent),
            "naive_sequential_epsilon": to_text(spent.naive_sequential_epsilon),
            "guarantee": spent.guarantee.to_json(),
            "epsilon_is": spent.epsilon_spent_is,
            "tasks": self.tasks,
            "releases": self.releases,
            "count": self.count,
            "limit": self.limit,
            "offset": self.offset,
            "data": [p.to_json() for p in self.data],
        }


def epsilon_history(
    db: Database, tenant_id: str, dataset_id: str, *, limit: int = 1000, offset: int = 0
) -> EpsilonHistory:
    """The dataset's guarantee, ε and naive sequential ε as tasks grow: one point per task with
    releases.

    A release belongs to the newest task (in registration order) among the batches it read — an
    episodic-memory replay of task 1's batch during task 5 is task 5's release. A task's point
    is the dataset's ``epsilon`` and ``naive_sequential_epsilon`` right after that task's last
    release (in commit order): running maxima over the certificates (module docstring).

    Its wire form: ``{dataset_id, rule, epsilon_budget, epsilon_spent, naive_sequential_epsilon,
    guarantee, epsilon_is, tasks, releases, count, limit, offset, data: [{task_id, task_name,
    task_index, releases, epsilon, naive_sequential_epsilon, guarantee: {epsilon, delta}}]}``; a
    point's ``guarantee`` is the (ε, δ) guarantee of everything released from the dataset up to
    that task's last release (the running maximum of the releases' guarantees: each is the
    maximum over the batches it read, and a batch's never decreases); its ``epsilon`` is what
    ``epsilon_is`` says (for a Rényi filter its progress, a budget share, not a guarantee).
    ``task_index`` is 1-based among all the dataset's tasks; ``count`` is the number of points,
    paged by ``limit`` / ``offset``.
    """
    check_page(limit, offset, 10 * MAX_PAGE)
    with db.session(readonly=True) as session:
        dataset = load_dataset(session, tenant_id, dataset_id)
        tasks = session.execute(
            select(Task.id, Task.name).where(Task.dataset_id == dataset_id).order_by(Task.created_at, Task.id)
        ).all()
        index = {t.id: i for i, t in enumerate(tasks)}
        released = select(Certificate.reservation_id).where(Certificate.dataset_id == dataset_id)
        members = reservation_members()
        newest_task: dict[str, int] = {}
        for reservation_id, task_id in session.execute(
            select(members.c.reservation_id, Batch.task_id)
            .join(Batch, Batch.id == members.c.batch_id)
            .where(members.c.reservation_id.in_(released))
            .distinct()
        ):
            position = index.get(task_id, -1)
            if position > newest_task.get(reservation_id, -1):
                newest_task[reservation_id] = position
        commits = session.execute(
            select(
                Certificate.reservation_id,
                _RESULT_EPSILON,
                _RESULT_NAIVE,
                _GUARANTEE_EPSILON,
                _GUARANTEE_DELTA,
                Certificate.id,
            )
            .where(Certificate.dataset_id == dataset_id)
            .order_by(Certificate.created_at, Certificate.id)
            .execution_options(yield_per=_STREAM_CHUNK)
        )
        points, total = _task_points(commits, newest_task, lambda cid: _stated_guarantee(db, cid))
        (spent,) = spent_of(session, [dataset])
    ordered = sorted(points.items())
    return EpsilonHistory(
        spent,
        len(tasks),
        total,
        len(ordered),
        limit,
        offset,
        tuple(
            HistoryPoint(tasks[k].id, tasks[k].name, k + 1, n, eps, naive, EpsilonDelta(*guarantee))
            for k, (n, eps, naive, guarantee) in ordered[offset : offset + limit]
        ),
    )


def _stated_guarantee(db: Database, certificate_id: str) -> tuple[Decimal, Decimal]:
    """The guarantee of a certificate issued before version 3, derived from its records (read in
    a session of its own: the caller's streams the certificates)."""
    with db.session(readonly=True) as session:
        body = session.scalar(select(Certificate.body).where(Certificate.id == certificate_id))
    assert body is not None, f"certificate {certificate_id} is gone"  # the caller streams it
    eps, dlt = guarantee_of(body)
    return Decimal(eps), Decimal(dlt)


Point = tuple[int, Decimal, Decimal, tuple[Decimal, Decimal]]


def _task_points(
    commits: Iterable[Any],
    newest_task: dict[str, int],
    derive: Callable[[str], tuple[Decimal, Decimal]],
) -> tuple[dict[int, Point], int]:
    """Running maxima over commits; per task index: (its releases, ε, naive ε, guarantee) after
    its last. ``derive(certificate_id)``: the guarantee of a certificate that states none."""
    epsilon = naive = ZERO
    guarantee = (ZERO, ZERO)
    points: dict[int, Point] = {}
    total = 0
    for reservation_id, eps_text, naive_text, g_eps, g_dlt, certificate_id in commits:
        total += 1
        epsilon = max(epsilon, Decimal(eps_text or 0))
        naive = max(naive, Decimal(naive_text or 0))
        stated = derive(certificate_id) if g_eps is None else (Decimal(g_eps), Decimal(g_dlt))
        guarantee = max_pair(guarantee, stated)
        task = newest_task.get(reservation_id)
        if task is None or task < 0:
            continue
        releases_so_far = points[task][0] if task in points else 0
        points[task] = (releases_so_far + 1, epsilon, naive, guarantee)
    return points, total


__all__ = [
    "MAX_PAGE",
    "BatchSpend",
    "BatchSpendPage",
    "EpsilonHistory",
    "HistoryPoint",
    "ReleaseHeadline",
    "ReleasesPage",
    "SpendSummaries",
    "SpendSummary",
    "StatedPair",
    "batch_spend",
    "epsilon_history",
    "releases",
    "spend_summaries",
]
