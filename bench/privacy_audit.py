"""Privacy-audit figures: the one-run ε lower bound next to the certified upper bound.

Run ``nice -n 10 python bench/privacy_audit.py [--quick] [--canaries 1000] [--epsilons 1 2 4 8]`` from
the repository root. Prints a table and writes ``bench/results/privacy_audit.json``
(``privacy_audit-m<canaries>.json`` for another canary count).

For each target ε (δ = 1e-5) the same DP-SGD run on ``builtin:digits`` (the default MLP, 10
epochs, expected batch 64, C = 1, σ calibrated by the RDP accountant, as a ``dp_sgd`` job with
``target_epsilon`` runs) is trained by ``service.training.privacy_audit.PrivacyAuditTrainer`` with
m Dirac canaries, and audited at 95% confidence (``accountant.privacy_audit.audit``):

* ``correct`` — the run as released;
* ``no_noise``, ``no_clipping``, ``sigma_over_10`` — the same plan (so the same ε would be
  certified) with privacy broken in the training code (the self-test's breakages).

Per run: the lower bound, the guesses made and right, the accountant's upper bound ε, test
accuracy and wall time; per ε, the wall time of the plain ``dp_sgd`` run of the same plan (what
the canaries cost) and the *ceiling*: the bound m canaries give when every guess of the largest
guess count is right (no audit of m canaries can report more). ``--seeds`` repeats every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
VARIANTS: tuple[str | None, ...] = (None, "no_noise", "no_clipping", "sigma_over_10")
DELTA = 1e-5
CONFIDENCE = 0.95


def ceiling(canaries: int) -> float:
    """The bound when every guess of the largest default guess count is right."""
    from accountant.privacy_audit import default_guess_counts, epsilon_lower_bound

    counts = default_guess_counts(canaries)
    k_positive, k_negative = max(counts, key=sum)
    share = 1 - (1 - CONFIDENCE) / len(counts)
    r = k_positive + k_negative
    return epsilon_lower_bound(canaries=canaries, guesses=r, correct=r, delta=DELTA, confidence=share)


def run_one(
    data: Any, epsilon: float, variant: str | None, canaries: int, epochs: float, seed: int
) -> dict[str, Any]:
    from service.training.privacy_audit import PrivacyAuditTrainer

    trainer = PrivacyAuditTrainer(device="cpu", breakage=variant)  # type: ignore[arg-type]
    params = {
        "target_epsilon": epsilon,
        "delta": DELTA,
        "epochs": epochs,
        "canaries": canaries,
        "confidence": CONFIDENCE,
        "seed": seed,
    }
    plan = trainer.plan(params, data.n_records)
    started = time.perf_counter()
    result = trainer.train(data, plan)
    wall = time.perf_counter() - started
    audit = result.metrics["privacy_audit"]
    return {
        "variant": variant or "correct",
        "epsilon_target": epsilon,
        "epsilon_upper": audit["accountant_epsilon"],
        "epsilon_lower": audit["epsilon_lower"],
        "guesses": audit["guesses"],
        "correct": audit["correct"],
        "noise_multiplier": plan.noise_multiplier,
        "steps": plan.steps,
        "test_accuracy": result.metrics.get("test_accuracy"),
        "wall_s": wall,
        "seed": seed,
    }


def plain_wall_s(data: Any, epsilon: float, epochs: float, seed: int) -> float:
    from service.training.dp_sgd import DpSgdTrainer

    trainer = DpSgdTrainer(device="cpu")
    plan = trainer.plan(
        {"target_epsilon": epsilon, "delta": DELTA, "epochs": epochs, "seed": seed}, data.n_records
    )
    started = time.perf_counter()
    trainer.train(data, plan)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--epochs", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="ε = 2 only, one seed")
    args = parser.parse_args(argv)
    import torch

    from service.training.data import load_data

    torch.set_num_threads(args.threads)
    epsilons = [2.0] if args.quick else args.epsilons
    data = load_data("builtin:digits")
    run_one(data, epsilons[0], None, args.canaries, args.epochs, 0)  # warm-up (tracing), untimed
    runs: list[dict[str, Any]] = []
    plain: dict[str, float] = {}
    for epsilon in epsilons:
        plain[str(epsilon)] = statistics.mean(
            plain_wall_s(data, epsilon, args.epochs, s) for s in range(args.seeds)
        )
        for variant in VARIANTS:
            for seed in range(1, args.seeds + 1):
                runs.append(run_one(data, epsilon, variant, args.canaries, args.epochs, seed))
    top = ceiling(args.canaries)

    print(
        f"one-run audit, builtin:digits, m = {args.canaries} canaries, confidence {CONFIDENCE}, δ = {DELTA}, "
        f"ceiling ε ≥ {top:.3f}"
    )
    header = ("ε target", "σ", "ε upper", "variant", "ε lower", "right/guesses", "acc", "s")
    print("".join(f"{h:>14}" for h in header))
    for r in runs:
        cells = (
            f"{r['epsilon_target']:g}",
            f"{r['noise_multiplier']:.3f}",
            f"{r['epsilon_upper']:.3f}",
            r["variant"],
            f"{r['epsilon_lower']:.3f}",
            f"{r['correct']}/{r['guesses']}",
            f"{r['test_accuracy']:.3f}",
            f"{r['wall_s']:.2f}",
        )
        print("".join(f"{c:>14}" for c in cells))
    for epsilon, wall in plain.items():
        print(f"plain dp_sgd at ε = {epsilon}: {wall:.2f} s")
    payload = {
        "config": {
            "canaries": args.canaries,
            "epochs": args.epochs,
            "seeds": args.seeds,
            "threads": args.threads,
            "delta": DELTA,
            "confidence": CONFIDENCE,
            "data": "builtin:digits",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "ceiling": top,
        "plain_dp_sgd_wall_s": plain,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "privacy_audit.json" if args.canaries == 1000 else f"privacy_audit-m{args.canaries}.json"
    (RESULTS / name).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
