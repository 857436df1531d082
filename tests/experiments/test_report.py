"""What every experiment writes (service.experiments.report), from a small summary of the shape the
experiments print: the aligned text table, the markdown table under its provenance, report.json
(real numbers only). In process, no experiment run: the experiments' own tests beside this one
(slow) run them end to end and check their plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # provenance reads torch's version, threads and device

from service.experiments.report import (
    markdown_table,
    provenance,
    provenance_lines,
    table,
    write_json,
)

ROWS: list[dict[str, Any]] = [
    {"method": "dp_sgd", "epsilon": 1.0, "AA %": 91.23456, "ε task 1": 0.123456, "succeeded": True},
    {"method": "naive|gaussian", "epsilon": 8.0, "AA %": 12345.678, "succeeded": False},
]
COLUMNS = ["method", "epsilon", "AA %", "ε task 1", "succeeded"]


def test_the_text_table_aligns_every_column_and_writes_four_significant_figures() -> None:
    title, header, rule, *body = table(ROWS, COLUMNS, title="Split digits, 2 seeds").split("\n")
    cells = [
        ["dp_sgd", "1", "91.23", "0.1235", "True"],
        ["naive|gaussian", "8", "1.235e+04", "", "False"],  # past 10⁴ in e-notation; a missing cell blank
    ]
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, name in enumerate(COLUMNS)]
    assert title == "Split digits, 2 seeds"
    assert header == "  ".join(name.rjust(w) for name, w in zip(COLUMNS, widths, strict=True))
    assert rule == "  ".join("-" * w for w in widths)
    assert body == ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    assert table([{"x": math.nan}], ["x"]).split("\n")[-1] == "nan"


def test_the_markdown_report_opens_with_its_provenance_and_escapes_cells() -> None:
    origin = provenance("report-test", "cpu", elapsed=12.34)
    assert origin["command"] == "ledger experiment report-test (called in-process)"  # not from argv
    assert origin["device"] == "cpu" and origin["wall_time_s"] == 12.3 and origin["torch_threads"] >= 1
    lines = provenance_lines(origin)
    assert lines[2] == "- command: `ledger experiment report-test (called in-process)`"
    assert lines[-1].endswith("wall time 12.3 s")
    assert provenance_lines({**origin, "tuning_wall_time_s": 4.5})[-1].endswith("(tuning 4.5 s)")

    header, rule, first, second = markdown_table(ROWS, COLUMNS).split("\n")
    assert header == "| method | epsilon | AA % | ε task 1 | succeeded |" and rule == "|---|---|---|---|---|"
    assert first == "| dp_sgd | 1 | 91.23 | 0.1235 | True |"
    assert second == "| naive\\|gaussian | 8 | 1.235e+04 |  | False |"  # the pipe escaped
    assert markdown_table(ROWS[:1]).split("\n")[0] == "| " + " | ".join(ROWS[0]) + " |"  # first row's keys
    assert markdown_table([]) == "(no rows)"


def test_report_json_round_trips_and_refuses_a_number_that_is_not_real(tmp_path: Path) -> None:
    report = {"experiment": "report-test", "summary": ROWS}
    path = write_json(tmp_path, report)
    assert path == tmp_path / "report.json" and json.loads(path.read_text()) == report
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json(tmp_path, {"accuracy": math.inf}, name="bad.json")
    assert not (tmp_path / "bad.json").exists()
