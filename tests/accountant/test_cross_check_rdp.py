"""Cross-check of accountant.rdp against dp-accounting on a sparse grid of DP-SGD settings.

* Against ``dp_accounting.rdp.RdpAccountant`` (default orders; improved conversion on both
  sides): ours is never more than 1 % above theirs. Ours may be far below where dp-accounting
  gives up on fractional orders (its series stops after 1000 terms and drops the order), e.g.
  q = 0.5 with σ = 4.
* Against ``dp_accounting.pld.PLDAccountant`` (pessimistic estimate, an upper bound close to the
  true ε): ours is never below it. RDP is an upper bound on the true ε, so a value below a
  pessimistic PLD (beyond its discretisation) would mean an under-report. The discretisation
  interval is chosen per point, fine enough that the PLD value is within ~1 % of the true ε, or
  else a coarse PLD would be the one above RDP (e.g. 0.045 at interval 1e-2 against a true 0.011).

Grid: q from 1e-3 to 1, σ from 0.6 to 4, steps 1 to 10^4, δ 1e-5 and 1e-6.
"""

from __future__ import annotations

import itertools

import pytest
from dp_accounting import dp_event as dpa_event  # type: ignore[import-untyped]
from dp_accounting.pld import pld_privacy_accountant as dpa_pld  # type: ignore[import-untyped]
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp  # type: ignore[import-untyped]

from accountant import events as ev
from accountant.rdp import RdpAccountant
from tests.conftest import fast_loop_sample

PROBABILITIES = [1e-3, 1e-2, 0.1, 0.5, 1.0]
NOISE = [0.6, 1.0, 2.0, 4.0]
STEPS = [1, 100, 10_000]
DELTAS = [1e-5, 1e-6]


def ours(q: float, sigma: float, steps: int, delta: float) -> float:
    event = ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma))
    return RdpAccountant().compose(event, steps).get_epsilon(delta).upper


def theirs_event(q: float, sigma: float) -> dpa_event.DpEvent:
    gaussian = dpa_event.GaussianDpEvent(sigma)
    return gaussian if q == 1.0 else dpa_event.PoissonSampledDpEvent(q, gaussian)


@pytest.mark.parametrize(
    ("q", "sigma"), fast_loop_sample(list(itertools.product(PROBABILITIES, NOISE)), keep=4)
)
def test_never_more_than_one_percent_above_dp_accounting_rdp(q: float, sigma: float) -> None:
    for steps in STEPS:
        accountant = dpa_rdp.RdpAccountant()  # dp-accounting's default orders
        accountant.compose(theirs_event(q, sigma), steps)
        for delta in DELTAS:
            reference = accountant.get_epsilon(delta)
            assert ours(q, sigma, steps, delta) <= 1.01 * reference, (q, sigma, steps, delta)


# (q, σ, steps, δ, PLD value discretisation interval): a few points per regime; 10^4 steps only
# with a coarse interval where ε is large (the interval is then well under 1 % of ε).
PLD_POINTS = [
    (1.0, 4.530877117, 1, 1e-6, 1e-4),  # dp-accounting's (1, 1e-6) Gaussian: tight ε = 0.927
    (1.0, 0.6, 1, 1e-5, 1e-3),
    (0.1, 1.0, 1, 1e-6, 1e-4),
    (1e-3, 4.0, 100, 1e-5, 1e-4),
    (1e-2, 2.0, 100, 1e-6, 1e-4),
    (0.5, 0.6, 100, 1e-5, 1e-3),
    (0.1, 4.0, 100, 1e-6, 1e-4),
    (1e-3, 0.6, 10_000, 1e-5, 1e-3),
    (1e-2, 1.0, 10_000, 1e-6, 1e-3),
    (0.1, 2.0, 10_000, 1e-5, 1e-2),
    (0.5, 4.0, 10_000, 1e-6, 1e-2),
]


@pytest.mark.parametrize(("q", "sigma", "steps", "delta", "interval"), fast_loop_sample(PLD_POINTS))
def test_never_below_dp_accounting_pessimistic_pld(
    q: float, sigma: float, steps: int, delta: float, interval: float
) -> None:
    accountant = dpa_pld.PLDAccountant(value_discretization_interval=interval)
    accountant.compose(theirs_event(q, sigma), steps)
    pld = accountant.get_epsilon(delta)
    rdp = ours(q, sigma, steps, delta)
    assert rdp >= pld, (q, sigma, steps, delta, rdp, pld)
    # Sanity of the reference: RDP's slack over the near-tight PLD value stays moderate.
    assert rdp <= 2.5 * pld + 0.05
