"""``ledger experiment lifelong --quick`` end to end: jobs behind the gate, report and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from service.cli import main

pytestmark = pytest.mark.slow


def _quick_lifelong(*args: str) -> int:
    """``ledger experiment lifelong --quick --device cpu ARGS`` in-process, torch on one thread
    (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["experiment", "lifelong", "--quick", "--device", "cpu", *args])
    finally:
        torch.set_num_threads(before)


def test_quick_lifelong_experiment_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _quick_lifelong(
        "--out", str(tmp_path / "out"), "--markdown", str(tmp_path / "doc" / "lifelong.md")
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "fm_multi" in printed and "joint*" in printed and "paper_l2dp" in printed
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [(r["tasks"], r["eps"]) for r in report["rows"]] == [("split", 1.0), ("permuted", 1.0)]
    for cell in report["claims"].values():
        # one batch's ε after every task; the multi-head job's reads were replays (free)
        assert cell["fm_epsilon_flat"] and cell["multi_head_replays_free"] and cell["naive_epsilon_grows"]
    for run in report["runs"]:
        assert run["fm_ledger_epsilon"][-1] <= 1.0 and run["naive_ledger_epsilon"][-1] <= 1.0
    assert report["paper"]["split"]["l2dp_ml"]["0.5"] == pytest.approx(0.7354)
    for name in ("epsilon.png", "accuracy.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
    # report.md: the same table in markdown under the machine and load that produced it, copied to
    # --markdown, with the done criterion read off each cell (one seed: no spread to compare with)
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "doc" / "lifelong.md").read_text() == markdown
    assert "- command: `ledger experiment lifelong (called in-process)`" in markdown
    assert "load average" in markdown and "CPU(s)" in markdown
    first = report["rows"][0]
    assert f"| split | 1 | {first['fm']} | {first['fm_multi']} | {first['naiveG']} |" in markdown
    margin = report["claims"]["split@1"]["margin_mean"]
    assert f"split@1: fm − naiveG = {margin:+.3f} ± 0.000 (one seed: no spread for 2 std)" in markdown
    assert "fm ledger ε flat over tasks: yes" in markdown


def test_quick_lifelong_experiment_on_the_synthetic_digits_at_a_chosen_size(tmp_path: Path) -> None:
    code = _quick_lifelong(
        "--out", str(tmp_path), "--sequences", "permuted", "--per-task", "60", "--batch-size", "60"
    )
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["per_task"] == 60
    assert report["sources"] == {"permuted": "builtin:permuted-synthetic-digits?tasks=2&per_task=60&seed=0"}
    [run] = report["runs"]
    # one ledger batch of 60 records per task: one release each, at the budget's ε, flat
    assert run["fm_ledger_epsilon"] == [pytest.approx(1.0, abs=1e-3)] * 2
    markdown = (tmp_path / "report.md").read_text()
    assert "the synthetic digits (60 records a task)" in markdown
    assert "the like-for-like comparison on permuted tasks is the shared head" in markdown
