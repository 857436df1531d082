"""The privacy audit: DP-SGD trained once with m canaries, turned into an ε *lower* bound.

One-run auditing (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run";
the bound is ``accountant.privacy_audit``). The job trains exactly the DP-SGD run its params describe
(``service.training.dp_sgd``: the same Poisson sampling, clipping, noise and accounting event, so
the ledger charges it like a release) with m auditor-owned canaries added, each included
independently with probability 1/2. After the run it scores every canary, guesses "in" for the
highest scores and "out" for the lowest (abstaining on the rest), and reports the largest ε the
correct guesses reject at confidence 1 − β, next to the run's certified upper bound.

Canaries: gradient-space **Dirac canaries**, the paper's white-box setting. Canary i is a record
whose gradient, at every step it is sampled (Poisson, probability q, like every record), is
λ·C·e_{P+i}: zero except one coordinate of its own. The private gradient is formed over P + m
coordinates — the model's P and one per canary — by the release's own code
(``dp_sgd.noisy_mean_gradient_of_ranks``: norms, clip to C, Σ, noise σ·C on every coordinate, ÷ q·N);
the model takes the first P, and canary i's score is Σₜ ĝₜ[P + i], the released noisy coordinate
summed over the steps (what an auditor who sees every iterate recovers). λ =
``CANARY_GRADIENT_SCALE`` > 1, so a working clip cuts a canary to C and a missing one does not.

Why these choices. The data's gradients are exactly zero on the canaries' coordinates, so the
canaries do not interfere with the data or with one another: on a model of a few thousand
parameters, a Dirac canary on a *model* coordinate drowned in how far that weight moves in
training (measured on digits: noise off, 350 of 500 guesses right, ε ≥ 0.6 only), while the
paper's large models leave each coordinate nearly untouched. And the model the run releases is
exactly a DP-SGD model of the data: the canaries never touch its coordinates. A black-box audit
(input-space canaries, final model only) of a few hundred steps on 8×8 digits at ε ≤ 8 stays near
ε = 0 and could not tell a correct implementation from a broken one. What this audit exercises
is what accounting bugs break — the sampler (q), the clip, the noise and its σ, the normaliser —
not the per-example gradients of the model, which it does not see. The guarantee audited is the
one the ledger certifies: (ε, δ)-DP of the run with respect to adding or removing one record,
of any gradient; a Dirac canary is such a record.

Canaries are the auditor's own synthetic records: they hold nothing of the dataset. The run
still reads every record of the dataset's batches, so the gate reserves and commits it as any
DP-SGD job, and the model it releases is a DP-SGD model of the data whose certificate holds.

What the audit publishes costs nothing beyond the run: the mechanism's output is the noisy
(P + m)-coordinate gradient of every step (each data row still has norm ≤ C there, so the
charged event covers all of it), the model is a function of its first P coordinates and the
scores of its last m, and the inclusions are drawn independently of the data.

Broken privacy (``Breakage``) exists for the self-test only (tests/service/training/test_privacy_audit.py,
``bench/privacy_audit.py``): a trainer built with ``breakage=...`` drops the noise, the clip, or
divides σ by 10 while its plan — and so the ledger's charge and the certificate — still claims
the correct run. It is a constructor argument, not a job param: ``trainer_for`` (the gate) builds
trainers with a device only, so no client can reach it and nothing it trains is ever released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

import numpy as np
import torch
from torch import nn

from accountant import privacy_audit as one_run
from accountant.calibration import tight_epsilon
from accountant.registry import make_accountant
from service.contract.job_params import PrivacyAuditParams
from service.training.data import LoadedData
from service.training.distributed import SOLO, Ranks
from service.training.dp_sgd import (
    DpSgdTrainer,
    ModelState,
    TrainingPlan,
    TrainingResult,
    _Run,
    noisy_mean_gradient_of_ranks,
)

Breakage = Literal["no_noise", "no_clipping", "sigma_over_10"]
BREAKAGES: Final[tuple[Breakage, ...]] = ("no_noise", "no_clipping", "sigma_over_10")

CANARY_GRADIENT_SCALE: Final = 10.0
"""λ: a canary's gradient has norm λ·C, so the clip (to C) is what bounds its influence."""
_UNCLIPPED: Final = 1e12  # C·_UNCLIPPED: a clip that never bites (the no_clipping breakage)


@dataclass
class Canaries:
    """The audit's m canaries: whether each was included (Sᵢ = +1), the running scores
    Σₜ ĝₜ[P + i], and the buffer (P + m,) the widened noisy gradient is written into."""

    included: np.ndarray  # (m,) bool
    members: torch.Tensor  # (k,) long: the indices i of the included canaries
    scores: torch.Tensor  # (m,)
    wide: torch.Tensor  # (P + m,)
    steps: int = 0


class PrivacyAuditTrainer(DpSgdTrainer):
    """DP-SGD with Dirac canaries; ``evaluate`` adds the audit (``privacy_audit``) to the metrics."""

    algorithm: ClassVar[str] = "dp_sgd_audit"
    params_type: ClassVar[type[PrivacyAuditParams]] = PrivacyAuditParams

    def __init__(self, *, device: str | torch.device | None = None, breakage: Breakage | None = None) -> None:
        super().__init__(device=device)
        if breakage is not None and breakage not in BREAKAGES:
            raise ValueError(f"breakage must be one of {BREAKAGES}. Found {breakage!r}.")
        self.breakage = breakage
        self.canaries: Canaries | None = None
        self._plan: TrainingPlan | None = None

    # -- the run ---------------------------------------------------------------------------------

    def _start(self, data: LoadedData, p: Any, seed: int, ranks: Ranks = SOLO) -> _Run:
        run = super()._start(data, p, seed, ranks)
        assert isinstance(p, PrivacyAuditParams)
        # A stream of its own (the 4th of the seed's), drawn before any step: the inclusions are
        # independent of the data, the sampling and the noise, as the paper's theorem requires.
        audit_seed = int(np.random.SeedSequence(seed).generate_state(4, dtype=np.uint64)[3])
        included = np.random.default_rng(audit_seed).random(p.canaries) < 0.5
        self.canaries = Canaries(
            included=included,
            members=torch.from_numpy(np.flatnonzero(included)).to(self.device),
            scores=run.update.new_zeros(p.canaries),
            wide=run.update.new_zeros(run.update.numel() + p.canaries),
        )
        return run

    def _private_gradient(self, run: _Run, plan: TrainingPlan, x: torch.Tensor, y: torch.Tensor) -> None:
        """DP-SGD's private gradient over P + m coordinates: the model's P, where the data's
        gradients live, and one per canary, where only canary i's gradient λ·C·e_{P+i} does.
        The data's rows are zero on the canaries' coordinates, so their norms, clips and sum
        are the release's; the noise σ·C covers every coordinate. The model takes the first P,
        the scores the last m. Distributed: the canaries are records of rank 0's shard (sampled
        and noised there); the widened sum is summed across ranks before it is split."""
        canaries = self.canaries
        assert canaries is not None
        per_example = run.grad_fn.flat(run.params, x, y)
        n_params, m = per_example.shape[1], len(canaries.scores)
        # Each included canary is a record: Poisson-sampled with probability q like the others.
        chosen = canaries.members[:0]
        if run.ranks.adds_noise:
            sampled = torch.rand(len(canaries.members), generator=run.sampler) < plan.sampling_probability
            chosen = canaries.members[sampled.to(self.device)]
        rows = per_example.new_zeros((len(per_example) + len(chosen), n_params + m))
        rows[: len(per_example), :n_params] = per_example
        rows[len(per_example) + torch.arange(len(chosen), device=self.device), n_params + chosen] = (
            CANARY_GRADIENT_SCALE * plan.params.max_grad_norm
        )
        max_grad_norm = plan.params.max_grad_norm
        noise_multiplier = plan.noise_multiplier
        if self.breakage == "no_noise":
            noise_multiplier = 0.0
        elif self.breakage == "sigma_over_10":
            noise_multiplier = plan.noise_multiplier / 10
        elif self.breakage == "no_clipping":  # the same noise σ·C, a clip that never bites
            max_grad_norm *= _UNCLIPPED
            noise_multiplier /= _UNCLIPPED
        noisy_mean_gradient_of_ranks(
            rows,
            ranks=run.ranks,
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=plan.expected_batch_size,
            generator=run.noise,
            out=canaries.wide,
        )
        run.update.copy_(canaries.wide[:n_params])
        canaries.scores += canaries.wide[n_params:]
        canaries.steps += 1

    def train(self, data: LoadedData, plan: TrainingPlan, **kwargs: Any) -> TrainingResult:
        self._plan = plan
        return super().train(data, plan, **kwargs)

    # -- the audit -------------------------------------------------------------------------------

    def audit(self) -> dict[str, Any]:
        """The one-run bound from the scores so far (``accountant.privacy_audit.audit``), with the
        steps it covers and the accountant's ε upper bound for those steps at the same δ."""
        canaries, plan = self.canaries, self._plan
        if canaries is None or plan is None or canaries.steps == 0:
            raise RuntimeError("no audit: the run has not taken a step.")
        p = plan.params
        assert isinstance(p, PrivacyAuditParams) and p.delta is not None
        result: dict[str, Any] = one_run.audit(
            canaries.scores.detach().cpu().numpy(), canaries.included, delta=p.delta, confidence=p.confidence
        ).to_json()
        # The claim's accountant: ``target_epsilon`` is met under the ledger's tight price.
        ran = plan.event_after(canaries.steps)
        if p.target_epsilon is not None:
            upper = tight_epsilon(ran, p.delta)
        else:
            upper = make_accountant(p.accountant).compose(ran).get_epsilon(p.delta).upper
        result["steps"] = canaries.steps
        result["accountant_epsilon"] = float(upper)
        return result

    def evaluate(self, data: LoadedData, model: nn.Module | ModelState, params: Any = None) -> dict[str, Any]:
        """The test metrics, and ``privacy_audit`` once the run has taken a step."""
        metrics: dict[str, Any] = dict(super().evaluate(data, model, params))
        if self.canaries is not None and self.canaries.steps > 0 and self._plan is not None:
            metrics["privacy_audit"] = self.audit()
        return metrics


__all__ = ["BREAKAGES", "CANARY_GRADIENT_SCALE", "Breakage", "Canaries", "PrivacyAuditTrainer"]
