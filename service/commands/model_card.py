"""``ledger model-card NAME VERSION``: a model version's DP statement as a model-card block —
Hugging Face README front matter (YAML) followed by a markdown section — on standard output or
into a file.

Client side (a plain install): it reads ``GET /v1/models/{name}/versions/{v}`` with a viewer key
and renders the ``dp_statement`` the server derived from the version's certificate
(``service.ledger.dp_statement``); nothing in it is typed in by hand. The front matter's values
are JSON scalars, which YAML reads as the same values, so the numbers stay the exact decimal
strings the ledger certified. The markdown shows each number in 4 significant digits rounded
toward the safe side (``accountant.statements.shown``: ε and δ up, what remains down) and says
what it bounds: the release's guarantee, the run alone, the budget share (not a guarantee).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accountant.statements import shown
from service.commands.export import add_connection_arguments, connection_error


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "model-card",
        help="a model version's DP statement as a model card (Hugging Face front matter + markdown)",
        description="Render the DP statement of a released model version (Ponomareva et al. 2023, "
        "Section 5.3 fields) as a Hugging Face README block.",
    )
    add_connection_arguments(parser)
    parser.add_argument("name", help="model name")
    parser.add_argument("version", type=int, help="model version (an integer)")
    parser.add_argument("-o", "--output", default="-", help="file to write (default '-': stdout)")
    parser.set_defaults(handler=run)


def _scalar(value: Any) -> str:
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


def front_matter(version: Mapping[str, Any]) -> str:
    """The YAML front matter: the Hub's ``library_name`` and ``tags``, and a
    ``differential_privacy`` mapping with the statement's headline fields."""
    s = version["dp_statement"]
    mechanism = s["mechanism"]
    sampler = mechanism.get("sampler") or {}
    fields = {
        "epsilon": s["guarantee"]["epsilon"],
        "delta": s["guarantee"]["delta"],
        "run_alone_epsilon": s["run_alone"]["epsilon"],
        "run_alone_delta": s["run_alone"]["delta"],
        "run_alone_accountant": s["run_alone"]["accountant"],
        # Derived from the certificate's charge and budget δ, not stated by it (ACCOUNTING.md).
        "run_alone_certified": bool(s["run_alone"].get("certified", False)),
        "budget_share_epsilon": s["budget_share"]["epsilon"],
        "budget_share_delta": s["budget_share"]["delta"],
        "privacy_unit": s["privacy_unit"]["unit"],
        "neighbouring_relation": ",".join(s["privacy_unit"]["relation"]) or None,
        "accountant": s["accounting"]["accountant"],
        "rule": s["accounting"]["rule"],
        "sampler": sampler.get("kind"),
        "sampling_probability": sampler.get("sampling_probability"),
        "steps": mechanism.get("steps"),
        "noise_multiplier": mechanism.get("noise_multiplier"),
        "clipping_norm": mechanism.get("clipping_norm"),
        "budget_epsilon": s["budget"]["epsilon"],
        "budget_delta": s["budget"]["delta"],
        "budget_epsilon_remaining": s["budget"]["epsilon_remaining"],
        "certificate_id": s["certificate"]["id"],
        "certificate_hash": s["certificate"]["hash"],
    }
    lines = [
        "---",
        "library_name: pytorch",
        "tags:",
        "- differential-privacy",
        "- privacy-ledger",
        f"model_name: {_scalar(version['name'])}",
        f"model_version: {int(version['version'])}",
        "differential_privacy:",
        *(f"  {key}: {_scalar(value)}" for key, value in fields.items()),
        "---",
    ]
    return "\n".join(lines) + "\n"


def markdown(version: Mapping[str, Any]) -> str:
    """The markdown section: every field of the statement, one line each."""
    s = version["dp_statement"]
    mechanism = s["mechanism"]
    sampler = mechanism.get("sampler")
    if sampler is None:
        how = "not one DP-SGD run; the charged event's kinds: " + ", ".join(mechanism.get("event_kinds", []))
    else:
        how = sampler["description"]
        if sampler.get("sampling_probability") is not None:
            how += f" (q ≈ {float(sampler['sampling_probability']):.4g})"
    clipping = mechanism.get("clipping_norm")
    guarantee, alone, share, budget = s["guarantee"], s["run_alone"], s["budget_share"], s["budget"]
    rows = [
        ("Privacy unit", s["privacy_unit"]["description"]),
        ("Granularity", s["granularity"]),
        (
            "Guarantee of this model",
            f"({_eps(guarantee['epsilon'])}, {_delta(guarantee['delta'])})-DP: {guarantee['scope']}; "
            f"it covers {guarantee['covers']}",
        ),
        (
            "This run alone",
            f"({_eps(alone['epsilon'])}, {_delta(alone['delta'])})-DP by {alone['accountant']}: "
            f"{alone['scope']}; derived from the certificate's charge and budget δ, not certified "
            "(`ledger check` recomputes it)",
        ),
        (
            "Budget share",
            f"ε {shown(share['epsilon'])} of the budget's {shown(budget['epsilon'])}"
            + (f", δ {shown(share['delta'])}" if budget["delta_remaining"] is not None else "")
            + f": {share['scope']}",
        ),
        ("Accountant", s["accounting"]["accountant"]),
        ("Conversion", s["accounting"]["conversion"]),
        ("Rule and theorem", f"{s['accounting']['rule']}: {s['accounting']['theorem']}"),
        ("Sampler", how),
        ("Steps", _shown(mechanism.get("steps"))),
        ("Noise multiplier σ", _shown(mechanism.get("noise_multiplier"))),
        (
            "Clipping norm C",
            _shown(clipping) if clipping is not None else str(mechanism["clipping_norm_source"]),
        ),
        ("Training algorithm", _shown(mechanism.get("algorithm"))),
        *_described(version.get("model_spec")),
        ("Public / pre-trained data", s["public_data"]),
        (
            "Budget",
            f"ε = {shown(budget['epsilon'])}, δ = {shown(budget['delta'])}; remaining "
            f"ε = {shown(budget['epsilon_remaining'], 'down')}"
            + (
                f", δ = {shown(budget['delta_remaining'], 'down')}"
                if budget["delta_remaining"] is not None
                else ""
            )
            + f" ({budget['scope']}; {budget['delta_note']})",
        ),
        (
            "Certificate",
            f"{s['certificate']['id']} ({s['certificate']['hash']}), issued {s['certificate']['issued_at']}, "
            "re-verifiable offline with `ledger check`",
        ),
    ]
    body = "\n".join(f"| {name} | {_cell(value)} |" for name, value in rows)
    return (
        f"## Differential privacy\n\n"
        f"`{version['name']}` version {version['version']} was released through a privacy ledger "
        f"that certified it; the fields follow {s['guidelines']}.\n\n"
        f"| field | value |\n|---|---|\n{body}\n"
    )


def _described(spec: Any) -> list[tuple[str, str]]:
    """An externally trained version's architecture and preprocessing, as its trainer wrote them
    (not certified: the statement's numbers come from the certificate alone)."""
    if not isinstance(spec, Mapping) or spec.get("kind") != "external":
        return []
    return [
        ("Architecture (as registered)", str(spec.get("architecture"))),
        ("Preprocessing (as registered)", str(spec.get("preprocessing"))),
    ]


def _eps(value: str) -> str:
    return f"ε ≤ {shown(value)}" if value != "0" else "ε = 0"


def _delta(value: str) -> str:
    return f"δ ≤ {shown(value)}" if value != "0" else "δ = 0"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _shown(value: Any) -> str:
    return "not recorded" if value is None else str(value)


def render(version: Mapping[str, Any]) -> str:
    """Front matter, a blank line, the markdown section."""
    return front_matter(version) + "\n" + markdown(version)


def run(args: argparse.Namespace) -> int:
    from service.client import LedgerClient, LedgerError

    problem = connection_error("model-card", args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        with LedgerClient(args.url, args.key, timeout=args.timeout, retries=2) as client:
            version = client.get_model_version(args.name, args.version)
    except LedgerError as exc:
        print(f"ledger model-card: {exc}", file=sys.stderr)
        return 2
    if not isinstance(version.get("dp_statement"), Mapping):
        print(f"ledger model-card: no dp_statement for {args.name} v{args.version}.", file=sys.stderr)
        return 2
    text = render(version)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"ledger model-card: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    return 0
