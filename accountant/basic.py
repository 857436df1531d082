"""Basic composition of pure and approximate DP: the ``"basic"`` accountant.

Theorem (basic composition; Dwork, McSherry, Nissim & Smith 2006; Dwork & Lei 2009; Dwork & Roth
2014, Theorem 3.16): running k mechanisms, each (εᵢ, δᵢ)-DP and each chosen *adaptively* after
seeing the outputs of the earlier ones, is (Σεᵢ, Σδᵢ)-DP. Because it holds under full adaptivity,
a ledger may sum charges one at a time as they are admitted.

What each event costs here (``epsilon_delta``):

* ``no_op`` → (0, 0); ``non_private`` → ε = ∞ (not an exception);
* ``pure_dp`` → (ε, 0); ``approx_dp`` → (ε, δ);
* ``laplace`` (L1 sensitivity 1, scale b) → (1/b, 0) (Dwork et al. 2006, the Laplace mechanism);
* ``l2dp_ml_functional`` → Theorem 2 of L2DP-ML (``accountant.mechanisms.l2dp_ml_epsilon``);
* ``output_perturbation`` → its ε = Δ₂/b (Chaudhuri et al. 2011, Theorem 6);
* ``self_composed`` → count × the child's cost (a multiplication, never a loop: count ≤ 10¹⁸);
  ``composed`` → the sum of its children;
* ``gaussian``, ``adaptive_gaussian`` (no pure-DP guarantee; δ depends on ε) and the sampled
  events (``poisson_sampled``, ``sampled_without_replacement``) → ``UnsupportedEventError``
  naming the innermost unsupported event. Use the ``rdp`` or ``prv`` accountant for those.

Arithmetic is exact: costs are kept as ``Fraction`` (every float is a dyadic rational, 1/b and
Theorem 2 are rational in the parameters), so a sum over 10¹⁸ steps or thousands of events never
drifts; results are rounded *up* to the next float. δ sums are capped at 1 (every mechanism is
(ε, 1)-DP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from accountant.base import EpsilonBound, PrivacyAccountant, check_delta, check_epsilon
from accountant.errors import InvalidArgumentError, UnsupportedEventError
from accountant.events import (
    MAX_COUNT,
    AdaptiveGaussianEvent,
    ApproxDpEvent,
    ComposedEvent,
    DpEvent,
    FunctionalMechanismL2DPEvent,
    GaussianEvent,
    LaplaceEvent,
    NonPrivateEvent,
    NoOpEvent,
    OutputPerturbationEvent,
    PoissonSampledEvent,
    PureDpEvent,
    SampledWithoutReplacementEvent,
    SelfComposedEvent,
)
from accountant.mechanisms import float_up, l2dp_ml_event_epsilon, output_perturbation_event_epsilon

NAME: Final = "basic"
_ONE: Final = Fraction(1)


@dataclass(frozen=True, slots=True)
class _Cost:
    """(ε, δ) in exact arithmetic; ``private=False`` means ε = ∞ (a non-private release)."""

    epsilon: Fraction
    delta: Fraction
    private: bool = True

    def __add__(self, other: _Cost) -> _Cost:
        return _Cost(
            self.epsilon + other.epsilon,
            min(self.delta + other.delta, _ONE),
            self.private and other.private,
        )

    def times(self, count: int) -> _Cost:
        if count == 0:
            return _ZERO
        return _Cost(self.epsilon * count, min(self.delta * count, _ONE), self.private)


_ZERO: Final = _Cost(Fraction(0), Fraction(0))


def _pure(epsilon: float) -> _Cost:
    """A formula's pure ε as a cost; one beyond the float range (∞) is no guarantee at all."""
    if not math.isfinite(epsilon):
        return _Cost(Fraction(0), Fraction(0), private=False)
    return _Cost(Fraction(epsilon), Fraction(0))


def _cost(event: DpEvent) -> _Cost:
    """The one recursive dispatcher behind ``supports``, ``compose`` and ``epsilon_delta``.

    Children are examined before their parent raises, so an error names the innermost
    unsupported event (e.g. the ``gaussian`` inside ``poisson_sampled``).
    """
    if isinstance(event, NoOpEvent):
        return _ZERO
    if isinstance(event, NonPrivateEvent):
        return _Cost(Fraction(0), Fraction(0), private=False)
    if isinstance(event, PureDpEvent):
        return _Cost(Fraction(event.epsilon), Fraction(0))
    if isinstance(event, ApproxDpEvent):
        return _Cost(Fraction(event.epsilon), Fraction(event.delta))
    if isinstance(event, LaplaceEvent):
        # Laplace mechanism, L1 sensitivity 1, scale b: pure ε = 1/b (Dwork et al. 2006).
        return _Cost(1 / Fraction(event.scale), Fraction(0))
    if isinstance(event, FunctionalMechanismL2DPEvent):
        # Theorem 2 of L2DP-ML, rounded up to a float by the formula itself.
        return _pure(l2dp_ml_event_epsilon(event))
    if isinstance(event, OutputPerturbationEvent):
        return _pure(output_perturbation_event_epsilon(event))
    if isinstance(event, SelfComposedEvent):
        return _cost(event.event).times(event.count)
    if isinstance(event, ComposedEvent):
        total = _ZERO
        for child in event.events:
            total = total + _cost(child)
        return total
    if isinstance(event, PoissonSampledEvent | SampledWithoutReplacementEvent):
        _cost(event.event)  # raises first if the inner event is itself unsupported
        raise UnsupportedEventError(
            NAME, event, "sampled events need the 'rdp' or 'prv' accountant (amplification)"
        )
    if isinstance(event, GaussianEvent | AdaptiveGaussianEvent):
        raise UnsupportedEventError(
            NAME, event, "the Gaussian mechanism is not pure or (ε, δ)-DP for one fixed δ; use 'rdp'"
        )
    raise UnsupportedEventError(NAME, event, "unknown event kind")


def epsilon_delta(event: DpEvent) -> tuple[float, float]:
    """(ε, δ) of ``event`` by basic composition, each rounded up; ε = ∞ for non-private events.

    Raises ``UnsupportedEventError`` naming the innermost Gaussian or sampled event.
    """
    cost = _cost(event)
    if not cost.private:
        return math.inf, float_up(cost.delta)
    return float_up(cost.epsilon), float_up(cost.delta)


class BasicAccountant(PrivacyAccountant):
    """Sums (ε, δ) over every composed event (basic composition, valid under adaptivity).

    ``get_epsilon(delta)`` returns the exact sum Σε as ``estimate = upper`` when the δ asked is at
    least the summed Σδ, and ε = ∞ otherwise; ``lower`` is 0 (the sum bounds the true ε from above
    only, and can be far above it: 83 of 400 random cases in issue 25's audit). Basic composition
    gives one (ε, δ) pair and no trade-off (a smaller δ cannot be bought with a larger ε — use
    ``rdp`` or ``prv``, or the advanced composition theorem, for that). ``get_delta(epsilon)`` returns Σδ when
    ε ≥ Σε and 1 otherwise.
    """

    name = NAME

    def __init__(self) -> None:
        self._total = _ZERO

    def supports(self, event: DpEvent) -> bool:
        try:
            _cost(event)
        except UnsupportedEventError:
            return False
        return True

    def compose(self, event: DpEvent, count: int = 1) -> BasicAccountant:
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
            raise InvalidArgumentError("count", f"must be an integer in [0, 10^18]. Found {count!r}.")
        self._total = self._total + _cost(event).times(count)
        return self

    @property
    def epsilon_spent(self) -> float:
        """Σε so far, rounded up (∞ after a non-private event)."""
        return float_up(self._total.epsilon) if self._total.private else math.inf

    @property
    def delta_spent(self) -> float:
        """Σδ so far (capped at 1), rounded up."""
        return float_up(self._total.delta)

    def get_epsilon(self, delta: float) -> EpsilonBound:
        check_delta(delta)
        epsilon = self.epsilon_spent
        details = {"delta_spent": self.delta_spent}
        if Fraction(delta) < self._total.delta:
            note = (
                f"the delta asked ({delta!r}) is below the summed delta ({self.delta_spent!r}); "
                "basic composition gives no finite epsilon for it"
            )
            return EpsilonBound(0.0, math.inf, math.inf, delta, NAME, note, details)
        # ``lower`` is 0: the sum is an upper bound, and nothing is known below it (pure ε-DP
        # events may be far more private than their ε: ε₀ = 3e-6 × 558 292 at δ = 4e-6 sums to
        # 1.67, while the exact composition of ε₀-DP mechanisms is at most 0.0057).
        return EpsilonBound(0.0, epsilon, epsilon, delta, NAME, "", details)

    def get_delta(self, epsilon: float) -> float:
        check_epsilon(epsilon)
        if epsilon == math.inf:
            return 0.0
        if not self._total.private or Fraction(epsilon) < self._total.epsilon:
            return 1.0
        return self.delta_spent


__all__ = ["BasicAccountant", "epsilon_delta"]
