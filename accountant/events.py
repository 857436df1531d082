"""Mechanism events: immutable descriptions of what was run, not of how to account it.

Modelled on ``DpEvent`` in Google's dp_accounting. An event carries the parameters of the
mechanism that touched the data; accountants (``accountant.basic``, ``accountant.rdp``,
``accountant.prv``) turn events into privacy bounds.

Compatibility contract
----------------------
Events are stored in ledger rows that outlive refactors. Therefore:

* every event serialises to JSON with a stable ``kind`` string, never a module path;
* an event kind or a field is never removed or redefined; new fields are optional;
* ``from_json(to_json(e)) == e`` for every event, and ``to_json`` writes only the fields of the
  event's kind (an optional field left unset is omitted, never written as ``null``);
* ``from_json`` **refuses every key that is not a field of the event's kind**, at any depth, with
  an ``EventValidationError`` naming its full path (``event.event.count``). A field the ledger
  ignored could change what ran: ``{"kind": "gaussian", "noise_multiplier": 60, "steps": 1000}``
  or a ``count`` one level too high, inside ``poisson_sampled``, describe a thousand steps and
  were charged as one. Refusing is also the safe side of the compatibility rule: a ledger that
  predates a new optional field refuses an event that uses it instead of charging it as if the
  field were absent. ``null`` stays accepted for the optional fields that ``to_json`` may omit.

Validation happens when an event is built, so an invalid event never exists. Errors are
``EventValidationError`` and name the field (as a dotted path for nested events) and the value:
``"event.noise_multiplier must be finite and > 0. Found nan."``.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Final

import numpy as np

from accountant.dp_accounting_table import dp_accounting_field, to_ledger_json
from accountant.errors import EventValidationError, InvalidFieldError

# Structural limits: events come from untrusted clients (HTTP bodies, CLI arguments).
MAX_NESTING_DEPTH: Final = 32
MAX_COMPOSED_EVENTS: Final = 10_000
MAX_COUNT: Final = 10**18
MAX_VECTOR_LENGTH: Final = 1_000_000

# ``FunctionalMechanismL2DPEvent.analysis``: Thm. 2 as printed, or with the input term re-derived.
L2DP_ML_ANALYSES: Final = ("paper", "sound")


def _fmt(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _encodes(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_positive(field_name: str, value: float) -> None:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise EventValidationError(field_name, f"must be finite and > 0. Found {_fmt(value)}.")


def _check_non_negative(field_name: str, value: float) -> None:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise EventValidationError(field_name, f"must be finite and >= 0. Found {_fmt(value)}.")


def _check_probability(field_name: str, value: float) -> None:
    if not _is_real(value) or not math.isfinite(value) or not 0 < value <= 1:
        raise EventValidationError(field_name, f"must be in (0, 1]. Found {_fmt(value)}.")


def _check_delta(field_name: str, value: float) -> None:
    if not _is_real(value) or not math.isfinite(value) or not 0 <= value < 1:
        raise EventValidationError(field_name, f"must be in [0, 1). Found {_fmt(value)}.")


def _check_count(field_name: str, value: int, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise EventValidationError(
            field_name, f"must be an integer in [{minimum}, 10^18]. Found {_fmt(value)}."
        )


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class DpEvent:
    """Base class of all events. ``kind`` is the stable JSON tag."""

    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, path: str = "event") -> None:
        """Raise ``EventValidationError`` naming ``path.field`` if a parameter is invalid.

        Checks this event's own fields; nested events validated themselves when built.
        """

    def children(self) -> tuple[DpEvent, ...]:
        return ()


@dataclass(frozen=True, slots=True)
class NoOpEvent(DpEvent):
    """A mechanism that touches no private data: costs nothing."""

    kind: ClassVar[str] = "no_op"


@dataclass(frozen=True, slots=True)
class NonPrivateEvent(DpEvent):
    """A release with no privacy guarantee: every accountant answers ε = ∞."""

    kind: ClassVar[str] = "non_private"


@dataclass(frozen=True, slots=True)
class GaussianEvent(DpEvent):
    """Gaussian mechanism with L2 sensitivity 1 and noise standard deviation ``noise_multiplier``."""

    kind: ClassVar[str] = "gaussian"
    noise_multiplier: float

    def validate(self, path: str = "event") -> None:
        _check_positive(f"{path}.noise_multiplier", self.noise_multiplier)


@dataclass(frozen=True, slots=True)
class FunctionalMechanismEvent(GaussianEvent):
    """The functional mechanism (Zhang et al. 2012) on one fixed batch's quadratic objective
    of a linear output layer over bounded features: the sound L2DP-ML (docs/ACCOUNTING.md,
    "The functional mechanism of the lifelong learner").

    Each record is a feature vector φ ∈ ℝ^p (``feature_dim``), ‖φ‖₂ ≤ B (``feature_bound``),
    from an encoder that never sees private data, and a one-hot label y ∈ {0, 1}^K
    (``num_classes``). The batch's coefficient vector is (Σφφᵀ, Σφyᵀ) — Σφ = Σφyᵀ·1 is part of it,
    since each y sums to 1 — and the 2nd-order Taylor objective of the output layer's per-class
    logistic loss (lifelong-dp-l2dp-ml.txt, Eq. 9–12) is a function of it. Gaussian noise of
    standard deviation ``noise_multiplier`` · Δ₂ is added to every coefficient once, where
    Δ₂ = ``accountant.mechanisms.functional_mechanism_l2_sensitivity(B)`` is the coefficient
    vector's L2 sensitivity under **replace-one** neighbours. It **is** the Gaussian mechanism with
    that noise multiplier, and every accountant prices it as one (it is a ``GaussianEvent``);
    the other fields say what the sensitivity was computed for, and bind a replay (its
    fingerprint) to the same mechanism.
    """

    kind: ClassVar[str] = "functional_mechanism"
    feature_dim: int
    num_classes: int
    feature_bound: float

    def validate(self, path: str = "event") -> None:
        _check_positive(f"{path}.noise_multiplier", self.noise_multiplier)
        _check_count(f"{path}.feature_dim", self.feature_dim)
        _check_count(f"{path}.num_classes", self.num_classes, minimum=2)
        _check_positive(f"{path}.feature_bound", self.feature_bound)


@dataclass(frozen=True, slots=True)
class LaplaceEvent(DpEvent):
    """Laplace mechanism with L1 sensitivity 1 and noise scale ``scale`` (so pure ε = 1/scale)."""

    kind: ClassVar[str] = "laplace"
    scale: float

    def validate(self, path: str = "event") -> None:
        _check_positive(f"{path}.scale", self.scale)


@dataclass(frozen=True, slots=True)
class PureDpEvent(DpEvent):
    """Any mechanism known to be ε-DP."""

    kind: ClassVar[str] = "pure_dp"
    epsilon: float

    def validate(self, path: str = "event") -> None:
        _check_non_negative(f"{path}.epsilon", self.epsilon)


@dataclass(frozen=True, slots=True)
class ApproxDpEvent(DpEvent):
    """Any mechanism known to be (ε, δ)-DP."""

    kind: ClassVar[str] = "approx_dp"
    epsilon: float
    delta: float

    def validate(self, path: str = "event") -> None:
        _check_non_negative(f"{path}.epsilon", self.epsilon)
        _check_delta(f"{path}.delta", self.delta)


@dataclass(frozen=True, slots=True)
class PoissonSampledEvent(DpEvent):
    """``event`` run on a Poisson subsample: each record included independently w.p. q."""

    kind: ClassVar[str] = "poisson_sampled"
    sampling_probability: float
    event: DpEvent

    def validate(self, path: str = "event") -> None:
        _check_probability(f"{path}.sampling_probability", self.sampling_probability)

    def children(self) -> tuple[DpEvent, ...]:
        return (self.event,)


@dataclass(frozen=True, slots=True)
class SampledWithoutReplacementEvent(DpEvent):
    """``event`` run on a uniformly random subset of ``sample_size`` out of ``population_size``."""

    kind: ClassVar[str] = "sampled_without_replacement"
    sample_size: int
    population_size: int
    event: DpEvent

    def validate(self, path: str = "event") -> None:
        _check_count(f"{path}.sample_size", self.sample_size)
        _check_count(f"{path}.population_size", self.population_size)
        if self.sample_size > self.population_size:
            raise EventValidationError(
                f"{path}.sample_size",
                f"must be <= population_size ({self.population_size}). Found {self.sample_size}.",
            )

    def children(self) -> tuple[DpEvent, ...]:
        return (self.event,)


@dataclass(frozen=True, slots=True)
class SelfComposedEvent(DpEvent):
    """``event`` run ``count`` times (adaptively) on the same data."""

    kind: ClassVar[str] = "self_composed"
    event: DpEvent
    count: int

    def validate(self, path: str = "event") -> None:
        _check_count(f"{path}.count", self.count, minimum=0)

    def children(self) -> tuple[DpEvent, ...]:
        return (self.event,)


@dataclass(frozen=True, slots=True)
class ComposedEvent(DpEvent):
    """The events run one after another (adaptively) on the same data."""

    kind: ClassVar[str] = "composed"
    events: tuple[DpEvent, ...]

    def validate(self, path: str = "event") -> None:
        if len(self.events) > MAX_COMPOSED_EVENTS:
            raise EventValidationError(
                f"{path}.events",
                f"must hold at most {MAX_COMPOSED_EVENTS} events. Found {len(self.events)}.",
            )

    def children(self) -> tuple[DpEvent, ...]:
        return self.events


@dataclass(frozen=True, slots=True)
class FunctionalMechanismL2DPEvent(DpEvent):
    """L2DP-ML's per-batch functional-mechanism perturbation (Phan et al., Alg. 1 and 2).

    One Laplace noise draw per batch perturbs the inputs (x̄ = x + χ1/|B|), the auto-encoder's
    hidden layer (h̄ = h + 2χ2/|B|) and the output layer's polynomial coefficients (χ3/|B|).
    Theorem 2 gives the pure ε = ε1 + ε1/γx + ε1/γ + ε2 with Δ_R = d(|h1| + 2),
    γx = Δ_R/|B| and γ = 2Δ_R/(|B|·‖θ̄1‖₁,₁) (``accountant.mechanisms.l2dp_ml_epsilon``).

    ``theta1_norm_bound`` is the bound on the maximum column 1-norm of θ1 that the trainer
    enforces (by projection after every step); the guarantee holds only under that bound.

    ``analysis`` (optional, added later; docs/DESIGN-NOTES.md note 21) says which input
    perturbation ran and which bound is charged:

    * ``"paper"`` — Alg. 2 as printed: **one** vector χ1 shared by every record of the batch,
      charged Thm. 2's ε1/γx = ε1|B|/Δ_R. That term is the Laplace bound for an ℓ1 sensitivity of
      1, but a record of [0, 1]^d moves by up to d, and with a shared χ1 the differences
      x̄_r − x̄_s = x_r − x_s are published without noise: we know no finite bound for it.
    * ``"sound"`` — an independent χ1 per record (same scale Δ_R/(ε1|B|) per coordinate),
      charged d·ε1/γx = ε1|B|/(|h1| + 2): replace-one neighbours (the batch size is public), one
      record moves by ≤ d in ℓ1. The other three terms are Thm. 2's.
    * absent (``None``) — **the paper's analysis**: what every event stored before the field
      existed meant; it is priced exactly as before, so stored rows keep their price and
      fingerprint. New clients should name the analysis; the built-in worker sends ``"sound"``.

    A **new** charge (``from_json(..., new=True)``: reservations, quotes, plans, ``ledger
    epsilon``) must say ``"sound"``: ``"paper"`` and absent are refused there
    (``refuse_unproven``), and a stored charge priced by them no longer verifies as a bound
    (``accountant.certificates.verify``).
    """

    kind: ClassVar[str] = "l2dp_ml_functional"
    epsilon1: float
    epsilon2: float
    input_dim: int
    hidden_units: int
    output_hidden_units: int
    batch_size: int
    theta1_norm_bound: float
    analysis: str | None = None

    @property
    def charged_analysis(self) -> str:
        """``"paper"`` or ``"sound"``: the analysis this event is priced with (absent = paper)."""
        return self.analysis if self.analysis is not None else "paper"

    def validate(self, path: str = "event") -> None:
        if self.analysis is not None and self.analysis not in L2DP_ML_ANALYSES:
            raise EventValidationError(
                f"{path}.analysis",
                f"must be one of {', '.join(repr(a) for a in L2DP_ML_ANALYSES)} (or absent: "
                f"'paper'). Found {_fmt(self.analysis)}.",
            )
        _check_positive(f"{path}.epsilon1", self.epsilon1)
        _check_positive(f"{path}.epsilon2", self.epsilon2)
        _check_count(f"{path}.input_dim", self.input_dim)
        _check_count(f"{path}.hidden_units", self.hidden_units)
        _check_count(f"{path}.output_hidden_units", self.output_hidden_units)
        _check_count(f"{path}.batch_size", self.batch_size)
        _check_positive(f"{path}.theta1_norm_bound", self.theta1_norm_bound)


@dataclass(frozen=True, slots=True)
class OutputPerturbationEvent(DpEvent):
    """Output perturbation of a strongly convex ERM minimiser (PSGD / PBERM).

    The released vector is θ + ν with density of ν ∝ exp(−‖ν‖₂/b), b = ``noise_scale``
    = l2_sensitivity/epsilon (‖ν‖₂ ~ Gamma(d, b), uniform direction; Chaudhuri et al. 2011).
    That is pure ε-DP with ε = l2_sensitivity / b. Per-coordinate Laplace calibrated to an L2
    sensitivity is *not* ε-DP and is deliberately not offered.
    """

    kind: ClassVar[str] = "output_perturbation"
    l2_sensitivity: float
    epsilon: float

    @property
    def noise_scale(self) -> float:
        return self.l2_sensitivity / self.epsilon

    def validate(self, path: str = "event") -> None:
        _check_positive(f"{path}.l2_sensitivity", self.l2_sensitivity)
        _check_positive(f"{path}.epsilon", self.epsilon)
        # The trainer draws noise of scale fl(Δ₂/ε): 0 (no noise: not private at all) or ∞ (no
        # output) cannot be what ran, and Δ₂/b would not be the ε it certifies.
        scale = self.l2_sensitivity / self.epsilon
        if not 0 < scale < math.inf:
            raise EventValidationError(
                f"{path}.epsilon",
                f"must give a finite noise scale l2_sensitivity/epsilon > 0. Found "
                f"l2_sensitivity={self.l2_sensitivity!r}, epsilon={self.epsilon!r} (scale {scale!r}).",
            )


@dataclass(frozen=True, slots=True)
class AdaptiveGaussianEvent(DpEvent):
    """AdaDp's per-coordinate Gaussian noise (Xu, Shi, Liu, Zhao & Chen 2019, Lemma 1).

    Coordinate i has sensitivity sᵢ and noise standard deviation σᵢ. When
    Σ sᵢ²/σᵢ² ≤ 1/σ*², the mechanism is as private as a Gaussian mechanism with noise multiplier
    σ* = ``noise_multiplier``, and it is accounted as one. The per-coordinate vectors are optional
    (a plan made before training cannot know them); when given, Lemma 1's condition is checked.
    """

    kind: ClassVar[str] = "adaptive_gaussian"
    noise_multiplier: float
    sensitivities: tuple[float, ...] | None = None
    noise_stddevs: tuple[float, ...] | None = None

    def validate(self, path: str = "event") -> None:
        _check_positive(f"{path}.noise_multiplier", self.noise_multiplier)
        if (self.sensitivities is None) != (self.noise_stddevs is None):
            raise EventValidationError(
                f"{path}.noise_stddevs", "and sensitivities must be given together or not at all."
            )
        if self.sensitivities is None or self.noise_stddevs is None:
            return
        if len(self.sensitivities) != len(self.noise_stddevs):
            raise EventValidationError(
                f"{path}.noise_stddevs",
                f"must have the length of sensitivities ({len(self.sensitivities)}). "
                f"Found {len(self.noise_stddevs)}.",
            )
        for i, s in enumerate(self.sensitivities):
            _check_non_negative(f"{path}.sensitivities[{i}]", s)
        for i, sd in enumerate(self.noise_stddevs):
            _check_positive(f"{path}.noise_stddevs[{i}]", sd)
        holds, total, limit = lemma1_holds(self.sensitivities, self.noise_stddevs, self.noise_multiplier)
        if not holds:
            raise EventValidationError(
                f"{path}.noise_stddevs",
                f"violate Lemma 1: sum(s_i^2/sigma_i^2) = {total} > 1/noise_multiplier^2 = {limit}.",
            )


# Above this relative margin the float test of Lemma 1 is decisive; inside it (a vector exactly at
# the boundary, up to rounding) the test is redone in exact rational arithmetic.
_LEMMA1_FLOAT_MARGIN: Final = 1e-9


def lemma1_holds(
    sensitivities: Sequence[float], noise_stddevs: Sequence[float], noise_multiplier: float
) -> tuple[bool, str, str]:
    """AdaDp Lemma 1's condition Σ sᵢ²/σᵢ² ≤ 1/σ*², decided exactly; also (total, limit) as text.

    Arguments must be finite, s ≥ 0, σᵢ > 0 and σ* > 0 (the caller checked). The sum is taken in
    long double (x86: exponent range ±4932, so no square of a ratio of floats over- or
    underflows, and σ* = 5e-324 gives a finite 1/σ*²); it decides when it is finite, free of
    underflow and more than 1e-9 (relative) away from the limit. Otherwise — at the boundary, or
    where long double is only float64 — the test is redone in rational arithmetic, which is exact.
    Never raises an arithmetic error (``(s/σ)**2`` of floats raises OverflowError beyond 1e154).
    """
    s = np.asarray(sensitivities, dtype=np.longdouble)
    sd = np.asarray(noise_stddevs, dtype=np.longdouble)
    sigma = np.longdouble(noise_multiplier)
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        ratios = s / sd
        squares = ratios * ratios
        total = np.sum(squares)
        limit = np.longdouble(1) / (sigma * sigma)
    tiny = np.finfo(np.longdouble).tiny
    lost = bool(np.any((ratios != 0) & (squares < tiny)))  # an underflowed (or subnormal) square
    if not lost and np.isfinite(total) and np.isfinite(limit) and limit >= tiny:
        text = (_scientific(total), _scientific(limit))
        if total < limit * (1 - _LEMMA1_FLOAT_MARGIN):
            return True, *text
        if total > limit * (1 + _LEMMA1_FLOAT_MARGIN):
            return False, *text
    exact_total = sum(
        ((Fraction(a) / Fraction(b)) ** 2 for a, b in zip(sensitivities, noise_stddevs, strict=True)),
        Fraction(0),
    )
    exact_limit = 1 / Fraction(noise_multiplier) ** 2
    return exact_total <= exact_limit, _approximately(exact_total), _approximately(exact_limit)


def _scientific(value: np.longdouble) -> str:
    return np.format_float_scientific(value, precision=17, trim="-")


def _approximately(value: Fraction) -> str:
    """``value`` to 17 significant digits, at any magnitude (``float()`` would overflow)."""
    return str(decimal.Context(prec=17).divide(decimal.Decimal(value.numerator), value.denominator))


EVENT_TYPES: Final[Mapping[str, type[DpEvent]]] = {
    cls.kind: cls
    for cls in (
        NoOpEvent,
        NonPrivateEvent,
        GaussianEvent,
        LaplaceEvent,
        PureDpEvent,
        ApproxDpEvent,
        PoissonSampledEvent,
        SampledWithoutReplacementEvent,
        SelfComposedEvent,
        ComposedEvent,
        FunctionalMechanismL2DPEvent,
        OutputPerturbationEvent,
        AdaptiveGaussianEvent,
        FunctionalMechanismEvent,
    )
}


def validate(event: DpEvent, path: str = "event", _depth: int = 0) -> None:
    """Validate ``event`` and everything nested in it; errors name the dotted field path."""
    if _depth > MAX_NESTING_DEPTH:
        raise EventValidationError(path, f"nests deeper than {MAX_NESTING_DEPTH} levels.")
    event.validate(path)
    if isinstance(event, ComposedEvent):
        for i, child in enumerate(event.events):
            validate(child, f"{path}.events[{i}]", _depth + 1)
    else:
        for child in event.children():
            validate(child, f"{path}.event", _depth + 1)


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def to_json(event: DpEvent) -> dict[str, Any]:
    """The JSON object for ``event``: ``{"kind": ..., <fields>}``, nested events as objects."""
    out: dict[str, Any] = {"kind": event.kind}
    if isinstance(event, ComposedEvent):
        out["events"] = [to_json(e) for e in event.events]
        return out
    for name in event.__dataclass_fields__:
        value = getattr(event, name)
        if isinstance(value, DpEvent):
            out[name] = to_json(value)
        elif isinstance(value, tuple):
            out[name] = list(value)
        elif value is not None:
            out[name] = value
    return out


def _number(obj: Mapping[str, Any], name: str, path: str) -> float:
    if name not in obj:
        raise EventValidationError(f"{path}.{name}", "is required.")
    return _as_float(obj[name], f"{path}.{name}")


def _as_float(value: object, field: str) -> float:
    """A JSON number as a float; an integer beyond the float range (10**400) names ``field``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EventValidationError(field, f"must be a number. Found {_fmt(value)}.")
    try:
        return float(value)
    except OverflowError:
        raise EventValidationError(
            field, "must be a number within the float range (|x| < 1.8e308)."
        ) from None


def _integer(obj: Mapping[str, Any], name: str, path: str) -> int:
    if name not in obj:
        raise EventValidationError(f"{path}.{name}", "is required.")
    value = obj[name]
    # JSON has one number type: 1e17 is the integer 10^17 (JSON Schema's "integer" agrees). Any
    # integral float is exact; the range check of the field (``_check_count``) bounds it.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise EventValidationError(f"{path}.{name}", f"must be an integer. Found {_fmt(value)}.")
    return value


def _vector(obj: Mapping[str, Any], name: str, path: str) -> tuple[float, ...] | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_VECTOR_LENGTH:
        raise EventValidationError(
            f"{path}.{name}", f"must be a list of at most {MAX_VECTOR_LENGTH} numbers."
        )
    return tuple(_as_float(item, f"{path}.{name}[{i}]") for i, item in enumerate(value))


_Parser = Callable[[Mapping[str, Any], str, int], DpEvent]


def _parse_simple(cls: type[DpEvent], numbers: Sequence[str], integers: Sequence[str] = ()) -> _Parser:
    def parse(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
        kwargs: dict[str, Any] = {n: _number(obj, n, path) for n in numbers}
        kwargs.update({n: _integer(obj, n, path) for n in integers})
        return cls(**kwargs)

    return parse


def _parse_poisson(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    return PoissonSampledEvent(
        sampling_probability=_number(obj, "sampling_probability", path),
        event=_parse(obj.get("event"), f"{path}.event", depth + 1),
    )


def _parse_without_replacement(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    return SampledWithoutReplacementEvent(
        sample_size=_integer(obj, "sample_size", path),
        population_size=_integer(obj, "population_size", path),
        event=_parse(obj.get("event"), f"{path}.event", depth + 1),
    )


def _parse_self_composed(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    return SelfComposedEvent(
        event=_parse(obj.get("event"), f"{path}.event", depth + 1),
        count=_integer(obj, "count", path),
    )


def _parse_composed(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    items = obj.get("events")
    if not isinstance(items, list):
        raise EventValidationError(f"{path}.events", "must be a list of events.")
    if len(items) > MAX_COMPOSED_EVENTS:
        raise EventValidationError(
            f"{path}.events", f"must hold at most {MAX_COMPOSED_EVENTS} events. Found {len(items)}."
        )
    return ComposedEvent(
        events=tuple(_parse(e, f"{path}.events[{i}]", depth + 1) for i, e in enumerate(items))
    )


def _parse_adaptive(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    return AdaptiveGaussianEvent(
        noise_multiplier=_number(obj, "noise_multiplier", path),
        sensitivities=_vector(obj, "sensitivities", path),
        noise_stddevs=_vector(obj, "noise_stddevs", path),
    )


def _parse_functional(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    return FunctionalMechanismEvent(
        noise_multiplier=_number(obj, "noise_multiplier", path),
        feature_dim=_integer(obj, "feature_dim", path),
        num_classes=_integer(obj, "num_classes", path),
        feature_bound=_number(obj, "feature_bound", path),
    )


def _parse_l2dp(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    analysis = obj.get("analysis")
    if analysis is not None and not isinstance(analysis, str):
        raise EventValidationError(f"{path}.analysis", f"must be a string. Found {_fmt(analysis)}.")
    return FunctionalMechanismL2DPEvent(
        epsilon1=_number(obj, "epsilon1", path),
        epsilon2=_number(obj, "epsilon2", path),
        input_dim=_integer(obj, "input_dim", path),
        hidden_units=_integer(obj, "hidden_units", path),
        output_hidden_units=_integer(obj, "output_hidden_units", path),
        batch_size=_integer(obj, "batch_size", path),
        theta1_norm_bound=_number(obj, "theta1_norm_bound", path),
        analysis=analysis,
    )


_PARSERS: Final[Mapping[str, _Parser]] = {
    "no_op": lambda obj, path, depth: NoOpEvent(),
    "non_private": lambda obj, path, depth: NonPrivateEvent(),
    "gaussian": _parse_simple(GaussianEvent, ["noise_multiplier"]),
    "laplace": _parse_simple(LaplaceEvent, ["scale"]),
    "pure_dp": _parse_simple(PureDpEvent, ["epsilon"]),
    "approx_dp": _parse_simple(ApproxDpEvent, ["epsilon", "delta"]),
    "poisson_sampled": _parse_poisson,
    "sampled_without_replacement": _parse_without_replacement,
    "self_composed": _parse_self_composed,
    "composed": _parse_composed,
    "l2dp_ml_functional": _parse_l2dp,
    "output_perturbation": _parse_simple(OutputPerturbationEvent, ["l2_sensitivity", "epsilon"]),
    "adaptive_gaussian": _parse_adaptive,
    "functional_mechanism": _parse_functional,
}


# The JSON keys of each kind: "kind" and the dataclass fields (``to_json`` writes no others).
_KEYS: Final[Mapping[str, frozenset[str]]] = {
    kind: frozenset({"kind", *(f.name for f in dataclasses.fields(cls))}) for kind, cls in EVENT_TYPES.items()
}


def _refuse_unknown_keys(obj: Mapping[Any, Any], kind: str, path: str) -> None:
    """Refuse a key that is not a field of ``kind``: the ledger would otherwise charge an event
    other than the one described (a ``count`` or ``steps`` it ignored), see the module docstring."""
    allowed = _KEYS[kind]
    unknown = [key for key in obj if key not in allowed]
    if unknown:
        first = min(unknown, key=repr)  # deterministic whatever the client's key order
        # A key UTF-8 cannot carry (a lone surrogate, "\ud800" in JSON) is named by its repr:
        # the field name travels in the 422 answer, which must encode.
        name = first if isinstance(first, str) and _encodes(first) else repr(first)
        value = repr(obj[first])
        if len(value) > 60:
            value = value[:57] + "..."
        raise EventValidationError(
            f"{path}.{name}",
            f"is not a field of a {kind!r} event (its fields: {', '.join(sorted(allowed))}); it is "
            f"refused, not ignored, since it could change what ran. Found {value}.",
        )


def _parse(obj: object, path: str, depth: int) -> DpEvent:
    if depth > MAX_NESTING_DEPTH:
        raise EventValidationError(path, f"nests deeper than {MAX_NESTING_DEPTH} levels.")
    if not isinstance(obj, Mapping):
        raise EventValidationError(path, f"must be an event object. Found {_fmt(obj)}.")
    if "class_name" in obj and "kind" not in obj:
        return _parse_dp_accounting(obj, path, depth)
    kind = obj.get("kind")
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise EventValidationError(f"{path}.kind", f"must be one of {sorted(_PARSERS)}. Found {_fmt(kind)}.")
    assert isinstance(kind, str)
    _refuse_unknown_keys(obj, kind, path)
    try:
        return parser(obj, path, depth)
    except EventValidationError as exc:
        # Errors raised while parsing already name their full path (it starts with ``path``).
        # Only a built event's own validation speaks of the generic path "event.<field>".
        placed = exc.field == path or exc.field.startswith(path + ".")
        if not placed and exc.field.startswith("event."):
            raise EventValidationError(path + exc.field[len("event") :], exc.message) from None
        raise


def _parse_dp_accounting(obj: Mapping[str, Any], path: str, depth: int) -> DpEvent:
    """An event in dp_accounting's form (``accountant.dp_accounting_form``); a bad value is
    named by its dp_accounting field (``LaplaceDpEvent.noise_multiplier``, not ``scale``)."""
    translated = to_ledger_json(obj, path)
    try:
        return _parse(translated, path, depth)
    except EventValidationError as exc:
        own, dot, field = exc.field.rpartition(".")
        if dot and own == path:
            raise EventValidationError(
                f"{path}.{dp_accounting_field(translated['kind'], field)}", exc.message
            ) from None
        raise


def from_json(obj: object, path: str = "event", *, new: bool = False) -> DpEvent:
    """Parse and validate an event from its JSON object — the ledger's (``kind``) or
    dp_accounting's (``class_name``, ``accountant.dp_accounting_form``), nested in either form.
    Errors name the dotted field path.

    ``new=True`` for an event a client asks to be priced or charged now (a reservation, a quote,
    a plan, ``ledger epsilon``): it must also pass ``refuse_unproven``. Stored events are read
    with ``new=False``, so that they keep their price and fingerprint."""
    event = _parse(obj, path, 0)
    if new:
        refuse_unproven(event, path)
    return event


def refuse_unproven(event: DpEvent, path: str = "event", _depth: int = 0) -> None:
    """``EventValidationError`` naming ``<path>.analysis`` for an ``l2dp_ml_functional`` event,
    at any depth, whose analysis is not ``"sound"``.

    Thm. 2 as printed (``"paper"``, and an event without ``analysis``, which means it) is not a
    bound we can prove (docs/DESIGN-NOTES.md note 21): a new charge priced by it would certify
    less privacy loss than what ran. Stored events keep their meaning; only new ones are refused."""
    if _depth > MAX_NESTING_DEPTH:
        raise EventValidationError(path, f"nests deeper than {MAX_NESTING_DEPTH} levels.")
    if isinstance(event, FunctionalMechanismL2DPEvent) and event.analysis != "sound":
        raise EventValidationError(
            f"{path}.analysis",
            "must be 'sound' for a new charge: L2DP-ML Thm. 2 as printed ('paper', which an event "
            "without 'analysis' means) is not a valid bound (docs/DESIGN-NOTES.md note 21). "
            f"Found {_fmt(event.analysis)}.",
        )
    if isinstance(event, ComposedEvent):
        for i, child in enumerate(event.events):
            refuse_unproven(child, f"{path}.events[{i}]", _depth + 1)
    else:
        for child in event.children():
            refuse_unproven(child, f"{path}.event", _depth + 1)


def walk(event: DpEvent) -> list[DpEvent]:
    """Every event in the tree, depth first, ``event`` itself first."""
    out: list[DpEvent] = []
    stack = [event]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(reversed(current.children()))
    return out


# ---------------------------------------------------------------------------------------------
# Neighbouring relations (docs/DESIGN-NOTES.md note 21)
# ---------------------------------------------------------------------------------------------

ADD_REMOVE: Final = "add_remove"
REPLACE_ONE: Final = "replace_one"


def neighbouring_relations(event: DpEvent) -> dict[str, str]:
    """The neighbouring relations ``event``'s guarantee is stated under, each with the kind of the
    first event in the tree that fixes it: ``{"add_remove": "poisson_sampled", ...}``.

    * ``poisson_sampled`` → add/remove one record: the accountants' bounds for it (exact RDP of
      the sampled Gaussian, Mironov, Talwar & Zhang 2019; the PRV "remove" pair) are add/remove.
    * ``sampled_without_replacement`` → replace-one: Wang, Balle & Kasiviswanathan 2019, Thm. 27,
      is stated for substitution, with the dataset size public.
    * ``l2dp_ml_functional`` → replace-one: its batches have a declared, public size |B| (the
      noise is scaled by 1/|B|), and the ``"sound"`` analysis releases one perturbed row per
      record, which no add/remove analysis can hide.
    * ``functional_mechanism`` → replace-one: its sensitivity (docs/ACCOUNTING.md) is the
      largest change of the coefficient vector when one record of the batch is replaced.
    * ``output_perturbation`` → replace-one: Chaudhuri, Monteleoni & Sarwate 2011's sensitivity
      2L/(λn) is for datasets of the same size n differing in one entry.

    Every other kind (Gaussian, Laplace, pure/approx DP, AdaDp, no-op, non-private) states no
    relation: its sensitivity or (ε, δ) is taken to be the one of the batch's relation (a client
    computing a sum's sensitivity under replace-one uses twice the add/remove value). An empty
    answer means the event is neutral; two keys mean it mixes relations.
    """
    found: dict[str, str] = {}
    for node in walk(event):
        relation = _RELATION_OF_KIND.get(node.kind)
        if relation is not None and relation not in found:
            found[relation] = node.kind
    return found


_RELATION_OF_KIND: Final[Mapping[str, str]] = {
    "poisson_sampled": ADD_REMOVE,
    "sampled_without_replacement": REPLACE_ONE,
    "l2dp_ml_functional": REPLACE_ONE,
    "output_perturbation": REPLACE_ONE,
    "functional_mechanism": REPLACE_ONE,
}


__all__ = [
    "ADD_REMOVE",
    "EVENT_TYPES",
    "L2DP_ML_ANALYSES",
    "MAX_COUNT",
    "MAX_NESTING_DEPTH",
    "REPLACE_ONE",
    "AdaptiveGaussianEvent",
    "ApproxDpEvent",
    "ComposedEvent",
    "DpEvent",
    "EventValidationError",
    "FunctionalMechanismEvent",
    "FunctionalMechanismL2DPEvent",
    "GaussianEvent",
    "InvalidFieldError",
    "LaplaceEvent",
    "NoOpEvent",
    "NonPrivateEvent",
    "OutputPerturbationEvent",
    "PoissonSampledEvent",
    "PureDpEvent",
    "SampledWithoutReplacementEvent",
    "SelfComposedEvent",
    "from_json",
    "neighbouring_relations",
    "refuse_unproven",
    "to_json",
    "validate",
    "walk",
]
