"""``ledger experiment pretrained --quick`` end to end: four algorithms as jobs behind the gate
of an embedded SQLite ledger, the JSON report, the PNG plots and the printed table."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from service.cli import main
from service.experiments.pretrained import _config, average_accuracy, average_forgetting


def test_metrics_follow_eq_a4_to_a6() -> None:
    matrix = [[1.0], [0.8, 0.9], [0.5, 0.7, 1.0]]
    assert average_accuracy(matrix) == pytest.approx((0.5 + 0.7 + 1.0) / 3)
    # task 1: max(1.0, 0.8) − 0.5; task 2: 0.9 − 0.7
    assert average_forgetting(matrix) == pytest.approx(((1.0 - 0.5) + (0.9 - 0.7)) / 2)
    assert average_forgetting([[0.7]]) is None


def _args(*argv: str) -> object:
    import argparse

    from service.commands.experiment import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["experiment", "pretrained", *argv])


def test_public_classes_pretrain_on_classes_the_tasks_never_hold() -> None:
    config = _config(_args("--public-classes", "4", "--feature-dim", "64"))  # type: ignore[arg-type]
    # 6 private classes (4…9): the default 5 tasks fit
    assert config["source"] == "builtin:split-digits?tasks=5&seed=0&public_classes=4"
    assert config["feature_dims"] == [64] and config["public"] == 0
    capped = _config(_args("--public-classes", "5", "--tasks", "2", "--public", "300"))  # type: ignore[arg-type]
    assert capped["source"] == "builtin:split-digits?tasks=2&seed=0&public_classes=5&public=300"
    with pytest.raises(SystemExit, match="--tasks must be in \\[2, 5\\]"):
        _config(_args("--public-classes", "5", "--tasks", "6"))  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="bundled digits only"):
        _config(_args("--public-classes", "4", "--per-task", "100"))  # type: ignore[arg-type]


def test_feature_dim_takes_a_list_of_widths_and_seeds_name_the_repeats() -> None:
    config = _config(_args("--feature-dim", "32,64, 128", "--seeds", "5"))  # type: ignore[arg-type]
    assert config["feature_dims"] == [32, 64, 128] and config["repeats"] == 5
    assert _config(_args())["feature_dims"] == [None]  # type: ignore[arg-type]
    assert _config(_args("--repeats", "2"))["repeats"] == 2  # type: ignore[arg-type]
    for bad in ("64,x", "1", "64,64", "5000"):
        with pytest.raises(SystemExit, match="--feature-dim"):
            _config(_args("--feature-dim", bad))  # type: ignore[arg-type]


@pytest.mark.slow
def test_quick_pretrained_experiment_writes_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(
            [
                "experiment",
                "pretrained",
                "--quick",
                "--tasks",
                "2",
                "--epsilons",
                "8",
                "--out",
                str(tmp_path),
                "--markdown",
                str(tmp_path / "doc.md"),
                "--device",
                "cpu",
            ]
        )
    finally:
        torch.set_num_threads(before)
    assert code == 0
    printed = capsys.readouterr().out
    for method in ("Cosine classifier", "PEFT ensemble", "Naive", "Full Data"):
        assert method in printed
    report = json.loads((tmp_path / "report.json").read_text())
    runs = {r["algorithm"]: r for r in report["runs"]}
    assert set(runs) == {"cosine_classifier", "peft_ensemble", "peft_naive", "peft_full_data"}
    for run in runs.values():
        assert run["status"] == "succeeded" and run["versions"] == 2
        assert len(run["accuracy_matrix"]) == 2
    # Parallel datasets: one release's ε per task, never more; Full-Data's task 1 is charged twice.
    for algorithm in ("cosine_classifier", "peft_ensemble", "peft_naive"):
        ledger = runs[algorithm]["ledger"]
        assert Decimal(ledger["epsilon_spent"]) <= Decimal(8)
        assert all(Decimal("7.9") < Decimal(e) <= Decimal(8) for e in ledger["task_epsilon"])
        assert Decimal(ledger["epsilon_after_task"][-1]) == Decimal(ledger["epsilon_spent"])
    full = runs["peft_full_data"]["ledger"]
    first, last = (Decimal(e) for e in full["task_epsilon"])
    assert first > last > 0 and first > Decimal(8)  # two charges on task 1, one on task 2
    assert [Decimal(e) for e in full["epsilon_after_task"]] == sorted(
        Decimal(e) for e in full["epsilon_after_task"]
    )
    # Every ε the report shows says what it is (issue 24 §3–4): on the parallel datasets the spend is
    # the guarantee; Full Data's sequential rdp budget is a Rényi filter, whose spend is its
    # progress — a budget share — and whose guarantee is the filter's budget, shown beside it.
    for algorithm in ("cosine_classifier", "peft_ensemble", "peft_naive"):
        ledger = runs[algorithm]["ledger"]
        assert ledger["guarantee"]["epsilon"] == ledger["epsilon_spent"]
        assert ledger["guarantee_after_task"] == ledger["epsilon_after_task"]
        assert "not a DP guarantee" not in ledger["epsilon_spent_is"]
    budget = full["epsilon_budget"]
    assert "not a DP guarantee" in full["epsilon_spent_is"]
    assert full["guarantee"] == {"epsilon": budget, "delta": full["guarantee"]["delta"]}
    assert full["task_guarantee"] == [budget] * 2 and full["guarantee_after_task"] == [budget] * 2
    assert Decimal(full["epsilon_spent"]) < Decimal(budget)
    assert "guarantee (ε, δ)" in printed and "budget used ε" in printed and "ledger ε" not in printed
    rows = {r["algorithm"]: r for r in report["summary"]}
    assert rows["peft_full_data"]["guarantee_epsilon"] == budget
    # The naive head forgets the first task; the ensemble and the cosine classifier do not.
    assert runs["peft_naive"]["average_forgetting"] > 0.5
    assert runs["cosine_classifier"]["average_forgetting"] < 0.2
    assert runs["cosine_classifier"]["average_accuracy"] > runs["peft_naive"]["average_accuracy"] + 0.2
    for name in ("accuracy.png", "ledger_epsilon.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # report.md (copied to --markdown): the table under its provenance, ours beside the paper's
    # Table A1 at ε = 8 in a column marked as the paper's, and the claims read off the rows.
    markdown = (tmp_path / "report.md").read_text()
    assert (tmp_path / "doc.md").read_text() == markdown
    assert "- command: `ledger experiment pretrained (called in-process)`" in markdown
    assert "load average" in markdown and "**the paper's** Table A1" in markdown
    cosine = rows["cosine_classifier"]
    assert (
        f"| Cosine classifier | parallel | 32 | 8 | {cosine['AA %']} | {cosine['AF %']} | 78.93 |" in markdown
    )
    assert f"| Naive | parallel | 32 | 8 | {rows['peft_naive']['AA %']} |" in markdown
    claim = report["claims"][0]
    assert f"K=32, ε=8: PEFT − cosine = {100 * claim['peft_minus_cosine']:+.2f} points" in markdown
