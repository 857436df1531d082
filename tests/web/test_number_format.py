"""The dashboard's ``sig`` rounds a ledger number as ``accountant.exact.shown`` does: 4 significant
digits toward the safe side, on the decimal digits themselves (issue 24 §3). Through a binary
float, 0.49980000000000001 "up" read 0.4998, below the certified number.

Runs ``sig`` from ``service/web/app.js`` in Node; skips where Node is not installed.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

from accountant.exact import shown

APP = Path(__file__).resolve().parents[2] / "service" / "web" / "app.js"
NODE = shutil.which("node")


def _sig(cases: list[tuple[str, str | None]]) -> list[str]:
    source = APP.read_text(encoding="utf-8")
    start = source.index("  function sig(text, way) {")
    end = source.index("  /** An element showing `value` with 4 significant digits")
    script = (
        source[start:end]
        + f"\nconst cases = {json.dumps(cases)};\n"
        + "process.stdout.write(JSON.stringify(cases.map(([v, w]) => sig(v, w === null ? undefined : w))));\n"
    )
    assert NODE is not None
    done = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=60, check=True)
    answer: list[str] = json.loads(done.stdout)
    return answer


@pytest.mark.skipif(NODE is None, reason="Node is not installed")
def test_sig_rounds_the_decimal_digits_toward_the_safe_side_as_shown_does() -> None:
    fixed = [
        ("0.49980000000000001", "up", "0.4999"),
        ("1.04191179380027777", "up", "1.042"),
        ("1.04191179380027777", "down", "1.041"),
        ("9.9996", "up", "10"),
        ("7.5002", "down", "7.5"),
        ("0.00001", "up", "1e-5"),
        ("123456", "up", "123500"),
        ("Infinity", "up", "∞"),
        ("0", "down", "0"),
        ("0.08907446068197634", None, "0.08907"),
    ]
    assert _sig([(v, w) for v, w, _ in fixed]) == [text for _, _, text in fixed]
    generator = random.Random(24)
    values = [f"{generator.randint(1, 10**18)}e{generator.randint(-30, 10)}" for _ in range(300)] + [
        str(Decimal(generator.randint(1, 10**17)).scaleb(-17)) for _ in range(300)
    ]
    cases: list[tuple[str, str | None]] = [(v, w) for v in values for w in ("up", "down")]
    for (value, way), text in zip(cases, _sig(cases), strict=True):
        assert Decimal(text) == Decimal(shown(value, way)), (value, way, text)  # type: ignore[arg-type]
