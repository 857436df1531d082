"""Lifelong rule: a batch is perturbed once; replays of its committed noise cost nothing.

Theorem relied on: **L2DP-ML, Theorem 2** (Phan et al., lifelong DP): in Alg. 1/2 every batch of
the episodic memory is perturbed once, with one Laplace noise draw, and every later computation
on the perturbed batch — episodic-memory replays at later tasks, extra epochs, other task orders —
touches only the perturbed data, so it is **post-processing** (Dwork & Roth 2014, Prop. 2.1) and
the lifelong budget ε = ε1 + ε1/γx + ε1/γ + ε2 does not grow with the number of tasks (unlike
naive per-task composition, their Thm. 1). What one batch's perturbation costs is the event's
business: ``l2dp_ml_functional`` names its analysis (Thm. 2 as printed, or with the input term
re-derived as d·ε1/γx for per-record noise; docs/DESIGN-NOTES.md note 21), and the certificate's
``analyses`` says which was charged. This rule relies only on the replay argument.

The ledger records a batch's noise draw as a *noise commitment* (an opaque id) together with
the fingerprint (sha256 of the canonical JSON) of the event it was drawn for:

* the first charge on a batch with a commitment creates it and is costed as a fresh charge;
* a later charge with the same commitment and the same event is a replay of fixed, already
  released noise: it costs 0 (and counts in ``naive_epsilon``, which counts every charge);
* the same commitment with a different event is refused (``noise_commitment_mismatch``): the
  noise was drawn for another mechanism, so the replay claim is false;
* a replay of noise whose charge is reserved but not committed is refused
  (``noise_commitment_pending``): if that reservation were aborted the noise would have been
  used without ever being paid for;
* a new commitment (fresh noise) on a batch that already has one, or a charge without a
  commitment, is a new charge composed **sequentially** with the budget's accountant
  (``accountant.rules.sequential``: basic composition or the Rényi filter of Feldman & Zrnic
  2021, Thm. 3.1).

After a progressive commit the commitment's fingerprint is that of the run released so far
(only that output is free to replay); an abort with nothing committed removes the commitment.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import replace

from accountant.errors import InvalidArgumentError
from accountant.events import DpEvent
from accountant.exact import ZERO, exact_add, exact_sub
from accountant.rules.bookkeeping import progressive_cost
from accountant.rules.budget import Budget
from accountant.rules.errors import Amount, ChargeRefused
from accountant.rules.memo import event_fingerprint
from accountant.rules.naive import naive_price
from accountant.rules.sequential import (
    PARALLEL_OVER_BATCHES,
    THEOREMS,
    cancel_fresh,
    commit_fresh,
    remaining_fresh,
    reserve_fresh,
    within_budget_fresh,
)
from accountant.rules.sequential import (
    stated_theorem as sequential_theorem,
)
from accountant.rules.state import Admission, BatchState, Charge, Cost, NoiseCommitment, Settlement


def _index(state: BatchState, commitment: str) -> int:
    keys = [c.commitment for c in state.noise_commitments]
    return bisect_left(keys, commitment)


def find_commitment(state: BatchState, commitment: str) -> NoiseCommitment | None:
    """The batch's record of ``commitment`` (commitments are kept sorted: binary search)."""
    i = _index(state, commitment)
    entries = state.noise_commitments
    return entries[i] if i < len(entries) and entries[i].commitment == commitment else None


def _with(state: BatchState, entry: NoiseCommitment) -> BatchState:
    i = _index(state, entry.commitment)
    entries = list(state.noise_commitments)
    if i < len(entries) and entries[i].commitment == entry.commitment:
        entries[i] = entry
    else:
        entries.insert(i, entry)
    return replace(state, noise_commitments=tuple(entries))


def _without(state: BatchState, commitment: str) -> BatchState:
    return replace(
        state,
        noise_commitments=tuple(c for c in state.noise_commitments if c.commitment != commitment),
    )


def _replay_cost(budget: Budget, event: DpEvent, commitment: str | None) -> Cost:
    """A replay of committed noise is post-processing: ε = δ = 0; only the naive count grows."""
    naive = naive_price(budget, event)
    return Cost(ZERO, ZERO, naive, event_fingerprint(event), replay=True, noise_commitment=commitment)


def reserve(budget: Budget, state: BatchState, charge: Charge) -> Admission:
    commitment = charge.noise_commitment
    fingerprint = event_fingerprint(charge.event)
    if commitment is not None:
        entry = find_commitment(state, commitment)
        if entry is not None:
            if not entry.committed:
                raise ChargeRefused(
                    "noise_commitment_pending",
                    f"noise commitment {commitment!r} belongs to a reservation that is not "
                    "committed yet; its noise can be replayed once it has been released.",
                )
            if entry.fingerprint != fingerprint:
                raise ChargeRefused(
                    "noise_commitment_mismatch",
                    f"noise commitment {commitment!r} was drawn for another event "
                    f"({entry.fingerprint}); a replay must carry the same event. Use a new "
                    "commitment for fresh noise.",
                )
            cost = _replay_cost(budget, charge.event, commitment)
            return Admission(replace(state, reads=state.reads + 1), cost)
    admission = reserve_fresh(budget, state, charge.event, noise_commitment=commitment)
    if commitment is None:
        return admission
    created = _with(admission.state, NoiseCommitment(commitment, fingerprint, committed=False))
    return Admission(created, admission.cost)


def commit(
    budget: Budget,
    state: BatchState,
    charge: Charge,
    reserved: Cost,
    committed_before: Cost | None,
    partial_event: DpEvent | None,
) -> Settlement:
    if reserved.replay:
        now = progressive_cost(
            reserved,
            committed_before,
            partial_event,
            lambda partial: _replay_cost(budget, partial, reserved.noise_commitment),
        )
        before = ZERO if committed_before is None else committed_before.naive_epsilon
        step = exact_sub(now.naive_epsilon, before)
        return Settlement(replace(state, naive_epsilon=exact_add(state.naive_epsilon, step)), now)
    settlement = commit_fresh(budget, state, charge, reserved, committed_before, partial_event)
    commitment = reserved.noise_commitment
    if commitment is None:
        return settlement
    released = NoiseCommitment(commitment, settlement.committed.fingerprint, committed=True)
    return Settlement(_with(settlement.state, released), settlement.committed)


def cancel(budget: Budget, state: BatchState, reserved: Cost, committed: Cost | None) -> BatchState:
    if reserved.replay:
        if committed is not None:
            return state
        if state.reads < 1:
            raise InvalidArgumentError("state.reads", "has no reservation to cancel.")
        return replace(state, reads=state.reads - 1)
    released = cancel_fresh(budget, state, reserved, committed)
    if committed is None and reserved.noise_commitment is not None:
        # The noise was never released: the commitment goes with the reservation.
        return _without(released, reserved.noise_commitment)
    return released


def remaining(budget: Budget, state: BatchState) -> Amount:
    return remaining_fresh(budget, state)


def within_budget(budget: Budget, state: BatchState) -> bool:
    return within_budget_fresh(budget, state)


def theorem(budget: Budget) -> str:
    return (
        "Lifelong DP (L2DP-ML, Phan et al., Thm. 2): a batch perturbed once, its noise recorded "
        "as a noise commitment; replays of committed noise are post-processing (Dwork & Roth "
        "2014, Prop. 2.1) and cost 0; fresh noise is a new charge. "
        + THEOREMS[budget.accountant]
        + PARALLEL_OVER_BATCHES
    )


def stated_theorem(budget: Budget) -> str:
    """``theorem`` with the budget's own parameters (the fresh charges' filter and its δ split)."""
    return (
        "Lifelong DP (L2DP-ML, Phan et al., Thm. 2): a batch perturbed once, its noise recorded "
        "as a noise commitment; replays of committed noise are post-processing (Dwork & Roth "
        "2014, Prop. 2.1) and cost 0; fresh noise is a new charge. " + sequential_theorem(budget)
    )
