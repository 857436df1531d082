"""Why L2DP-ML is near chance: its trainer, outside the ledger, over a grid of ε, |B| and analysis.

Runs ``L2dpMlTrainer`` (the worker's code: perturbation, gradients, A-gem, θ1 projection) on the
first ``--tasks`` tasks of ``builtin:permuted-synthetic-digits`` with ε1 calibrated by
``epsilon1_for`` to each target ε, and prints, per (analysis, ε, |B|): ε1, the Laplace scales the
trainer draws with (per-coordinate input noise b_in = Δ_R/(ε1|B|), hidden-unit noise
b_h = 2Δ_R/(ε1|B|), label-coefficient noise Δ_L/ε2 relative to a class's |B|/K records), and the
average accuracy after the last task. ``--noiseless`` adds the same network with every noise
scale set to 0 (what the architecture can learn at all).

The figures it printed are in docs/experiments/lifelong.md ("Why L2DP-ML is near chance").
Example (2 shared CPU cores: about 2 minutes):

    nice -n 10 .venv/bin/python -m bench.l2dp_ml_utility --tasks 2 --per-task 10000 \\
        --epsilons 0.5 2 10 100 1000 --batch-sizes 1000 5000 --out /tmp/l2dp-utility.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.training.data import load_data
from service.training.l2dp_ml import L2dpMlParams, L2dpMlTrainer, epsilon1_for, noise_scales
from service.training.stages import LedgerBatch, LedgerTask


def ledger_tasks(data: Any, batch_size: int) -> tuple[list[LedgerTask], dict[str, tuple[str, ...]]]:
    """The source's tasks cut into fixed batches in source order, as a data owner would."""
    tasks, records = [], {}
    for split in data.train:
        ids = split.record_ids
        batches = []
        for position, start in enumerate(range(0, len(ids), batch_size)):
            batch_id = f"t{split.task}-b{position}"
            records[batch_id] = ids[start : start + batch_size]
            batches.append(LedgerBatch(batch_id, f"task-{split.task}", position, len(records[batch_id])))
        tasks.append(LedgerTask(f"task-{split.task}", split.task, f"task-{split.task}", tuple(batches)))
    return tasks, records


def run_one(data: Any, params: L2dpMlParams, batch_size: int, *, noiseless: bool) -> Mapping[str, Any]:
    trainer = L2dpMlTrainer(device="cpu")
    tasks, records = ledger_tasks(data, batch_size)
    state = trainer.start(params, data, tasks)
    if noiseless:
        state.scales = replace(state.scales, input=0.0, hidden=0.0, labels=0.0)
    metrics: Mapping[str, Any] = {}
    for stage in trainer.stages(params, tasks):
        metrics = trainer.train_stage(state, stage, data, {b: records[b] for b in stage.batch_ids}).metrics
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--per-task", type=int, default=10_000)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 2.0, 10.0, 100.0, 1000.0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--analyses", nargs="+", default=["sound", "paper"], choices=["sound", "paper"])
    parser.add_argument("--hidden-units", type=int, default=8)
    parser.add_argument("--theta1-norm-bound", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument(
        "--encoder-learning-rate", type=float, default=0.0005, help="under 'paper' (0 under 'sound')"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    uri = f"builtin:permuted-synthetic-digits?tasks={args.tasks}&per_task={args.per_task}&seed={args.seed}"
    data = load_data(uri)
    base = {
        "input_dim": 64,
        "hidden_units": args.hidden_units,
        "theta1_norm_bound": args.theta1_norm_bound,
        "epochs": args.epochs,
        "learning_rate": args.learning_rate,
        "encoder_learning_rate": args.encoder_learning_rate,
        "seed": args.seed,
    }
    rows = []
    header = (
        f"{'analysis':>9} {'eps':>7} {'|B|':>6} {'eps1':>10} {'b_in':>9} {'b_h':>9} {'chi3/sig':>9} "
        f"{'acc':>6} {'s':>5}"
    )
    print(f"L2DP-ML on {uri}, |h1|={args.hidden_units}, bound={args.theta1_norm_bound}, {args.epochs} epochs")
    print(header)
    for batch_size in args.batch_sizes:
        started = time.perf_counter()
        noiseless = run_one(
            data,
            L2dpMlParams.read({**base, "epsilon1": 1.0, "epsilon2": 1.0, "analysis": "paper"}),
            batch_size,
            noiseless=True,
        )
        rows.append(
            {
                "analysis": "noiseless",
                "batch_size": batch_size,
                "average_accuracy": noiseless["average_accuracy"],
            }
        )
        print(
            f"{'noiseless':>9} {'inf':>7} {batch_size:>6} {'-':>10} {0:>9} {0:>9} {0:>9} "
            f"{noiseless['average_accuracy']:>6.3f} {time.perf_counter() - started:>5.0f}"
        )
        for analysis in args.analyses:
            for epsilon in args.epsilons:
                started = time.perf_counter()
                epsilon2 = 0.5 * epsilon
                eps1 = epsilon1_for(
                    target_epsilon=epsilon,
                    epsilon2=epsilon2,
                    input_dim=64,
                    hidden_units=args.hidden_units,
                    batch_size=batch_size,
                    theta1_norm_bound=args.theta1_norm_bound,
                    analysis=analysis,
                )
                fixed_encoder = {"encoder_learning_rate": 0.0} if analysis == "sound" else {}
                params = L2dpMlParams.read(
                    {**base, "epsilon1": eps1, "epsilon2": epsilon2, "analysis": analysis, **fixed_encoder}
                )
                trainer = L2dpMlTrainer(device="cpu")
                event = trainer.stages(params, ledger_tasks(data, batch_size)[0])[0].event
                scales = noise_scales(event)  # type: ignore[arg-type]
                # χ3 on a class's summed coefficient against that sum (|B|/K records, |hπ| ≤ 1 each)
                chi3_ratio = scales.labels / (batch_size / data.num_classes)
                metrics = run_one(data, params, batch_size, noiseless=False)
                row = {
                    "analysis": analysis,
                    "epsilon": epsilon,
                    "batch_size": batch_size,
                    "epsilon1": eps1,
                    "input_noise_scale": scales.input,
                    "hidden_noise_scale": scales.hidden,
                    "label_noise_relative": chi3_ratio,
                    "average_accuracy": metrics["average_accuracy"],
                }
                rows.append(row)
                print(
                    f"{analysis:>9} {epsilon:>7g} {batch_size:>6} {eps1:>10.3g} {scales.input:>9.3g} "
                    f"{scales.hidden:>9.3g} {chi3_ratio:>9.3g} {metrics['average_accuracy']:>6.3f} "
                    f"{time.perf_counter() - started:>5.0f}"
                )
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {"source": uri, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2
            )
        )


if __name__ == "__main__":
    main()
