"""The contract every accountant keeps (basic, rdp, prv): one abstract class, one subclass each.

* a no-op event costs 0; a non-private event gives ε = ∞ (not an exception);
* a nested unsupported event raises ``UnsupportedEventError`` naming the innermost kind, and
  leaves the accountant unchanged;
* ``supports`` agrees with ``compose`` on every example event;
* ε is monotone in the count; lower ≤ estimate ≤ upper.
"""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import pytest

from accountant import events as ev
from accountant.base import EpsilonBound, PrivacyAccountant
from accountant.errors import UnsupportedEventError
from accountant.registry import make_accountant

GAUSSIAN = ev.GaussianEvent(noise_multiplier=1.2)
SAMPLED = ev.PoissonSampledEvent(sampling_probability=0.01, event=ev.GaussianEvent(1.0))
L2DP = ev.FunctionalMechanismL2DPEvent(
    epsilon1=0.1,
    epsilon2=0.05,
    input_dim=10,
    hidden_units=4,
    output_hidden_units=3,
    batch_size=5,
    theta1_norm_bound=1.0,
)

# One of every kind (and a few nestings); each accountant supports a subset of them.
EXAMPLES: list[ev.DpEvent] = [
    ev.NoOpEvent(),
    ev.NonPrivateEvent(),
    GAUSSIAN,
    ev.LaplaceEvent(scale=4.0),
    ev.PureDpEvent(epsilon=0.2),
    ev.ApproxDpEvent(epsilon=0.2, delta=1e-7),
    ev.ApproxDpEvent(epsilon=0.2, delta=0.0),
    SAMPLED,
    ev.PoissonSampledEvent(sampling_probability=0.1, event=ev.LaplaceEvent(1.0)),
    ev.SampledWithoutReplacementEvent(sample_size=60, population_size=6000, event=GAUSSIAN),
    ev.SelfComposedEvent(event=SAMPLED, count=100),
    ev.ComposedEvent(events=(ev.PureDpEvent(0.1), ev.LaplaceEvent(10.0))),
    ev.ComposedEvent(events=(GAUSSIAN, SAMPLED)),
    L2DP,
    ev.OutputPerturbationEvent(l2_sensitivity=0.1, epsilon=0.3),
    ev.AdaptiveGaussianEvent(noise_multiplier=1.5, sensitivities=(0.5, 0.5), noise_stddevs=(1.1, 1.1)),
    ev.PoissonSampledEvent(sampling_probability=0.02, event=ev.AdaptiveGaussianEvent(noise_multiplier=1.0)),
]


class AccountantContract:
    """Abstract contract test; subclasses set the accountant and their own example events."""

    name: ClassVar[str]
    finite_event: ClassVar[ev.DpEvent]
    nested_unsupported: ClassVar[ev.DpEvent]
    innermost_kind: ClassVar[str]
    deltas: ClassVar[tuple[float, ...]] = (1e-5, 1e-8)

    def make(self) -> PrivacyAccountant:
        return make_accountant(self.name)

    def bound(self, event: ev.DpEvent, count: int = 1, delta: float = 1e-5) -> EpsilonBound:
        return self.make().compose(event, count).get_epsilon(delta)

    def test_registered_under_its_name(self) -> None:
        assert self.make().name == self.name

    def test_nothing_composed_costs_zero(self) -> None:
        assert self.make().get_epsilon(1e-5).upper == 0.0

    def test_no_op_costs_zero(self) -> None:
        bound = self.bound(ev.NoOpEvent(), count=10**18)
        assert bound.upper == bound.estimate == bound.lower == 0.0
        with_no_op = self.make().compose(self.finite_event).compose(ev.NoOpEvent(), 1000)
        assert with_no_op.get_epsilon(1e-5).upper == self.bound(self.finite_event).upper

    def test_non_private_is_infinite_not_an_exception(self) -> None:
        assert self.bound(ev.NonPrivateEvent()).upper == math.inf
        mixed = ev.ComposedEvent(events=(self.finite_event, ev.NonPrivateEvent()))
        assert self.bound(mixed).upper == math.inf
        assert self.make().compose(mixed).get_delta(1.0) == 1.0

    def test_nested_unsupported_event_names_the_innermost_kind(self) -> None:
        accountant = self.make().compose(self.finite_event)
        before = accountant.get_epsilon(1e-5).upper
        assert not accountant.supports(self.nested_unsupported)
        with pytest.raises(UnsupportedEventError) as info:
            accountant.compose(self.nested_unsupported)
        assert info.value.event.kind == self.innermost_kind
        assert repr(self.innermost_kind) in str(info.value)
        assert accountant.get_epsilon(1e-5).upper == before  # unchanged

    @pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: e.kind)
    def test_supports_agrees_with_compose(self, event: ev.DpEvent) -> None:
        accountant = self.make()
        supported = accountant.supports(event)
        try:
            accountant.compose(event)
        except UnsupportedEventError:
            composed = False
        else:
            composed = True
        assert supported == composed
        if composed:
            bound = accountant.get_epsilon(1e-5)
            assert bound.lower <= bound.estimate <= bound.upper

    def test_monotone_in_count(self) -> None:
        uppers = [self.bound(self.finite_event, count).upper for count in (1, 3, 10, 100)]
        assert all(a <= b for a, b in itertools.pairwise(uppers)), uppers
        assert uppers[0] > 0

    def test_bounds_are_ordered(self) -> None:
        for count in (1, 50):
            for delta in self.deltas:
                bound = self.bound(self.finite_event, count, delta)
                assert 0 <= bound.lower <= bound.estimate <= bound.upper < math.inf
                assert bound.delta == delta

    def test_get_delta_is_consistent_with_get_epsilon(self) -> None:
        accountant = self.make().compose(self.finite_event, 20)
        upper = accountant.get_epsilon(1e-5).upper
        assert accountant.get_delta(upper) <= 1e-5 * 1.05
        assert accountant.get_delta(upper / 2) >= accountant.get_delta(upper)
        assert accountant.get_delta(math.inf) == 0.0


class TestBasicContract(AccountantContract):
    name = "basic"
    finite_event = ev.PureDpEvent(epsilon=0.3)
    nested_unsupported = ev.ComposedEvent(
        events=(ev.PureDpEvent(0.1), ev.SelfComposedEvent(ev.PoissonSampledEvent(0.1, GAUSSIAN), 5))
    )
    innermost_kind = "gaussian"


class TestRdpContract(AccountantContract):
    name = "rdp"
    finite_event = SAMPLED
    nested_unsupported = ev.ComposedEvent(
        events=(GAUSSIAN, ev.SelfComposedEvent(ev.ApproxDpEvent(epsilon=1.0, delta=1e-6), 3))
    )
    innermost_kind = "approx_dp"


class TestPrvContract(AccountantContract):
    name = "prv"
    finite_event = SAMPLED
    # No PRV for Poisson sampling of an (ε, δ) event, and no RDP either: the innermost is approx_dp.
    nested_unsupported = ev.ComposedEvent(
        events=(
            GAUSSIAN,
            ev.SelfComposedEvent(ev.PoissonSampledEvent(0.1, ev.ApproxDpEvent(1.0, 1e-6)), 3),
        )
    )
    innermost_kind = "approx_dp"
