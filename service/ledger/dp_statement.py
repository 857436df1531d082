"""The DP statement of a model version: what was certified, in the fields the reporting
guidelines of "How to DP-fy ML" (Ponomareva et al. 2023, §5.3) ask a published model to state.

Derived on read, never stored, from what the ledger itself knows:

* the version's **certificate** (signed; ``accountant.certificates``): ε and δ, the accountant,
  the rule and its theorem, the event that was charged (→ sampler, steps, noise multiplier,
  neighbouring relation → privacy unit), the budget and what was spent after the release;
* the **job** that trained it, when the built-in worker did (``service.ledger.jobs``): its
  validated params (the clipping norm C) and the plan the worker recorded before it reserved
  (σ, q, steps) — used only where they agree with the certified event;
* the version's ``model_spec`` (the source it read, hence whether public data was used).

A release made by a client's own trainer (``release_gate``) has a certificate and no job: the
statement then says what the ledger cannot know (the clipping norm, pre-training) instead of
repeating a client's claim.

Three figures, each a valid bound for what it names (``accountant.statements``; issue 24 §3):

* ``guarantee`` — the (ε, δ)-DP guarantee of the released model: of *every* release computed
  from the batches this version read, up to and including it, under the dataset's rule, valid
  whatever the trainer chose after seeing earlier outputs (early stopping included). A version-3
  certificate states it (``result.guarantee``); for older ones it is derived from the
  certificate's inputs by the same function. For a Rényi filter it is the filter's budget, never
  its progress;
* ``run_alone`` — the run that produced this version as if it were the only mechanism ever run
  on its records: its (ε, δ) at the budget's δ — exact for a lone Gaussian run, else the PRV
  upper bound or the exact basic composition (``accountant.statements.run_alone``) — for the whole
  reserved run; the privacy audit of a ``dp_sgd_audit`` version is compared with it;
* ``budget_share`` — the budget the release consumed (the reservation's committed cost, in the
  rule's units), labelled as what it is: not a DP guarantee.

``release`` (statement version 1: the committed cost, which for a filter or a plan segment is no
guarantee of anything) now carries ``run_alone``'s numbers, for API users that read it.
``accounting.theorem`` is written from the budget's parameters (``rules.stated_theorem``).
Numbers are exact decimal strings; ``accountant.exact.shown`` writes them for people.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Final

from accountant import events as ev
from accountant.certificates import BatchRecord, ClassRecord
from accountant.exact import to_text
from accountant.rules import Budget, stated_theorem
from accountant.statements import (
    GUARANTEE_SCOPE,
    RUN_ALONE_SCOPE,
    RUN_ALONE_SOURCE,
    certificate_run_alone,
    release_guarantee,
)

STATEMENT_VERSION: Final = 2
GUIDELINES: Final = "Ponomareva et al. 2023, How to DP-fy ML, Section 5.3 (reporting)"

CONVERSIONS: Final[Mapping[str, str]] = {
    "basic": "none: pure and (epsilon, delta) guarantees summed exactly (basic composition)",
    "rdp": "Renyi DP curve converted to (epsilon, delta) by Balle et al. 2020, Thm. 21 (an upper "
    "bound); a single charge is priced at the minimum of its RDP conversion, the Poisson coupling "
    "bound and its exact basic (epsilon, delta)",
    "tight": "each charge's own tight epsilon (PRV upper bound, Gopi, Lee & Wutschitz 2021) composed "
    "by a basic-composition filter, or its Renyi DP curve by a Renyi filter (Balle et al. 2020, "
    "Thm. 21 conversion), whichever still admits the batch's full list",
    "prv": "privacy loss random variables, Gopi, Lee & Wutschitz 2021, Thm. 5.5: the upper end of "
    "the numerical error bound (RDP where PRV does not apply)",
}

UNITS: Final[Mapping[str, str]] = {
    ev.ADD_REMOVE: "one record (one row of the data source, named by its record id); neighbouring "
    "datasets differ by adding or removing one record",
    ev.REPLACE_ONE: "one record (one row of the data source, named by its record id); neighbouring "
    "datasets differ by replacing one record, the dataset size being public",
}
_UNIT_UNSTATED: Final = (
    "one record (one row of the data source, named by its record id); the event states no "
    "neighbouring relation: its sensitivity is the client's, under the batch's relation"
)
_PER_PERSON: Final = (
    "record-level: a person with k records is protected at the group-privacy level of k records "
    "(about k times epsilon); the ledger does not bound records per person"
)


def _mechanism(event: ev.DpEvent) -> dict[str, Any]:
    """Sampler, steps and noise multiplier of the charged event when it is one DP-SGD run
    (``SelfComposed(Sampled(Gaussian(σ)), T)`` or a single step of it); else the event's kinds."""
    steps = 1
    inner = event
    if isinstance(inner, ev.SelfComposedEvent):
        steps, inner = inner.count, inner.event
    sampler: dict[str, Any] = {"kind": "none", "description": "every record of the batches, once per step"}
    if isinstance(inner, ev.PoissonSampledEvent):
        sampler = {
            "kind": "poisson",
            "sampling_probability": inner.sampling_probability,
            "description": "Poisson sampling: each record joins each step's batch independently with "
            "probability q",
        }
        inner = inner.event
    elif isinstance(inner, ev.SampledWithoutReplacementEvent):
        sampler = {
            "kind": "without_replacement",
            "sample_size": inner.sample_size,
            "population_size": inner.population_size,
            "description": "each step reads a uniformly random subset of fixed size",
        }
        inner = inner.event
    if isinstance(inner, ev.GaussianEvent):
        return {"sampler": sampler, "steps": steps, "noise_multiplier": inner.noise_multiplier}
    kinds = sorted({node.kind for node in ev.walk(event)})
    return {"sampler": None, "steps": None, "noise_multiplier": None, "event_kinds": kinds}


def _sub(a: str, b: str) -> str:
    return to_text(max(Decimal(a) - Decimal(b), Decimal(0)))


def _public_data(algorithm: str | None, source: str | None) -> str:
    if algorithm is None:
        return "not known to the ledger: the model was trained by the client, outside the ledger's worker"
    if source is not None and "public=" in source:
        return (
            f"the public split of {source} (declared public by the operator, outside the ledger and "
            "without any privacy guarantee) pre-trains the feature extractor"
        )
    if algorithm in ("dp_sgd", "adadp"):
        return (
            "none: random initialisation, no pre-training; the source's held-out test split (not "
            "ledgered) is used only for the reported metrics"
        )
    return "none declared by the source; see the algorithm's documentation"


BUDGET_SHARE_SCOPE: Final = (
    "the budget this release consumed, in the rule's units (the reservation's committed cost: for a "
    "Renyi filter the growth of its progress, for a plan segment its share, for a geometric level "
    "its allowance); a budget figure, NOT a DP guarantee"
)


def covers(budget: Budget) -> str:
    """What the guarantee covers under ``budget``'s rule, and the theorem it rests on."""
    if budget.uses_union:
        return (
            "the budget of the union of privacy filters on each batch this version read (a "
            "basic-composition filter over each run's tight epsilon, Rogers, Roth, Ullman & Vadhan "
            "2016, and a Renyi filter, Feldman & Zrnic 2021): all releases from those batches "
            "together, past and future, under fully adaptive choices including early stopping; "
            "the progress is a budget share"
        )
    if budget.uses_filter:
        return (
            "the Renyi filter's budget on each batch this version read: all releases from those "
            "batches together, past and future, under fully adaptive choices including early "
            "stopping (Feldman & Zrnic 2021, Thm. 3.1); the filter's progress is a budget share"
        )
    if budget.rule == "sequential" and budget.accountant == "prv":
        return (
            "the declared plan segments that ran on the batches this version read, each whole once "
            "any of it ran, at the budget's delta (a segment stopped early is post-processing of the "
            "whole segment, Dwork & Roth 2014, Prop. 2.1), summed by the basic-composition filter "
            "(Rogers, Roth, Ullman & Vadhan 2016, Thm. 3.6)"
        )
    if budget.rule == "parallel":
        return (
            "the one charge of each batch this version read (the whole reserved run, or on basic the "
            "exact sum of what ran); disjoint batches compose in parallel (McSherry 2009, Thm. 4)"
        )
    if budget.rule == "geometric":
        return (
            "the geometric levels used on the blocks this version read, each level's whole "
            "allowance, summed by basic composition with adaptive parameters, at the budget's delta "
            "(Rogers, Roth, Ullman & Vadhan 2016)"
        )
    return (
        "every charge on the batches this version read up to and including this release, summed "
        "exactly by basic composition, which holds as a privacy odometer at the budget's delta "
        "(Rogers, Roth, Ullman & Vadhan 2016)"
    )


def guarantee_of(body: Mapping[str, Any]) -> tuple[str, str]:
    """The guarantee (ε, δ) of the release a certificate ``body`` justifies: its
    ``result.guarantee`` (version 3), else the same figure derived from its records
    (``accountant.statements.release_guarantee``)."""
    stated = body["result"].get("guarantee")
    if isinstance(stated, Mapping):
        return str(stated["epsilon"]), str(stated["delta"])
    inputs = body["inputs"]
    records: list[BatchRecord] | list[ClassRecord]
    if "classes" in inputs:
        records = [ClassRecord.from_json(c, f"inputs.classes[{i}]") for i, c in enumerate(inputs["classes"])]
    else:
        records = [BatchRecord.from_json(b, f"inputs.batches[{i}]") for i, b in enumerate(inputs["batches"])]
    eps, dlt = release_guarantee(Budget.from_json(inputs["budget"]), records)
    return to_text(eps), to_text(dlt)


def dp_statement(
    certificate: Mapping[str, Any],
    *,
    job: Mapping[str, Any] | None,
    model_spec: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The statement of a version (module docstring). ``certificate``: the stored certificate
    (``{id, certificate: body, ...}``); ``job``: the job row's ``algorithm``, ``params`` and
    ``plan`` (``None`` for a client's release)."""
    body = certificate["certificate"]
    inputs = body["inputs"]
    result = body["result"]
    budget_obj = Budget.from_json(inputs["budget"])
    charged = ev.from_json(inputs["partial_event"] or inputs["charge"]["event"])
    mechanism = _mechanism(charged)
    relations = ev.neighbouring_relations(charged)
    unit = UNITS.get(next(iter(relations)), _UNIT_UNSTATED) if len(relations) == 1 else _UNIT_UNSTATED
    algorithm = None if job is None else job.get("algorithm")
    plan = (job or {}).get("plan") or {}
    clipping: float | None = None
    # The job's C only when its recorded plan is the run that was certified (same σ and q).
    if (
        plan.get("noise_multiplier") == mechanism["noise_multiplier"]
        and plan.get("sampling_probability") == (mechanism["sampler"] or {}).get("sampling_probability")
        and isinstance(plan.get("params"), Mapping)
    ):
        clipping = plan["params"].get("max_grad_norm")
    source = None if model_spec is None else model_spec.get("data_source")
    budget = result["budget"]
    guarantee = guarantee_of(body)
    alone = certificate_run_alone(body)
    # RDP and PRV convert at the budget's own δ: every release holds at that δ and none spends
    # it, so "δ remaining" would read 0 after the first release. Basic composition sums δ.
    delta_sums = body["accountant"] == "basic"
    return {
        "version": STATEMENT_VERSION,
        "guidelines": GUIDELINES,
        "privacy_unit": {"unit": "record", "relation": sorted(relations), "description": unit},
        "granularity": _PER_PERSON,
        "guarantee": {
            "epsilon": guarantee[0],
            "delta": guarantee[1],
            "scope": GUARANTEE_SCOPE,
            "covers": covers(budget_obj),
        },
        "run_alone": {**alone, "scope": RUN_ALONE_SCOPE, "certified": False, "source": RUN_ALONE_SOURCE},
        "budget_share": {
            "epsilon": result["charge"]["epsilon"],
            "delta": result["charge"]["delta"],
            "scope": BUDGET_SHARE_SCOPE,
        },
        "release": {
            "epsilon": alone["epsilon"],
            "delta": alone["delta"],
            "scope": "deprecated (statement version 1): the numbers of run_alone",
        },
        "accounting": {
            "accountant": body["accountant"],
            "conversion": CONVERSIONS.get(body["accountant"], body["accountant"]),
            "rule": body["rule"],
            "theorem": stated_theorem(budget_obj),
        },
        "mechanism": {
            **mechanism,
            "clipping_norm": clipping,
            "clipping_norm_source": "the job's params"
            if clipping is not None
            else (
                "not known to the ledger: the noise multiplier is relative to the clipping norm the "
                "client used"
            ),
            "event": ev.to_json(charged),
            "algorithm": algorithm,
        },
        "public_data": _public_data(algorithm, source),
        "budget": {
            "epsilon": budget["epsilon"],
            "delta": budget["delta"],
            "epsilon_remaining": _sub(budget["epsilon"], result["epsilon"]),
            "delta_remaining": _sub(budget["delta"], result["delta"]) if delta_sums else None,
            "delta_note": "delta adds up over releases (basic composition)"
            if delta_sums
            else "every release holds at the budget's delta, at which the accountant converts; "
            "releases spend epsilon, not delta",
            "scope": "budget shares on the batches this version read, right after its release (what "
            "the rule lets later releases use; not a DP guarantee)",
        },
        "certificate": {
            "id": certificate["id"],
            "hash": body["hash"],
            "issued_at": body["issued_at"],
            "dataset_id": body["dataset_id"],
        },
    }


__all__ = [
    "BUDGET_SHARE_SCOPE",
    "CONVERSIONS",
    "GUIDELINES",
    "STATEMENT_VERSION",
    "covers",
    "dp_statement",
    "guarantee_of",
]
