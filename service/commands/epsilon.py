"""``ledger epsilon``: the accountant from the shell, JSON out.

Give the mechanism either as an event (``--event '<json>'``, the event JSON of docs/ARCHITECTURE.md,
"Mechanism events") or with the DP-SGD shorthand ``--noise-multiplier σ --sampling-probability q
--steps T`` (T steps of the Poisson-subsampled Gaussian), and the δ (``--delta``). ``--accountant``
picks ``basic``, ``rdp`` or ``prv``; the default is ``rdp``: the accountant the ledger's adaptive
budgets use, fast and defined for every DP-SGD event. ``prv`` gives the tighter numerical value for
this fixed (pre-declared) sequence and says when it fell back to RDP.

With ``--dataset ID`` (and ``--url`` / ``--key``, defaults ``$LEDGER_URL`` / ``$LEDGER_API_KEY``) it
asks the server what the event would cost on that dataset (``POST /v1/datasets/{id}/quote``: the
dataset's own rule, accountant, grid and δ, on the ``--batch`` ids or, with ``--new-batch``, on a
new empty batch: one of the two is required), which is the number to calibrate to; ``--delta`` and
``--accountant`` then do not apply. Nothing is held.

Prints one JSON object on stdout::

    {"epsilon": {"lower": ..., "estimate": ..., "upper": ...}, "delta": ...,
     "accountant": "rdp", "method": "...", "note": "...", "event": {...},
     "tight": {"upper": ..., "method": "...", "note": "..."}}

``epsilon`` is the named accountant's answer; ``upper`` is a valid upper bound, and ``lower`` a
valid lower bound on the true ε (0 where the accountant has none: ``rdp``, ``basic``). ``tight``
is the tightest valid upper bound for this one fixed sequence of mechanisms
(``accountant.prv.tight_epsilon``: the exact analytic Gaussian for Gaussians, dp-accounting's
pessimistic PLD or PRV otherwise, never above RDP): what a single charge that needs no filter
costs on a ledger. RDP can be far above it at tiny q and δ (q 4.3e-5, σ 1.18, 33 steps, δ 5.6e-9:
0.544 against 0.0020). An infinite ε (a non-private event, or a δ basic
composition cannot reach) is written as the string ``"Infinity"``, so the output stays strict
JSON. Bad input exits 2 with a message on stderr that names the option or the event field.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from accountant.errors import AccountantError, InvalidArgumentError, UnsupportedEventError
from accountant.events import (
    MAX_COUNT,
    DpEvent,
    EventValidationError,
    GaussianEvent,
    PoissonSampledEvent,
    SelfComposedEvent,
    from_json,
    to_json,
)
from accountant.prv import tight_epsilon
from accountant.registry import accountant_names, make_accountant
from service.commands.export import add_connection_arguments

DEFAULT_ACCOUNTANT = "rdp"
_PROG = "ledger epsilon"
_TIGHT_NOTE = (
    "the tightest valid upper bound for this one fixed sequence (what a single charge that needs "
    "no filter costs on a ledger, pricing version 4); epsilon is the named accountant's answer"
)


class _UsageError(Exception):
    """Bad command-line input; the message names the option or field."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "epsilon",
        help="compute epsilon for an event or a DP-SGD run (JSON out)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--event", metavar="JSON", help="the mechanism event as JSON")
    parser.add_argument("--noise-multiplier", type=float, metavar="SIGMA", help="DP-SGD noise multiplier")
    parser.add_argument(
        "--sampling-probability", type=float, metavar="Q", help="DP-SGD Poisson sampling probability"
    )
    parser.add_argument("--steps", type=int, metavar="T", help="number of DP-SGD steps")
    parser.add_argument("--delta", type=float, help="the delta of (epsilon, delta)-DP (not with --dataset)")
    parser.add_argument(
        "--dataset", help="price on this dataset (id or name) of a running server (its own budget)"
    )
    parser.add_argument(
        "--batch", action="append", metavar="ID", help="with --dataset: price on these batches"
    )
    parser.add_argument(
        "--new-batch", action="store_true", help="with --dataset: price on a new, empty batch instead"
    )
    add_connection_arguments(parser)
    parser.add_argument(
        "--accountant",
        default=DEFAULT_ACCOUNTANT,
        help=f"basic, rdp or prv (default: {DEFAULT_ACCOUNTANT})",
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        result = quote(args) if args.dataset is not None else compute(args)
    except _UsageError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _event(args: argparse.Namespace) -> DpEvent:
    shorthand = {
        "--noise-multiplier": args.noise_multiplier,
        "--sampling-probability": args.sampling_probability,
        "--steps": args.steps,
    }
    given = [name for name, value in shorthand.items() if value is not None]
    if args.event is not None:
        if given:
            raise _UsageError(f"--event cannot be combined with {', '.join(given)}.")
        try:
            obj = json.loads(args.event)
        except json.JSONDecodeError as exc:
            raise _UsageError(f"--event must be valid JSON: {exc.msg} at character {exc.pos}.") from None
        try:
            return from_json(obj, new=True)
        except EventValidationError as exc:
            raise _UsageError(f"--event: {exc}") from None
    if not given:
        raise _UsageError("give --event JSON, or --noise-multiplier, --sampling-probability and --steps.")
    missing = [name for name, value in shorthand.items() if value is None]
    if missing:
        raise _UsageError(f"{', '.join(missing)} is required with {', '.join(given)}.")
    sigma, q, steps = args.noise_multiplier, args.sampling_probability, args.steps
    if not math.isfinite(sigma) or sigma <= 0:
        raise _UsageError(f"--noise-multiplier must be finite and > 0. Found {sigma!r}.")
    if not math.isfinite(q) or not 0 < q <= 1:
        raise _UsageError(f"--sampling-probability must be in (0, 1]. Found {q!r}.")
    if not 1 <= steps <= MAX_COUNT:
        raise _UsageError(f"--steps must be an integer in [1, 10^18]. Found {steps!r}.")
    return SelfComposedEvent(
        event=PoissonSampledEvent(sampling_probability=q, event=GaussianEvent(noise_multiplier=sigma)),
        count=steps,
    )


def _number(value: float) -> float | str:
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def quote(args: argparse.Namespace) -> dict[str, Any]:
    """``--dataset``: the server's quote for the event on that dataset."""
    from service.client import LedgerClient, LedgerError

    if args.delta is not None or args.accountant != DEFAULT_ACCOUNTANT:
        raise _UsageError(
            "--delta and --accountant do not apply with --dataset (the dataset's budget decides)."
        )
    if not args.url or not args.key:
        raise _UsageError("--dataset needs --url and --key (or $LEDGER_URL and $LEDGER_API_KEY).")
    if bool(args.batch) == args.new_batch:
        raise _UsageError("--dataset needs --batch ID (repeatable) or --new-batch (one of the two).")
    event = _event(args)
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            dataset_id = str(client.find_dataset(args.dataset)["id"])  # an id or a name
            answer = dict(
                client.quote(dataset_id, to_json(event), batches=args.batch, new_batch=args.new_batch)
            )
    except LedgerError as exc:
        raise _UsageError(f"--dataset: {exc}") from None
    answer["event"] = to_json(event)
    return answer


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON answer for parsed arguments; raises ``_UsageError`` naming the bad input."""
    if args.delta is None:
        raise _UsageError("--delta is required (or --dataset, to price on a dataset's own budget).")
    if args.batch or args.new_batch:
        raise _UsageError("--batch and --new-batch apply with --dataset only.")
    delta = args.delta
    if not math.isfinite(delta) or not 0 <= delta < 1:
        raise _UsageError(f"--delta must be in [0, 1). Found {delta!r}.")
    names = accountant_names()
    if args.accountant not in names:
        raise _UsageError(f"--accountant must be one of {names}. Found {args.accountant!r}.")
    event = _event(args)
    accountant = make_accountant(args.accountant)
    try:
        accountant.compose(event)
        bound = accountant.get_epsilon(delta)
        tight = tight_epsilon(event, delta)
    except UnsupportedEventError as exc:
        raise _UsageError(f"--event: {exc}") from None
    except InvalidArgumentError as exc:
        raise _UsageError(f"--{exc.field.replace('_', '-')}: {exc.message}") from None
    except AccountantError as exc:
        raise _UsageError(str(exc)) from None
    return {
        "epsilon": {
            "lower": _number(bound.lower),
            "estimate": _number(bound.estimate),
            "upper": _number(bound.upper),
        },
        "delta": delta,
        "accountant": args.accountant,
        "method": bound.method,
        "note": bound.note,
        "event": to_json(event),
        "tight": {
            "upper": _number(min(tight.upper, bound.upper)),
            "method": tight.method if tight.upper <= bound.upper else bound.method,
            "note": _TIGHT_NOTE,
        },
    }
