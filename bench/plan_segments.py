"""What successive plan segments cost on a sequential ``prv`` budget, next to the alternatives.

Run ``python bench/plan_segments.py`` from the repository root. Prints a markdown table for
``docs/ACCOUNTING.md`` ("Successive plans") and writes ``bench/results/plan_segments.json``.

The user trial's shape: a budget (ε = 2, δ = 1e-5) whose first declared plan is one DP-SGD run;
after it, a second run chosen once the first one's outcome is known. Rows: the first run alone at
the whole δ (the plan as before segments: its leftover could never be spent); the two runs as
two segments, each priced at δ/2 as a new budget prices its plans (the tight engine since issue
25 §4: ``Budget.plan_pricing``; PRV before) and composed by basic composition (the filter of Rogers,
Roth, Ullman & Vadhan 2016, Thm. 3.6) — what the ledger charges now; the same two runs on a
Rényi-filter budget (``rdp``, the grid placed for the budget), the other sound adaptive choice;
and, for reference only, both runs declared up front as one plan (at the whole δ), which is
not available when the second run depends on the first's outcome. Each segment's ε is shown next
to prv-accountant's own ``PRVAccountant`` (upper bound, ``eps_error`` 0.01).
"""

from __future__ import annotations

import json
import sys
import warnings
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from prv_accountant import PRVAccountant  # noqa: E402
from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism  # noqa: E402

from accountant import events as ev  # noqa: E402
from accountant import rules  # noqa: E402
from accountant.rules import BatchState, Budget, Charge  # noqa: E402
from accountant.rules.prices import plan_epsilon  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "plan_segments.json"
EPSILON, DELTA = Decimal(2), Decimal("1e-5")
# (q, σ, steps) of the first and the second run: a first run that takes most of the budget (the
# trial), and two runs of similar size.
SCENARIOS = {
    "first run dominant": ((0.01, 1.0, 500), (0.01, 2.5, 200)),
    "two similar runs": ((0.01, 1.1, 500), (0.01, 1.5, 300)),
}


def dpsgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def library_upper(q: float, sigma: float, steps: int, delta: float) -> float:
    accountant = PRVAccountant(
        PoissonSubsampledGaussianMechanism(q, sigma),
        max_self_compositions=steps,
        eps_error=0.01,
        delta_error=1e-9,
    )
    return float(accountant.compute_epsilon(delta, steps)[2])


def charged(budget: Budget, events: list[ev.DpEvent], grow: list[Budget] | None = None) -> str:
    """The batch's ε after running ``events`` in order (a segment declared before each later
    one), or the refusal's code."""
    state = BatchState.empty()
    try:
        for i, event in enumerate(events):
            if grow and i > 0:
                state = rules.close_segment(budget, state)
                budget = grow[i - 1]
            admission = rules.reserve(budget, state, Charge(event))
            state = rules.commit(budget, admission.state, Charge(event), admission.cost, None).state
    except rules.BudgetExceeded:
        return "refused (budget_exceeded)"
    return str(state.epsilon_spent)


def scenario(runs: tuple[tuple[float, float, int], ...]) -> list[dict[str, Any]]:
    first, second = (dpsgd(*r) for r in runs)
    half = DELTA / 2
    alone = Budget.create(rule="sequential", epsilon=EPSILON, delta=DELTA, accountant="prv", plan=[first])
    segmented = Budget.create(
        rule="sequential", epsilon=EPSILON, delta=DELTA, accountant="prv", plan=[first], plan_delta=half
    )
    grown = segmented.with_segment([second], half)
    filtered = Budget.create(rule="sequential", epsilon=EPSILON, delta=DELTA, accountant="rdp")
    assert alone.plan_epsilon is not None and segmented.plan_epsilon is not None
    return [
        {
            "what": "first run alone, plan at the whole delta (before segments: the rest is stranded)",
            "epsilon": str(alone.plan_epsilon),
            "prv_accountant": library_upper(*runs[0], float(DELTA)),
        },
        {
            "what": "segment 0: first run at delta/2",
            "epsilon": str(segmented.plan_epsilon),
            "prv_accountant": library_upper(*runs[0], float(half)),
        },
        {
            "what": "segment 1: second run at delta/2",
            "epsilon": str(grown.segments[0].epsilon),
            "prv_accountant": library_upper(*runs[1], float(half)),
        },
        {
            "what": "**both runs as two segments** (basic composition, RRUV 2016 Thm. 3.6): charged",
            "epsilon": charged(segmented, [first, second], [grown]),
            "prv_accountant": None,
        },
        {
            "what": "both runs on a Renyi-filter budget (rdp, placed grid): charged",
            "epsilon": charged(filtered, [first, second]),
            "prv_accountant": None,
        },
        {
            "what": "reference, not adaptive: both runs declared up front as one plan",
            "epsilon": str(plan_epsilon((first, second), DELTA, segmented.plan_pricing)),
            "prv_accountant": None,
        },
    ]


def shown(value: str) -> str:
    return value if value.startswith("refused") else f"{Decimal(value):.4f}"


def main() -> None:
    out: dict[str, Any] = {"epsilon": str(EPSILON), "delta": str(DELTA), "scenarios": {}}
    print(f"budget (epsilon, delta) = ({EPSILON}, {DELTA})\n")
    print("| scenario, runs (q, sigma, steps) | what | epsilon | prv-accountant |")
    print("|---|---|---|---|")
    for name, runs in SCENARIOS.items():
        rows = scenario(runs)
        out["scenarios"][name] = {"runs": runs, "rows": rows}
        for row in rows:
            library = "" if row["prv_accountant"] is None else f"{row['prv_accountant']:.4f}"
            print(f"| {name}: {runs} | {row['what']} | {shown(row['epsilon'])} | {library} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
