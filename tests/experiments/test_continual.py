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


def test_quick_continual_experiment_on_a_one_vs_rest_digits_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.training.data import load_data

    code = main(
        [
            "experiment",
            "continual",
            "--quick",
            "--out",
            str(tmp_path),
            "--blocks",
            "8",
            "--epsilon",
            "1",
            "--source",
            "digits",
            "--positive-class",
            "3",
            "--modes",
            "cumulative",
            "--sampling",
            "off",
        ]
    )
    assert code == 0
    assert "one-vs-rest: digit 3 is label 1" in capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["source"] == "builtin:permuted-synthetic-digits?tasks=1&per_task=128&seed=0"
    _, test_y = load_data(report["source"]).test_arrays()
    share = float((test_y == 3).mean())
    assert 0.0 < share < 0.5 and report["test_majority_rate"] == pytest.approx(1 - share)
    [run] = report["runs"]
    assert run["status"] == "succeeded" and run["never_exceeded"] and run["level_mismatches"] == []
    assert run["releases"] == 8 and 0 < run["epsilon_trajectory"][-1] <= 1.0
    for point in run["accuracy"]:
        # the labels the models are scored on are binary: the non-private model is at least the
        # majority rule's accuracy (λ = 1 on 64 pixels: it is the majority rule)
        assert point["nonprivate"] >= 1 - share - 1e-9 and 0.0 <= point["private"] <= 1.0


def test_a_positive_class_the_source_does_not_have_is_refused(tmp_path: Path) -> None:
    from service.contract.job_params import InvalidParamsError
    from service.training.continual_release import ContinualReleaseTrainer, parse_params
    from service.training.data import load_data

    data = load_data("builtin:permuted-synthetic-digits?tasks=1&per_task=32&seed=0")
    params = parse_params({"mode": "cumulative", "epsilon": 1.0, "positive_class": 10})
    with pytest.raises(InvalidParamsError) as caught:
        ContinualReleaseTrainer().start(params, data, [])
    assert caught.value.field == "params.positive_class" and "10 classes" in str(caught.value)
    with pytest.raises(ValueError, match="positive_class makes it one-vs-rest"):
        ContinualReleaseTrainer().start(parse_params({"mode": "cumulative", "epsilon": 1.0}), data, [])
