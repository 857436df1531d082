"""The Opacus adapter (``service.integrations.opacus``) with real Opacus and a real ledger over
HTTP (uvicorn on the test's SQLite file): the event is read from what Opacus built, plain
samplers are refused, and ``make_private_with_epsilon`` calibrates on the dataset's quote and
reserves before the first record is read."""

from __future__ import annotations

import itertools
import secrets
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opacus", reason="the Opacus adapter needs opacus (the dev extra installs it)")

import torch
from dp_accounting.pld import privacy_loss_distribution
from opacus import PrivacyEngine
from opacus.accountants.utils import get_noise_multiplier
from opacus.optimizers import AdaClipDPOptimizer
from sqlalchemy.engine import URL

from accountant import events as ev
from accountant.calibration import tight_epsilon
from accountant.certificates import verify
from accountant.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from accountant.registry import make_accountant
from service.client import BudgetExceeded, LedgerClient
from service.db.session import Database
from service.integrations.opacus import UndescribedRun, event_from_opacus, make_private_with_epsilon
from service.ledger import tenancy
from tests.service.live_server import serve, settings_for

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus: secure RNG, empty batches
# The gate's calls run on SQLite (tests/service/test_client.py runs every call on both backends).
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])

RECORDS = 200
BATCH = 20  # q = 1/10, 10 steps per epoch


class CountedRecords(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Records that count how often they are read: the gate must reserve before the first."""

    def __init__(self, n: int = RECORDS, held: Callable[[], float] | None = None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = (self.x[:, 0] > 0).long()
        self.reads = 0
        self.held = held  # the ledger's held epsilon, asked at the first read
        self.held_at_first_read: float | None = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reads == 0 and self.held is not None:
            self.held_at_first_read = self.held()
        self.reads += 1
        return self.x[i], self.y[i]


def _trainable(records: CountedRecords, **loader: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    module = torch.nn.Linear(4, 2)
    return (
        module,
        torch.optim.SGD(module.parameters(), lr=0.1),
        torch.utils.data.DataLoader(records, **loader),
    )


def _train(run: Any, steps: int | None = None, loader: Any = None) -> int:
    """One private step per batch drawn from ``loader`` (default: the gate's ``run.data_loader``),
    stopping after ``steps`` without drawing another batch."""
    done = 0
    for x, y in itertools.islice(run.data_loader if loader is None else loader, steps):
        run.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(run.module(x), y).backward()
        run.optimizer.step()
        done += 1
    return done


def test_the_event_is_what_opacus_built_and_its_epsilon_is_opacus_s() -> None:
    records = CountedRecords()
    module, optimizer, loader = _trainable(records, batch_size=BATCH)
    engine = PrivacyEngine()  # Opacus >= 1.5: the PRV accountant by default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, optimizer, loader = engine.make_private(
            module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=1.3, max_grad_norm=1.0
        )
    event = event_from_opacus(optimizer, loader, epochs=2)
    assert event == SelfComposedEvent(PoissonSampledEvent(0.1, GaussianEvent(1.3)), 20)
    run = type("Run", (), {"data_loader": loader, "optimizer": optimizer, "module": module})
    assert _train(run) == 10
    # One epoch as Opacus accounted it (its PRV accountant's upper bound) and as the ledger's
    # prv accountant prices the adapter's event: two implementations of Gopi et al. 2021 on
    # their own grids, both at eps_error 0.01, agree to 2e-9 (measured); 1e-6 leaves the grids room.
    ours = make_accountant("prv")
    ours.compose(event_from_opacus(optimizer, loader, epochs=1), 1)
    assert ours.get_epsilon(1e-5).upper == pytest.approx(engine.get_epsilon(1e-5), rel=1e-6)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_plain_data_loader_is_refused_naming_its_sampler(shuffle: bool) -> None:
    module, optimizer, loader = _trainable(CountedRecords(), batch_size=BATCH, shuffle=shuffle)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, optimizer, loader = PrivacyEngine().make_private(
            module=module,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.3,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    with pytest.raises(UndescribedRun) as refused:
        event_from_opacus(optimizer, loader, epochs=1)
    sampler = "RandomSampler" if shuffle else "SequentialSampler"
    assert f"BatchSampler({sampler})" in str(refused.value)
    assert "#813" in str(refused.value) and "poisson_sampling=True" in str(refused.value)


def test_optimizers_that_are_not_one_gaussian_step_are_refused() -> None:
    module, optimizer, loader = _trainable(CountedRecords(), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, private, loader = PrivacyEngine().make_private(
            module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=1.3, max_grad_norm=1.0
        )
    with pytest.raises(UndescribedRun, match="optimizer is a SGD"):
        event_from_opacus(optimizer, loader, epochs=1)  # the torch optimizer: no noise at all
    adaptive = AdaClipDPOptimizer(
        torch.optim.SGD(module.parameters(), lr=0.1),
        noise_multiplier=1.3,
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.1,
        unclipped_num_std=1.0,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
    )
    with pytest.raises(UndescribedRun, match="AdaClipDPOptimizer"):
        event_from_opacus(adaptive, loader, epochs=1)
    for epochs in (0, 1.5, True):
        with pytest.raises(UndescribedRun, match="epochs must be an integer"):
            event_from_opacus(private, loader, epochs=epochs)  # type: ignore[arg-type]
    private.noise_multiplier = 0.0
    with pytest.raises(UndescribedRun, match="noise_multiplier must be finite and > 0"):
        event_from_opacus(private, loader, epochs=1)


# ---------------------------------------------------------------------------------------------
# The gate, against a real ledger
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ledger(database_url: URL, db: Database, tmp_path: Path) -> Iterator[LedgerClient]:
    key = tenancy.create_api_key(db, "acme", "admin")
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, key) as client,
    ):
        yield client


def _dataset(ledger: LedgerClient, epsilon: str = "2", records: int = RECORDS) -> tuple[str, str]:
    dataset = ledger.create_dataset(
        f"opacus-{secrets.token_hex(4)}", rule="sequential", epsilon=epsilon, delta="1e-5", accountant="rdp"
    )
    task = ledger.create_task(dataset["id"], "all")
    per = records // 4
    ledger.create_batches(
        dataset["id"],
        task["id"],
        [{"name": f"b{i}", "records": [f"r{j}" for j in range(i * per, (i + 1) * per)]} for i in range(4)],
    )
    return dataset["id"], task["id"]


def _gate(
    ledger: LedgerClient,
    dataset_id: str,
    records: CountedRecords,
    engine: PrivacyEngine | None = None,
    **changes: Any,
) -> Any:
    module, optimizer, loader = _trainable(records, batch_size=BATCH)
    arguments: dict[str, Any] = {
        "dataset_id": dataset_id,
        "module": module,
        "optimizer": optimizer,
        "data_loader": loader,
        "target_epsilon": 1.0,
        "epochs": 1,
        "max_grad_norm": 1.0,
        "model": "linear",
        "version": "1",
        **changes,
    }
    return make_private_with_epsilon(ledger, engine or PrivacyEngine(accountant="rdp"), **arguments)


@SQLITE_ONLY
def test_the_gate_calibrates_on_the_quote_reserves_before_reading_and_commits(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    records = CountedRecords(held=lambda: float(ledger.spend(dataset_id)["epsilon_held"]))
    with _gate(ledger, dataset_id, records) as run:
        # the first record was read (by make_private, for its shapes) with the cost already held
        assert records.held_at_first_read == float(run.gate.cost["epsilon"]) > 0
        assert ledger.get_reservation(run.gate.reservation_id)["status"] == "reserved"
        step = run.event.event
        sigma, q = step.event.noise_multiplier, step.sampling_probability
        assert (q, run.event.count) == (0.1, 10)
        assert run.charging_for.startswith(
            f"10 DP-SGD steps, each the Gaussian mechanism with noise multiplier {sigma}"
        )
        assert _train(run) == 10
    assert records.reads > 0
    certificate = run.certificate
    assert certificate is not None and run.gate.status == "committed"
    assert certificate["certificate"]["release"] == {"model": "linear", "version": "1"}
    # target_epsilon is the run's own ε at the budget's δ, as Opacus means it, by the engine the
    # ledger prices a run alone with (issue 25 §3): σ is the smallest on the grid whose price
    # meets 1.0, at most the σ of Opacus's PRV calibration (its upper bound is looser) and within
    # 2% of it; the price is a valid bound (dp-accounting's optimistic PLD is below it).
    lower = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(round(sigma - 1e-4, 4))), 10)
    assert tight_epsilon(run.event, 1e-5) <= 1.0 < tight_epsilon(lower, 1e-5)
    optimistic = (
        privacy_loss_distribution.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            value_discretization_interval=1e-3,
            pessimistic_estimate=False,
            use_connect_dots=False,
        )
        .self_compose(10)
        .get_epsilon_for_delta(1e-5)
    )
    assert optimistic <= tight_epsilon(run.event, 1e-5)
    theirs = get_noise_multiplier(
        target_epsilon=1.0,
        target_delta=1e-5,
        sample_rate=q,
        steps=10,
        accountant="prv",
        epsilon_tolerance=0.001,
    )
    assert theirs * 0.98 <= sigma <= theirs * 1.002
    assert 1.0 < float(ledger.spend(dataset_id)["epsilon_spent"]) <= 2.0


@SQLITE_ONLY
def test_target_budget_epsilon_calibrates_on_the_datasets_quote(ledger: LedgerClient) -> None:
    """The separate option, named apart: σ such that the dataset *charges* at most the target."""
    dataset_id, _ = _dataset(ledger)
    with _gate(ledger, dataset_id, CountedRecords(), target_epsilon=None, target_budget_epsilon=1.0) as run:
        step = run.event.event
        sigma, q = step.event.noise_multiplier, step.sampling_probability
        assert _train(run) == 10
    assert run.certificate is not None and float(ledger.spend(dataset_id)["epsilon_spent"]) <= 1.0
    # σ is the one of the dataset's quote (on a twin with nothing spent): it fits the target,
    # one grid step less does not; Opacus's own RDP σ for ε = 1 would be smaller still.
    twin, twin_task = _dataset(ledger)
    lower = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(round(sigma - 1e-4, 4))), 10)
    assert float(ledger.quote(twin, run.event, tasks=[twin_task])["cost"]["epsilon"]) <= 1.0
    assert float(ledger.quote(twin, lower, tasks=[twin_task])["cost"]["epsilon"]) > 1.0
    with pytest.raises(ValueError, match="exactly one of target_epsilon"):
        with _gate(ledger, dataset_id, CountedRecords(), target_budget_epsilon=1.0):
            raise AssertionError("the block must not run")


@SQLITE_ONLY
def test_a_run_stopped_early_commits_the_steps_opacus_ran(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    with _gate(ledger, dataset_id, CountedRecords()) as run:
        assert _train(run, steps=4) == 4
    assert run.certificate is not None
    certified = run.certificate["certificate"]
    assert ev.from_json(certified["inputs"]["partial_event"]) == SelfComposedEvent(run.event.event, 4)
    assert verify(certified).ok
    assert float(certified["result"]["epsilon"]) < float(run.gate.cost["epsilon"])
    # The release certifies the 4 steps it trained on; the rest could have run in the trainer's
    # process, which the ledger cannot see: its abort charges it (issue 24 §2).
    spend = ledger.spend(dataset_id)
    assert (spend["epsilon_held"], spend["epsilon_spent"]) == ("0", run.gate.cost["epsilon"])


@SQLITE_ONLY
def test_more_steps_than_reserved_release_nothing(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    with pytest.raises(UndescribedRun, match="Opacus ran 20 steps, the ledger reserved 10"):
        with _gate(ledger, dataset_id, CountedRecords()) as run:
            _train(run)
            _train(run)  # a second epoch nobody reserved
    assert run.certificate is None and run.gate.status == "aborted"
    spend = ledger.spend(dataset_id)  # nothing released, everything reserved charged
    assert (spend["epsilon_spent"], spend["epsilon_held"]) == (run.gate.cost["epsilon"], "0")


@SQLITE_ONLY
def test_refused_by_the_budget_before_a_record_is_read(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger, epsilon="0.5")
    records = CountedRecords()
    with pytest.raises(BudgetExceeded) as refused, _gate(ledger, dataset_id, records):
        raise AssertionError("the block must not run")
    assert records.reads == 0 and ledger.spend(dataset_id)["reservations_open"] == 0
    # The refusal names the largest target_epsilon that fits; that one runs.
    largest = refused.value.largest_target_epsilon
    assert largest is not None and 0 < largest < 0.5
    assert refused.value.details["field"] == "target_epsilon" and f"{largest}" in refused.value.message
    with _gate(ledger, dataset_id, records, target_epsilon=largest) as run:
        assert _train(run) == 10
    assert run.certificate is not None and float(ledger.spend(dataset_id)["epsilon_spent"]) <= 0.5
    assert tight_epsilon(run.event, 1e-5) <= largest


@SQLITE_ONLY
def test_a_loader_over_other_records_is_refused_before_reserving(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    records = CountedRecords(RECORDS + 1)
    with pytest.raises(UndescribedRun, match="holds 201 records but the charged batches"):
        with _gate(ledger, dataset_id, records):
            raise AssertionError("the block must not run")
    assert records.reads == 0
    assert ledger.spend(dataset_id)["reservations_open"] == 0


@SQLITE_ONLY
def test_a_noise_multiplier_changed_in_the_run_releases_nothing(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    with pytest.raises(UndescribedRun, match=r"Opacus ran steps with noise_multiplier=0\.5"):
        with _gate(ledger, dataset_id, CountedRecords()) as run:
            _train(run, steps=3)
            run.optimizer.noise_multiplier = 0.5  # less noise than reserved
            _train(run, steps=3)
    assert run.certificate is None and run.gate.status == "aborted"
    assert ledger.spend(dataset_id)["epsilon_spent"] == run.gate.cost["epsilon"]  # charged, not released


@SQLITE_ONLY
def test_an_engine_that_accounted_other_steps_is_refused(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    engine = PrivacyEngine(accountant="rdp")
    engine.accountant.step(noise_multiplier=1.0, sample_rate=0.1)  # an earlier run's step
    records = CountedRecords()
    with pytest.raises(UndescribedRun, match="make a new PrivacyEngine per release"):
        with _gate(ledger, dataset_id, records, engine):
            raise AssertionError("the block must not run")
    assert records.reads == 0 and ledger.spend(dataset_id)["reservations_open"] == 0


def _charged_and_unreleased(ledger: LedgerClient, dataset_id: str, run: Any) -> None:
    """The refused run released nothing and was charged everything it reserved."""
    assert run.certificate is None and run.gate.status == "aborted"
    spend = ledger.spend(dataset_id)
    assert (spend["epsilon_spent"], spend["epsilon_held"], spend["last_release"]) == (
        run.gate.cost["epsilon"],
        "0",
        None,
    )
    (charged,) = ledger.list_certificates(dataset_id)["data"]
    assert (charged["outcome"], charged["release"]) == ("aborted", None)
    assert verify(charged["certificate"]).ok


@SQLITE_ONLY
def test_iterating_the_original_shuffled_loader_is_refused_and_charged(ledger: LedgerClient) -> None:
    """Issue 24 §2: training on the original shuffled loader instead of ``run.data_loader``.
    Opacus's accountant records 10 Poisson steps that never sampled as Poisson; before, the gate
    committed ε ≈ 1.0 for them and released the model. Now 0 batches drawn ≠ 10 steps: refused."""
    dataset_id, _ = _dataset(ledger)
    records = CountedRecords()
    shuffled = torch.utils.data.DataLoader(records, batch_size=BATCH, shuffle=True)
    with pytest.raises(UndescribedRun, match=r"0 batch\(es\) were drawn from run.data_loader but .* took 10"):
        with _gate(ledger, dataset_id, records) as run:
            assert _train(run, loader=shuffled) == 10
    assert run.engine.accountant.history  # Opacus did account the steps
    _charged_and_unreleased(ledger, dataset_id, run)


@SQLITE_ONLY
def test_a_batch_drawn_without_a_private_step_is_refused_and_charged(ledger: LedgerClient) -> None:
    dataset_id, _ = _dataset(ledger)
    with pytest.raises(UndescribedRun, match=r"10 batch\(es\) were drawn .* took 9 private step"):
        with _gate(ledger, dataset_id, CountedRecords()) as run:
            batches = iter(run.data_loader)
            looked_at = next(batches)  # a batch drawn and looked at, with no private step
            assert looked_at[0].shape[1] == 4
            _train(run, loader=batches)
    _charged_and_unreleased(ledger, dataset_id, run)


@SQLITE_ONLY
def test_the_gate_renews_its_hold_while_training_draws_batches(ledger: LedgerClient) -> None:
    """Issue 28 §2: the adapter had no ``ttl_s`` and a run longer than the hold ended in
    ``409 reservation_expired``. Now a run longer than its ``ttl_s`` renews the hold as it draws
    batches (each renewal audited) and commits."""
    dataset_id, _ = _dataset(ledger)
    with _gate(ledger, dataset_id, CountedRecords(), ttl_s=1.0) as run:
        assert run.gate.ttl_s == pytest.approx(1.0, abs=0.01)
        for x, y in run.data_loader:  # 10 steps over ~1.6 s: past the first expiry
            time.sleep(0.16)
            run.optimizer.zero_grad()
            torch.nn.functional.cross_entropy(run.module(x), y).backward()
            run.optimizer.step()
    assert run.gate.status == "committed" and run.certificate is not None
    renewals = [e for e in ledger.iter_audit_entries(dataset_id) if e["event_type"] == "reservation.extended"]
    assert renewals and {e["payload"]["reservation_id"] for e in renewals} == {run.gate.reservation_id}
