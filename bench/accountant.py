"""Accountant benchmark: our accountants side by side with dp-accounting and prv-accountant.

Run ``python bench/accountant.py [--quick]`` from the repository root. Prints a table and writes
``bench/results/accountant.json``. Every time is reported next to the ε it bought (speed is never
bought with a looser number) and as a ratio to ours.

(a) 10⁶ homogeneous Poisson-subsampled-Gaussian steps (q = 0.004, σ = 1.1, δ = 1e-5): our ``rdp``
    and ``prv`` accountants vs dp-accounting RDP and PLD and prv-accountant's ``PRVAccountant``.
(b) A plan of 200 distinct subsampled-Gaussian entries × 50 steps each, admitted one at a time as
    a ledger does: our Rényi-filter admission on a budget ε = 4 (the grid placed for the budget,
    next to the fixed 20-order grid with equal δ shares) (``accountant.rdp_filter.RenyiFilter``
    with the RDP of each entry from ``accountant.rdp.compute_rdp``; the filter's per-order sums
    make each admission O(#orders)), our tight PRV value of the whole plan, and the one-at-a-time
    recomputation with dp-accounting RDP, dp-accounting PLD and prv-accountant. Under ``--quick`` the slow
    one-at-a-time runs stop at a time cap and their totals are *extrapolated* (marked so).
(c) Admission of one new charge against a batch whose history holds 10⁴ charges
    (``accountant.rules.reserve`` on a ``BatchState`` built from 10⁴ committed charges).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore")

from accountant import events as ev  # noqa: E402
from accountant.registry import make_accountant  # noqa: E402

DELTA = 1e-5
HOMOGENEOUS = {"sampling_probability": 0.004, "noise_multiplier": 1.1, "steps": 10**6}
PLAN_ENTRIES = 200
PLAN_STEPS = 50
HISTORY = 10_000
RESULTS = ROOT / "bench" / "results" / "accountant.json"


def _plan_parameters(entries: int = PLAN_ENTRIES) -> list[tuple[float, float]]:
    """200 distinct (q, σ): q ∈ [0.001, 0.01], σ ∈ [0.8, 2.0], fixed seed."""
    rng = np.random.default_rng(2024)
    qs = rng.uniform(0.001, 0.01, entries)
    sigmas = rng.uniform(0.8, 2.0, entries)
    return [(round(float(q), 6), round(float(s), 4)) for q, s in zip(qs, sigmas, strict=True)]


def _entry_event(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(
        event=ev.PoissonSampledEvent(sampling_probability=q, event=ev.GaussianEvent(sigma)),
        count=steps,
    )


def _dpa_event(q: float, sigma: float, steps: int) -> Any:
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _child(fn: Callable[[], Any], queue: Any) -> None:
    try:
        queue.put(("ok", _timed(fn)))
    except Exception as exc:  # reported, not raised: one failing competitor must not stop the run
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _capped(fn: Callable[[], Any], cap_s: float) -> tuple[float | None, Any, str]:
    """Run ``fn`` in a child process with a wall-clock cap: (seconds, result, status)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, queue))
    proc.start()
    proc.join(cap_s)
    if proc.is_alive():
        proc.terminate()
        proc.join()
        return None, None, f"stopped at the {cap_s:.0f} s cap"
    if queue.empty():
        return None, None, f"exited with code {proc.exitcode}"
    status, payload = queue.get()
    if status != "ok":
        return None, None, str(payload)
    seconds, result = payload
    return float(seconds), result, "ok"


# ---------------------------------------------------------------------------------------------
# (a) 10⁶ homogeneous steps
# ---------------------------------------------------------------------------------------------


def bench_homogeneous(quick: bool) -> list[dict[str, Any]]:
    q, sigma = HOMOGENEOUS["sampling_probability"], HOMOGENEOUS["noise_multiplier"]
    steps = HOMOGENEOUS["steps"]
    event = _entry_event(q, sigma, int(steps))
    rows: list[dict[str, Any]] = []

    def ours(name: str) -> Callable[[], Any]:
        def run() -> Any:
            bound = make_accountant(name).compose(event).get_epsilon(DELTA)
            return {"epsilon": bound.upper, "method": bound.method, "note": bound.note}

        return run

    def dpa_rdp() -> Any:
        from dp_accounting.rdp import RdpAccountant

        return {"epsilon": RdpAccountant().compose(_dpa_event(q, sigma, int(steps))).get_epsilon(DELTA)}

    def dpa_pld() -> Any:
        from dp_accounting.pld import PLDAccountant

        return {"epsilon": PLDAccountant().compose(_dpa_event(q, sigma, int(steps))).get_epsilon(DELTA)}

    def prv_direct() -> Any:
        from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

        acc = PRVAccountant(
            prvs=[PoissonSubsampledGaussianMechanism(q, sigma)],
            max_self_compositions=[int(steps)],
            eps_error=0.1,
            delta_error=DELTA / 1000,
        )
        _, estimate, upper = acc.compute_epsilon(DELTA, [int(steps)])
        return {
            "epsilon": upper,
            "estimate": estimate,
            "note": "eps_error 0.01 needs a 10^7-point long-double grid",
        }

    cap = 120.0 if quick else 600.0
    for label, fn, vs in [
        ("ours rdp", ours("rdp"), None),
        ("ours prv", ours("prv"), None),
        ("dp-accounting RDP", dpa_rdp, "ours rdp"),
        ("dp-accounting PLD", dpa_pld, "ours prv"),
        ("prv-accountant PRVAccountant (eps_error 0.1)", prv_direct, "ours prv"),
    ]:
        seconds, result, status = _capped(fn, cap)
        row = {"case": "a", "what": label, "seconds": seconds, "status": status, "vs": vs}
        if result:
            row.update(result)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# (b) 200 distinct entries × 50 steps, one at a time
# ---------------------------------------------------------------------------------------------


def _filter_admissions(
    params: list[tuple[float, float]], budget_epsilon: Decimal, *, placed: bool
) -> dict[str, Any]:
    """Admit the plan's entries one at a time through a Rényi filter of budget (ε, 1e-5): the
    fixed 20-order grid with equal δ shares, or the grid placed for the budget
    (``accountant.rdp_filter.placed_grid``: orders around where the budget binds, δ weights)."""
    from accountant.exact import exact_add
    from accountant.rdp import compute_rdp
    from accountant.rdp_filter import DEFAULT_FILTER_ORDERS, RenyiFilter, as_charge, placed_grid, rdp_epsilon

    delta = Decimal(str(DELTA))
    if placed:
        orders, weights = placed_grid(budget_epsilon, delta)
        renyi = RenyiFilter(epsilon=budget_epsilon, delta=delta, orders=orders, weights=weights)
    else:
        orders = tuple(DEFAULT_FILTER_ORDERS)
        renyi = RenyiFilter(epsilon=budget_epsilon, delta=delta, orders=orders)
    spent = tuple(Decimal(0) for _ in orders)
    admitted = 0
    start = time.perf_counter()
    for q, sigma in params:
        charge = as_charge(compute_rdp(_entry_event(q, sigma, PLAN_STEPS), orders))
        if renyi.admits(spent, charge):
            spent = tuple(exact_add(a, b) for a, b in zip(spent, charge, strict=True))
            admitted += 1
    seconds = time.perf_counter() - start
    # The ε the filter's sums certify for this budget's δ split (a progress value) and the same
    # sums converted without a split (what one fixed RDP composition on these orders gives).
    return {
        "seconds": seconds,
        "admitted": admitted,
        "epsilon": float(renyi.epsilon_of(spent)),
        "epsilon_no_split": float(rdp_epsilon(spent, orders, DELTA)),
        "orders": len(orders),
    }


def _ours_prv_plan(params: list[tuple[float, float]]) -> dict[str, Any]:
    acc = make_accountant("prv")
    for q, sigma in params:
        acc.compose(_entry_event(q, sigma, PLAN_STEPS))
    bound = acc.get_epsilon(DELTA)
    return {"epsilon": bound.upper, "estimate": bound.estimate, "method": bound.method, "note": bound.note}


def _one_at_a_time(step: Callable[[int], float], entries: int, cap_s: float | None) -> dict[str, Any]:
    """Run admissions 1..entries (each returning ε), stopping at ``cap_s``; extrapolate the rest.

    The extrapolation fits time-per-admission = a + b·i (least squares) on the admissions that
    ran and sums it over all ``entries``: clearly an estimate, labelled so.
    """
    times: list[float] = []
    epsilon = math.nan
    start = time.perf_counter()
    for i in range(entries):
        t0 = time.perf_counter()
        epsilon = step(i)
        times.append(time.perf_counter() - t0)
        if cap_s is not None and time.perf_counter() - start > cap_s and i + 1 < entries:
            break
    done = len(times)
    measured = math.fsum(times)
    if done == entries:
        return {"seconds": measured, "epsilon": epsilon, "admissions_run": done, "extrapolated": False}
    xs = np.arange(1, done + 1, dtype=float)
    if done >= 2:
        b, a = np.polyfit(xs, np.array(times), 1)
        b = max(b, 0.0)
    else:
        a, b = times[0], 0.0
    rest = np.arange(done + 1, entries + 1, dtype=float)
    total = measured + float(np.sum(np.maximum(a + b * rest, 0.0)))
    return {
        "seconds": total,
        "epsilon": epsilon,
        "epsilon_after": done,
        "admissions_run": done,
        "measured_seconds": measured,
        "extrapolated": True,
    }


def bench_plan(quick: bool, cap_s: float | None) -> list[dict[str, Any]]:
    params = _plan_parameters()
    rows: list[dict[str, Any]] = []

    filter_label = "ours RDP-filter admission, one at a time (budget 4, placed grid)"
    plan_label = "ours tight PRV of the whole plan"
    result = _filter_admissions(params, Decimal(4), placed=True)
    rows.append({"case": "b", "what": filter_label, **result})
    for label, budget_epsilon in [
        ("ours RDP-filter, fixed 20-order grid, equal δ shares (budget 4)", Decimal(4)),
        ("ours RDP-filter, fixed 20-order grid, equal δ shares (budget 1000, as before)", Decimal(1000)),
    ]:
        result = _filter_admissions(params, budget_epsilon, placed=False)
        rows.append({"case": "b", "what": label, "vs": filter_label, **result})
    seconds, result = _timed(lambda: _ours_prv_plan(params))
    rows.append({"case": "b", "what": plan_label, "seconds": seconds, **result})

    def dpa_pld_once() -> dict[str, Any]:
        from dp_accounting.pld import PLDAccountant

        acc = PLDAccountant()
        for q, sigma in params:
            acc.compose(_dpa_event(q, sigma, PLAN_STEPS))
        return {"epsilon": float(acc.get_epsilon(DELTA))}

    # prv-accountant on the whole plan takes ~6 min at eps_error 0.01 (a long-double grid of
    # millions of points per PRV); --quick runs it at its "typical" 0.1 instead, labelled.
    prv_eps_error = 0.1 if quick else 0.01

    def prv_once() -> dict[str, Any]:
        from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

        prvs = [PoissonSubsampledGaussianMechanism(q, s) for q, s in params]
        counts = [PLAN_STEPS] * len(prvs)
        acc = PRVAccountant(
            prvs=prvs, max_self_compositions=counts, eps_error=prv_eps_error, delta_error=DELTA / 1000
        )
        _, estimate, upper = acc.compute_epsilon(DELTA, counts)
        return {"epsilon": float(upper), "estimate": float(estimate)}

    for label, fn in [
        ("dp-accounting PLD, whole plan once", dpa_pld_once),
        (f"prv-accountant PRVAccountant, whole plan once (eps_error {prv_eps_error})", prv_once),
    ]:
        seconds, result, status = _capped(fn, 900.0)
        rows.append(
            {
                "case": "b",
                "what": label,
                "seconds": seconds,
                "status": status,
                "vs": plan_label,
                **(result or {}),
            }
        )

    cap = cap_s if cap_s is not None else (20.0 if quick else None)

    def dpa_rdp() -> dict[str, Any]:
        from dp_accounting.rdp import RdpAccountant

        acc = RdpAccountant()

        def step(i: int) -> float:
            q, sigma = params[i]
            acc.compose(_dpa_event(q, sigma, PLAN_STEPS))
            return float(acc.get_epsilon(DELTA))

        return _one_at_a_time(step, PLAN_ENTRIES, cap)

    def dpa_pld() -> dict[str, Any]:
        from dp_accounting.pld import PLDAccountant

        acc = PLDAccountant()

        def step(i: int) -> float:
            q, sigma = params[i]
            acc.compose(_dpa_event(q, sigma, PLAN_STEPS))
            return float(acc.get_epsilon(DELTA))

        return _one_at_a_time(step, PLAN_ENTRIES, cap)

    def prv_direct() -> dict[str, Any]:
        from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

        prvs = [PoissonSubsampledGaussianMechanism(q, s) for q, s in params]

        def step(i: int) -> float:
            counts = [PLAN_STEPS] * (i + 1)
            acc = PRVAccountant(
                prvs=prvs[: i + 1],
                max_self_compositions=counts,
                eps_error=0.01,
                delta_error=DELTA / 1000,
            )
            return float(acc.compute_epsilon(DELTA, counts)[2])

        return _one_at_a_time(step, PLAN_ENTRIES, cap)

    for label, fn in [
        ("dp-accounting RDP, get_epsilon after each admission", dpa_rdp),
        ("dp-accounting PLD, get_epsilon after each admission", dpa_pld),
        ("prv-accountant, recomputed after each admission (eps_error 0.01)", prv_direct),
    ]:
        result = fn()
        rows.append({"case": "b", "what": label, "vs": filter_label, **result})
    return rows


# ---------------------------------------------------------------------------------------------
# (c) one admission against a 10⁴-charge history
# ---------------------------------------------------------------------------------------------


def bench_history(quick: bool) -> list[dict[str, Any]]:
    try:
        from accountant import rules
    except ImportError as exc:  # pragma: no cover - depends on another module being present
        return [{"case": "c", "what": "rules.reserve", "status": f"accountant.rules missing: {exc}"}]
    rows: list[dict[str, Any]] = []
    params = _plan_parameters(20)
    history_events = [
        _entry_event(q, s, 1)
        for q, s in params  # 20 distinct one-step charges, cycled
    ]
    new_charge = rules.Charge(event=_entry_event(0.005, 1.3, 1))
    for accountant_name in ("rdp", "basic"):
        if accountant_name == "basic":
            history_events_used: list[ev.DpEvent] = [ev.PureDpEvent(1e-4 * (1 + i % 7)) for i in range(20)]
            new = rules.Charge(event=ev.LaplaceEvent(scale=1e4))
        else:
            history_events_used, new = history_events, new_charge
        budget = rules.Budget.create(
            rule="sequential", epsilon=Decimal(1000), delta=Decimal("1e-5"), accountant=accountant_name
        )
        state = rules.BatchState.empty()
        t0 = time.perf_counter()
        for i in range(HISTORY):
            charge = rules.Charge(event=history_events_used[i % len(history_events_used)])
            admission = rules.reserve(budget, state, charge)
            state = rules.commit(budget, admission.state, charge, admission.cost, None).state
        build_s = time.perf_counter() - t0
        timings = []
        for _ in range(50 if quick else 200):
            t0 = time.perf_counter()
            admission = rules.reserve(budget, state, new)
            timings.append(time.perf_counter() - t0)
        row: dict[str, Any] = {
            "case": "c",
            "what": f"rules.reserve, sequential/{accountant_name}, history of {HISTORY} charges",
            "seconds": statistics.median(timings),
            "p95_seconds": float(np.percentile(timings, 95)),
            "epsilon": float(admission.state.epsilon_spent + admission.state.epsilon_held),
            "epsilon_history": float(state.epsilon_spent),
            "history_build_seconds": build_s,
        }
        held = admission.state
        if accountant_name == "rdp" and held.rdp_spent is not None and budget.orders is not None:
            from accountant.exact import exact_add
            from accountant.rdp_filter import rdp_epsilon

            sums = [
                exact_add(a, b)
                for a, b in zip(
                    held.rdp_spent, held.rdp_held or [Decimal(0)] * len(held.rdp_spent), strict=True
                )
            ]
            row["epsilon_no_split"] = float(rdp_epsilon(sums, budget.orders, DELTA))
            row["admitted"] = HISTORY + 1
        rows.append(row)
    ours_label = f"rules.reserve, sequential/rdp, history of {HISTORY} charges"
    per_event = HISTORY // len(params)

    def dpa(kind: str) -> Callable[[], Any]:
        def run() -> Any:
            from dp_accounting.pld import PLDAccountant
            from dp_accounting.rdp import RdpAccountant

            acc = RdpAccountant() if kind == "rdp" else PLDAccountant()
            for q, sigma in params:
                acc.compose(_dpa_event(q, sigma, 1), per_event)
            t0 = time.perf_counter()
            acc.compose(_dpa_event(0.005, 1.3, 1))
            epsilon = float(acc.get_epsilon(DELTA))
            return {"admission_seconds": time.perf_counter() - t0, "epsilon": epsilon}

        return run

    def prv_recompute() -> Any:
        from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

        prvs = [PoissonSubsampledGaussianMechanism(q, s) for q, s in params]
        prvs.append(PoissonSubsampledGaussianMechanism(0.005, 1.3))
        counts = [per_event] * len(params) + [1]
        t0 = time.perf_counter()
        acc = PRVAccountant(prvs=prvs, max_self_compositions=counts, eps_error=0.01, delta_error=DELTA / 1000)
        upper = float(acc.compute_epsilon(DELTA, counts)[2])
        return {"admission_seconds": time.perf_counter() - t0, "epsilon": upper}

    for label, fn in [
        ("dp-accounting RDP: compose 1 + get_epsilon on the history", dpa("rdp")),
        ("dp-accounting PLD: compose 1 + get_epsilon on the history", dpa("pld")),
        ("prv-accountant: recompute with 1 more (eps_error 0.01)", prv_recompute),
    ]:
        _, result, status = _capped(fn, 600.0)
        row = {"case": "c", "what": label, "status": status, "vs": ours_label}
        if result:
            row.update(result)
            row["seconds"] = result["admission_seconds"]
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1e-2:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def _print_table(rows: list[dict[str, Any]]) -> None:
    """One line per measurement; "× ours" is the time over the like-for-like row of ours."""
    seconds_of = {(row["case"], row["what"]): row.get("seconds") for row in rows}
    print(f"{'case':<5}{'what':<68}{'time':>11}{'× ours':>10}{'epsilon':>11}  note")
    for row in rows:
        seconds = row.get("seconds")
        ratio = ""
        ours = seconds_of.get((row["case"], row.get("vs") or ""))
        if seconds and ours:
            ratio = f"{seconds / ours:,.0f}" if seconds / ours >= 100 else f"{seconds / ours:.1f}"
            row["ratio_to_ours"] = seconds / ours
        eps = row.get("epsilon")
        eps_text = "—" if eps is None else f"{eps:.4f}"
        notes = []
        if row.get("vs"):
            notes.append(f"vs '{row['vs']}'")
        if row.get("extrapolated"):
            notes.append(
                f"EXTRAPOLATED from {row['admissions_run']} admissions "
                f"({row['measured_seconds']:.1f} s measured); ε after {row['epsilon_after']}"
            )
        if row.get("status") not in (None, "ok"):
            notes.append(str(row["status"]))
        if row.get("method"):
            notes.append(f"method={row['method']}")
        if row.get("note"):
            notes.append(str(row["note"]))
        if "epsilon_no_split" in row:
            notes.append(
                f"ε = filter's guarantee (δ split over orders); same sums without split "
                f"{row['epsilon_no_split']:.4f}; {row['admitted']} admitted"
            )
        if "p95_seconds" in row:
            p95 = _fmt_seconds(row["p95_seconds"])
            notes.append(f"p95 {p95}, history built in {row['history_build_seconds']:.1f} s")
        timing = f"{_fmt_seconds(seconds):>11}{ratio:>10}{eps_text:>11}"
        print(f"{row['case']:<5}{row['what']:<68}{timing}  {'; '.join(notes)}")


def _warm_up() -> None:
    """Import every library once in the parent, so no timing includes an import."""
    import dp_accounting
    import prv_accountant  # noqa: F401
    from dp_accounting.pld import PLDAccountant  # noqa: F401
    from dp_accounting.rdp import RdpAccountant  # noqa: F401

    make_accountant("basic").compose(ev.LaplaceEvent(1.0)).get_epsilon(DELTA)
    for name in ("rdp", "prv"):
        make_accountant(name).compose(_entry_event(0.01, 1.0, 2)).get_epsilon(DELTA)
    dp_accounting.rdp.RdpAccountant().compose(_dpa_event(0.01, 1.0, 2)).get_epsilon(DELTA)
    try:
        import accountant.rdp_filter
        import accountant.rules  # noqa: F401
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="cap the slow competitors and extrapolate")
    parser.add_argument("--only", choices=("a", "b", "c"), action="append", help="run only these cases")
    parser.add_argument(
        "--cap",
        type=float,
        help="seconds each one-at-a-time competitor in (b) may run before extrapolating "
        "(default: 20 with --quick, none without)",
    )
    args = parser.parse_args(argv)
    cases = args.only or ["a", "b", "c"]
    load_before = os.getloadavg()
    _warm_up()
    rows: list[dict[str, Any]] = []
    if "a" in cases:
        rows += bench_homogeneous(args.quick)
    if "b" in cases:
        rows += bench_plan(args.quick, args.cap)
    if "c" in cases:
        rows += bench_history(args.quick)
    _print_table(rows)
    load_after = os.getloadavg()
    print(
        f"\nload average (1, 5, 15 min) before {load_before[0]:.1f} {load_before[1]:.1f} "
        f"{load_before[2]:.1f}, after {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f} "
        f"on {mp.cpu_count()} CPUs (other work on the machine slows every row alike)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join(["python", "bench/accountant.py", *(argv if argv is not None else sys.argv[1:])]),
        "delta": DELTA,
        "machine": {
            "python": platform.python_version(),
            "cpus": mp.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwritten: {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
