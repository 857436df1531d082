"""``ledger experiment lifelong --quick`` end to end: jobs behind the gate, report and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from service.cli import main

pytestmark = pytest.mark.slow


def test_quick_lifelong_experiment_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["experiment", "lifelong", "--quick", "--out", str(tmp_path), "--device", "cpu"])
    finally:
        torch.set_num_threads(before)
    assert code == 0
    printed = capsys.readouterr().out
    assert "fm_multi" in printed and "joint*" in printed and "paper_l2dp" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["tasks"], r["eps"]) for r in report["rows"]] == [("split", 1.0), ("permuted", 1.0)]
    for cell in report["claims"].values():
        # one batch's ε after every task; the multi-head job's reads were replays (free)
        assert cell["fm_epsilon_flat"] and cell["multi_head_replays_free"] and cell["naive_epsilon_grows"]
    for run in report["runs"]:
        assert run["fm_ledger_epsilon"][-1] <= 1.0 and run["naive_ledger_epsilon"][-1] <= 1.0
    assert report["paper"]["split"]["l2dp_ml"]["0.5"] == pytest.approx(0.7354)
    for name in ("epsilon.png", "accuracy.png"):
        assert (tmp_path / name).stat().st_size > 1000
