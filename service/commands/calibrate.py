"""``ledger calibrate``: the noise multiplier σ of a DP-SGD run that a dataset will charge at most
a target ε, and that charge (issue 28 §9). JSON out, as ``ledger epsilon``.

``--target-epsilon E`` is what the *dataset charges* for the run (its own quote:
``POST /v1/datasets/{id}/quote``, under the dataset's rule, accountant, grid and δ — a Rényi
filter charges more than plain RDP): σ is the smallest on a 10⁻⁴ grid whose quote is at most E
(``LedgerClient.calibrate_noise_multiplier(target_budget_epsilon=E)``, which searches with
``accountant.calibration.calibrate_to_price``). It is not the run's own ε of Opacus's
``target_epsilon`` (that is ``run_epsilon`` in the answer, by the tight accountant at the
budget's δ, for comparison). The run is ``--steps T`` steps of the Gaussian mechanism on a
Poisson sample at ``--sampling-probability q``, priced on the ``--batch`` ids, the ``--task``
ids, a ``--new-batch``, or (none given) every task of the dataset, which is what a job reads.
Nothing is held: the reservation decides (the states may change in between).

Prints one JSON object on stdout::

    {"dataset_id": ..., "noise_multiplier": σ, "charge": {"epsilon", "delta"},
     "target_epsilon": E, "run_epsilon": ..., "on": ..., "admitted": ..., "event": {...}}

Exit 0; 2 for bad input, an unreachable server, or a target no σ reaches (the message names the
option).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from accountant.events import MAX_COUNT, GaussianEvent, PoissonSampledEvent, SelfComposedEvent, to_json
from service.commands.export import add_connection_arguments

_PROG = "ledger calibrate"


class _UsageError(Exception):
    """Bad command-line input; the message names the option."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="the noise multiplier a dataset charges at most a target epsilon for (JSON out)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--dataset", required=True, help="the dataset (id or name) whose quote decides")
    parser.add_argument(
        "--target-epsilon",
        type=float,
        required=True,
        metavar="E",
        help="the most the dataset may charge for the run",
    )
    parser.add_argument(
        "--sampling-probability", type=float, required=True, metavar="Q", help="Poisson sampling probability"
    )
    parser.add_argument("--steps", type=int, required=True, metavar="T", help="number of DP-SGD steps")
    on = parser.add_mutually_exclusive_group()
    on.add_argument("--batch", action="append", metavar="ID", help="price on these batches (repeatable)")
    on.add_argument("--task", action="append", metavar="ID", help="price on every batch of these tasks")
    on.add_argument("--new-batch", action="store_true", help="price on a new, empty batch")
    add_connection_arguments(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        result = calibrate(args)
    except _UsageError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _checked(args: argparse.Namespace) -> None:
    target, q, steps = args.target_epsilon, args.sampling_probability, args.steps
    if not math.isfinite(target) or target <= 0:
        raise _UsageError(f"--target-epsilon must be finite and > 0. Found {target!r}.")
    if not math.isfinite(q) or not 0 < q <= 1:
        raise _UsageError(f"--sampling-probability must be in (0, 1]. Found {q!r}.")
    if not 1 <= steps <= MAX_COUNT:
        raise _UsageError(f"--steps must be an integer in [1, 10^18]. Found {steps!r}.")
    if not args.url or not args.key:
        raise _UsageError("needs --url and --key (or $LEDGER_URL and $LEDGER_API_KEY).")


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON answer; raises ``_UsageError`` naming the bad option."""
    from accountant.calibration import tight_epsilon
    from accountant.errors import InvalidArgumentError
    from service.client import InvalidInput, LedgerClient, LedgerError

    _checked(args)
    q, steps = args.sampling_probability, args.steps
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            dataset = client.find_dataset(args.dataset)  # an id or a name
            args.dataset = str(dataset["id"])
            tasks = args.task
            if args.batch is None and tasks is None and not args.new_batch:
                tasks = [t["id"] for t in client.iter_tasks(args.dataset)]  # what a job reads
                if not tasks:
                    raise _UsageError(f"--dataset {args.dataset} has no tasks: give --new-batch.")
            on: dict[str, Any] = {"batches": args.batch, "tasks": tasks, "new_batch": args.new_batch}
            sigma = client.calibrate_noise_multiplier(
                args.dataset,
                target_budget_epsilon=args.target_epsilon,
                sampling_probability=q,
                steps=steps,
                **on,
            )
            event = SelfComposedEvent(PoissonSampledEvent(q, GaussianEvent(sigma)), steps)
            quote = client.quote(args.dataset, to_json(event), limit=1, **on)
            delta = float(dataset["budget"]["delta"])
    except InvalidInput as exc:
        option = "--target-epsilon" if exc.field == "target_epsilon" else f"--dataset {args.dataset}"
        raise _UsageError(f"{option}: {exc}") from None
    except LedgerError as exc:
        raise _UsageError(f"--dataset {args.dataset}: {exc}") from None
    except InvalidArgumentError as exc:  # no σ up to the largest reaches the target
        raise _UsageError(f"--target-epsilon: {exc.message}") from None
    return {
        "dataset_id": args.dataset,
        "noise_multiplier": sigma,
        "charge": quote["cost"],
        "target_epsilon": args.target_epsilon,
        "run_epsilon": tight_epsilon(event, delta) if 0 < delta < 1 else None,
        "delta": quote["cost"]["delta"],
        "on": quote["on"],
        "admitted": quote["admitted"],
        "event": to_json(event),
    }
