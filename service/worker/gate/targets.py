"""A run calibrated to a target ε: the budget's δ when the params name none, and a refusal before
anything is reserved or read when the budget cannot admit it (``service.worker.gate``, step 1).

Why its own module: a refusal here names the largest ``target_epsilon`` that fits, found by
calibrating against the dataset's own quote (``quotes.DatasetPrices``, ``quotes.StagedPrices``),
never against a pricing rule the worker would import; it is the only place the gate searches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from accountant import events as ev
from accountant.errors import AccountantError
from accountant.rules import Charge
from service.db.session import Database
from service.ledger import quotes
from service.ledger.jobs.leases import ClaimedJob
from service.training.stages import LedgerTask, Stage
from service.worker.gate.attempt import Run, fail


def with_budget_delta(db: Database, job: ClaimedJob, params: Any) -> Any:
    """Params with a target ε and no ``delta`` (DP-SGD, AdaDp, the pre-trained trainers,
    NaiveGaussian): the budget's δ (the target is the run's own ε at it)."""
    from service.contract.job_params import (
        DpSgdParams,
        InvalidParamsError,
        NaiveGaussianParams,
        PretrainedParams,
    )

    targeted = isinstance(params, DpSgdParams | PretrainedParams | NaiveGaussianParams)
    if not targeted or params.delta is not None or params.noise_multiplier is not None:
        return params
    from service.ledger.spending.store import dataset_budget

    delta = dataset_budget(db, job.dataset_id)[1].delta
    if not 0 < delta < 1:
        raise InvalidParamsError(
            "params.delta",
            f"is required: the budget's delta is {delta}, and a target epsilon needs one in (0, 1).",
        )
    return replace(params, delta=float(delta))


def check_target_fits(run: Run, params: Any, prices: quotes.DatasetPrices) -> None:
    """A run calibrated to ``target_epsilon`` (its own ε) that the budget cannot admit is refused
    here, before anything is reserved or read, naming the largest ``target_epsilon`` that fits
    (``accountant.calibration.largest_fitting_epsilon`` on the dataset's quote)."""
    from accountant.calibration import largest_fitting_epsilon
    from service.training.dp_sgd import dp_sgd_event

    plan = run.plan
    quoted = prices.quote(plan.event)
    refused = quoted.refused
    if refused is None or refused.refusal is None:
        return

    def make(sigma: float) -> ev.DpEvent:
        q, steps = plan.sampling_probability, plan.steps
        return dp_sgd_event(sampling_probability=q, noise_multiplier=sigma, steps=steps)

    largest = largest_fitting_epsilon(
        make, admits=prices.admits, delta=params.delta, start=plan.noise_multiplier
    )
    fits = (
        f"the largest target_epsilon that fits is {largest}"
        if largest is not None
        else "no target_epsilon fits (no noise multiplier is admitted)"
    )
    raise fail(
        run,
        {
            **refused.refusal.to_json(),
            "message": (
                f"the run calibrated to target_epsilon={params.target_epsilon} (its own epsilon at "
                f"delta={params.delta}, sigma={plan.noise_multiplier}) does not fit this dataset's "
                f"budget: {fits}. Nothing was reserved or read. ({refused.refusal.message})"
            ),
            "field": "params.target_epsilon",
            "largest_target_epsilon": largest,
        },
    )


def check_stages_fit(run: Run, params: Any, tasks: Sequence[LedgerTask], stages: Sequence[Stage]) -> None:
    """A staged run calibrated to ``target_epsilon`` (each stage's run's own ε; NaiveGaussian:
    the whole run's) whose stages the budget cannot admit in turn is refused here, before
    anything is reserved or read (``quotes.StagedPrices``: a later stage meets what the earlier
    ones leave). When the budget is what refuses it, the refusal names the largest
    ``target_epsilon`` under which every stage fits (``largest_fitting_target``: the stages
    re-planned by the trainer at each target tried); a rule's refusal (a ``parallel`` batch read
    twice) names none, as no target changes it."""
    from accountant.calibration import largest_fitting_target
    from service.ledger.errors import BudgetExceeded

    # the stages' batches do not depend on the target (only their σ does): classes formed once
    batch_sets = [stage.batch_ids for stage in stages]
    prices = quotes.StagedPrices(run.db, run.job.tenant_id, run.job.dataset_id, batch_sets)

    def charges(planned: Sequence[Stage]) -> list[Charge]:
        if [s.batch_ids for s in planned] != batch_sets:
            raise AssertionError("re-planned stages read other batches")
        return [Charge(s.event, s.noise_commitment) for s in planned]

    refused = prices.refusal(charges(stages))
    if refused is None:
        return
    stage = stages[refused.index]
    details: dict[str, Any] = {
        **refused.refusal.to_json(),
        "stage": stage.index,
        "stage_name": stage.name,
        "field": "params.target_epsilon",
    }
    if isinstance(refused.refusal, BudgetExceeded):

        def admits(target: float) -> bool:
            try:
                planned = run.trainer.stages(replace(params, target_epsilon=target), tasks)
            except AccountantError:  # no σ reaches this target
                return False
            return prices.refusal(charges(planned)) is None

        largest = largest_fitting_target(admits, below=params.target_epsilon)
        details["largest_target_epsilon"] = largest
        fits = (
            f"the largest target_epsilon under which every stage fits is {largest}"
            if largest is not None
            else "no target_epsilon fits (no noise multiplier is admitted)"
        )
    else:
        fits = "no target_epsilon changes that"
    details["message"] = (
        f"the run calibrated to target_epsilon={params.target_epsilon} (its own epsilon at "
        f"delta={params.delta}) would be refused at stage {stage.index} ({stage.name}): {fits}. "
        f"Nothing was reserved or read. ({refused.refusal.message})"
    )
    raise fail(run, details)


__all__ = ["check_stages_fit", "check_target_fits", "with_budget_delta"]
