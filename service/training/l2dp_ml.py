"""L2DP-ML (lifelong DP) and its NaiveGaussian baseline as staged jobs behind the release gate.

Paper: ``lifelong-dp-l2dp-ml.txt`` (Phan et al., Lifelong DP): Alg. 1, Alg. 2 (streaming batch
training), Eq. 11–13, Thm. 1 and Thm. 2; the DPL2M form (``dp-lifelong-learning-dpl2m.txt``):
fixed disjoint batches, one episodic-memory batch per task.

L2DP-ML (``L2dpMlTrainer``)
---------------------------
Network f(x) = G(a(x, θ1), θ2). The auto-encoder a has θ1 = W1 (|h1| × d, no bias; the paper's
h = θ1ᵀx) with h = clip(W1 x, −1, 1). G is the output layer W2 (K × |hπ|) on hπ = clip(h̄, −1, 1),
so |hπ| = |h1| (see "Departures" below). Per batch B of the declared size |B| one noise draw,
fixed for every later read (Alg. 2 lines 1–2, Eq. 13):

* x̄_r = x_r + χ1_r/|B|,   χ1_r ~ Lap(Δ_R/ε1)^d,    Δ_R = d(|h1| + 2) — an independent χ1_r
  per record with the default ``analysis: "sound"``; one χ1 shared by the batch's records with
  ``analysis: "paper"`` (Alg. 2 as printed, whose Thm. 2 term we do not believe: note 21 of
  docs/DESIGN-NOTES.md);
* h̄ = clip(W1 x̄, −1, 1) + 2χ2/|B|,   χ2 ~ Lap(Δ_R/ε1)^{|h1|};
* the output layer's label coefficients Σ_r hπ_r y_rkᵀ + χ3_k (mean form: + χ3_k/|B|),
  χ3_k ~ Lap(Δ_L/ε2)^{|hπ|} for each class k, Δ_L = 2|hπ|.

Gradients, both of the perturbed Taylor polynomials (mean over the batch, a learning-rate
convention):

* θ1 from R̄ (Eq. 13): ∇_{θ1s} R̄ = Σ_r h̄_r(½ − x̄_rs) (the paper's formula, h̄ held fixed);
* θ2 from L̄, the 2nd-order Taylor polynomial of the per-class logistic loss of Eq. 9 at 0:
  Σ_k Σ_r [z_rk(½ − y_rk) + z_rk²/8], z_rk = hπ_r·W2_k, so
  ∇_{W2_k} L̄ = Σ_r [½ hπ_r + ¼ z_rk hπ_r] − (Σ_r hπ_r y_rk + χ3_k).

A step on a task batch B (Alg. 2 lines 11–16): g on B; if the episodic memory is not empty, g_ref
on one memory batch drawn at random; g̃ = A-gem projection (``agem``); θ ← θ − ϱ g̃ (ϱ per part:
``encoder_learning_rate`` for θ1, ``learning_rate`` for θ2, θ2's part the Newton direction of the
quadratic L̄). Under ``analysis: "sound"`` θ1 stays at its seeded initial value (encoder
learning rate 0, g's θ1 part left out of the projection), so every read of a batch computes the
same label coefficients and ε2 bounds them (``service.contract.job_params``). Otherwise θ1 is
projected so that both its maximum row and column 1-norms are ≤ ``theta1_norm_bound`` — the
bound the event declares and Thm. 2's γ = 2Δ_R/(|B|·‖θ̄1‖₁,₁) needs (each ℓ1-ball projection
soft-thresholds, so the second one keeps the first one's bound). After task τ one batch of it,
drawn from the seed before any data is read, joins the memory (Alg. 2 lines 17–18).

Ledger. The dataset's rule is ``lifelong``. Stage τ reserves the event
``FunctionalMechanismL2DPEvent(ε1, ε2, d, |h1|, |hπ|, |B|, bound)`` on task τ's batches and the
memory's batches with the job's ``noise_commitment``: a task batch's first read creates the
commitment and costs Thm. 2's ε = ε1 + s·ε1/γx + ε1/γ + ε2 (s = d for the default
``analysis: "sound"``, 1 for ``"paper"``; docs/DESIGN-NOTES.md note 21); the memory batches are replays of the
same noise and cost 0. So the dataset's ε after any number of tasks, epochs or task orders is one
batch's ε. The noise is a deterministic function of (seed, batch id) and the commitment is
``"l2dp-ml:" + sha256(seed)``: a replay really uses the same draw, and a job with another seed
cannot claim it. A job without ``seed`` draws a secret one.

Departures from the paper (docs/experiments/lifelong.md):

* Eq. 12 as printed (−½|z| − ⅛z²) is unbounded below; we use the Taylor expansion of Eq. 9 it
  comes from, whose linear term z(½ − y) is Eq. 12's z − zy − ½z.
* χ3 is drawn per class (K·|hπ| draws, not |hπ|): one vector shared by all classes would publish
  the differences of the classes' coefficients without noise.
* G is a single output layer on clip(h̄): the functional mechanism perturbs the output layer's
  coefficients only, so hidden layers of G trained through L̄ would read labels outside it.
* The declared |B| is the largest batch of the dataset: every batch's noise is divided by it, so
  a smaller last batch gets the same noise the event is costed for.
* Input noise is drawn per record by default (``analysis: "sound"``), charged d·ε1/γx: one
  vector shared by the batch (Alg. 2, ``"paper"``) publishes x̄_r − x̄_s = x_r − x_s, and the
  paper's ε1/γx assumes an ℓ1 sensitivity of 1 where a record moves by d (note 21 of
  docs/DESIGN-NOTES.md). Fixed χ3 against coefficients that move with θ1: under ``"sound"`` θ1
  stays at its seeded initial value, so the coefficients do not move and χ3 is used once; under
  ``"paper"`` θ1 trains and the concern stands (docs/experiments/lifelong.md).
* θ2 steps along the Newton direction of the quadratic L̄ (a plain gradient step crawled; the
  damped Hessian ¼ Σ hπ hπᵀ/|B| is computed from h̄ only).

NaiveGaussian (``service.training.lifelong_baselines.NaiveGaussianTrainer``)
------------------------------------------------------------------------
The paper's baseline, what Thm. 1 warns about: DP-SGD (``service.training.dp_sgd`` helpers) with
A-gem, where g is the noisy clipped gradient of a Poisson sample (probability q) of task τ's
records and g_ref that of a Poisson sample (same q) of the memory's records. Each record is in
one of the two pools, so stage τ is the event ``SelfComposed(PoissonSampled(q, Gaussian(σ)), T_τ)``
(T_τ = ⌈epochs_τ/q⌉) on task τ's batches and the memory's batches, charged afresh on a
``sequential`` dataset: the first task's memory batch bears every stage, and the dataset's ε
grows with the number of tasks. ``target_epsilon`` calibrates σ so that the whole run fits the
Rényi filter of an ``rdp`` budget of that ε (default order grid).

The noiseless A-gem baseline (``train_noiseless_agem``) cannot be charged a finite ε; it runs
outside the ledger, in the experiment, labelled non-private.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar, Final

import numpy as np
import torch
import torch.nn.functional as F

from accountant.events import DpEvent, FunctionalMechanismL2DPEvent
from service.contract.job_params import (  # noqa: F401  (re-exported: declared in the torch-free module)
    MAX_EPOCHS,
    MAX_TASKS,
    FunctionalMechanismParams,
    InvalidParamsError,
    JobParams,
    L2dpMlParams,
    NaiveGaussianParams,
    read_l2dp_ml,
)
from service.training.agem import (
    agem_project,
    flatten,
    unflatten,
)
from service.training.data import LoadedData
from service.training.dp_sgd import (
    default_device,
)
from service.training.functional_mechanism import FunctionalMechanismTrainer
from service.training.lifelong_tasks import LifelongRecord, Plan, make_plan
from service.training.stages import LedgerTask, Stage, StageRelease

COMMITMENT_PREFIX: Final = "l2dp-ml:"
# Tikhonov damping of the output layer's Newton step (``L2dpMlTrainer.gradient``): keeps the solve
# defined when hidden units are dead (constant 0) in a batch.
NEWTON_DAMPING: Final = 1e-3


# ---------------------------------------------------------------------------------------------
# The functional mechanism's calibration (Thm. 2; Alg. 2 lines 1–2)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NoiseScales:
    """Laplace scales of one batch's perturbation, from its event alone.

    ``input``: of χ1/|B| on each coordinate of x̄ (Δ_R/(ε1|B|)); ``hidden``: of 2χ2/|B| on each
    unit of h̄ (2Δ_R/(ε1|B|)); ``labels``: of χ3 on each summed label coefficient (Δ_L/ε2).
    ``sensitivity_input``: the ℓ1 sensitivity the event's analysis charges the input noise for —
    d for ``"sound"`` (a record of [0, 1]^d moves by ≤ d), 1 for ``"paper"`` (Thm. 2's ε1/γx).
    """

    input: float
    hidden: float
    labels: float
    sensitivity_r: int
    sensitivity_l: int
    sensitivity_input: int = 1


def noise_scales(event: FunctionalMechanismL2DPEvent) -> NoiseScales:
    """The scales the trainer draws with for ``event`` (module docstring). Each term of Thm. 2 is
    sensitivity/scale of one of them: ε1 = Δ_R/(Δ_R/ε1), ε1/γx = 1/input,
    ε1/γ = ‖θ̄1‖/hidden, ε2 = Δ_L/labels, and the input term sensitivity_input/input (``"sound"``:
    d/input = d·ε1/γx; ``"paper"``: 1/input = ε1/γx). ``tests/service/training/test_l2dp_ml.py`` checks the
    sum against ``accountant.mechanisms.l2dp_ml_event_epsilon``."""
    delta_r = event.input_dim * (event.hidden_units + 2)
    delta_l = 2 * event.output_hidden_units
    scale_r = delta_r / event.epsilon1
    return NoiseScales(
        input=scale_r / event.batch_size,
        hidden=2 * scale_r / event.batch_size,
        labels=delta_l / event.epsilon2,
        sensitivity_r=delta_r,
        sensitivity_l=delta_l,
        sensitivity_input=event.input_dim if event.charged_analysis == "sound" else 1,
    )


def epsilon1_for(
    *,
    target_epsilon: float,
    epsilon2: float,
    input_dim: int,
    hidden_units: int,
    batch_size: int,
    theta1_norm_bound: float,
    analysis: str = "sound",
    price: Callable[[DpEvent], Decimal] | None = None,
) -> float:
    """The largest ε1 (up to a relative 1e-12) whose Thm. 2 ε with ``epsilon2``, as the ledger
    prices the event (``price``; default ``accountant.calibration.basic_price``: exact decimals,
    rounded up), is
    ≤ ``target_epsilon`` taken as written: ε = ε1·(1 + s·|B|/Δ_R + |B|·‖θ̄1‖/(2Δ_R)) + ε2 (s = d
    for ``analysis="sound"``, 1 for ``"paper"``), solved, then stepped down past rounding."""
    from accountant.calibration import basic_price
    from accountant.exact import as_written

    charge = basic_price if price is None else price

    if not 0 < epsilon2 < target_epsilon:
        raise InvalidParamsError("epsilon2", f"must be in (0, target_epsilon). Found {epsilon2}.")
    delta_r = input_dim * (hidden_units + 2)
    input_sensitivity = input_dim if analysis == "sound" else 1
    factor = 1 + input_sensitivity * batch_size / delta_r + batch_size * theta1_norm_bound / (2 * delta_r)
    eps1 = (target_epsilon - epsilon2) / factor
    target = as_written(target_epsilon)

    def price_of(e1: float) -> Decimal:
        event = FunctionalMechanismL2DPEvent(
            epsilon1=e1,
            epsilon2=epsilon2,
            input_dim=input_dim,
            hidden_units=hidden_units,
            output_hidden_units=hidden_units,
            batch_size=batch_size,
            theta1_norm_bound=theta1_norm_bound,
            analysis=analysis,
        )
        return charge(event)

    while price_of(eps1) > target:
        eps1 *= 1 - 1e-12
    return eps1


def noise_commitment(seed: int) -> str:
    """The commitment of the noise drawn from ``seed``: a replay with the same commitment is the
    same draw; the seed itself is not revealed (a 62-bit secret seed is not guessable)."""
    digest = hashlib.sha256(f"l2dp-ml noise seed {seed}".encode()).hexdigest()[:32]
    return COMMITMENT_PREFIX + digest


def batch_noise(
    seed: int, batch_id: str, *, input_dim: int, hidden_units: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard Laplace draws (χ1 (d,), χ2 (|h1|,), χ3 (|hπ|, K)) of one batch, a deterministic
    function of (seed, batch id): every read of the batch sees the same draw."""
    key = hashlib.sha256(batch_id.encode()).digest()
    words = [int.from_bytes(key[i : i + 4], "little") for i in range(0, 16, 4)]
    rng = np.random.default_rng(np.random.SeedSequence([seed & (2**64 - 1), *words]))
    chi1 = rng.laplace(0.0, 1.0, input_dim)
    chi2 = rng.laplace(0.0, 1.0, hidden_units)
    chi3 = rng.laplace(0.0, 1.0, (hidden_units, num_classes))
    return chi1, chi2, chi3


def record_input_noise(seed: int, batch_id: str, record_ids: Sequence[str], *, input_dim: int) -> np.ndarray:
    """Standard Laplace χ1_r (d,) for each record, stacked (n, d): the ``"sound"`` analysis's
    independent input noise. Each row is a deterministic function of (seed, batch id, record id),
    so every read of the batch sees the same draw whatever order its records come in."""
    batch_key = hashlib.sha256(batch_id.encode()).digest()
    rows = []
    for record_id in record_ids:
        key = batch_key + hashlib.sha256(f"record {record_id}".encode()).digest()
        words = [int.from_bytes(key[i : i + 4], "little") for i in range(0, len(key), 4)]
        rng = np.random.default_rng(np.random.SeedSequence([seed & (2**64 - 1), 1, *words]))
        rows.append(rng.laplace(0.0, 1.0, input_dim))
    return np.stack(rows) if rows else np.zeros((0, input_dim))


def project_l1_rows(matrix: torch.Tensor, radius: float) -> torch.Tensor:
    """Each row of ``matrix`` projected (Euclidean) onto the ℓ1 ball of ``radius``
    (Duchi, Shalev-Shwartz, Singer & Chandra 2008, Fig. 1): soft-thresholding by the smallest θ
    that brings the row's 1-norm to ``radius``; rows already inside are unchanged."""
    absolute = matrix.abs()
    inside = absolute.sum(dim=1) <= radius
    if bool(inside.all()):
        return matrix
    sorted_abs, _ = torch.sort(absolute, dim=1, descending=True)
    cumulative = sorted_abs.cumsum(dim=1) - radius
    ks = torch.arange(1, matrix.shape[1] + 1, device=matrix.device, dtype=matrix.dtype)
    condition = sorted_abs - cumulative / ks > 0
    rho = condition.to(torch.int64).cumsum(dim=1).argmax(dim=1, keepdim=True)  # last True
    theta = (cumulative.gather(1, rho) / (rho + 1).to(matrix.dtype)).clamp(min=0)
    projected = torch.sign(matrix) * (absolute - theta).clamp(min=0)
    return torch.where(inside.unsqueeze(1), matrix, projected)


def project_theta1(w1: torch.Tensor, bound: float) -> torch.Tensor:
    """W1 with every row and every column in the ℓ1 ball of ``bound``: rows first, then columns
    (soft-thresholding only shrinks entries, so rows stay within the bound)."""
    return project_l1_rows(project_l1_rows(w1, bound).T, bound).T.contiguous()


def theta1_norm(w1: torch.Tensor) -> float:
    """max(largest row 1-norm, largest column 1-norm) of W1: what the event's bound covers."""
    return float(max(w1.abs().sum(dim=1).max(), w1.abs().sum(dim=0).max()))


# ---------------------------------------------------------------------------------------------
# L2DP-ML (its task plan and accuracy matrix, shared with the other lifelong trainers:
# service.training.lifelong_tasks)
# ---------------------------------------------------------------------------------------------


def l2dp_ml_event(p: L2dpMlParams, batch_size: int) -> FunctionalMechanismL2DPEvent:
    """The per-batch event every stage of the run reserves (|hπ| = |h1|: G is the output layer)."""
    return FunctionalMechanismL2DPEvent(
        epsilon1=p.epsilon1,
        epsilon2=p.epsilon2,
        input_dim=p.input_dim,
        hidden_units=p.hidden_units,
        output_hidden_units=p.hidden_units,
        batch_size=batch_size,
        theta1_norm_bound=p.theta1_norm_bound,
        analysis=p.analysis,
    )


@dataclass
class PerturbedBatch:
    """One batch after its single noise draw: x̄ (fixed), labels, the scaled χ2 and χ3."""

    x_bar: torch.Tensor  # (n, d)
    labels: torch.Tensor  # (n, K) one-hot
    hidden_noise: torch.Tensor  # (|h1|,) = 2χ2/|B| scaled
    label_noise: torch.Tensor  # (|hπ|, K) = χ3 scaled (sum form)


@dataclass
class L2dpMlState:
    params: L2dpMlParams
    plan: Plan
    event: FunctionalMechanismL2DPEvent
    scales: NoiseScales
    w1: torch.Tensor
    w2: torch.Tensor
    num_classes: int
    record: LifelongRecord
    picker: np.random.Generator
    position: int = 0


class L2dpMlTrainer:
    """L2DP-ML as a staged trainer (module docstring; ``service.training.stages``)."""

    algorithm: ClassVar[str] = "l2dp_ml"

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else default_device()

    def parse_params(self, params: Mapping[str, Any]) -> L2dpMlParams | FunctionalMechanismParams:
        return read_l2dp_ml(params)

    def _functional(self) -> Any:
        return FunctionalMechanismTrainer(device=self.device)

    @staticmethod
    def declared_batch_size(tasks: Sequence[LedgerTask]) -> int:
        return max(b.size for t in tasks for b in t.batches)

    def stages(
        self, params: L2dpMlParams | FunctionalMechanismParams, tasks: Sequence[LedgerTask]
    ) -> list[Stage]:
        if isinstance(params, FunctionalMechanismParams):
            stages: list[Stage] = self._functional().stages(params, tasks)
            return stages
        plan = make_plan(tasks, task_order=params.task_order, epochs=params.epochs, seed=params.seed)
        event = l2dp_ml_event(params, self.declared_batch_size(tasks))
        commitment = noise_commitment(params.seed)
        out = []
        for position, task in enumerate(plan.order):
            memory = plan.memory_before(position)
            out.append(
                Stage(
                    index=position + 1,
                    name=f"task {task.name}",
                    batch_ids=(*task.batch_ids, *memory),
                    event=event,
                    noise_commitment=commitment,
                    info={
                        "task": task.index,
                        "epochs": plan.epochs[position],
                        "memory_batches": len(memory),
                    },
                )
            )
        return out

    def start(
        self, params: L2dpMlParams | FunctionalMechanismParams, data: LoadedData, tasks: Sequence[LedgerTask]
    ) -> Any:
        if isinstance(params, FunctionalMechanismParams):
            return self._functional().start(params, data, tasks)
        if data.n_features != params.input_dim:
            raise InvalidParamsError(
                "params.input_dim",
                f"must be the data's number of features ({data.n_features}). Found {params.input_dim}.",
            )
        num_classes = params.num_classes if params.num_classes is not None else data.num_classes
        if num_classes < data.num_classes:
            raise InvalidParamsError(
                "params.num_classes",
                f"must cover the data's {data.num_classes} classes. Found {num_classes}.",
            )
        plan = make_plan(tasks, task_order=params.task_order, epochs=params.epochs, seed=params.seed)
        event = l2dp_ml_event(params, self.declared_batch_size(tasks))
        init = torch.Generator(device="cpu")
        init.manual_seed(int(np.random.SeedSequence([params.seed, 1]).generate_state(1)[0]))
        h1, d = params.hidden_units, params.input_dim
        w1 = (torch.rand(h1, d, generator=init, dtype=torch.float64) * 2 - 1).to(self.device)
        w1 = project_theta1(w1 * params.theta1_norm_bound * 4 / d, params.theta1_norm_bound)
        w2 = torch.zeros(num_classes, h1, dtype=torch.float64, device=self.device)
        picker = np.random.default_rng(np.random.SeedSequence([params.seed, 2]))
        return L2dpMlState(
            params, plan, event, noise_scales(event), w1, w2, num_classes, LifelongRecord.of(data), picker
        )

    # -- one batch ----------------------------------------------------------------------------

    def perturb(
        self,
        state: L2dpMlState,
        batch_id: str,
        features: np.ndarray,
        labels: np.ndarray,
        record_ids: Sequence[str],
    ) -> PerturbedBatch:
        """The batch's single perturbation (Alg. 2 line 2), reproducible from (seed, batch id,
        record ids): per-record input noise for ``"sound"``, one shared vector for ``"paper"``."""
        p, s = state.params, state.scales
        chi1, chi2, chi3 = batch_noise(
            p.seed,
            batch_id,
            input_dim=p.input_dim,
            hidden_units=p.hidden_units,
            num_classes=state.num_classes,
        )
        x = np.clip(features.astype(np.float64), 0.0, 1.0)
        if state.event.charged_analysis == "sound":
            if len(record_ids) != x.shape[0]:
                raise ValueError(f"batch {batch_id!r}: {x.shape[0]} rows but {len(record_ids)} record ids")
            chi1 = record_input_noise(p.seed, batch_id, record_ids, input_dim=p.input_dim)
        x_bar = torch.from_numpy(x + s.input * chi1).to(self.device)
        one_hot = F.one_hot(torch.from_numpy(labels), state.num_classes).to(self.device, torch.float64)
        return PerturbedBatch(
            x_bar,
            one_hot,
            torch.from_numpy(s.hidden * chi2).to(self.device),
            torch.from_numpy(s.labels * chi3).to(self.device),
        )

    @staticmethod
    def gradient(
        w1: torch.Tensor, w2: torch.Tensor, batch: PerturbedBatch, weight_decay: float = 0.0
    ) -> torch.Tensor:
        """g = {∇θ1 R̄_B, H⁻¹∇θ2 L̄_B} at (W1, W2), flat (module docstring), mean over the batch;
        θ2's part is the Newton direction of the quadratic L̄ (H its damped Hessian)."""
        n = batch.x_bar.shape[0]
        h_bar = (batch.x_bar @ w1.T).clamp(-1.0, 1.0) + batch.hidden_noise  # (n, h1)
        # Eq. 13: ∂R̄/∂θ1[s, j] = Σ_r h̄_rj (½ − x̄_rs); W1 = θ1ᵀ, so ∂/∂W1[j, s].
        g1 = h_bar.T @ (0.5 - batch.x_bar) / n
        h_pi = h_bar.clamp(-1.0, 1.0)
        z = h_pi @ w2.T  # (n, K)
        # ∂L̄/∂W2_k = Σ_r (½ + ¼ z_rk) hπ_r − (Σ_r y_rk hπ_r + χ3_k)
        coefficients = (batch.labels.T @ h_pi + batch.label_noise.T) / n  # (K, hπ)
        g2 = (0.5 + 0.25 * z).T @ h_pi / n - coefficients + weight_decay * w2
        # L̄ is quadratic in W2 with Hessian ¼ Σ_r hπ_r hπ_rᵀ (+ weight decay) for every class:
        # step along the Newton direction, so that ϱ = 1 reaches the batch's minimiser. Plain
        # gradient steps crawl (|hπ| ≈ 0.05–0.3, so curvature ≈ 10⁻³–10⁻²: docs/experiments/
        # lifelong.md, "Why L2DP-ML is near chance"). The Hessian is computed from h̄ only, so it
        # is post-processing of what the event already charges for.
        hessian = 0.25 * (h_pi.T @ h_pi) / n
        damping = NEWTON_DAMPING + weight_decay
        hessian = hessian + damping * torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
        g2 = torch.linalg.solve(hessian, g2.T).T
        return flatten([g1, g2])

    def _gradient_to_step(self, state: L2dpMlState, batch: PerturbedBatch, *, frozen: bool) -> torch.Tensor:
        g = self.gradient(state.w1, state.w2, batch, state.params.weight_decay)
        if frozen:
            g[: state.w1.numel()] = 0.0
        return g

    def _step(self, state: L2dpMlState, batch: PerturbedBatch, memory: Sequence[PerturbedBatch]) -> None:
        p = state.params
        frozen = p.encoder_learning_rate == 0.0  # θ1 does not move: A-gem projects θ2's part only
        g = self._gradient_to_step(state, batch, frozen=frozen)
        if memory:
            reference = memory[int(state.picker.integers(len(memory)))]
            g = agem_project(g, self._gradient_to_step(state, reference, frozen=frozen))
        g1, g2 = unflatten(g, [state.w1, state.w2])
        if not frozen:
            state.w1 = project_theta1(state.w1 - p.encoder_learning_rate * g1, p.theta1_norm_bound)
        state.w2 = state.w2 - p.learning_rate * g2

    def predict(self, w1: torch.Tensor, w2: torch.Tensor, features: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.clip(features.astype(np.float64), 0.0, 1.0)).to(self.device)
        h = (x @ w1.T).clamp(-1.0, 1.0)
        return (h @ w2.T).argmax(dim=1).cpu().numpy()

    def train_stage(
        self, state: Any, stage: Stage, data: LoadedData, records: Mapping[str, tuple[str, ...]]
    ) -> StageRelease:
        if not isinstance(state, L2dpMlState):
            release: StageRelease = self._functional().train_stage(state, stage, data, records)
            return release
        position = state.position
        task = state.plan.order[position]
        features: dict[str, np.ndarray] = {}
        labels: dict[str, np.ndarray] = {}
        index = {r: (split, i) for split in data.train for i, r in enumerate(split.record_ids)}
        for batch_id, ids in records.items():
            rows = [index[r] for r in ids]
            features[batch_id] = np.stack([split.features[i] for split, i in rows])
            labels[batch_id] = np.asarray([split.labels[i] for split, i in rows], dtype=np.int64)
        perturbed = {b: self.perturb(state, b, features[b], labels[b], records[b]) for b in records}
        current = [perturbed[b] for b in task.batch_ids]
        memory = [perturbed[b] for b in state.plan.memory_before(position)]
        order = np.random.default_rng(np.random.SeedSequence([state.params.seed, 3, position]))
        for _ in range(state.plan.epochs[position]):
            for i in order.permutation(len(current)):
                self._step(state, current[int(i)], memory)
        state.record.learnt(data, [r for b in task.batch_ids for r in records[b]])
        state.position += 1
        w1, w2 = state.w1, state.w2
        metrics = state.record.evaluate(lambda x: self.predict(w1, w2, x))
        metrics["theta1_norm"] = theta1_norm(w1)
        metrics["epochs"] = state.plan.epochs[position]
        model_state = {
            "encoder.weight": w1.detach().to("cpu", torch.float32, copy=True),
            "classifier.weight": w2.detach().to("cpu", torch.float32, copy=True),
        }
        return StageRelease(model_state, metrics)


__all__ = [
    "L2dpMlParams",
    "L2dpMlTrainer",
    "NoiseScales",
    "batch_noise",
    "epsilon1_for",
    "l2dp_ml_event",
    "noise_commitment",
    "noise_scales",
    "project_l1_rows",
    "project_theta1",
    "record_input_noise",
]
