"""``ledger experiment lifelong``: the sound lifelong learner vs NaiveGaussian, over seeds.

The claim (lifelong-dp-l2dp-ml.txt, Thm. 1 vs Thm. 2; docs/experiments/lifelong.md): a learner that
perturbs every fixed, disjoint batch once keeps one batch's ε for the whole lifelong run, and so
learns better at equal ε than NaiveGaussian (DP-SGD + A-gem), whose ε grows with the tasks. The
learner here is the functional mechanism proper (``l2dp_ml`` with ``perturbation:
"functional_mechanism"``, ``service.training.functional_mechanism``); Alg. 2's perturbation is the
historical variant (``bench/l2dp_ml_utility.py``).

For each task sequence (``split``: builtin:split-digits, the paper's split-MNIST shape of 5 tasks
of 2 classes; ``permuted``: builtin:permuted-digits), each seed and each ε, every private model
is a job behind the release gate of one embedded ledger:

1. ``l2dp_ml`` (functional mechanism, one shared head, the whole perturbed past as memory) on a
   ``lifelong``/``rdp`` dataset of budget (ε, δ), σ the smallest that fits its Rényi filter;
2. the same with ``multi_head`` and the same seed: every read replays committed noise (free);
3. ``naive_gaussian`` on a ``sequential``/``rdp`` dataset of the same budget, σ such that all
   tasks fit.

Outside the ledger, **non-private** (ε = ∞): the functional-mechanism learner without noise,
noiseless A-gem, and joint training of A-gem's network on every task at once (the ceiling).
Reports the average accuracy after the last task, mean ± standard deviation over seeds, the
margin of the learner over NaiveGaussian (paired by seed), each dataset's ledger ε after the first
and the last task, and the paper's own numbers in columns marked as the paper's (MNIST, a CNN).
Writes ``report.json``, ``report.md`` (the table in markdown under the command, machine and load
that produced it, and the claims read off it; ``--markdown`` copies it elsewhere), ``accuracy.png``
and ``epsilon.png``.
"""

from __future__ import annotations

import argparse
import time
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

import numpy as np

from service.experiments.embedded import EmbeddedLedger, JobResult, RegisteredDataset
from service.experiments.report import (
    markdown_table,
    provenance,
    provenance_lines,
    pyplot,
    save_figure,
    table,
    write_json,
)
from service.ledger import certificates

DELTA: Final = "1e-5"
SEQUENCES: Final = ("split", "permuted")

PAPER: Final[dict[str, dict[str, Any]]] = {
    # lifelong-dp-l2dp-ml.txt, "Results in Split Tasks" (split MNIST, 5 tasks, after task 5)
    "split": {
        "dataset": "split MNIST, 5 tasks (paper, a CNN)",
        "l2dp_ml": {0.5: 0.7354, 1.0: 0.8183},
        "agem": 0.7971,
    },
    # "Results in Permuted MNIST" (20 tasks, after task 20)
    "permuted": {
        "dataset": "permuted MNIST, 20 tasks (paper, a CNN)",
        "l2dp_ml": {0.5: 0.4773},
        "naive_gaussian": {0.5: 0.1043},
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 5; --quick 1)")
    parser.add_argument(
        "--epsilons", type=float, nargs="+", default=None, help="budgets ε (default 0.5 1 2; --quick 1)"
    )
    parser.add_argument(
        "--sequences", choices=SEQUENCES, nargs="+", default=list(SEQUENCES), help="task sequences"
    )
    parser.add_argument("--split-tasks", type=int, default=5, help="split-digits tasks (≤ 10; --quick ≤ 3)")
    parser.add_argument(
        "--permuted-tasks", type=int, default=None, help="permuted-digits tasks (default 10; --quick 2)"
    )
    parser.add_argument(
        "--per-task",
        type=int,
        default=None,
        help="records per task: the synthetic digits at this size (builtin:<sequence>-synthetic-digits, "
        "the bundled digits' templates warped, one independent draw per record) instead of the 1 437 "
        "bundled digits shared out among the tasks (default)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=300, help="records per fixed ledger batch (both datasets)"
    )
    parser.add_argument(
        "--features",
        type=int,
        nargs=2,
        default=[64, 16],
        metavar=("SPLIT", "PERMUTED"),
        help="the learner's random features p on split and on permuted tasks",
    )
    parser.add_argument(
        "--regularization",
        type=float,
        nargs=2,
        default=[30.0, 10.0],
        metavar=("SPLIT", "PERMUTED"),
        help="the learner's ridge λ on split and on permuted tasks",
    )
    parser.add_argument(
        "--memory-per-task",
        type=int,
        default=None,
        help="perturbed batches of each task the shared head keeps (default: all)",
    )
    parser.add_argument(
        "--naive-epochs", type=int, default=None, help="NaiveGaussian epochs per task (default 5; --quick 1)"
    )
    parser.add_argument("--naive-learning-rate", type=float, default=0.5, help="NaiveGaussian's SGD rate")
    parser.add_argument(
        "--sampling-probability", type=float, default=0.2, help="NaiveGaussian's Poisson sampling q"
    )
    parser.add_argument(
        "--agem-epochs", type=int, default=None, help="A-gem epochs per task (default 5; --quick 1)"
    )
    parser.add_argument("--agem-learning-rate", type=float, default=0.1, help="A-gem's SGD rate")
    parser.add_argument("--agem-batch-size", type=int, default=32, help="A-gem's batch size")
    parser.add_argument(
        "--agem-memory", type=int, default=4, help="A-gem's episodic memory: batches kept per task"
    )
    parser.add_argument(
        "--baseline-seeds",
        type=int,
        default=None,
        help="seeds of the non-private baselines, the first ones (default: all; they are the costly part)",
    )
    parser.add_argument("--markdown", type=Path, default=None, help="also write report.md here")
    parser.add_argument(
        "--joint-epochs", type=int, default=None, help="joint training epochs (default 30; --quick 2)"
    )


def _uri(sequence: str, tasks: int, seed: int, per_task: int | None = None) -> str:
    if per_task is not None:
        return f"builtin:{sequence}-synthetic-digits?tasks={tasks}&per_task={per_task}&seed={seed}"
    return f"builtin:{sequence}-digits?tasks={tasks}&seed={seed}"


def _ledger_epsilons(ledger: EmbeddedLedger, result: JobResult) -> list[float]:
    """The dataset's ε right after each of the job's releases (certificates' results)."""
    return [
        float(
            certificates.get_certificate(ledger.db, "experiments", v.certificate_id)["certificate"]["result"][
                "epsilon"
            ]
        )
        for v in result.versions
    ]


def _checked(result: JobResult, what: str) -> JobResult:
    if result.status != "succeeded":
        raise RuntimeError(f"{what} did not succeed: {result.job.error}")
    return result


def _register(
    ledger: EmbeddedLedger, uri: str, name: str, rule: str, epsilon: float, batch_size: int
) -> RegisteredDataset:
    """``uri``'s records as a new dataset ``name`` under an ``rdp`` budget of ``rule`` at ε."""
    budget = {"rule": rule, "epsilon": repr(epsilon), "delta": DELTA, "accountant": "rdp"}
    return ledger.register_source(uri, name=name, budget=budget, batch_size=batch_size)


def _noiseless_functional(uri: str, params: dict[str, Any], batch_size: int) -> float:
    """The functional-mechanism learner without its noise, outside the ledger (non-private): the
    same encoder, batches, memory and heads; average accuracy after the last task."""
    from service.contract.job_params import FunctionalMechanismParams
    from service.training.data import load_data
    from service.training.functional_mechanism import FunctionalMechanismTrainer
    from service.training.stages import LedgerBatch, LedgerTask

    data = load_data(uri)
    tasks, records = [], {}
    for split in data.train:
        ids = split.record_ids
        batches = []
        for position, start in enumerate(range(0, len(ids), batch_size)):
            batch_id = f"t{split.task}-b{position}"
            records[batch_id] = tuple(ids[start : start + batch_size])
            batches.append(LedgerBatch(batch_id, f"t{split.task}", position, len(records[batch_id])))
        tasks.append(LedgerTask(f"t{split.task}", split.task, f"task-{split.task}", tuple(batches)))
    trainer = FunctionalMechanismTrainer()
    parsed = FunctionalMechanismParams.read(params)
    state = trainer.start(parsed, data, tasks)
    state.stddev = 0.0  # no noise: not private
    metrics: dict[str, Any] = {}
    for stage in trainer.stages(parsed, tasks):
        metrics = dict(
            trainer.train_stage(state, stage, data, {b: records[b] for b in stage.batch_ids}).metrics
        )
    return float(metrics["average_accuracy"])


def _mean_std(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0


def _pm(values: list[float]) -> str:
    if not values:
        return "-"
    mean, std = _mean_std(values)
    return f"{mean:.3f} ± {std:.3f}"


def run(args: argparse.Namespace) -> int:
    from service.training.data import load_data
    from service.training.functional_mechanism import noise_multiplier_for_budget
    from service.training.lifelong_baselines import train_joint, train_noiseless_agem

    quick = bool(args.quick)
    seeds = args.seeds or (1 if quick else 5)
    epsilons = args.epsilons or ([1.0] if quick else [0.5, 1.0, 2.0])
    tasks_of = {
        "split": args.split_tasks if not quick else min(args.split_tasks, 3),
        "permuted": args.permuted_tasks or (2 if quick else 10),
    }
    naive_epochs = args.naive_epochs or (1 if quick else 5)
    agem_epochs = args.agem_epochs or (1 if quick else 5)
    joint_epochs = args.joint_epochs or (2 if quick else 30)
    out: Path = args.out
    started = time.perf_counter()
    sigma = {eps: noise_multiplier_for_budget(epsilon=eps, delta=float(DELTA)) for eps in epsilons}
    learners: dict[str, dict[str, Any]] = {
        sequence: {
            "perturbation": "functional_mechanism",
            "features": args.features[i],
            "regularization": args.regularization[i],
            **({"memory_per_task": args.memory_per_task} if args.memory_per_task is not None else {}),
        }
        for i, sequence in enumerate(SEQUENCES)
    }
    runs: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    with EmbeddedLedger(out, database_url=args.database_url, device=args.device) as ledger:
        for sequence in args.sequences:
            tasks = tasks_of[sequence]
            learner = learners[sequence]
            for seed in range(args.seed, args.seed + seeds):
                uri = _uri(sequence, tasks, seed, args.per_task)
                data = load_data(uri)
                if args.baseline_seeds is not None and seed >= args.seed + args.baseline_seeds:
                    agem = []
                else:
                    agem = train_noiseless_agem(
                        data,
                        task_order=list(range(tasks)),
                        batch_size=args.agem_batch_size,
                        epochs=[agem_epochs] * tasks,
                        learning_rate=args.agem_learning_rate,
                        memory_per_task=args.agem_memory,
                        seed=seed,
                        device=args.device,
                    )
                if agem:
                    joint = train_joint(data, epochs=joint_epochs, seed=seed, device=args.device)
                    baselines.append(
                        {
                            "sequence": sequence,
                            "seed": seed,
                            "fm_noiseless": _noiseless_functional(
                                uri, {**learner, "noise_multiplier": 1.0, "seed": seed}, args.batch_size
                            ),
                            "fm_multi_noiseless": _noiseless_functional(
                                uri,
                                {**learner, "noise_multiplier": 1.0, "seed": seed, "multi_head": True},
                                args.batch_size,
                            ),
                            "agem": agem[-1]["average_accuracy"],
                            "agem_multi": agem[-1]["multi_head_average_accuracy"],
                            "agem_forgetting": agem[-1].get("average_forgetting", 0.0),
                            "joint": joint["average_accuracy"],
                        }
                    )
                for eps in epsilons:
                    tag = f"{sequence}-{seed}-{eps:g}"
                    lifelong = _register(ledger, uri, f"fm-{tag}", "lifelong", eps, args.batch_size)
                    params = {**learner, "noise_multiplier": sigma[eps], "seed": seed}
                    shared = _checked(
                        ledger.run_job(lifelong, "l2dp_ml", params, model_name=f"fm-{tag}"), f"fm {tag}"
                    )
                    multi = _checked(
                        ledger.run_job(
                            lifelong, "l2dp_ml", {**params, "multi_head": True}, model_name=f"fm-multi-{tag}"
                        ),
                        f"fm multi-head {tag}",
                    )
                    sequential = _register(ledger, uri, f"naive-{tag}", "sequential", eps, args.batch_size)
                    naive = _checked(
                        ledger.run_job(
                            sequential,
                            "naive_gaussian",
                            {
                                "target_budget_epsilon": eps,
                                "delta": float(DELTA),
                                "epochs": naive_epochs,
                                "learning_rate": args.naive_learning_rate,
                                "sampling_probability": args.sampling_probability,
                                "seed": seed,
                            },
                            model_name=f"naive-{tag}",
                        ),
                        f"naive_gaussian {tag}",
                    )
                    fm_eps = _ledger_epsilons(ledger, shared)
                    runs.append(
                        {
                            "sequence": sequence,
                            "seed": seed,
                            "epsilon": eps,
                            "fm": shared.versions[-1].metrics["average_accuracy"],
                            "fm_forgetting": shared.versions[-1].metrics.get("average_forgetting", 0.0),
                            "fm_multi": multi.versions[-1].metrics["average_accuracy"],
                            "naive": naive.versions[-1].metrics["average_accuracy"],
                            "naive_multi": naive.versions[-1].metrics["multi_head_average_accuracy"],
                            "naive_forgetting": naive.versions[-1].metrics.get("average_forgetting", 0.0),
                            "fm_ledger_epsilon": fm_eps,
                            "fm_ledger_epsilon_after_multi_head": float(multi.spend.spent.epsilon_spent),
                            "naive_ledger_epsilon": _ledger_epsilons(ledger, naive),
                            "naive_noise_multiplier": naive.versions[0].metrics["noise_multiplier"],
                        }
                    )
    rows = _rows(runs, baselines, args.sequences, epsilons)
    data_name = (
        "digits" if args.per_task is None else f"the synthetic digits ({args.per_task} records a task)"
    )
    title = (
        f"Lifelong DP on {data_name}, budget (ε, {DELTA}) per dataset, {seeds} seed(s), mean ± std of the "
        "average accuracy after the last task. fm = functional mechanism (random features p and "
        "ridge λ: "
        + ", ".join(
            f"{q} p = {learners[q]['features']}, λ = {learners[q]['regularization']:g}"
            for q in args.sequences
        )
        + f"; batches of {args.batch_size}), σ by ε: "
        + ", ".join(f"{e:g}: {sigma[e]:.4g}" for e in epsilons)
        + f"; naiveG = DP-SGD + A-gem ({naive_epochs} epochs/task, q = {args.sampling_probability:g}).\n"
        "* non-private (ε = ∞): fm_noiseless, agem (memory "
        f"{args.agem_memory} batches/task, lr {args.agem_learning_rate:g}), joint (all tasks at once: "
        "the ceiling). paper_*: the paper's figures on MNIST with a CNN, not ours."
        + (
            "\n* permuted tasks all hold the ten classes, so naiveG_multi is naiveG (one network, "
            "argmax over all classes), while fm_multi picks the task's own head by its identity at "
            "test time: the like-for-like comparison on permuted tasks is the shared head (fm vs naiveG)."
            if "permuted" in args.sequences
            else ""
        )
    )
    columns = list(rows[0])
    text = table(rows, columns, title=title)
    print(text)
    elapsed = time.perf_counter() - started
    print(f"wall time: {elapsed:.1f} s")
    claims = _claims(runs, args.sequences, epsilons)
    report = {
        "experiment": "lifelong",
        "quick": quick,
        "seeds": list(range(args.seed, args.seed + seeds)),
        "budget_delta": DELTA,
        "noise_multiplier": {repr(e): sigma[e] for e in epsilons},
        "learner": {q: learners[q] for q in args.sequences},
        "batch_size": args.batch_size,
        "tasks": tasks_of,
        "per_task": args.per_task,
        "sources": {q: _uri(q, tasks_of[q], args.seed, args.per_task) for q in args.sequences},
        "naive_gaussian": {
            "epochs": naive_epochs,
            "learning_rate": args.naive_learning_rate,
            "sampling_probability": args.sampling_probability,
        },
        "agem": {
            "private": False,
            "epochs": agem_epochs,
            "learning_rate": args.agem_learning_rate,
            "batch_size": args.agem_batch_size,
            "memory_per_task": args.agem_memory,
        },
        "joint": {"private": False, "epochs": joint_epochs},
        "paper": {k: {**v, "marked": "the paper's numbers (MNIST), not ours"} for k, v in PAPER.items()},
        "rows": rows,
        "runs": runs,
        "baselines": baselines,
        "claims": claims,
        "wall_time_s": elapsed,
        "table": text,
    }
    report["provenance"] = provenance("lifelong", args.device, elapsed)
    write_json(out, _json_safe(report))
    markdown = _markdown(title, rows, claims, report["provenance"])
    (out / "report.md").write_text(markdown)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown)
    _plots(out, runs, args.sequences, epsilons)
    return 0


def _markdown(title: str, rows: list[dict[str, Any]], claims: dict[str, Any], origin: dict[str, Any]) -> str:
    """The table as markdown under its provenance, and the done criterion read off each cell."""
    lines = [*provenance_lines(origin), "", title.replace("\n", "\n\n"), "", markdown_table(rows), ""]
    for cell, claim in claims.items():
        verdict = {True: "more than", False: "not more than", None: "one seed: no spread for"}
        lines.append(
            f"- {cell}: fm − naiveG = {claim['margin_mean']:+.3f} ± {claim['margin_std']:.3f} "
            f"({verdict[claim['beats_naive_by_2_std']]} 2 std); multi-head "
            f"{claim['multi_head_margin_mean']:+.3f} ± {claim['multi_head_margin_std']:.3f} "
            f"({verdict[claim['multi_head_beats_naive_by_2_std']]} 2 std); fm ledger ε flat over tasks: "
            f"{'yes' if claim['fm_epsilon_flat'] else 'NO'}; multi-head replays free: "
            f"{'yes' if claim['multi_head_replays_free'] else 'NO'}; NaiveGaussian's ε grows: "
            f"{'yes' if claim['naive_epsilon_grows'] else 'no'}"
        )
    return "\n".join(lines) + "\n"


def _rows(
    runs: list[dict[str, Any]], baselines: list[dict[str, Any]], sequences: list[str], epsilons: list[float]
) -> list[dict[str, Any]]:
    rows = []
    for sequence in sequences:
        base = [b for b in baselines if b["sequence"] == sequence]
        paper = PAPER[sequence]
        for eps in epsilons:
            cell = [r for r in runs if r["sequence"] == sequence and r["epsilon"] == eps]
            margin = [r["fm"] - r["naive"] for r in cell]
            rows.append(
                {
                    "tasks": sequence,
                    "eps": eps,
                    "fm": _pm([r["fm"] for r in cell]),
                    "fm_multi": _pm([r["fm_multi"] for r in cell]),
                    "naiveG": _pm([r["naive"] for r in cell]),
                    "fm-naiveG": _pm(margin),
                    "naiveG_multi": _pm([r["naive_multi"] for r in cell]),
                    "multi: fm-naiveG": _pm([r["fm_multi"] - r["naive_multi"] for r in cell]),
                    "fm_eps_1st/last": f"{cell[0]['fm_ledger_epsilon'][0]:.4g}/"
                    f"{cell[0]['fm_ledger_epsilon'][-1]:.4g}",
                    "naiveG_eps_1st/last": f"{cell[0]['naive_ledger_epsilon'][0]:.4g}/"
                    f"{cell[0]['naive_ledger_epsilon'][-1]:.4g}",
                    "fm_noiseless*": _pm([b["fm_noiseless"] for b in base]),
                    "fm_multi_noiseless*": _pm([b["fm_multi_noiseless"] for b in base]),
                    "agem*": _pm([b["agem"] for b in base]),
                    "agem_multi*": _pm([b["agem_multi"] for b in base]),
                    "joint*": _pm([b["joint"] for b in base]),
                    "paper_l2dp": _paper(paper["l2dp_ml"].get(eps)),
                    "paper_naiveG": _paper(paper.get("naive_gaussian", {}).get(eps)),
                    "paper_agem*": _paper(paper.get("agem")),
                }
            )
    return rows


def _paper(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _claims(runs: list[dict[str, Any]], sequences: list[str], epsilons: list[float]) -> dict[str, Any]:
    """Per sequence and ε: the learner beats NaiveGaussian by more than two standard deviations of
    the paired (per-seed) margin, and its ledger ε is the same after every task."""
    out: dict[str, Any] = {}
    for sequence in sequences:
        for eps in epsilons:
            cell = [r for r in runs if r["sequence"] == sequence and r["epsilon"] == eps]
            mean, std = _mean_std([r["fm"] - r["naive"] for r in cell])
            multi_mean, multi_std = _mean_std([r["fm_multi"] - r["naive_multi"] for r in cell])
            out[f"{sequence}@{eps:g}"] = {
                "margin_mean": mean,
                "margin_std": std,
                "beats_naive_by_2_std": bool(mean > 2 * std and mean > 0) if len(cell) > 1 else None,
                "multi_head_margin_mean": multi_mean,
                "multi_head_margin_std": multi_std,
                "multi_head_beats_naive_by_2_std": bool(multi_mean > 2 * multi_std and multi_mean > 0)
                if len(cell) > 1
                else None,
                "fm_epsilon_flat": all(len(set(r["fm_ledger_epsilon"])) == 1 for r in cell),
                "multi_head_replays_free": all(
                    r["fm_ledger_epsilon_after_multi_head"] == r["fm_ledger_epsilon"][-1] for r in cell
                ),
                "naive_epsilon_grows": all(
                    r["naive_ledger_epsilon"][-1] > r["naive_ledger_epsilon"][0] for r in cell
                ),
            }
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, Decimal):
        return str(value)
    return value


def _plots(out: Path, runs: list[dict[str, Any]], sequences: list[str], epsilons: list[float]) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, len(sequences), figsize=(5 * len(sequences), 4), squeeze=False)
    for axis, sequence in zip(axes[0], sequences, strict=True):
        for key, label in (
            ("fm", "functional mechanism"),
            ("fm_multi", "  multi-head"),
            ("naive", "NaiveGaussian"),
        ):
            stats = [
                _mean_std([r[key] for r in runs if r["sequence"] == sequence and r["epsilon"] == e])
                for e in epsilons
            ]
            axis.errorbar(
                epsilons,
                [m for m, _ in stats],
                yerr=[s for _, s in stats],
                marker="o",
                capsize=3,
                label=label,
            )
        axis.set_title(f"{sequence} digits")
        axis.set_xlabel("budget ε")
        axis.set_ylabel("average accuracy after the last task")
        axis.legend()
    save_figure(figure, out, "accuracy.png")
    figure, axis = plt.subplots(figsize=(6, 4))
    first = [r for r in runs if r["seed"] == runs[0]["seed"] and r["epsilon"] == epsilons[-1]]
    for r in first:
        steps = range(1, len(r["fm_ledger_epsilon"]) + 1)
        axis.plot(steps, r["fm_ledger_epsilon"], "o-", label=f"functional mechanism ({r['sequence']})")
        axis.plot(
            steps, r["naive_ledger_epsilon"], "^:", label=f"NaiveGaussian filter progress ({r['sequence']})"
        )
    axis.set_xlabel("tasks learnt")
    axis.set_ylabel(f"ledger ε (budget {epsilons[-1]:g})")
    axis.legend()
    save_figure(figure, out, "epsilon.png")


__all__ = ["add_arguments", "run"]
