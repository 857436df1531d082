"""Print where ``ledger serve`` spent its CPU per committed spend during ``bench/ledger.py``'s hot
loop, from the records of ``bench/spend_layers/sitecustomize.py``::

    SPEND_LAYERS_OUT=/tmp/layers PYTHONPATH=bench/spend_layers:$PWD \\
        python bench/ledger.py --backends postgres,sqlite --duration 8 --charges 1000
    python bench/spend_layers/report.py /tmp/layers-*.json

The hot loop is the longest run of half-second records in which the ledger decided more than 50
operations each (a spend is a reserve and a commit); its first and last records are left out.
"""

from __future__ import annotations

import json
import sys

DECIDE = "    decide"


def report(path: str) -> None:
    with open(path) as f:
        snapshots = json.load(f)
    decided = [s["calls"].get(DECIDE, 0) for s in snapshots]
    best, i = (0, 0), 0
    while i < len(snapshots) - 1:
        j = i
        while j < len(snapshots) - 1 and decided[j + 1] - decided[j] > 50:
            j += 1
        if j - i > best[1] - best[0]:
            best = (i, j)
        i = j + 1
    if best[1] - best[0] < 3:
        print(f"{path}: no hot loop found")
        return
    first, last = snapshots[best[0] + 1], snapshots[best[1] - 1]
    spends = (last["calls"][DECIDE] - first["calls"].get(DECIDE, 0)) / 2
    seconds = last["t"] - first["t"]
    print(
        f"{path}: {seconds:.1f} s, {spends:.0f} spends, {spends / seconds:.0f} spends/s; ms of CPU per spend:"
    )
    total = 0.0
    for name, cpu in sorted(last["threads"].items()):
        used = cpu - first["threads"].get(name, 0.0)
        total += used
        print(f"  {name:36s} {1000 * used / spends:6.3f}")
    print(f"  {'all threads':36s} {1000 * total / spends:6.3f}")
    for name, cpu in last["cpu"].items():
        used = cpu - first["cpu"].get(name, 0.0)
        calls = last["calls"][name] - first["calls"].get(name, 0)
        print(f"  {name:36s} {1000 * used / spends:6.3f}  ({calls / spends:.2f} calls per spend)")


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        report(argument)
