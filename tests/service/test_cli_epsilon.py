"""``ledger epsilon``: the console entry point, good and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

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
    assert out["epsilon"] == {"lower": 0.75, "estimate": 0.75, "upper": 0.75}
    assert out["method"] == "basic"
    code, out, _ = _run(capsys, "--event", '{"kind": "non_private"}', "--delta", "1e-5")
    assert code == 0 and out is not None
    assert out["epsilon"]["upper"] == "Infinity"


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
