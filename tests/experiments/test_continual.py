"""``ledger experiment continual --quick`` end to end: six jobs behind the gate of a real SQLite
ledger, the report's guarantees checked release by release, plots and the printed table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from service.cli import main

pytestmark = pytest.mark.slow


def test_quick_continual_experiment_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["experiment", "continual", "--quick", "--out", str(tmp_path), "--blocks", "16", "--epsilon", "1.5"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "max_eps" in printed and "acc_nonprivate" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    runs = report["runs"]
    assert [(r["mode"], r["sampling"]) for r in runs] == [
        (mode, sampling)
        for mode in ("multi_resolution", "cumulative", "sliding_window")
        for sampling in (False, True)
    ]
    for run in runs:
        assert run["status"] == "succeeded"
        assert run["never_exceeded"] and run["level_mismatches"] == []
        trajectory = run["epsilon_trajectory"]
        assert len(trajectory) == run["releases"]
        assert trajectory == sorted(trajectory) and 0 < trajectory[-1] <= 1.5
        assert float(run["ledger_epsilon"]) == pytest.approx(trajectory[-1], rel=1e-12)
        for point in run["accuracy"]:
            assert 0.0 <= point["private"] <= 1.0 and 0.5 < point["nonprivate"] <= 1.0
    by_mode = {(r["mode"], r["sampling"]): r for r in runs}
    # 16 blocks: Algorithm 2 releases 16 + 8 + 4 + 2 + 1 models, Algorithm 4 one per block, the
    # sliding window (w = 7) from t = 7 on.
    assert by_mode["multi_resolution", False]["releases"] == 31
    assert (
        by_mode["cumulative", False]["releases"]
        == by_mode["cumulative", False]["releases_for_inference"]
        == 16
    )
    assert by_mode["sliding_window", False]["releases_for_inference"] == 16 - 7 + 1
    # Block 0 is read at every resolution: ε(1/2 + 1/4 + ... + 1/32).
    assert float(by_mode["multi_resolution", False]["ledger_epsilon"]) == pytest.approx(1.5 * (1 - 2**-5))
    for name in ("epsilon.png", "accuracy.png"):
        assert (tmp_path / name).stat().st_size > 1000
