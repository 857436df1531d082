"""Progressive commits are the reserved run cut short, each extending the last (issue 13 §1).

The audit's attacks, over HTTP on both databases: each was accepted and certified less privacy
loss than what ran; each is now a 409 naming the reason, and the ledger's spend is what ran.
"""

from __future__ import annotations

from typing import Any

from tests.service.api.conftest import Keys, TestClient
from tests.service.api.test_ledger_over_http import Api


def _steps(n: int) -> dict[str, Any]:
    return {"kind": "self_composed", "count": n, "event": {"kind": "pure_dp", "epsilon": 0.001}}


def test_a_replay_cannot_commit_fresh_noise(client: TestClient, keys: Keys) -> None:
    """Lifelong ε = 1.5: pure ε = 1 committed with commitment c; then five free replays of c, each
    committing ``laplace(scale 1)`` as "the run so far" and aborting. Before: all accepted, the
    ledger said 1.0 while 6.0 ran. Now each such commit is refused and nothing more is spent."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "lifelong", "epsilon": "1.5", "delta": "0", "accountant": "basic"}
    dataset, batches = admin.dataset(budget)
    event = {"kind": "pure_dp", "epsilon": 1}
    first = trainer.reserve(dataset, batches, event, noise_commitment="c").json()
    trainer.commit(first["id"])
    for _ in range(5):
        replay = trainer.reserve(dataset, batches, event, noise_commitment="c").json()
        assert replay["cost"]["epsilon"] == "0"
        refused = trainer.commit(replay["id"], status=409, event={"kind": "laplace", "scale": 1}).json()
        assert refused["error"] == "commit_not_prefix" and "laplace" in refused["message"]
        trainer.call("POST", f"/v1/reservations/{replay['id']}/abort", status=200)
    assert admin.spend(dataset)["epsilon_spent"] == "1"
    # A true replay (the reserved event itself, or no event) is still free.
    replay = trainer.reserve(dataset, batches, event, noise_commitment="c").json()
    trainer.commit(replay["id"], event=event)
    assert admin.spend(dataset)["epsilon_spent"] == "1"


def test_a_declared_prv_plan_entry_cannot_be_swapped_at_commit(client: TestClient, keys: Keys) -> None:
    """Plan [G(1), G(1)], ε = 6.6: reserve G then commit ``pure_dp(4.3)`` as what ran. Before:
    accepted, 6.583 certified while the true ε(1e-5) was 8.67. Now 409, and the plan proceeds
    with what it declared."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    gaussian = {"kind": "gaussian", "noise_multiplier": 1}
    budget = {
        "rule": "sequential",
        "epsilon": "6.6",
        "delta": "1e-5",
        "accountant": "prv",
        "plan": [gaussian, gaussian],
    }
    dataset, batches = admin.dataset(budget)
    held = trainer.reserve(dataset, batches, gaussian).json()
    refused = trainer.commit(held["id"], status=409, event={"kind": "pure_dp", "epsilon": 4.3}).json()
    assert refused["error"] == "commit_not_prefix"
    trainer.call("POST", f"/v1/reservations/{held['id']}/abort", status=200)
    # The aborted entry could have run: it is charged as the plan's first entry (issue 24 §2),
    # and from its first entry a plan segment is charged its whole ε (pricing 3, issue 24 §4: the
    # prefix's ε is no guarantee when where a run stops may depend on what it saw).
    first = float(admin.spend(dataset)["epsilon_spent"])
    assert 6.5 < first <= 6.6  # the plan's PRV ε, 6.583
    held = trainer.reserve(dataset, batches, gaussian).json()
    trainer.commit(held["id"])
    assert float(admin.spend(dataset)["epsilon_spent"]) == first  # the rest of the plan adds nothing


def test_each_progressive_commit_extends_the_last(client: TestClient, keys: Keys) -> None:
    """Checkpoints of one run: 300 steps, then an *earlier* checkpoint (200 steps: not the same
    run further along) is refused, 400 steps and the whole run are accepted; unrelated events and
    more steps than reserved are refused. The spend is the run's."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "sequential", "epsilon": "1", "delta": "0", "accountant": "basic"}
    dataset, batches = admin.dataset(budget)
    held = trainer.reserve(dataset, batches, _steps(500)).json()
    trainer.commit(held["id"], event=_steps(300))
    refused = trainer.commit(held["id"], status=409, event=_steps(200)).json()
    assert refused["error"] == "commit_does_not_extend"
    for other in (_steps(501), {"kind": "pure_dp", "epsilon": 0.1}):
        assert trainer.commit(held["id"], status=409, event=other).json()["error"] == "commit_not_prefix"
    trainer.commit(held["id"], event=_steps(400))
    assert admin.spend(dataset)["epsilon_spent"] == "0.4"
    trainer.commit(held["id"])
    assert admin.spend(dataset)["epsilon_spent"] == "0.5"
    reservation = trainer.call("GET", f"/v1/reservations/{held['id']}", status=200).json()
    assert reservation["status"] == "committed" and reservation["commits"] == 3


def test_a_checkpoint_commit_on_the_default_tight_budget(client: TestClient, keys: Keys) -> None:
    """A DP-SGD run's checkpoints on a ``tight`` budget (the default): the first charge fixes the
    batch's focus order, so its reservation is priced on a grid the state *at reserve* does not
    have yet. The checkpoint commit was a 500 (its price computed outside the lock on that
    earlier state) and left the worker's job running; now it settles, and the whole run after it."""
    admin, trainer = Api(client, keys.get("acme", "admin")), Api(client, keys.get("acme", "trainer"))
    budget = {"rule": "sequential", "epsilon": "8", "delta": "1e-5", "accountant": "tight"}
    dataset, batches = admin.dataset(budget)

    def sgd(steps: int) -> dict[str, Any]:
        subsampled = {"kind": "poisson_sampled", "sampling_probability": 0.04,
                      "event": {"kind": "gaussian", "noise_multiplier": 1.0}}  # fmt: skip
        return {"kind": "self_composed", "count": steps, "event": subsampled}

    held = trainer.reserve(dataset, batches, sgd(60)).json()
    half = trainer.commit(held["id"], event=sgd(30)).json()
    whole = trainer.commit(held["id"]).json()
    spent = float(admin.spend(dataset)["epsilon_spent"])
    assert 0 < float(half["reservation"]["committed"]["epsilon"]) <= spent
    assert spent == float(whole["reservation"]["committed"]["epsilon"]) <= 8
