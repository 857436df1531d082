"""Certificates: issued from a commit, verified offline from their own contents.

Any edited field fails ``verify``: without a new hash through the content hash; with a
recomputed hash through a recomputation for every field something is derived from or checked
against (costs, states after, result, theorem, plan ε, the budget check). Fields nothing derives
from (ids, release, library versions) are protected by the hash, which the service anchors in
its hash-chained audit log.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from accountant import events as ev
from accountant import rules as R
from accountant.certificates import (
    BatchSet,
    ClassRecord,
    batch_set_hash,
    check_batch_set,
    content_hash,
    issue,
    library_versions,
    verify,
)
from accountant.errors import InvalidArgumentError

DPSGD_STEP = ev.PoissonSampledEvent(0.01, ev.GaussianEvent(1.1))


def certify(
    budget: R.Budget,
    charge: R.Charge,
    states: list[R.BatchState],
    partial: ev.DpEvent | None = None,
) -> dict[str, Any]:
    """Reserve ``charge`` on every batch, commit it (or ``partial``) and certify the commit."""
    records = []
    for i, state in enumerate(states):  # one batch per state: class i is batch-i
        admission = R.reserve(budget, state, charge)
        settled = R.commit(budget, admission.state, charge, admission.cost, None, partial)
        records.append(
            ClassRecord(i, 1, state, admission.cost, admission.state, None, settled.state, settled.committed)
        )
    return issue(
        budget=budget, charge=charge, classes=records, batch_set=members_set(len(states)),
        reservation_id="res-1", release={"model": "m", "version": 3}, partial_event=partial,
        release_id="rel-1", dataset_id="ds-1", issued_at="2024-01-01T00:00:00Z",
    )  # fmt: skip


def members(count: int) -> list[tuple[str, int]]:
    return [(f"batch-{i}", i) for i in range(count)]


def members_set(count: int) -> BatchSet:
    return BatchSet(count, batch_set_hash(members(count)))


def as_version_2(cert: dict[str, Any]) -> dict[str, Any]:
    """The certificate as version 2 issued it: the fixed theorem text (``rules.theorem``), no
    ``guarantee`` or ``budget_share`` in its result; re-hashed."""
    old = copy.deepcopy(cert)
    old["theorem"] = R.theorem(R.Budget.from_json(old["inputs"]["budget"]))
    del old["result"]["guarantee"], old["result"]["budget_share"]
    old["version"] = 2
    old["hash"] = content_hash(old)
    return old


def as_version_1(cert: dict[str, Any]) -> dict[str, Any]:
    """The certificate as version 1 issued it: one record per batch (here, per class: each class
    is one batch), a levels map by batch id, no batch set; re-hashed."""
    old = as_version_2(cert)
    inputs = old["inputs"]
    inputs["batches"] = [
        {"batch_id": f"batch-{c.pop('class')}", **{k: v for k, v in c.items() if k != "batches"}}
        for c in inputs.pop("classes")
    ]
    del inputs["batch_set"]
    if "levels" in old["result"]:
        old["result"]["levels"] = {
            b["batch_id"]: lvl for b, lvl in zip(inputs["batches"], old["result"]["levels"], strict=True)
        }
    old["version"] = 1
    old["hash"] = content_hash(old)
    return old


def spent(budget: R.Budget, charge: R.Charge) -> R.BatchState:
    admission = R.reserve(budget, R.BatchState.empty(), charge)
    return R.commit(budget, admission.state, charge, admission.cost, None).state


def scenarios() -> dict[str, dict[str, Any]]:
    seq = R.Budget.create(rule="sequential", epsilon=1.0, delta=1e-5, accountant="basic")
    par = R.Budget.create(rule="parallel", epsilon=8.0, delta=1e-5, accountant="rdp")
    life = R.Budget.create(rule="lifelong", epsilon=2.0, delta=0, accountant="basic")
    geo = R.Budget.create(rule="geometric", epsilon=1.0, delta=0, accountant="basic")
    filt = R.Budget.create(rule="sequential", epsilon=4.0, delta=1e-5, accountant="rdp")
    plan = R.Budget.create(
        rule="sequential", epsilon=1.0, delta=1e-6, accountant="prv",
        plan=[ev.PureDpEvent(0.2), ev.PureDpEvent(0.3)],
    )  # fmt: skip
    memory = R.Charge(ev.PureDpEvent(0.5), "noise-0")
    dpsgd = R.Charge(ev.SelfComposedEvent(DPSGD_STEP, 500))
    return {
        "sequential-basic": certify(
            seq, R.Charge(ev.PureDpEvent(0.01)),
            [R.BatchState.empty(), spent(seq, R.Charge(ev.ApproxDpEvent(0.2, 1e-6)))],
        ),
        "parallel-rdp-progressive": certify(
            par, dpsgd, [R.BatchState.empty()], ev.SelfComposedEvent(DPSGD_STEP, 200)
        ),
        "lifelong-replay": certify(life, memory, [spent(life, memory)]),
        "geometric": certify(geo, R.Charge(ev.PureDpEvent(0.1)), [spent(geo, R.Charge(ev.PureDpEvent(0.1)))]),
        "sequential-rdp-filter": certify(filt, dpsgd, [spent(filt, dpsgd)]),
        "sequential-prv-plan": certify(plan, R.Charge(ev.PureDpEvent(0.3)),
                                       [spent(plan, R.Charge(ev.PureDpEvent(0.2)))]),
    }  # fmt: skip


SCENARIOS = scenarios()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_issued_certificates_verify_also_after_a_json_round_trip(name: str) -> None:
    cert = SCENARIOS[name]
    result = verify(cert)
    assert result.ok, result.reason
    assert verify(json.loads(json.dumps(cert))).ok
    assert cert["hash"] == content_hash(cert)
    assert cert["theorem"] == R.stated_theorem(R.Budget.from_json(cert["inputs"]["budget"]))
    assert set(cert["libraries"]) == {"numpy", "scipy", "prv-accountant", "privacy-ledger"}


def test_certificate_content() -> None:
    geo = SCENARIOS["geometric"]
    assert geo["result"]["infinite_horizon_bound"] == "1"
    assert geo["result"]["levels"] == [1]  # level 2 was used by the first 0.1
    assert geo["result"]["epsilon"] == "0.375"
    assert geo["result"]["naive_epsilon"] == "0.2"
    replay = SCENARIOS["lifelong-replay"]
    assert replay["inputs"]["classes"][0]["committed"]["replay"] is True
    assert replay["result"]["charge"]["epsilon"] == "0"
    seq = SCENARIOS["sequential-basic"]
    assert seq["result"]["epsilon"] == "0.21"
    assert seq["reservation_id"] == "res-1" and seq["release"] == {"model": "m", "version": 3}
    assert library_versions()["numpy"] != "not installed"


def test_issue_is_deterministic() -> None:
    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=0, accountant="basic")
    a = certify(budget, R.Charge(ev.PureDpEvent(0.1)), [R.BatchState.empty()])
    b = certify(budget, R.Charge(ev.PureDpEvent(0.1)), [R.BatchState.empty()])
    assert a == b


def leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from leaves(value, (*path, i))
    else:
        yield path, obj


def edited(cert: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(cert)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if value is None:
        return "x"
    if isinstance(value, str):
        try:
            return str(float(value) + 1) if value not in ("Infinity",) else "0"
        except ValueError:
            return value + "x"
    raise AssertionError(value)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_any_edited_field_fails_the_hash(name: str) -> None:
    cert = SCENARIOS[name]
    for path, value in leaves(cert):
        if path == ("hash",):
            continue
        result = verify(edited(cert, path, changed(value)))
        assert not result.ok, path
        assert "hash" in result.reason
    assert not verify({k: v for k, v in cert.items() if k != "hash"}).ok


DERIVED = ("reserved", "committed", "state_after")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_edits_with_a_recomputed_hash_fail_a_recomputation(name: str) -> None:
    cert = SCENARIOS[name]
    checked = 0
    for path, value in leaves(cert):
        derived = (
            path[:1] in (("result",), ("theorem",), ("rule",), ("accountant",))
            or (path[:2] == ("inputs", "classes") and path[3] in DERIVED)
            or path == ("inputs", "budget", "plan_epsilon")
        )
        if not derived or (path[-1] == "fingerprint" and value is None):
            continue
        forged = edited(cert, path, changed(value))
        forged["hash"] = content_hash(forged)
        result = verify(forged)
        assert not result.ok, path
        assert "hash" not in result.reason
        checked += 1
    assert checked > 10


def test_inputs_that_change_a_decision_fail_with_a_recomputed_hash() -> None:
    cert = SCENARIOS["sequential-basic"]
    for path, value in [
        (("inputs", "budget", "epsilon"), "0.1"),  # the state after no longer fits
        (("inputs", "classes", 1, "state_before", "epsilon_held"), "0"),  # no hold to commit
        (("inputs", "classes", 1, "batches"), 2),  # more batches than the batch set holds
        (("inputs", "batch_set", "count"), 3),
        (("inputs", "charge", "event", "epsilon"), 0.02),  # another charge, other costs
        (("inputs", "budget", "rule"), "parallel"),
    ]:
        forged = edited(cert, path, value)
        forged["hash"] = content_hash(forged)
        assert not verify(forged).ok, path


def test_issue_refuses_bad_arguments() -> None:
    from accountant.errors import InvalidArgumentError

    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=0, accountant="basic")
    with pytest.raises(InvalidArgumentError, match="classes"):
        issue(budget=budget, charge=R.Charge(ev.NoOpEvent()), classes=[], batch_set=members_set(0),
              reservation_id="r", release={})  # fmt: skip
    cert = certify(budget, R.Charge(ev.NoOpEvent()), [R.BatchState.empty()])
    record = ClassRecord.from_json(cert["inputs"]["classes"][0], "b")
    with pytest.raises(InvalidArgumentError, match="classes"):  # 1 batch in the classes, 2 in the set
        issue(budget=budget, charge=R.Charge(ev.NoOpEvent()), classes=[record], batch_set=members_set(2),
              reservation_id="r", release={})  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="release"):
        issue(budget=budget, charge=R.Charge(ev.NoOpEvent()), classes=[record], batch_set=members_set(1),
              reservation_id="r", release={"x": float("nan")})  # fmt: skip
    assert not verify("not a certificate").ok  # type: ignore[arg-type]


def _issued_before_pricing_versions() -> dict[str, dict[str, Any]]:
    """The scenarios as the ledger issued them before pricing versions were recorded: priced
    under version 1, without the ``pricing`` field (re-hashed)."""
    with R.pricing_version(1):
        old = {name: as_version_2(cert) for name, cert in scenarios().items()}
    for cert in old.values():
        del cert["pricing"]
        cert["hash"] = content_hash(cert)
    return old


def test_certificates_issued_before_an_upgrade_still_verify() -> None:
    """Pricing version 2 charges a parallel/rdp DP-SGD run on the accountant's full grid; a
    certificate issued under version 1 (the budget's grid) re-verifies under its own version, and
    does not under the new one (its numbers are the old ones)."""
    old = _issued_before_pricing_versions()
    for name, cert in old.items():
        assert verify(cert).ok, (name, verify(cert).reason)
    with R.pricing_version(2):
        new = as_version_2(scenarios()["parallel-rdp-progressive"])
    before = old["parallel-rdp-progressive"]
    assert new["pricing"] == 2 and verify(new).ok
    assert Decimal(new["result"]["epsilon"]) < Decimal(before["result"]["epsilon"])
    relabelled = {**before, "pricing": 2}
    relabelled["hash"] = content_hash(relabelled)
    assert not verify(relabelled).ok
    unknown = {**SCENARIOS["sequential-basic"], "pricing": R.PRICING_VERSIONS[-1] + 1}
    unknown["hash"] = content_hash(unknown)
    assert "unknown pricing version" in verify(unknown).reason


def test_a_certificate_issued_under_pricing_version_3_verifies_unchanged() -> None:
    """Pricing version 4 prices a charge that needs no filter by its tight ε (issue 25 §2): the
    parallel/rdp DP-SGD run costs less than version 3's RDP price. Every scenario issued under
    version 3 re-verifies byte for byte under its recorded version; relabelled 4 it does not."""
    with R.pricing_version(3):
        old = scenarios()
    for name, cert in old.items():
        assert cert["pricing"] == 3
        assert verify(cert).ok, (name, verify(cert).reason)
    new = SCENARIOS["parallel-rdp-progressive"]
    before = old["parallel-rdp-progressive"]
    assert new["pricing"] == R.PRICING_VERSION and verify(new).ok
    assert Decimal(new["result"]["epsilon"]) < Decimal(before["result"]["epsilon"])
    relabelled = {**before, "pricing": 4}
    relabelled["hash"] = content_hash(relabelled)
    assert not verify(relabelled).ok


def test_a_certificate_issued_under_pricing_version_4_verifies_unchanged() -> None:
    """Pricing version 5 prices a heterogeneous event (more than 4 distinct mechanisms) by
    composed pessimistic PLDs instead of PRV (issue 25 §4): every scenario issued under version 4
    re-verifies under it, and a heterogeneous parallel charge costs less under 5 than under 4 (so
    each version's certificates replay only under their own)."""
    with R.pricing_version(4):
        old = scenarios()
    for name, cert in old.items():
        assert cert["pricing"] == 4
        assert verify(cert).ok, (name, verify(cert).reason)
    mixed = ev.ComposedEvent(
        tuple(
            ev.SelfComposedEvent(ev.PoissonSampledEvent(0.01 + 0.002 * i, ev.GaussianEvent(1.0)), 30)
            for i in range(6)
        )
    )
    budget = R.Budget.create(rule="parallel", epsilon="10", delta="1e-5", accountant="rdp")
    with R.pricing_version(4):
        v4 = R.reserve(budget, R.BatchState.empty(), R.Charge(mixed)).cost.epsilon
    v5 = R.reserve(budget, R.BatchState.empty(), R.Charge(mixed)).cost.epsilon
    assert v5 < v4


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_version_1_certificates_one_record_per_batch_still_verify(name: str) -> None:
    old = as_version_1(SCENARIOS[name])
    assert verify(old).ok, verify(old).reason
    forged = copy.deepcopy(old)
    committed = forged["inputs"]["batches"][0]["committed"]
    committed["epsilon"] = changed(committed["epsilon"])
    forged["hash"] = content_hash(forged)
    assert not verify(forged).ok


def test_the_batch_list_is_checked_against_the_batch_set() -> None:
    cert = SCENARIOS["sequential-basic"]  # two classes of one batch each
    assert check_batch_set(cert, members(2)).ok
    assert not check_batch_set(cert, members(1)).ok  # one batch left out
    assert not check_batch_set(cert, [("batch-0", 0), ("batch-9", 1)]).ok  # another batch
    assert not check_batch_set(cert, [("batch-0", 1), ("batch-1", 0)]).ok  # classes swapped
    assert not check_batch_set(cert, [("batch-0", 0), ("batch-0", 0)]).ok  # repeated
    assert not check_batch_set(as_version_1(cert), members(2)).ok  # version 1 lists its batches


def test_a_class_counts_its_batches_once_each() -> None:
    """A class of 1000 batches in one state verifies with one replay, and says so."""
    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=0, accountant="basic")
    charge = R.Charge(ev.PureDpEvent(0.1))
    admission = R.reserve(budget, R.BatchState.empty(), charge)
    settled = R.commit(budget, admission.state, charge, admission.cost, None)
    record = ClassRecord(0, 1000, R.BatchState.empty(), admission.cost, admission.state, None,
                         settled.state, settled.committed)  # fmt: skip
    ids = [(f"b{i:04d}", 0) for i in range(1000)]
    cert = issue(budget=budget, charge=charge, classes=[record],
                 batch_set=BatchSet(1000, batch_set_hash(ids)), reservation_id="r", release={})  # fmt: skip
    assert verify(cert).ok and "1000 batch(es)" in verify(cert).reason
    assert check_batch_set(cert, ids).ok
    assert len(json.dumps(cert)) < 8000


def _rehashed(cert: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = {**copy.deepcopy(cert), **changes}
    out = {k: v for k, v in out.items() if v is not _DROP}
    out["hash"] = content_hash(out)
    return out


_DROP = object()


def test_an_aborted_reservations_certificate_names_no_release_and_verifies() -> None:
    """Issue 24 §2: an abort or expiry is a charge with a certificate and no release."""
    budget = R.Budget.create(rule="sequential", epsilon=1.0, delta=0, accountant="basic")
    charge = R.Charge(ev.PureDpEvent(0.4))
    admission = R.reserve(budget, R.BatchState.empty(), charge)
    settled = R.commit(budget, admission.state, charge, admission.cost, None)
    record = ClassRecord(
        0, 1, R.BatchState.empty(), admission.cost, admission.state, None, settled.state, settled.committed
    )
    for outcome in ("aborted", "expired"):
        cert = issue(
            budget=budget, charge=charge, classes=[record], batch_set=members_set(1),
            reservation_id="res-1", release=None, dataset_id="ds-1", outcome=outcome,
        )  # fmt: skip
        assert (cert["release"], cert["release_id"], cert["outcome"]) == (None, None, outcome)
        assert verify(cert).ok and cert["result"]["charge"]["epsilon"] == "0.4"
        # outcome and release must agree, even with a recomputed hash
        assert not verify(_rehashed(cert, release={"model": "m", "version": 1})).ok
        assert not verify(_rehashed(cert, outcome="released")).ok
        assert not verify(_rehashed(cert, release_id="rel-1")).ok
    assert not verify(_rehashed(SCENARIOS["sequential-basic"], release=None)).ok
    assert not verify(_rehashed(SCENARIOS["sequential-basic"], outcome="withdrawn")).ok
    for bad in ({"release": {"model": "m", "version": 1}, "outcome": "aborted"}, {"release": None}):
        with pytest.raises(InvalidArgumentError):
            issue(
                budget=budget, charge=charge, classes=[record], batch_set=members_set(1),
                reservation_id="res-1", **bad,
            )  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_certificates_issued_before_outcomes_still_verify(name: str) -> None:
    cert = SCENARIOS[name]
    assert cert["outcome"] == "released"
    old = _rehashed(cert, outcome=_DROP)
    assert "outcome" not in old
    result = verify(old)
    assert result.ok, result.reason
