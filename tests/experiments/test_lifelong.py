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
    assert "eps_l2dp" in printed and "acc_agem*" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    rows = report["per_task"]
    assert len(rows) == 3
    assert report["claims"] == {
        "l2dp_ml_epsilon_constant": True,
        "heterogeneous_run_epsilon_unchanged": True,
        "naive_gaussian_epsilon_grows": True,
        "l2dp_ml_naive_sequential_epsilon_grows": True,
    }
    assert rows[0]["eps_l2dp"] == pytest.approx(report["budget"]["epsilon"], rel=1e-9)
    assert rows[-1]["naive_seq_eps_l2dp"] == pytest.approx(3 * rows[0]["eps_l2dp"], rel=1e-9)
    assert rows[-1]["eps_naiveG"] <= report["budget"]["epsilon"]
    for name in ("epsilon.png", "accuracy.png", "forgetting.png"):
        assert (tmp_path / name).stat().st_size > 1000
