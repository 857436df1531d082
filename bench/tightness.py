"""What the default accountant (``tight``) admits, next to plain RDP composition and dp-accounting's
PLD, on the audit's cases of issue 25, side by side in one run.

Run ``python bench/tightness.py`` from the repository root (a few minutes). Prints one table per
case and writes ``bench/results/tightness.json``. Every ledger figure comes from
``accountant.rules.reserve`` / ``commit`` on a fresh batch, exactly as the service decides it.

* **lone run** — the issue's Opacus run (builtin:digits at expected batch 64: q = 1/23, 115 steps,
  δ = 1e-5; σ = 2.03125, Opacus's PRV calibration to ε = 1) on a budget of 1: our charge, the Rényi
  filter's (``rdp``), plain RDP (dp-accounting's RDP accountant at δ), dp-accounting's PLD
  (pessimistic), and our charge over PLD.
* **k runs chosen adaptively** — k identical DP-SGD runs (q 0.01, 300 steps) on (ε, δ) = (2,
  1e-5): the smallest σ (on a 1e-3 grid) at which all k are admitted by ``tight``, by ``rdp``, and
  at which k runs fit non-adaptively under plain RDP and under PLD; "used" is the PLD ε of the k
  runs at that σ over ε: the share of the tight capacity each rule lets the analyst use.
* **streams** — how many copies of a charge a batch admits: the chunk stream (q 0.01, σ 1, 10
  steps on (2, 1e-6)), pure ε = 0.05, Laplace b = 20 and Gaussian σ = 20 on (1, 1e-5); next to
  plain RDP composition at the whole δ and PLD (the tight non-adaptive capacity).

Figures are exact computations, not timings: load on the machine does not move them.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

from accountant import events as ev  # noqa: E402
from accountant import rules  # noqa: E402
from accountant.exact import to_text  # noqa: E402
from accountant.rdp import DEFAULT_ORDERS  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "tightness.json"


def _dpsgd(q: float, sigma: float, steps: int) -> ev.DpEvent:
    return ev.SelfComposedEvent(ev.PoissonSampledEvent(q, ev.GaussianEvent(sigma)), steps)


def _dpa(event: ev.DpEvent) -> Any:
    import dp_accounting

    if isinstance(event, ev.SelfComposedEvent):
        return dp_accounting.SelfComposedDpEvent(_dpa(event.event), event.count)
    if isinstance(event, ev.PoissonSampledEvent):
        return dp_accounting.PoissonSampledDpEvent(event.sampling_probability, _dpa(event.event))
    if isinstance(event, ev.GaussianEvent):
        return dp_accounting.GaussianDpEvent(event.noise_multiplier)
    if isinstance(event, ev.LaplaceEvent):
        return dp_accounting.LaplaceDpEvent(event.scale)
    raise TypeError(event.kind)


def pld_epsilon(event: ev.DpEvent, count: int, delta: float) -> float:
    """dp-accounting's PLD ε (pessimistic) of ``count`` copies of ``event`` at δ. Pure ε-DP
    charges: the composition of their worst-case pair (randomized response)."""
    from dp_accounting.pld import PLDAccountant, privacy_loss_distribution

    if isinstance(event, ev.PureDpEvent):
        from dp_accounting.pld.common import DifferentialPrivacyParameters

        one = privacy_loss_distribution.from_privacy_parameters(
            DifferentialPrivacyParameters(float(event.epsilon), 0.0), value_discretization_interval=1e-4
        )
        return float(one.self_compose(count).get_epsilon_for_delta(delta))
    accountant = PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(_dpa(event), count)
    return float(accountant.get_epsilon(delta))


def rdp_epsilon(event: ev.DpEvent, count: int, delta: float) -> float:
    """Plain RDP composition: dp-accounting's RDP accountant on our accountant's order grid."""
    from dp_accounting.rdp import RdpAccountant

    if isinstance(event, ev.PureDpEvent):
        from accountant.rdp import RdpAccountant as Ours

        return Ours().compose(event, count).get_epsilon(delta).upper
    accountant = RdpAccountant(orders=list(DEFAULT_ORDERS))
    accountant.compose(_dpa(event), count)
    return float(accountant.get_epsilon(delta))


def admitted(budget: rules.Budget, events: list[ev.DpEvent], cap: int) -> int:
    """How many of ``events`` (cycled) a fresh batch admits, reserved and committed in turn."""
    state = rules.BatchState()
    for n in range(cap):
        charge = rules.Charge(events[n % len(events)])
        try:
            admission = rules.reserve(budget, state, charge)
        except rules.BudgetExceeded:
            return n
        state = rules.commit(budget, admission.state, charge, admission.cost, None).state
    return cap


def largest_count(fits: Any, cap: int) -> int:
    """The largest n ≤ cap with fits(n) (fits monotone decreasing in n)."""
    lo, hi = 0, 1
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def smallest_sigma(fits: Any, lo: float = 0.3, hi: float = 40.0) -> float:
    """The smallest σ on a 1e-3 grid with fits(σ) (fits monotone increasing in σ)."""
    for _ in range(40):
        if hi - lo <= 1e-3:
            break
        mid = (lo + hi) / 2.0
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return math.ceil(hi * 1000.0) / 1000.0


def lone_run() -> dict[str, Any]:
    event, delta = _dpsgd(1 / 23, 2.03125, 115), 1e-5
    out: dict[str, Any] = {"case": "Opacus run, q 1/23, 115 steps, sigma 2.03125, budget (1, 1e-5)"}
    for accountant in ("tight", "rdp"):
        budget = rules.Budget.create(rule="sequential", epsilon="1", delta="1e-5", accountant=accountant)
        try:
            cost = rules.reserve(budget, rules.BatchState(), rules.Charge(event)).cost
            out[accountant] = float(cost.epsilon)
        except rules.BudgetExceeded as refused:
            out[accountant] = f"refused ({to_text(refused.requested.epsilon)})"
    out["plain RDP"] = rdp_epsilon(event, 1, delta)
    out["PLD"] = pld_epsilon(event, 1, delta)
    out["tight / PLD"] = out["tight"] / out["PLD"] if isinstance(out["tight"], float) else None
    return out


def k_runs(k: int, epsilon: str = "2", delta: float = 1e-5, steps: int = 300) -> dict[str, Any]:
    def run(sigma: float) -> ev.DpEvent:
        return _dpsgd(0.01, sigma, steps)

    def ledger(accountant: str) -> float:
        budget = rules.Budget.create(
            rule="sequential", epsilon=epsilon, delta=repr(delta), accountant=accountant
        )
        return smallest_sigma(lambda s: admitted(budget, [run(s)], k) >= k)

    eps = float(epsilon)
    sigmas = {
        "tight": ledger("tight"),
        "rdp": ledger("rdp"),
        "plain RDP": smallest_sigma(lambda s: rdp_epsilon(run(s), k, delta) <= eps),
        "PLD": smallest_sigma(lambda s: pld_epsilon(run(s), k, delta) <= eps),
    }
    used = {name: pld_epsilon(run(s), k, delta) / eps for name, s in sigmas.items()}
    return {
        "case": f"{k} run(s), q 0.01, {steps} steps, budget ({epsilon}, {delta:g})",
        "sigma": sigmas,
        "used": used,
        "tight / PLD capacity": used["tight"] / used["PLD"],
    }


def stream(label: str, event: ev.DpEvent, epsilon: str, delta: str, cap: int) -> dict[str, Any]:
    eps, dlt = float(epsilon), float(delta)
    counts: dict[str, Any] = {}
    for accountant in ("tight", "rdp"):
        budget = rules.Budget.create(rule="sequential", epsilon=epsilon, delta=delta, accountant=accountant)
        counts[accountant] = admitted(budget, [event], cap)
    counts["plain RDP"] = largest_count(lambda n: rdp_epsilon(event, n, dlt) <= eps, cap)
    counts["PLD"] = largest_count(lambda n: pld_epsilon(event, n, dlt) <= eps, cap)
    counts["tight / PLD"] = counts["tight"] / counts["PLD"] if counts["PLD"] else None
    return {"case": f"{label}, budget ({epsilon}, {delta})", "admitted": counts}


def main() -> int:
    results: dict[str, Any] = {"lone run": lone_run()}
    print("## Lone run (the issue's Opacus run)")
    print(json.dumps(results["lone run"], indent=2))
    results["k runs"] = []
    print("\n## k identical runs chosen adaptively: smallest sigma admitted, share of PLD capacity used")
    print("| k | tight | rdp | plain RDP | PLD | tight / PLD capacity |")
    print("|---|---|---|---|---|---|")
    for k in (1, 2, 3, 5, 10):
        row = k_runs(k)
        results["k runs"].append(row)
        u = row["used"]
        print(
            f"| {k} | {u['tight']:.3f} | {u['rdp']:.3f} | {u['plain RDP']:.3f} | {u['PLD']:.3f} | "
            f"{row['tight / PLD capacity']:.3f} |"
        )
    results["streams"] = []
    print("\n## Streams: charges admitted on one batch")
    print("| stream | tight | rdp | plain RDP | PLD | tight / PLD |")
    print("|---|---|---|---|---|---|")
    for label, event, eps, dlt, cap in (
        ("chunks q 0.01 sigma 1 x10 steps", _dpsgd(0.01, 1.0, 10), "2", "1e-6", 400),
        ("pure epsilon 0.05", ev.PureDpEvent(0.05), "1", "1e-5", 2000),
        ("Laplace b 20", ev.LaplaceEvent(20.0), "1", "1e-5", 2000),
        ("Gaussian sigma 20", ev.GaussianEvent(20.0), "1", "1e-5", 2000),
    ):
        row = stream(label, event, eps, dlt, cap)
        results["streams"].append(row)
        c = row["admitted"]
        ratio = "-" if c["tight / PLD"] is None else f"{c['tight / PLD']:.3f}"
        print(f"| {row['case']} | {c['tight']} | {c['rdp']} | {c['plain RDP']} | {c['PLD']} | {ratio} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
