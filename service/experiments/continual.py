"""``ledger experiment continual``: continual and sliding-window release with a constant ε.

The claim (continual-sliding-window-release.txt, Thm. 1, 4, 7): releasing a private model at every
block of an unbounded stream costs every record at most ε, because the releases that read one
block cost a geometric series (levels ε/2, ε/4, … of the ``geometric`` rule; for the sliding window
one ε/3 level and two series ε/6, ε/12, …), while the released models stay close to non-private
ones on the same window of data.

Runs, each a ``continual_release`` job behind the release gate of an embedded ledger, on its own
dataset (one ledger batch per block of ``builtin:stream``, the budget ``budget_for(mode, ε)``):
``multi_resolution`` (Alg. 2; Alg. 6 with sampling), ``cumulative`` (Alg. 4 with Alg. 2 bases;
Alg. 8 with sampling) and ``sliding_window`` (Alg. 5 / Example 1; fine-tuning sampling), each with
and without sampling.

Per run: the ledger's maximum per-record ε after every release (running maximum of the
certificates), checked against the budget after *every* release; the level of every block of every
release as the ledger recorded it, checked against the level the trainer expected; the test
accuracy of each model released for inference at time t next to a **non-private** L2-regularised
logistic regression (same λ, no noise, computed here by the data owner, never released) on the same
window of data. Writes ``report.json``, ``epsilon.png``, ``accuracy.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from accountant.exact import to_text
from service.experiments.embedded import TENANT, EmbeddedLedger, JobResult, RegisteredDataset
from service.experiments.report import pyplot, save_figure, table, write_json
from service.ledger import certificates, reservations

MODES = ("multi_resolution", "cumulative", "sliding_window")
COLUMNS = (
    "mode",
    "sampling",
    "releases",
    "blocks",
    "max_eps",
    "budget",
    "max_reads",
    "level_ok",
    "acc_private",
    "acc_nonprivate",
    "acc_last_q",
    "nonpriv_last_q",
    "s/release",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epsilon", type=float, default=2.0, help="the budget ε of every dataset")
    parser.add_argument("--regularization", type=float, default=1.0, help="λ of the regularised ERM")
    parser.add_argument("--blocks", type=int, default=None, help="stream blocks (default 512; --quick 24)")
    parser.add_argument(
        "--block-size", type=int, default=None, help="records per block b0 (default 64; --quick 16)"
    )
    parser.add_argument("--dim", type=int, default=None, help="feature dimension (default 5; --quick 3)")
    parser.add_argument("--window-levels", type=int, default=3, help="sliding window of 2^J - 1 blocks")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="which algorithms to run"
    )
    parser.add_argument(
        "--sampling", choices=("off", "on", "both"), default="both", help="the sampling variants"
    )
    parser.add_argument(
        "--source",
        choices=("stream", "digits"),
        default="stream",
        help="stream: builtin:stream (a logistic model on the sphere, --dim); digits: a harder "
        "one-vs-rest stream, the synthetic digits (64 pixels; one independent warped draw of a "
        "bundled digit per record) labelled 1 for --positive-class, 0 for the rest",
    )
    parser.add_argument(
        "--positive-class", type=int, default=0, help="the digit that is label 1 of --source digits"
    )


def _sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    blocks = args.blocks or (24 if args.quick else 512)
    block_size = args.block_size or (16 if args.quick else 64)
    dim = args.dim or (3 if args.quick else 5)
    return blocks, block_size, dim


def _certified(ledger: EmbeddedLedger, result: JobResult, batch_index: dict[str, int]) -> dict[str, Any]:
    """From every version's certificate: the running maximum per-record ε, each release's levels
    by block, and whether they are the levels the trainer expected (``info``)."""
    running = Decimal(0)
    trajectory: list[float] = []
    mismatches: list[dict[str, Any]] = []
    reads: dict[str, int] = {}
    for version in result.versions:
        body = certificates.get_certificate(ledger.db, TENANT, version.certificate_id)["certificate"]
        running = max(running, Decimal(body["result"]["epsilon"]))
        trajectory.append(float(running))
        levels = reservations.levels_by_batch(ledger.db, TENANT, body)
        metrics = version.metrics
        first, stop = metrics["blocks"]
        ordered = sorted(levels, key=lambda b: batch_index[b])
        if [batch_index[b] for b in ordered] != list(range(first, stop)):
            mismatches.append({"version": version.version, "blocks": [first, stop]})
        got = [levels[b] for b in ordered]
        want = metrics["levels"] if "levels" in metrics else [metrics["level"]] * len(got)
        if got != want:
            mismatches.append({"version": version.version, "ledger": got, "expected": want})
        for b in levels:
            reads[b] = reads.get(b, 0) + 1
    return {"trajectory": trajectory, "mismatches": mismatches, "max_reads": max(reads.values(), default=0)}


def _nonprivate(
    data: tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]],
    block_size: int,
    window: tuple[int, int],
    lam: float,
    cache: dict[tuple[int, int], npt.NDArray[np.float64]],
) -> npt.NDArray[np.float64]:
    """The non-private L2-regularised logistic regression (same λ, no noise) on blocks
    [first, stop): the data owner's reference, never released."""
    from service.training.continual_release import fit_biased_logistic, project_to_unit_ball

    if window not in cache:
        first, stop = window
        features, labels = data
        x = project_to_unit_ball(features[first * block_size : stop * block_size].astype(np.float64))
        s = 2.0 * labels[first * block_size : stop * block_size].astype(np.float64) - 1.0
        cache[window] = fit_biased_logistic(
            x, s, normaliser=len(s), regularization=lam, anchor=np.zeros(x.shape[1])
        )
    return cache[window]


def _window_of(mode: str, metrics: dict[str, Any], window_blocks: int) -> tuple[int, int]:
    """The data a model released for inference at t stands for: its own window (multi-resolution),
    everything so far (cumulative), the last w blocks (sliding window)."""
    t = int(metrics["t"])
    if mode == "cumulative":
        return (0, t)
    if mode == "sliding_window":
        return (t - window_blocks, t)
    first, stop = metrics["blocks"]
    return (int(first), int(stop))


def run(args: argparse.Namespace) -> int:
    from service.training.continual_release import budget_for, evaluate, one_vs_rest, project_to_unit_ball
    from service.training.data import load_data

    out: Path = args.out
    blocks, block_size, dim = _sizes(args)
    positive: int | None = None
    if args.source == "digits":
        positive = args.positive_class
        uri = f"builtin:permuted-synthetic-digits?tasks=1&per_task={blocks * block_size}&seed={args.seed}"
    else:
        uri = f"builtin:stream?blocks={blocks}&block_size={block_size}&dim={dim}&seed={args.seed}"
    source = load_data(uri)
    dim = source.n_features
    features = source.train[0].features
    labels = one_vs_rest(source.train[0].labels, positive)
    test_x, test_y = source.test_arrays()
    test_y = one_vs_rest(test_y, positive)
    majority = float(max(test_y.mean(), 1 - test_y.mean()))
    test_x64 = project_to_unit_ball(test_x.astype(np.float64))
    window_blocks = 2**args.window_levels - 1
    samplings = {"off": [False], "on": [True], "both": [False, True]}[args.sampling]
    runs: list[dict[str, Any]] = []
    failed = False
    with EmbeddedLedger(out, database_url=args.database_url, device=args.device) as ledger:
        for mode in args.modes:
            for sampling in samplings:
                name = f"{mode}{'-sampled' if sampling else ''}"
                dataset: RegisteredDataset = ledger.register_source(
                    uri, name=f"stream-{name}", budget=budget_for(mode, args.epsilon), batch_size=block_size
                )
                batch_index = {b: i for i, b in enumerate(dataset.batch_ids)}
                params = {
                    "mode": mode,
                    "epsilon": args.epsilon,
                    "regularization": args.regularization,
                    "sampling": sampling,
                    "window_levels": args.window_levels,
                    "seed": args.seed,
                    **({"positive_class": positive} if positive is not None else {}),
                }
                started = time.perf_counter()
                result = ledger.run_job(dataset, "continual_release", params, model_name=f"continual-{name}")
                wall = time.perf_counter() - started
                if result.status != "succeeded":
                    failed = True
                    runs.append({"mode": mode, "sampling": sampling, "status": result.status,
                                 "error": result.job.error})  # fmt: skip
                    continue
                certified = _certified(ledger, result, batch_index)
                cache: dict[tuple[int, int], npt.NDArray[np.float64]] = {}
                serving = []
                for version in result.versions:
                    m = version.metrics
                    if not m["serves"]:
                        continue
                    window = _window_of(mode, m, window_blocks)
                    w = _nonprivate((features, labels), block_size, window, args.regularization, cache)
                    serving.append(
                        {
                            "t": m["t"],
                            "private": m["test_accuracy"],
                            "nonprivate": evaluate(w, test_x64, test_y)["test_accuracy"],
                        }
                    )
                budget = float(args.epsilon)
                never_exceeded = all(e <= budget for e in certified["trajectory"])
                spent = result.spend.spent
                schedule = spent.budget.geometric
                assert schedule is not None  # the experiment's budget is geometric
                runs.append(
                    {
                        "mode": mode,
                        "sampling": sampling,
                        "status": result.status,
                        "releases": len(result.versions),
                        "releases_for_inference": len(serving),
                        "blocks": blocks,
                        "block_size": block_size,
                        "budget_epsilon": budget,
                        "ledger_epsilon": to_text(spent.epsilon_spent),
                        # Geometric levels: the spend is the guarantee (at the budget's δ).
                        "guarantee": spent.guarantee.to_json(),
                        "epsilon_spent_is": spent.epsilon_spent_is,
                        "naive_sequential_epsilon": to_text(spent.naive_sequential_epsilon),
                        "infinite_horizon_bound": to_text(schedule.infinite_horizon_bound()),
                        "never_exceeded": never_exceeded,
                        "level_mismatches": certified["mismatches"][:10],
                        "max_reads_of_a_block": certified["max_reads"],
                        "epsilon_trajectory": certified["trajectory"],
                        "accuracy": serving,
                        "wall_s": wall,
                        "s_per_release": wall / max(1, len(result.versions)),
                    }
                )
                if not never_exceeded or certified["mismatches"]:
                    failed = True
    rows = []
    for r in runs:
        if r["status"] != "succeeded":
            rows.append(
                {"mode": r["mode"], "sampling": "on" if r["sampling"] else "off", "releases": r["status"]}
            )
            continue
        acc = r["accuracy"]
        q = max(1, len(acc) // 4)
        rows.append(
            {
                "mode": r["mode"],
                "sampling": "on" if r["sampling"] else "off",
                "releases": r["releases"],
                "blocks": r["blocks"],
                "max_eps": float(r["ledger_epsilon"]),
                "budget": r["budget_epsilon"],
                "max_reads": r["max_reads_of_a_block"],
                "level_ok": "yes" if not r["level_mismatches"] else "NO",
                "acc_private": float(np.mean([a["private"] for a in acc])),
                "acc_nonprivate": float(np.mean([a["nonprivate"] for a in acc])),
                "acc_last_q": float(np.mean([a["private"] for a in acc[-q:]])),
                "nonpriv_last_q": float(np.mean([a["nonprivate"] for a in acc[-q:]])),
                "s/release": r["s_per_release"],
            }
        )
    report = {
        "experiment": "continual",
        "source": uri,
        "epsilon": args.epsilon,
        "regularization": args.regularization,
        "window_blocks": window_blocks,
        "positive_class": positive,
        "test_majority_rate": majority,
        "quick": bool(args.quick),
        "runs": runs,
        "table": rows,
    }
    write_json(out, report)
    _plots(out, runs, float(args.epsilon))
    print(
        table(
            rows,
            COLUMNS,
            title=f"continual release, {uri}: {blocks} blocks of {block_size}, dim {dim}, "
            f"eps={args.epsilon}, lambda={args.regularization}"
            + (
                f", one-vs-rest: digit {positive} is label 1 (test accuracy of always predicting the "
                f"majority label: {majority:.4f})"
                if positive is not None
                else ""
            ),
        )
    )
    return 1 if failed else 0


def _plots(out: Path, runs: list[dict[str, Any]], budget: float) -> None:
    plt = pyplot()
    done = [r for r in runs if r["status"] == "succeeded"]
    figure, axis = plt.subplots(figsize=(7, 4))
    for r in done:
        label = f"{r['mode']}{' (sampled)' if r['sampling'] else ''}"
        axis.plot(range(1, len(r["epsilon_trajectory"]) + 1), r["epsilon_trajectory"], label=label)
    axis.axhline(budget, color="black", linestyle="--", label="budget ε")
    axis.set_xlabel("releases")
    axis.set_ylabel("guarantee ε (= the ledger's spend: geometric levels)")
    axis.set_ylim(0, budget * 1.15)
    axis.legend(fontsize=7)
    save_figure(figure, out, "epsilon.png")

    columns = min(3, max(1, len(done)))
    rows = max(1, -(-len(done) // columns))
    size = (3.6 * columns, 3.0 * rows)
    figure, axes = plt.subplots(rows, columns, figsize=size, sharey=True, squeeze=False)
    for axis, r in zip(axes.flat, done, strict=False):
        t = [a["t"] for a in r["accuracy"]]
        axis.plot(t, [a["private"] for a in r["accuracy"]], ".", markersize=2, label="private")
        axis.plot(t, [a["nonprivate"] for a in r["accuracy"]], "-", linewidth=1, label="non-private")
        axis.set_title(f"{r['mode']}{' (sampled)' if r['sampling'] else ''}", fontsize=8)
        axis.set_xlabel("t (blocks)")
    for row in axes:
        row[0].set_ylabel("test accuracy")
    axes[0][0].legend(fontsize=7)
    save_figure(figure, out, "accuracy.png")
