"""``examples/opacus_release.py`` end to end, with tiny sizes: a real ``ledger serve`` subprocess
(SQLite in a temporary folder, no worker, a free port, a bootstrap admin key), a dataset whose
batches are the ``builtin:digits`` training record ids, and the example run (its ``main``; a
subprocess where a package is hidden from it). The first run reserves, trains with Opacus,
commits and saves a checkpoint holding a certificate that re-verifies; the second is refused by
the budget before it loads any data and writes nothing."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

from accountant.certificates import verify
from service.cli import main as ledger_main
from service.client import LedgerClient
from service.training.data import load_data
from tests.service.api.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "opacus_release.py"

pytest.importorskip("opacus", reason="the Opacus example needs opacus (the dev extra installs it)")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    served = start_server(
        f"sqlite:///{tmp_path / 'ledger.db'}", env={"LEDGER_ARTIFACT_DIR": str(tmp_path / "artifacts")}
    )
    try:
        yield served
    finally:
        stop_server(served.process)


def _example_module() -> ModuleType:
    name = "opacus_release_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def run_example(
    server: Server, dataset_id: str, output: Path, *noise: str, shadow: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The example with its key from the environment, as in CI: its ``main`` called in this
    process (each subprocess paid ~5 s of torch and Opacus imports; the example is the same code
    either way), or, with ``shadow`` (a folder put first on its path, to hide a package), as a
    subprocess."""
    args = [
        "--url", server.base_url, "--dataset", dataset_id,
        *noise, "--epochs", "1", "--expected-batch-size", "256", "--output-dir", str(output),
    ]  # fmt: skip
    if shadow is None:
        out, err = io.StringIO(), io.StringIO()
        with (
            mock.patch.dict(os.environ, {"LEDGER_API_KEY": server.admin_key}),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            code = _example_module().main(args)
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), str(ROOT)])
    env["LEDGER_API_KEY"] = server.admin_key
    command = [sys.executable, str(EXAMPLE), *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_release_through_the_gate_then_refused_before_touching_data(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record_ids = load_data("builtin:digits").record_ids
    with LedgerClient(server.base_url, server.admin_key) as admin:
        # RDP filter budget: one run at sigma 2.3318 (q = 1/6, 6 steps) costs ~1.17; two ~1.53
        dataset = admin.create_dataset(
            "digits", rule="sequential", epsilon="1.2", delta="1e-5", accountant="rdp"
        )
        task = admin.create_task(dataset["id"], "all digits")
        admin.create_batches(
            dataset["id"],
            task["id"],
            [{"name": f"b{i}", "records": list(record_ids[i::4])} for i in range(4)],
        )
        output = tmp_path / "checkpoints"

        first = run_example(server, dataset["id"], output, "--noise-multiplier", "2.3318")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "loading data" in first.stdout
        released = json.loads(first.stdout.strip().splitlines()[-1])
        checkpoint = Path(released["checkpoint"])
        assert checkpoint.is_file() and checkpoint.parent == output
        assert released["released"] == {"model": "opacus-digits", "version": "1"}
        # What it prints says what each number is: the filter's guarantee, and a budget share.
        assert released["guarantee"] == {"epsilon": "1.2", "delta": "0.00001"} and "epsilon" not in released
        assert 0 < float(released["budget_share"]["epsilon"]) <= 1.2

        import torch

        saved = torch.load(checkpoint, weights_only=False)
        assert verify(saved["certificate"]["certificate"]).ok
        assert saved["certificate"]["id"] == released["certificate_id"]
        assert set(saved["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        stored = admin.get_certificate(released["certificate_id"])
        assert stored["certificate"] == saved["certificate"]["certificate"]
        assert stored["certificate"]["inputs"]["charge"]["event"]["event"]["kind"] == "poisson_sampled"
        spent = admin.spend(dataset["id"])["epsilon_spent"]
        assert 1 < float(spent) <= 1.2

        # the same run again, sigma calibrated this time: over budget, refused before any data
        second = run_example(server, dataset["id"], output, "--target-epsilon", "1.0")
        assert second.returncode == 3, second.stdout + second.stderr
        assert "refused by the ledger before training (budget_exceeded)" in second.stdout
        assert "loading data" not in second.stdout
        assert sorted(p.name for p in output.iterdir()) == [checkpoint.name]
        after = admin.spend(dataset["id"])
        assert after["epsilon_spent"] == spent and after["reservations_open"] == 0

        # the weights are registered under the certificate: version, DP statement, model card
        version = admin.get_model_version("opacus-digits", 1)
        assert version["origin"] == "external" and version["certificate_id"] == released["certificate_id"]
        assert version["dp_statement"]["guarantee"]["epsilon"] == "1.2"
        weights = admin.download_artifact("opacus-digits", 1).content
        assert set(torch.load(io.BytesIO(weights), weights_only=True)) == set(saved["state_dict"])
        assert ledger_main(["model-card", "--url", server.base_url, "--key", server.admin_key,
                            "opacus-digits", "1"]) == 0  # fmt: skip
        assert released["certificate_id"] in capsys.readouterr().out

        # and the CI gate agrees with what was released
        assert ledger_main(["check", "--url", server.base_url, "--key", server.admin_key,
                            "--dataset", dataset["id"], "--model", "opacus-digits"]) == 0  # fmt: skip
        assert "result: PASS" in capsys.readouterr().out

        # Issue 24 §3: --target-epsilon 1.2 is the run's own ε (at the budget's δ), as
        # Opacus means it; the budget's Rényi filter charges that run more than 1.2, so it is
        # refused before any data is read, naming the largest --target-epsilon that fits.
        def fresh_dataset(name: str) -> str:
            made = admin.create_dataset(
                name, rule="sequential", epsilon="1.2", delta="1e-5", accountant="rdp"
            )
            task = admin.create_task(made["id"], "all digits")
            admin.create_batches(
                made["id"],
                task["id"],
                [{"name": f"b{i}", "records": list(record_ids[i::4])} for i in range(4)],
            )
            return str(made["id"])

        fresh = fresh_dataset("digits-2")
        too_big = run_example(server, fresh, tmp_path / "third", "--target-epsilon", "1.2", "--model", "own")
        assert too_big.returncode == 3, too_big.stdout + too_big.stderr
        assert "loading data" not in too_big.stdout
        assert admin.spend(fresh)["reservations_open"] == 0
        named = re.search(r"the largest that fits is (\d+\.\d+)\. No data was read", too_big.stdout)
        assert named is not None, too_big.stdout
        largest = float(named.group(1))
        assert 0.9 < largest < 1.2
        # That target runs; the run's own ε by the ledger's engine meets it (issue 25 §3), and
        # Opacus's PRV accountant, a looser upper bound of the same run, is at most 2% above ours.
        own = run_example(
            server, fresh, tmp_path / "third", "--target-epsilon", str(largest), "--model", "own"
        )
        assert own.returncode == 0, own.stdout + own.stderr
        released = json.loads(own.stdout.strip().splitlines()[-1])
        ours, theirs = released["run_epsilon"]["ledger_tight"], released["run_epsilon"]["opacus_prv"]
        assert ours <= largest and ours <= theirs <= ours * 1.02
        assert ours < float(released["budget_share"]["epsilon"]) <= 1.2  # the filter charges the run more

        # The separate option: calibrated to what the dataset charges (its own quote), the run
        # fits and spends at most the budget.
        budget = fresh_dataset("digits-3")
        third = run_example(
            server, budget, tmp_path / "fourth", "--target-budget-epsilon", "1.2", "--model", "calibrated"
        )
        assert third.returncode == 0, third.stdout + third.stderr
        assert 1.1 < float(admin.spend(budget)["epsilon_spent"]) <= 1.2


def test_without_opacus_nothing_is_reserved(server: Server, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "opacus"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("opacus is hidden by the test")\n')
    with LedgerClient(server.base_url, server.admin_key) as admin:
        dataset = admin.create_dataset("d", rule="sequential", epsilon="1.2", delta="1e-5", accountant="rdp")
        task = admin.create_task(dataset["id"], "t")
        admin.create_batches(dataset["id"], task["id"], [{"name": "b", "records": ["digits-0000"]}])
        run = run_example(
            server, dataset["id"], tmp_path / "out", "--noise-multiplier", "2", shadow=shadow.parent
        )
        assert run.returncode == 2, run.stdout + run.stderr
        assert "opacus not installed" in run.stderr and "nothing was reserved" in run.stderr
        spend = admin.spend(dataset["id"])
        assert spend["reservations_open"] == 0 and float(spend["epsilon_held"]) == 0
        assert list(admin.iter_certificates(dataset["id"])) == []
