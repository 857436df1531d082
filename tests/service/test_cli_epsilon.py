"""``ledger epsilon``: the console entry point, good and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from accountant.events import GaussianEvent, PoissonSampledEvent, SelfComposedEvent
from service.cli import main
from service.client import LedgerClient
from service.db.session import Database
from service.ledger import tenancy
from tests.service.live_server import serve, settings_for

ROOT = Path(__file__).resolve().parents[2]
DP_SGD = ["--noise-multiplier", "1.1", "--sampling-probability", "0.004", "--steps", "14060"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any] | None, str]:
    code = main(["epsilon", *argv])
    captured = capsys.readouterr()
    payload = json.loads(captured.out) if code == 0 else None
    if code != 0:
        assert captured.out == ""
    return code, payload, captured.err


@pytest.mark.slow
def test_real_console_entry_point_prints_json() -> None:
    # The module entry point as a user runs it (``ledger`` is ``service.cli:main``).
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "epsilon", *DP_SGD, "--delta", "1e-5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"epsilon", "delta", "accountant", "method", "note"}
    assert out["accountant"] == "rdp"  # the documented default
    eps = out["epsilon"]
    assert 0 <= eps["lower"] <= eps["estimate"] <= eps["upper"] < 10
    assert out["delta"] == 1e-5


def test_shorthand_equals_the_event_form(capsys: pytest.CaptureFixture[str]) -> None:
    event = {
        "kind": "self_composed",
        "count": 14060,
        "event": {
            "kind": "poisson_sampled",
            "sampling_probability": 0.004,
            "event": {"kind": "gaussian", "noise_multiplier": 1.1},
        },
    }
    code, short, _ = _run(capsys, *DP_SGD, "--delta", "1e-5")
    assert code == 0 and short is not None
    code, full, _ = _run(capsys, "--event", json.dumps(event), "--delta", "1e-5")
    assert code == 0 and full is not None
    assert short["epsilon"] == full["epsilon"]
    assert full["event"] == event


def test_opacus_golden_value_with_prv(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        "--noise-multiplier",
        "1.5",
        "--sampling-probability",
        "0.04",
        "--steps",
        "2250",
        "--delta",
        "1e-5",
        "--accountant",
        "prv",
    )
    assert code == 0 and out is not None
    assert out["method"] == "prv"
    assert out["epsilon"]["upper"] == pytest.approx(6.777, abs=0.01)
    assert out["epsilon"]["upper"] >= 6.769


def test_basic_accountant_and_infinity_as_a_string(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys,
        "--event",
        '{"kind": "composed", "events": [{"kind": "laplace", "scale": 2.0},'
        ' {"kind": "pure_dp", "epsilon": 0.25}]}',
        "--delta",
        "0",
        "--accountant",
        "basic",
    )
    assert code == 0 and out is not None
    # lower is a real lower bound: 0 (issue 25: the sum was reported as one and lay above exact
    # upper bounds); δ = 0, so the tight bound is basic composition's too.
    assert out["epsilon"] == {"lower": 0.0, "estimate": 0.75, "upper": 0.75}
    assert out["method"] == "basic"
    assert out["tight"]["upper"] == 0.75
    code, out, _ = _run(capsys, "--event", '{"kind": "non_private"}', "--delta", "1e-5")
    assert code == 0 and out is not None
    assert out["epsilon"]["upper"] == "Infinity"


def test_rdp_is_reported_with_the_tight_bound_beside_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25: at tiny q and δ RDP is valid but 293x the tight value (0.544 vs 0.0019); the
    answer keeps the named accountant's number and reports the tight one, saying which is which.
    The tight value is checked against dp-accounting's pessimistic PLD on a fine grid."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    argv = ["--noise-multiplier", "1.18", "--sampling-probability", "4.3e-5", "--steps", "33"]
    code, out, _ = _run(capsys, *argv, "--delta", "5.6e-9")
    assert code == 0 and out is not None
    assert out["accountant"] == "rdp" and out["epsilon"]["upper"] > 0.5
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(4.3e-5, dp_accounting.GaussianDpEvent(1.18)), 33
    )
    pld = PLDAccountant(value_discretization_interval=1e-5).compose(event).get_epsilon(5.6e-9)
    assert out["tight"]["upper"] <= 1.02 * pld
    assert out["tight"]["method"] == "pld" and "named accountant" in out["tight"]["note"]


def test_prv_fallback_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    event = (
        '{"kind": "self_composed", "count": 100, "event": {"kind": "sampled_without_replacement",'
        ' "sample_size": 600, "population_size": 60000,'
        ' "event": {"kind": "gaussian", "noise_multiplier": 1.0}}}'
    )
    code, out, _ = _run(capsys, "--event", event, "--delta", "1e-5", "--accountant", "prv")
    assert code == 0 and out is not None
    assert out["method"] == "rdp-fallback"
    assert "sampled_without_replacement" in out["note"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (
            ["--event", '{"kind": "gaussian", "noise_multiplier": "x"}', "--delta", "1e-5"],
            "event.noise_multiplier",
        ),
        (
            [
                "--event",
                '{"kind": "poisson_sampled", "sampling_probability": 1.5, "event": '
                '{"kind": "gaussian", "noise_multiplier": 1.0}}',
                "--delta",
                "1e-5",
            ],
            "event.sampling_probability",
        ),
        (["--event", "{not json", "--delta", "1e-5"], "--event"),
        (["--event", '{"kind": "nope"}', "--delta", "1e-5"], "event.kind"),
        ([*DP_SGD, "--delta", "nan"], "--delta"),
        ([*DP_SGD, "--delta", "1.5"], "--delta"),
        ([*DP_SGD, "--delta", "abc"], "--delta"),
        (["--noise-multiplier", "1.1", "--steps", "10", "--delta", "1e-5"], "--sampling-probability"),
        (
            ["--noise-multiplier", "-1", "--sampling-probability", "0.1", "--steps", "10", "--delta", "1e-5"],
            "--noise-multiplier",
        ),
        (
            ["--noise-multiplier", "1", "--sampling-probability", "0", "--steps", "10", "--delta", "1e-5"],
            "--sampling-probability",
        ),
        (
            ["--noise-multiplier", "1", "--sampling-probability", "0.1", "--steps", "0", "--delta", "1e-5"],
            "--steps",
        ),
        (
            ["--noise-multiplier", "1", "--sampling-probability", "0.1", "--steps", "2.5", "--delta", "1e-5"],
            "--steps",
        ),
        ([*DP_SGD, "--event", '{"kind": "no_op"}', "--delta", "1e-5"], "--event"),
        (["--delta", "1e-5"], "--event"),
        ([*DP_SGD], "--delta"),
        ([*DP_SGD, "--delta", "1e-5", "--accountant", "moments"], "--accountant"),
        (
            [
                "--event",
                '{"kind": "gaussian", "noise_multiplier": 1.0}',
                "--delta",
                "1e-5",
                "--accountant",
                "basic",
            ],
            "gaussian",
        ),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: str
) -> None:
    try:
        code = main(["epsilon", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert names in captured.err


@pytest.fixture
def quoting(database_url: URL, db: Database, tmp_path: Path) -> Iterator[tuple[str, str, str, LedgerClient]]:
    """A running server with a sequential/rdp dataset of ε = 8: (url, viewer key, dataset, admin)."""
    admin_key = tenancy.create_api_key(db, "acme", "admin")
    viewer_key = tenancy.create_api_key(db, "acme", "viewer")
    with (
        serve(settings_for(database_url, tmp_path / "artifacts"), db) as url,
        LedgerClient(url, admin_key) as client,
    ):
        dataset = client.create_dataset("d", rule="sequential", epsilon="8", delta="1e-5", accountant="rdp")
        yield url, viewer_key, dataset["id"], client


def test_dataset_prices_on_the_datasets_own_budget(
    quoting: tuple[str, str, str, LedgerClient], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--dataset``: the server's quote (a Rényi filter budget charges more than plain RDP at the
    same δ, and that is the number to calibrate to); nothing is held."""
    url, viewer_key, dataset_id, client = quoting
    run = ("--noise-multiplier", "1.0", "--sampling-probability", "0.01", "--steps", "2000")
    # Issue 25: a quote names what it prices; without --batch or --new-batch it is refused.
    code, quoted, err = _run(capsys, *run, "--dataset", dataset_id, "--url", url, "--key", viewer_key)
    assert code == 2 and quoted is None and "--new-batch" in err
    code, quoted, err = _run(
        capsys, *run, "--dataset", dataset_id, "--url", url, "--key", viewer_key, "--new-batch"
    )
    assert code == 0, err
    assert quoted is not None and quoted["admitted"] is True and quoted["on"] == "new_batch"
    code, plain, _ = _run(capsys, *run, "--delta", "1e-5")
    assert plain is not None
    assert plain["epsilon"]["upper"] < float(quoted["cost"]["epsilon"]) <= 8
    assert client.spend(dataset_id)["epsilon_spent"] == "0"
    code, _, err = _run(
        capsys, *run, "--dataset", dataset_id, "--url", url, "--key", viewer_key, "--delta", "1e-5"
    )
    assert code == 2 and "--delta" in err
    code, _, err = _run(capsys, *run, "--dataset", "nope", "--url", url, "--key", viewer_key, "--new-batch")
    assert code == 2 and "--dataset" in err


@pytest.mark.slow
def test_calibrate_finds_the_noise_the_dataset_charges_at_most_the_target_for(
    quoting: tuple[str, str, str, LedgerClient],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28 §9, the real console command in a subprocess: ``ledger calibrate`` prints σ and
    the dataset's charge for it (at most the target; one grid step less charges more), on every
    task of the dataset by default, on ``--new-batch`` on request; nothing is held. The other
    runs call the same ``main`` in this process (a subprocess each paid ~5 s of imports)."""
    url, viewer_key, dataset_id, client = quoting
    task = client.create_task(dataset_id, "t")
    client.create_batches(dataset_id, task["id"], [{"name": "b", "records": ["r1", "r2"]}])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LEDGER_URL": url, "LEDGER_API_KEY": viewer_key}
    run = [
        "--dataset",
        dataset_id,
        "--target-epsilon",
        "2",
        "--sampling-probability",
        "0.01",
        "--steps",
        "1000",
    ]

    def console(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "service.cli", "calibrate", *run, *extra]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    def calibrate(*extra: str) -> subprocess.CompletedProcess[str]:
        monkeypatch.setenv("LEDGER_URL", url)
        monkeypatch.setenv("LEDGER_API_KEY", viewer_key)
        capsys.readouterr()
        try:
            code = main(["calibrate", *run, *extra])
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code if isinstance(exit_.code, int) else 2
        out = capsys.readouterr()
        return subprocess.CompletedProcess(extra, code, out.out, out.err)

    done = console()
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    sigma = answer["noise_multiplier"]
    assert answer["on"] == "tasks" and answer["admitted"] is True
    assert Decimal(answer["charge"]["epsilon"]) <= 2
    assert answer["run_epsilon"] < float(answer["charge"]["epsilon"])  # the filter charges more
    finer = SelfComposedEvent(PoissonSampledEvent(0.01, GaussianEvent(round(sigma - 1e-4, 4))), 1000)
    assert Decimal(client.quote(dataset_id, finer, tasks=[task["id"]])["cost"]["epsilon"]) > 2
    fresh = json.loads(calibrate("--new-batch", "--dataset", "d").stdout)  # by name (issue 28 §6)
    assert fresh["dataset_id"] == dataset_id
    assert fresh["on"] == "new_batch" and fresh["noise_multiplier"] == sigma  # nothing spent yet
    unknown = calibrate("--dataset", "no-such-dataset")
    assert unknown.returncode == 2 and "'no-such-dataset'" in unknown.stderr
    assert client.spend(dataset_id)["epsilon_held"] == "0"

    unreachable = calibrate("--target-epsilon", "1e-9")
    assert unreachable.returncode == 2 and unreachable.stderr.startswith("ledger calibrate: --target-epsilon")
    bad = calibrate("--sampling-probability", "1.5")
    assert bad.returncode == 2 and "--sampling-probability must be in (0, 1]" in bad.stderr


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        (["--target-epsilon", "0"], "--target-epsilon"),
        (["--target-epsilon", "inf"], "--target-epsilon"),
        (["--sampling-probability", "1.5"], "--sampling-probability"),
        (["--sampling-probability", "0"], "--sampling-probability"),
        (["--steps", "0"], "--steps"),
        (["--url", ""], "--url"),
    ],
)
def test_calibrate_refuses_bad_options_before_it_connects(
    capsys: pytest.CaptureFixture[str], bad: list[str], names: str
) -> None:
    """``ledger calibrate`` in this process (the fast loop's run of the command; the end-to-end
    test above is slow): each bad option exits 2 naming it, before any request (the URL is one
    no server answers, so a request would fail otherwise)."""
    good = {
        "--dataset": "d",
        "--target-epsilon": "1",
        "--sampling-probability": "0.01",
        "--steps": "100",
        "--url": "http://127.0.0.1:9",
        "--key": "k",
    }
    good.update(dict(zip(bad[::2], bad[1::2], strict=True)))
    code = main(["calibrate", *[part for option in good.items() for part in option]])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.startswith("ledger calibrate: ") and names in captured.err
