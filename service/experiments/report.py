"""What every experiment writes: ``report.json``, PNG plots (matplotlib, no display needed) and
a plain-text table on standard output."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def write_json(out_dir: Path, report: Mapping[str, Any], name: str = "report.json") -> Path:
    """Write ``report`` as indented JSON (NaN/inf refused: every number must be a real one)."""
    path = out_dir / name
    path.write_text(json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n")
    return path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *, title: str | None = None) -> str:
    """``rows`` as an aligned text table of ``columns`` (missing cells blank)."""
    cells = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells)
    return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """``rows`` as a GitHub-flavoured markdown table of ``columns`` (default: the first row's keys)."""
    if not rows:
        return "(no rows)"
    names = list(columns) if columns is not None else list(rows[0])
    cells = [[_cell(row.get(c, "")).replace("|", "\\|") for c in names] for row in rows]
    lines = ["| " + " | ".join(names) + " |", "|" + "|".join("---" for _ in names) + "|"]
    lines.extend("| " + " | ".join(r) + " |" for r in cells)
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, out_dir: Path, name: str) -> Path:
    path = out_dir / name
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot().close(figure)
    return path


__all__ = ["markdown_table", "pyplot", "save_figure", "table", "write_json"]
