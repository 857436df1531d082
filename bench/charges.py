"""What the ledger charges, next to what independent accountants give for the same event and δ.

Run ``python bench/charges.py`` from the repository root. Prints the markdown table of
``docs/ACCOUNTING.md`` and writes ``bench/results/charges.json``. Each row is one charge on a
fresh batch (``accountant.rules.reserve`` on an empty state: what a reservation holds), next to
dp-accounting's RDP accountant (on our accountant's order grid, so the comparison is the
conversion and the rule, not the grid), dp-accounting's PLD accountant and prv-accountant's
``PRVAccountant`` (upper bound, ``eps_error`` 0.01). The last two columns are our charge over
dp-accounting's RDP ε (the issue's targets) and over the tightest of the three.

The rows: single charges on ``parallel`` (no filter, no δ split), a ``geometric`` level's ε′ at
its δ share, ``sequential``/``lifelong`` Rényi filters (the fixed 20-order grid with equal δ shares
versus the grid placed for the budget), a declared ``prv`` plan, and pure ε; issue 25's audit cases
(single charges priced by their tight ε since pricing version 4). dp-accounting's PLD runs on its
default value grid (1e-4), which is above the tight value at small ε: a ratio below 1 there means
ours is the tighter (valid) bound.

Then the speed of the tight engine (``accountant.prv.tight_epsilon``), side by side in one run:
10⁶ steps of one DP-SGD step (q 0.01, σ 1, δ 1e-5) against dp-accounting's ``PLDAccountant``
(default grid) and our ``prv`` accountant; two heterogeneous plans of 200 distinct entries (DP-SGD
runs; a DP-SGD / Gaussian / Laplace mixture) against the engine of pricing version 4 and our
``prv`` accountant (what a declared plan is priced with); ``--slow-pld`` adds dp-accounting's PLD
on a 1e-3 grid, composed one entry at a time (a reference ε, tens of seconds). One run each, caches
cleared: wall and CPU seconds on a shared box. ``--speed-only`` runs only this part and writes
``bench/results/charges_speed.json``.
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

from accountant import events as ev  # noqa: E402
from accountant import rules  # noqa: E402
from accountant.rdp import DEFAULT_ORDERS  # noqa: E402
from accountant.rdp_filter import DEFAULT_FILTER_ORDERS  # noqa: E402
from accountant.rules.prices import rdp_charge  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "charges.json"


def _dpsgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def _references(event: ev.DpEvent, delta: float) -> dict[str, float | None]:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    def convert(e: ev.DpEvent) -> Any:
        if isinstance(e, ev.SelfComposedEvent):
            return dp_accounting.SelfComposedDpEvent(convert(e.event), e.count)
        if isinstance(e, ev.ComposedEvent):
            return dp_accounting.ComposedDpEvent([convert(c) for c in e.events])
        if isinstance(e, ev.PoissonSampledEvent):
            return dp_accounting.PoissonSampledDpEvent(e.sampling_probability, convert(e.event))
        if isinstance(e, ev.GaussianEvent):
            return dp_accounting.GaussianDpEvent(e.noise_multiplier)
        if isinstance(e, ev.LaplaceEvent):
            return dp_accounting.LaplaceDpEvent(e.scale)
        raise TypeError(e.kind)

    out: dict[str, float | None] = {
        "dp-accounting RDP": None,
        "dp-accounting PLD": None,
        "prv-accountant": None,
    }
    if isinstance(event, ev.PureDpEvent):
        return {k: float(event.epsilon) for k in out}  # every accountant: exactly ε
    dpa = convert(event)
    out["dp-accounting RDP"] = float(
        RdpAccountant(orders=list(DEFAULT_ORDERS)).compose(dpa).get_epsilon(delta)
    )
    out["dp-accounting PLD"] = float(PLDAccountant().compose(dpa).get_epsilon(delta))
    out["prv-accountant"] = _prv(event, delta)
    return out


def _prv(event: ev.DpEvent, delta: float) -> float | None:
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    steps: list[tuple[float, float, int]] = []
    parts = event.events if isinstance(event, ev.ComposedEvent) else (event,)
    for part in parts:
        if not (isinstance(part, ev.SelfComposedEvent) and isinstance(part.event, ev.PoissonSampledEvent)):
            return None
        inner = part.event.event
        if not isinstance(inner, ev.GaussianEvent):
            return None
        steps.append((part.event.sampling_probability, inner.noise_multiplier, part.count))
    accountant = PRVAccountant(
        prvs=[PoissonSubsampledGaussianMechanism(q, s) for q, s, _ in steps],
        max_self_compositions=[t for _, _, t in steps],
        eps_error=0.01,
        delta_error=delta / 1000,
    )
    return float(accountant.compute_epsilon(delta, [t for _, _, t in steps])[2])


# One ε = 8, δ = 1e-5 sequential budget, with the grid placed for it or the fixed 20-order grid.
SEQUENTIAL_PLACED: dict[str, Any] = {
    "rule": "sequential",
    "epsilon": "8",
    "delta": "1e-5",
    "accountant": "rdp",
}
SEQUENTIAL_FIXED_GRID: dict[str, Any] = {**SEQUENTIAL_PLACED, "orders": list(DEFAULT_FILTER_ORDERS)}

CASES: list[tuple[str, dict[str, Any], ev.DpEvent]] = [
    (
        "parallel, rdp: one DP-SGD run (audit: 7.2x before)",
        {"rule": "parallel", "epsilon": "1", "delta": "1e-7", "accountant": "rdp"},
        _dpsgd(0.001235, 8.609, 18),
    ),
    (
        "parallel, rdp: DP-SGD, 20 epochs",
        {"rule": "parallel", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"},
        _dpsgd(0.01, 0.8, 2000),
    ),
    (
        "parallel, rdp: pure epsilon 0.1 (audit: 0.1446 before)",
        {"rule": "parallel", "epsilon": "1", "delta": "1e-5", "accountant": "rdp"},
        ev.PureDpEvent(0.1),
    ),
    (
        "parallel, prv: DP-SGD, 20 epochs",
        {"rule": "parallel", "epsilon": "8", "delta": "1e-5", "accountant": "prv"},
        _dpsgd(0.01, 0.8, 2000),
    ),
    (
        "sequential, rdp filter placed for (8, 1e-5): DP-SGD at ~7.5",
        SEQUENTIAL_PLACED,
        _dpsgd(0.01, 0.686, 2000),
    ),
    (
        "sequential, rdp filter, fixed 20 orders, equal shares: same run",
        SEQUENTIAL_FIXED_GRID,
        _dpsgd(0.01, 0.686, 2000),
    ),
    (
        "sequential, rdp filter placed for (8, 1e-5): DP-SGD at ~3 (far below the budget)",
        SEQUENTIAL_PLACED,
        _dpsgd(0.01, 1.0, 2000),
    ),
    (
        "sequential, rdp filter, fixed 20 orders, equal shares: same run at ~3",
        SEQUENTIAL_FIXED_GRID,
        _dpsgd(0.01, 1.0, 2000),
    ),
    (
        "geometric, rdp: level 0's epsilon' at its delta share",
        {"rule": "geometric", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"},
        _dpsgd(0.01, 1.0, 2000),
    ),
    # Issue 25's audit cases (single charges need no filter: their tight ε since pricing v4).
    (
        "issue 25: parallel, prv: the first row's run",
        {"rule": "parallel", "epsilon": "1", "delta": "1e-7", "accountant": "prv"},
        _dpsgd(0.001235, 8.609, 18),
    ),
    (
        "issue 25: geometric, rdp: the first row's run, level 0's epsilon' (audit: 2.07x PRV)",
        {"rule": "geometric", "epsilon": "0.005", "delta": "1e-7", "accountant": "rdp"},
        _dpsgd(0.001235, 8.609, 18),
    ),
    (
        "issue 25: parallel, rdp: a lone Gaussian sigma 1e4 (audit: 7.6x exact)",
        {"rule": "parallel", "epsilon": "1", "delta": "1e-10", "accountant": "rdp"},
        ev.GaussianEvent(1e4),
    ),
    (
        "issue 25: parallel, rdp: DP-SGD q 0.01, sigma 1, 1000 steps (audit: 1.15x)",
        {"rule": "parallel", "epsilon": "8", "delta": "1e-5", "accountant": "rdp"},
        _dpsgd(0.01, 1.0, 1000),
    ),
    (
        "issue 25: parallel, rdp: q 4.3e-5, sigma 1.18, 33 steps (ledger epsilon rdp: 293x)",
        {"rule": "parallel", "epsilon": "1", "delta": "5.6e-9", "accountant": "rdp"},
        _dpsgd(4.3e-5, 1.18, 33),
    ),
]


def _plan_row() -> dict[str, Any]:
    run = _dpsgd(0.01, 0.686, 2000)
    budget = rules.Budget.create(rule="sequential", epsilon="8", delta="1e-5", accountant="prv", plan=[run])
    charged = rules.reserve(budget, rules.BatchState.empty(), rules.Charge(run)).cost
    return _row("sequential, prv plan [that run]: declared, no filter", budget, run, charged.epsilon)


def _row(label: str, budget: rules.Budget, event: ev.DpEvent, charged: Decimal) -> dict[str, Any]:
    delta = float(budget.delta)
    if budget.rule == "geometric":
        assert budget.geometric is not None
        delta = float(budget.geometric.level_delta(budget.delta, 0))
    refs = _references(event, delta)
    tightest = min(v for v in refs.values() if v is not None)
    return {
        "charge": label,
        "delta": delta,
        "ours": float(charged),
        **refs,
        "ratio": float(charged) / tightest if tightest > 0 else None,
        "ratio_rdp": float(charged) / refs["dp-accounting RDP"] if refs["dp-accounting RDP"] else None,
    }


FILTER_BUDGETS = [("4", "1e-5"), ("8", "1e-5"), ("8", "1e-7"), ("16", "1e-5")]
FILTER_RUNS = [(q, epochs) for q in (0.004, 0.01, 0.05) for epochs in (5, 20, 50)]


def _calibrated_sigma(q: float, steps: int, target: float, delta: float) -> float | None:
    """σ with our RDP accountant's ε = ``target`` (bisection), or None if out of reach."""
    from accountant.registry import make_accountant

    def epsilon(sigma: float) -> float:
        return make_accountant("rdp").compose(_dpsgd(q, sigma, steps)).get_epsilon(delta).upper

    lo, hi = 0.3, 100.0
    if epsilon(hi) > target or epsilon(lo) < target:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if epsilon(mid) > target else (lo, mid)
    return hi


def filter_placement() -> list[dict[str, Any]]:
    """Certified ε over plain RDP ε for DP-SGD runs calibrated to a fraction of the budget: near
    it (90–100%: the runs whose admission the filter decides) and far below it (35–50%)."""
    import statistics

    from accountant.rdp_filter import RenyiFilter
    from accountant.registry import make_accountant

    out = []
    for eps, delta in FILTER_BUDGETS:
        placed = rules.renyi_filter(
            rules.Budget.create(rule="sequential", epsilon=eps, delta=delta, accountant="rdp")
        )
        fixed = RenyiFilter(epsilon=eps, delta=delta, orders=DEFAULT_FILTER_ORDERS)
        for band, fractions in (
            ("near the budget (90-100%)", (0.9, 1.0)),
            ("far below (35-50%)", (0.35, 0.5)),
        ):
            ratios: dict[str, list[float]] = {"placed": [], "fixed": []}
            for q, epochs in FILTER_RUNS:
                steps = round(epochs / q)
                for fraction in fractions:
                    sigma = _calibrated_sigma(q, steps, fraction * float(eps), float(delta))
                    if sigma is None:
                        continue
                    event = _dpsgd(q, sigma, steps)
                    plain = make_accountant("rdp").compose(event).get_epsilon(float(delta)).upper
                    for name, f in (("placed", placed), ("fixed", fixed)):
                        ratios[name].append(float(f.epsilon_of(rdp_charge(event, f.orders))) / plain)
            row: dict[str, Any] = {"budget": f"({eps}, {delta})", "runs": band, "n": len(ratios["placed"])}
            for name, values in ratios.items():
                row[f"{name}_median"] = statistics.median(values)
                row[f"{name}_max"] = max(values)
            out.append(row)
    return out


def _timed(compute: Any) -> tuple[float, float, float]:
    """(value, wall seconds, CPU seconds of this process): on a shared box the CPU time is the
    figure load moves least."""
    import time

    start, cpu = time.perf_counter(), time.process_time()
    value = float(compute())
    return value, time.perf_counter() - start, time.process_time() - cpu


def heterogeneous_plans() -> list[tuple[str, ev.DpEvent, Any]]:
    """Two plans of 200 distinct entries (issue 25 §4), with their dp-accounting events: DP-SGD
    runs of 50 steps at q ~ U(0.001, 0.02), σ ~ U(0.8, 2); and a mixture, a third each, of DP-SGD
    runs (10–99 steps), repeated Gaussians (σ 5–50, 1–19 times) and repeated Laplace (b 50–500)."""
    import dp_accounting
    import numpy as np

    def dpa(e: ev.DpEvent) -> Any:
        if isinstance(e, ev.SelfComposedEvent):
            return dp_accounting.SelfComposedDpEvent(dpa(e.event), e.count)
        if isinstance(e, ev.ComposedEvent):
            return dp_accounting.ComposedDpEvent([dpa(c) for c in e.events])
        if isinstance(e, ev.PoissonSampledEvent):
            return dp_accounting.PoissonSampledDpEvent(e.sampling_probability, dpa(e.event))
        if isinstance(e, ev.GaussianEvent):
            return dp_accounting.GaussianDpEvent(e.noise_multiplier)
        if isinstance(e, ev.LaplaceEvent):
            return dp_accounting.LaplaceDpEvent(e.scale)
        raise TypeError(e.kind)

    rng = np.random.default_rng(0)
    entries = [(float(rng.uniform(0.001, 0.02)), float(rng.uniform(0.8, 2.0))) for _ in range(200)]
    dpsgd = ev.ComposedEvent(tuple(_dpsgd(q, s, 50) for q, s in entries))
    rng = np.random.default_rng(1)
    mixed: list[ev.DpEvent] = []
    for i in range(200):
        if i % 3 == 0:
            q, s, n = (
                float(rng.uniform(0.001, 0.02)),
                float(rng.uniform(0.8, 2.0)),
                int(rng.integers(10, 100)),
            )
            mixed.append(_dpsgd(q, s, n))
        elif i % 3 == 1:
            mixed.append(
                ev.SelfComposedEvent(ev.GaussianEvent(float(rng.uniform(5, 50))), int(rng.integers(1, 20)))
            )
        else:
            mixed.append(
                ev.SelfComposedEvent(ev.LaplaceEvent(float(rng.uniform(50, 500))), int(rng.integers(1, 20)))
            )
    mixture = ev.ComposedEvent(tuple(mixed))
    return [
        ("200 distinct DP-SGD entries x 50 steps, delta 1e-5", dpsgd, dpa(dpsgd)),
        ("200 distinct entries: DP-SGD / Gaussian / Laplace, delta 1e-5", mixture, dpa(mixture)),
    ]


def _dpa_pld_one_by_one(dpa_event: Any, delta: float) -> float:
    """dp-accounting's pessimistic PLD of a composed event on a 1e-3 grid, composed one entry at a
    time (``PLDAccountant`` does the same; its default 1e-4 grid takes minutes here)."""
    from dp_accounting.pld import PLDAccountant

    return float(PLDAccountant(value_discretization_interval=1e-3).compose(dpa_event).get_epsilon(delta))


def speed(slow_pld: bool) -> list[dict[str, Any]]:
    """The tight engine against dp-accounting's PLD and our ``prv`` accountant, one run each, with
    caches cleared: engine 2 (pricing version 5), engine 1 (version 4: PRV beyond 4 distinct
    mechanisms) and the ``prv`` accountant (what a declared plan is priced with)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    from accountant import pld, prv, rdp
    from accountant.prv import tight_engine
    from accountant.registry import make_accountant

    def cold() -> None:
        tight_engine.composed_pld.cache_clear()
        pld._composed.cache_clear()
        pld.mechanism_pmfs.cache_clear()
        for cached in (rdp._poisson_gaussian_rdp_cached,):
            cached.cache_clear()

    out: list[dict[str, Any]] = []
    long_run = _dpsgd(0.01, 1.0, 10**6)
    dpa_long = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 10**6
    )
    cases: list[tuple[str, ev.DpEvent, Any, Any]] = [
        (
            "10^6 steps, q 0.01, sigma 1, delta 1e-5",
            long_run,
            lambda: PLDAccountant().compose(dpa_long).get_epsilon(1e-5),
            None,
        )
    ]
    for label, event, dpa_event in heterogeneous_plans():
        reference = (lambda d=dpa_event: _dpa_pld_one_by_one(d, 1e-5)) if slow_pld else None
        cases.append((label, event, reference, True))
    for case, event, reference, heterogeneous in cases:
        row: dict[str, Any] = {"case": case}
        cold()
        row["ours (tight)"] = _timed(lambda e=event: prv.tight_epsilon(e, 1e-5).upper)
        cold()
        row["tight, pricing 4 (engine 1)"] = (
            _timed(lambda e=event: prv.tight_epsilon(e, 1e-5, engine=1).upper) if heterogeneous else None
        )
        cold()
        row["our prv accountant"] = _timed(
            lambda e=event: make_accountant("prv").compose(e).get_epsilon(1e-5).upper
        )
        row["dp-accounting PLD"] = None if reference is None else _timed(reference)
        out.append(row)
    return out


ENGINES = ["ours (tight)", "tight, pricing 4 (engine 1)", "our prv accountant", "dp-accounting PLD"]


def _print_speed(timings: list[dict[str, Any]]) -> None:
    print("\n| composition | " + " | ".join(f"{e}: ε, wall s (CPU s)" for e in ENGINES) + " |")
    print("|---|" + "---|" * len(ENGINES))
    for row in timings:
        cells = [
            "–" if row[e] is None else f"{row[e][0]:.5g}, {row[e][1]:.2f} s ({row[e][2]:.2f} s)"
            for e in ENGINES
        ]
        print(f"| {row['case']} | " + " | ".join(cells) + " |")


def main() -> int:
    slow_pld = "--slow-pld" in sys.argv[1:]
    if "--speed-only" in sys.argv[1:]:
        timings = speed(slow_pld)
        _print_speed(timings)
        path = RESULTS.with_name("charges_speed.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"speed": timings}, indent=2))
        print(json.dumps({"speed": timings}))
        print(f"\nwrote {path.relative_to(ROOT)}")
        return 0
    rows = []
    for label, spec, event in CASES:
        budget = rules.Budget.from_json(spec) if "orders" in spec else rules.Budget.create(**spec)
        if budget.uses_filter:  # what the filter certifies, also when above the budget (refused)
            assert budget.orders is not None
            charged = rules.renyi_filter(budget).epsilon_of(rdp_charge(event, budget.orders))
        else:
            cost = rules.reserve(budget, rules.BatchState.empty(), rules.Charge(event)).cost
            charged = cost.naive_epsilon if budget.rule == "geometric" else cost.epsilon
        rows.append(_row(label, budget, event, charged))
    rows.append(_plan_row())
    names = ["ours", "dp-accounting RDP", "dp-accounting PLD", "prv-accountant"]
    print("| charge | δ | " + " | ".join(names) + " | ours / RDP | ours / tightest |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for row in rows:
        cells = ["–" if row[n] is None else f"{row[n]:.4g}" for n in names]
        ratios = f" | {row['ratio_rdp']:.3f} | {row['ratio']:.3f} |"
        print(f"| {row['charge']} | {row['delta']:g} | " + " | ".join(cells) + ratios)
    placement = filter_placement()
    print("\n| budget (ε, δ) | DP-SGD runs | n | placed grid: median / max | fixed 20 orders: median / max |")
    print("|---|---|---|---|---|")
    for row in placement:
        print(
            f"| {row['budget']} | {row['runs']} | {row['n']} | {row['placed_median']:.3f} / "
            f"{row['placed_max']:.3f} | {row['fixed_median']:.3f} / {row['fixed_max']:.3f} |"
        )
    timings = speed(slow_pld)
    _print_speed(timings)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "filter_placement": placement, "speed": timings}, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
