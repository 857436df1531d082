"""``ledger experiment lifelong|continual|pretrained|adadp``: reproduce a paper's claim at small scale.

Each experiment runs its private algorithms as jobs behind the release gate of an embedded ledger
(``service.experiments.embedded``; a fresh SQLite file in the output folder unless
``--database-url`` names another), writes ``report.json`` and PNG plots into ``--out`` and prints
a table. ``--quick`` shrinks every size so the run takes seconds (the test suite uses it).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

EXPERIMENTS = {
    "lifelong": "the sound L2DP-ML (functional mechanism) vs NaiveGaussian over split and permuted "
    "digits, mean ± std over --seeds, with A-gem, joint training and the paper's numbers",
    "continual": "continual and sliding-window release of private logistic regression (geometric rule)",
    "pretrained": "cosine classifier and PEFT ensemble on a frozen public extractor (parallel rule)",
    "adadp": "AdaDp (sound) vs DP-SGD on the digits, tuned alike: ε to reach accuracies and accuracy at "
    "matched ε, mean ± std over --seeds, with the paper's non-private line 23 as an ablation",
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "experiment",
        help="reproduce a paper's claim at small scale (JSON report, PNG plots, table)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    which = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name, summary in EXPERIMENTS.items():
        module = _module(name)
        sub = which.add_parser(name, help=summary, description=summary)
        sub.add_argument(
            "--out", type=Path, default=None, help=f"output folder (default ./experiments/{name})"
        )
        sub.add_argument("--database-url", default=None, help="ledger database (default: SQLite in --out)")
        sub.add_argument("--device", default=None, help="torch device (default: cuda when present, else cpu)")
        sub.add_argument("--seed", type=int, default=0, help="seed of data splits, noise and models")
        sub.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
        module.add_arguments(sub)
        sub.set_defaults(handler=run)


def _module(name: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"service.experiments.{name}")


def run(args: argparse.Namespace) -> int:
    if args.out is None:
        args.out = Path("experiments") / args.experiment
    args.out.mkdir(parents=True, exist_ok=True)
    code: int = _module(args.experiment).run(args)
    return code
