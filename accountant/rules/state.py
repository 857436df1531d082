"""What the rules read and return: a charge (``Charge``), its cost (``Cost``), a batch's
aggregate state (``BatchState``, with its ``NoiseCommitment``s) and the results of ``reserve`` and
``commit`` (``Admission``, ``Settlement``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final

from accountant import events as ev
from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent, EventValidationError
from accountant.exact import ZERO, to_text
from accountant.rdp import MAX_ORDER
from accountant.rules.budget import MAX_GEOMETRIC_LEVEL, budget_number

MAX_COMMITMENT_LENGTH: Final = 256
# The configurations of the ``tight`` accountant's union of filters, fixed per batch at its first
# charge (``accountant.rules.tight``).
UNION_PROFILES: Final = ("run", "stream")


# ---------------------------------------------------------------------------------------------
# Charges, costs, per-batch state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Charge:
    """What a reservation ran on a batch: the event, and for lifelong budgets its noise commitment
    (an opaque id of one fixed noise draw). Other rules ignore ``noise_commitment``."""

    event: DpEvent
    noise_commitment: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.event, DpEvent):
            raise InvalidArgumentError("event", f"must be an event. Found {self.event!r}.")
        c = self.noise_commitment
        if c is not None and (
            not isinstance(c, str) or not 1 <= len(c) <= MAX_COMMITMENT_LENGTH or not c.isprintable()
        ):
            raise InvalidArgumentError(
                "noise_commitment",
                f"must be a printable string of 1 to {MAX_COMMITMENT_LENGTH} characters. Found {c!r}.",
            )

    def to_json(self) -> dict[str, Any]:
        return {"event": ev.to_json(self.event), "noise_commitment": self.noise_commitment}

    @classmethod
    def from_json(cls, obj: object) -> Charge:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError("charge", f"must be an object. Found {obj!r}.")
        try:
            event = ev.from_json(obj.get("event"), "charge.event")
        except EventValidationError as exc:
            raise InvalidArgumentError(exc.field, exc.message) from None
        return cls(event, obj.get("noise_commitment"))


def _decimal_field(obj: Mapping[str, Any], name: str, path: str) -> Decimal:
    value = obj.get(name)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{path}.{name}", f"must be a decimal string. Found {value!r}.")
    number = budget_number(f"{path}.{name}", value)
    return number


def _vector_field(obj: Mapping[str, Any], name: str, path: str) -> tuple[Decimal, ...] | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidArgumentError(f"{path}.{name}", "must be a list of decimal strings or null.")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidArgumentError(f"{path}.{name}[{i}]", f"must be a decimal string. Found {item!r}.")
        out.append(budget_number(f"{path}.{name}[{i}]", item))
    return tuple(out)


def _int_field(obj: Mapping[str, Any], name: str, path: str, *, optional: bool = False) -> int | None:
    value = obj.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{path}.{name}", f"must be an integer >= 0. Found {value!r}.")
    return value


def _vector_json(vector: tuple[Decimal, ...] | None) -> list[str] | None:
    return None if vector is None else [to_text(v) for v in vector]


def _pair_json(pair: tuple[Decimal, Decimal]) -> dict[str, str]:
    return {"epsilon": to_text(pair[0]), "delta": to_text(pair[1])}


def _pair_field(obj: Mapping[str, Any], name: str, path: str) -> tuple[Decimal, Decimal] | None:
    """An optional ``{epsilon, delta}`` pair of decimal strings (each >= 0)."""
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"epsilon", "delta"}:
        raise InvalidArgumentError(f"{path}.{name}", "must be an object {epsilon, delta} or absent.")
    pair = (
        _decimal_field(value, "epsilon", f"{path}.{name}"),
        _decimal_field(value, "delta", f"{path}.{name}"),
    )
    if pair[0] < 0 or pair[1] < 0:
        raise InvalidArgumentError(f"{path}.{name}", "must be >= 0.")
    return pair


@dataclass(frozen=True, slots=True)
class Cost:
    """What one reservation adds to one batch (``Admission.cost``), or what it has committed so
    far (``Settlement.committed``, cumulative).

    ``epsilon``/``delta``: the increase of the batch's spend under the rule (for the Rényi filter:
    the increase of its derived ε indicator when it was computed; the per-order sums ``rdp`` are
    authoritative). ``naive_epsilon``: the charge's ε as a fresh charge (replays and geometric
    levels included). ``fingerprint``: of the event accounted. ``level``: the geometric level.
    ``replay``: a lifelong replay of committed noise. ``plan_position``: the prv plan entry.
    """

    epsilon: Decimal
    delta: Decimal
    naive_epsilon: Decimal
    fingerprint: str
    rdp: tuple[Decimal, ...] | None = None
    level: int | None = None
    replay: bool = False
    noise_commitment: str | None = None
    plan_position: int | None = None
    basic: tuple[Decimal, Decimal] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "epsilon": to_text(self.epsilon),
            "delta": to_text(self.delta),
            "naive_epsilon": to_text(self.naive_epsilon),
            "fingerprint": self.fingerprint,
            "rdp": _vector_json(self.rdp),
            "level": self.level,
            "replay": self.replay,
            "noise_commitment": self.noise_commitment,
            "plan_position": self.plan_position,
            # Omitted when unset, so every cost of another accountant serialises as before.
            **({} if self.basic is None else {"basic": _pair_json(self.basic)}),
        }

    @classmethod
    def from_json(cls, obj: object, path: str = "cost") -> Cost:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(path, f"must be an object. Found {obj!r}.")
        fingerprint = obj.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise InvalidArgumentError(f"{path}.fingerprint", "must be a string.")
        replay = obj.get("replay", False)
        if not isinstance(replay, bool):
            raise InvalidArgumentError(f"{path}.replay", "must be a boolean.")
        commitment = obj.get("noise_commitment")
        if commitment is not None and not isinstance(commitment, str):
            raise InvalidArgumentError(f"{path}.noise_commitment", "must be a string or null.")
        return cls(
            epsilon=_decimal_field(obj, "epsilon", path),
            delta=_decimal_field(obj, "delta", path),
            naive_epsilon=_decimal_field(obj, "naive_epsilon", path),
            fingerprint=fingerprint,
            rdp=_vector_field(obj, "rdp", path),
            level=_int_field(obj, "level", path, optional=True),
            replay=replay,
            noise_commitment=commitment,
            plan_position=_int_field(obj, "plan_position", path, optional=True),
            basic=_pair_field(obj, "basic", path),
        )


@dataclass(frozen=True, slots=True)
class NoiseCommitment:
    """A lifelong batch's fixed noise draw: the event it was drawn for, and whether it has been
    committed (released). Only committed noise can be replayed for free."""

    commitment: str
    fingerprint: str
    committed: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "commitment": self.commitment,
            "fingerprint": self.fingerprint,
            "committed": self.committed,
        }


@dataclass(frozen=True, slots=True)
class BatchState:
    """Per-batch aggregate, JSON-serialisable; the service stores it and passes it back.

    ``epsilon_spent`` (committed, under the rule), ``epsilon_held`` (reserved, not committed),
    ``delta_spent`` / ``delta_held`` likewise; ``naive_epsilon``: committed, every charge counted
    as fresh. ``reads``: reservations on the batch not cancelled before any commit. Rule state:
    ``rdp_spent`` / ``rdp_held`` (Rényi filter per-order sums; ``None`` = all zero), ``levels``
    (geometric levels in use, sorted), ``noise_commitments`` (lifelong, sorted),
    ``plan_position`` / ``plan_open`` (prv: entries of the open plan segment claimed; a
    reservation is open), ``plan_closed`` (prv: the closed segments this batch ran, each charged
    its whole declared (εᵢ, δᵢ); omitted from the JSON while empty).
    ``neighbouring_relation``: ``"add_remove"`` or ``"replace_one"`` once a charge whose event
    states one has been reserved on the batch (``None``: none has; rows stored before the field
    existed read as ``None``). Charges under the other relation are refused (``reserve``).
    The ``tight`` accountant's union of filters (``accountant.rules.tight``): ``union_profile``
    (``"run"`` / ``"stream"``) and filter B's extra order ``union_focus`` with its δ part
    ``union_focus_weight``, fixed at the batch's first charge; filter A's sums ``basic_spent`` /
    ``basic_held`` ((Σε, Σδ) pairs, ``None`` = zero), ``basic_open`` (false once a charge A refused
    is held) and ``basic_departed`` (once such a charge committed). All omitted from the JSON while
    unset, so the states of every other accountant serialise (and hash) as before.
    """

    epsilon_spent: Decimal = ZERO
    epsilon_held: Decimal = ZERO
    delta_spent: Decimal = ZERO
    delta_held: Decimal = ZERO
    naive_epsilon: Decimal = ZERO
    reads: int = 0
    rdp_spent: tuple[Decimal, ...] | None = None
    rdp_held: tuple[Decimal, ...] | None = None
    levels: tuple[int, ...] = ()
    noise_commitments: tuple[NoiseCommitment, ...] = field(default=())
    plan_position: int = 0
    plan_open: bool = False
    neighbouring_relation: str | None = None
    plan_closed: tuple[int, ...] = ()
    union_profile: str | None = None
    basic_spent: tuple[Decimal, Decimal] | None = None
    basic_held: tuple[Decimal, Decimal] | None = None
    basic_open: bool = True
    basic_departed: bool = False
    union_focus: float | None = None
    union_focus_weight: Decimal | None = None

    @classmethod
    def empty(cls) -> BatchState:
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {
            "epsilon_spent": to_text(self.epsilon_spent),
            "epsilon_held": to_text(self.epsilon_held),
            "delta_spent": to_text(self.delta_spent),
            "delta_held": to_text(self.delta_held),
            "naive_epsilon": to_text(self.naive_epsilon),
            "reads": self.reads,
            "rdp_spent": _vector_json(self.rdp_spent),
            "rdp_held": _vector_json(self.rdp_held),
            "levels": list(self.levels),
            "noise_commitments": [c.to_json() for c in self.noise_commitments],
            "plan_position": self.plan_position,
            "plan_open": self.plan_open,
            # Omitted when unset, so a state without a relation serialises as before.
            **(
                {}
                if self.neighbouring_relation is None
                else {"neighbouring_relation": self.neighbouring_relation}
            ),
            **({} if not self.plan_closed else {"plan_closed": list(self.plan_closed)}),
            # The ``tight`` accountant's union of filters (``accountant.rules.tight``); omitted
            # while unset, so every other batch's state serialises (and hashes) as before.
            **({} if self.union_profile is None else {"union_profile": self.union_profile}),
            **({} if self.basic_spent is None else {"basic_spent": _pair_json(self.basic_spent)}),
            **({} if self.basic_held is None else {"basic_held": _pair_json(self.basic_held)}),
            **({} if self.basic_open else {"basic_open": False}),
            **({"basic_departed": True} if self.basic_departed else {}),
            **({} if self.union_focus is None else {"union_focus": self.union_focus}),
            **(
                {}
                if self.union_focus_weight is None
                else {"union_focus_weight": to_text(self.union_focus_weight)}
            ),
        }

    @classmethod
    def from_json(cls, obj: object, path: str = "state") -> BatchState:
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(path, f"must be an object. Found {obj!r}.")
        levels = obj.get("levels", [])
        if (
            not isinstance(levels, list)
            or any(
                isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_GEOMETRIC_LEVEL
                for k in levels
            )
            or sorted(set(levels)) != levels
        ):
            raise InvalidArgumentError(f"{path}.levels", "must be a sorted list of distinct levels.")
        commitments_obj = obj.get("noise_commitments", [])
        if not isinstance(commitments_obj, list):
            raise InvalidArgumentError(f"{path}.noise_commitments", "must be a list.")
        commitments = []
        for i, c in enumerate(commitments_obj):
            p = f"{path}.noise_commitments[{i}]"
            if (
                not isinstance(c, Mapping)
                or not all(isinstance(c.get(k), str) for k in ("commitment", "fingerprint"))
                or not isinstance(c.get("committed"), bool)
            ):
                raise InvalidArgumentError(p, "must be {commitment, fingerprint, committed}.")
            commitments.append(NoiseCommitment(c["commitment"], c["fingerprint"], c["committed"]))
        if [c.commitment for c in commitments] != sorted({c.commitment for c in commitments}):
            raise InvalidArgumentError(
                f"{path}.noise_commitments", "must be sorted by commitment, without repeats."
            )
        plan_open = obj.get("plan_open", False)
        if not isinstance(plan_open, bool):
            raise InvalidArgumentError(f"{path}.plan_open", "must be a boolean.")
        relation = obj.get("neighbouring_relation")
        if relation is not None and relation not in (ev.ADD_REMOVE, ev.REPLACE_ONE):
            raise InvalidArgumentError(
                f"{path}.neighbouring_relation",
                f"must be {ev.ADD_REMOVE!r}, {ev.REPLACE_ONE!r} or absent. Found {relation!r}.",
            )
        closed = obj.get("plan_closed", [])
        if (
            not isinstance(closed, list)
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in closed)
            or sorted(set(closed)) != closed
        ):
            raise InvalidArgumentError(
                f"{path}.plan_closed", f"must be a sorted list of distinct segment indexes. Found {closed!r}."
            )
        profile = obj.get("union_profile")
        if profile is not None and profile not in UNION_PROFILES:
            raise InvalidArgumentError(
                f"{path}.union_profile",
                f"must be one of {list(UNION_PROFILES)} or absent. Found {profile!r}.",
            )
        focus = obj.get("union_focus")
        if focus is not None and (
            isinstance(focus, bool)
            or not isinstance(focus, int | float)
            or not math.isfinite(focus)
            or not 1 < focus <= MAX_ORDER
        ):
            raise InvalidArgumentError(
                f"{path}.union_focus", f"must be an order in (1, 2^20] or absent. Found {focus!r}."
            )
        basic_open = obj.get("basic_open", True)
        basic_departed = obj.get("basic_departed", False)
        for name, flag in (("basic_open", basic_open), ("basic_departed", basic_departed)):
            if not isinstance(flag, bool):
                raise InvalidArgumentError(f"{path}.{name}", "must be a boolean.")
        if basic_open and basic_departed:
            raise InvalidArgumentError(f"{path}.basic_departed", "needs basic_open false.")
        state = cls(
            epsilon_spent=_decimal_field(obj, "epsilon_spent", path),
            epsilon_held=_decimal_field(obj, "epsilon_held", path),
            delta_spent=_decimal_field(obj, "delta_spent", path),
            delta_held=_decimal_field(obj, "delta_held", path),
            naive_epsilon=_decimal_field(obj, "naive_epsilon", path),
            reads=_int_field(obj, "reads", path) or 0,
            rdp_spent=_vector_field(obj, "rdp_spent", path),
            rdp_held=_vector_field(obj, "rdp_held", path),
            levels=tuple(levels),
            noise_commitments=tuple(commitments),
            plan_position=_int_field(obj, "plan_position", path) or 0,
            plan_open=plan_open,
            neighbouring_relation=relation,
            plan_closed=tuple(closed),
            union_profile=profile,
            basic_spent=_pair_field(obj, "basic_spent", path),
            basic_held=_pair_field(obj, "basic_held", path),
            basic_open=basic_open,
            basic_departed=basic_departed,
            union_focus=None if focus is None else float(focus),
            union_focus_weight=None
            if obj.get("union_focus_weight") is None
            else _decimal_field(obj, "union_focus_weight", path),
        )
        if state.union_focus_weight is not None and not 0 < state.union_focus_weight < 1:
            raise InvalidArgumentError(f"{path}.union_focus_weight", "must be in (0, 1).")
        if (state.union_focus is None) != (state.union_focus_weight is None):
            raise InvalidArgumentError(f"{path}.union_focus", "and union_focus_weight come together.")
        for name in ("epsilon_spent", "epsilon_held", "delta_spent", "delta_held", "naive_epsilon"):
            if getattr(state, name) < 0:
                raise InvalidArgumentError(f"{path}.{name}", "must be >= 0.")
        return state


@dataclass(frozen=True, slots=True)
class Admission:
    """``reserve``'s answer: the batch's new state (charge held) and the reservation's cost."""

    state: BatchState
    cost: Cost


@dataclass(frozen=True, slots=True)
class Settlement:
    """``commit``'s answer: the batch's new state and the cumulative committed cost."""

    state: BatchState
    committed: Cost
