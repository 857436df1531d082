"""Job params: the typed document each algorithm takes, declared once and torch-free.

The API checks a job's params against its algorithm's declaration when the job is submitted
(``service.ledger.jobs.queue.create_job``: an unknown key, a wrong type or a value out of range is a 422
naming ``params.<key>``), and the trainer reads them through the same declaration when the job
runs (``trainer.parse_params``). One definition, so what the API accepted is what the trainer
runs: a job can no longer be queued (201) and then fail on a param.

Each algorithm's params are a frozen dataclass whose ``from_params``/``read`` states every key it
takes with its type, range and default through ``JobParams``'s typed getters (``real``,
``integer``, ``string`` with choices, ``boolean``, ``integers``), and refuses keys that no getter
read (``JobParams.finish``), so a typo (``"epoch"``) is refused instead of silently training
with a default. ``PARAMS`` maps each algorithm of ``service.training.algorithms.TRAINERS`` to its
reader; ``validate(algorithm, params)`` is what the API calls.

This module imports neither torch nor numpy: the API process loads it. The trainer modules
(``dp_sgd``, ``adadp``, ``l2dp_ml``, ``continual_release``, ``pretrained``) re-export these names.
Checks that need the dataset (the steps an ``epochs`` param implies, ``task_order`` as a
permutation of the dataset's tasks, the model against the data's shape) stay in the trainers'
``plan``/``stages``: the worker makes them before it reserves, so a refused plan reads no data.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final

from accountant.events import InvalidFieldError

MODEL_KINDS: Final = ("mlp", "cnn")
DEFAULT_HIDDEN: Final[Mapping[str, tuple[int, ...]]] = {"mlp": (64,), "cnn": (16, 32)}
MAX_WIDTH: Final = 65_536
MAX_LAYERS: Final = 16
MAX_STEPS: Final = 10_000_000
MAX_WORLD_SIZE: Final = 64
"""The most processes one DP-SGD job may span (``params.world_size``; one worker host's)."""
ACCOUNTANTS: Final = ("rdp", "prv")
MAX_EPOCHS: Final = 10_000
MAX_TASKS: Final = 1_000
MODES: Final = ("multi_resolution", "cumulative", "sliding_window")
MAX_LEVEL: Final = 60
MAX_WINDOW_LEVELS: Final = 12
HEAD_DEFAULTS: Final[Mapping[str, float]] = {
    "epochs": 10.0,
    "expected_batch_size": 128,
    "max_grad_norm": 1.0,
    "learning_rate": 0.5,
}
"""DP-SGD defaults of the heads, tuned once on builtin:split-digits?tasks=5&public=400 at ε = 1
(three seeds) and used for the ensemble and both baselines at every ε, as the paper does
(App. C.1). The tuning looked at the private tasks' test accuracy and is not itself accounted."""


# ---------------------------------------------------------------------------------------------
# Typed reads of a params document
# ---------------------------------------------------------------------------------------------


class InvalidParamsError(InvalidFieldError):
    """A job param is invalid. ``field`` names it (``"params.learning_rate"``)."""


def _fmt(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


class JobParams:
    """Typed, validating reads of a job's ``params`` object; ``finish()`` refuses unknown keys."""

    def __init__(self, params: Mapping[str, Any], prefix: str = "params") -> None:
        if not isinstance(params, Mapping):
            raise InvalidParamsError(prefix, f"must be an object. Found {type(params).__name__}.")
        self._params = params
        self._prefix = prefix
        self._read: set[str] = set()

    def _get(self, name: str) -> Any:
        self._read.add(name)
        return self._params.get(name)

    def _field(self, name: str) -> str:
        return f"{self._prefix}.{name}"

    def has(self, name: str) -> bool:
        return self._params.get(name) is not None

    def string(self, name: str, default: str, choices: Sequence[str]) -> str:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, str) or value not in choices:
            raise InvalidParamsError(
                self._field(name), f"must be one of {list(choices)}. Found {_fmt(value)}."
            )
        return value

    def real(
        self,
        name: str,
        default: float | None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float | None:
        value = self._get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidParamsError(self._field(name), f"must be a finite number. Found {_fmt(value)}.")
        if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
            op = ">" if exclusive_minimum else ">="
            raise InvalidParamsError(self._field(name), f"must be {op} {minimum}. Found {_fmt(value)}.")
        if maximum is not None and value > maximum:
            raise InvalidParamsError(self._field(name), f"must be <= {maximum}. Found {_fmt(value)}.")
        return float(value)

    def integer(
        self, name: str, default: int | None, *, minimum: int = 0, maximum: int = 2**62
    ) -> int | None:
        value = self._get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise InvalidParamsError(
                self._field(name),
                f"must be an integer in [{minimum}, {maximum}]. Found {_fmt(value)}.",
            )
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self._get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise InvalidParamsError(self._field(name), f"must be true or false. Found {_fmt(value)}.")
        return value

    def integers(self, name: str, default: tuple[int, ...], *, minimum: int = 1) -> tuple[int, ...]:
        value = self._get(name)
        if value is None:
            return default
        items = [value] if isinstance(value, int | float) and not isinstance(value, bool) else value
        if not isinstance(items, list | tuple) or not 1 <= len(items) <= MAX_LAYERS:
            raise InvalidParamsError(
                self._field(name),
                f"must be an integer or a list of 1 to {MAX_LAYERS} integers. Found {_fmt(value)}.",
            )
        out: list[int] = []
        for item in items:
            if isinstance(item, float) and item.is_integer():
                item = int(item)
            if isinstance(item, bool) or not isinstance(item, int) or not minimum <= item <= MAX_WIDTH:
                raise InvalidParamsError(
                    self._field(name),
                    f"must hold integers in [{minimum}, {MAX_WIDTH}]. Found {_fmt(value)}.",
                )
            out.append(item)
        return tuple(out)

    def finish(self) -> None:
        """Raise for the first key that no getter read: an unknown param."""
        for name in self._params:
            if name not in self._read:
                raise InvalidParamsError(self._field(str(name)), "is not a known param.")


# ---------------------------------------------------------------------------------------------
# DP-SGD and AdaDp
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which model to build: ``kind`` (``"mlp"`` or ``"cnn"``) and its ``hidden`` widths."""

    kind: str = "mlp"
    hidden: tuple[int, ...] = DEFAULT_HIDDEN["mlp"]

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise InvalidParamsError(
                "params.model", f"must be one of {list(MODEL_KINDS)}. Found {self.kind!r}."
            )
        if self.kind == "cnn" and len(self.hidden) != 2:
            raise InvalidParamsError(
                "params.hidden", f"must be two channel counts for the cnn. Found {list(self.hidden)}."
            )
        if not self.hidden or any(w < 1 or w > MAX_WIDTH for w in self.hidden):
            raise InvalidParamsError(
                "params.hidden", f"must be widths in [1, {MAX_WIDTH}]. Found {list(self.hidden)}."
            )

    @classmethod
    def read(cls, params: JobParams) -> ModelSpec:
        kind = params.string("model", "mlp", MODEL_KINDS)
        hidden = params.integers("hidden", DEFAULT_HIDDEN[kind])
        return cls(kind=kind, hidden=hidden)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.kind, "hidden": list(self.hidden)}


@dataclass(frozen=True, slots=True)
class DpSgdParams:
    """A DP-SGD job's params, validated. Build with ``from_params(mapping)``.

    Privacy: exactly one of ``target_epsilon`` (σ calibrated so that the run's own ε at ``delta``
    by the tight accountant, PRV, is at most the target: what Opacus users mean),
    ``target_budget_epsilon`` (σ calibrated so that the dataset *charges* at most this much: the
    budget's increase) and ``noise_multiplier``. ``delta``: absent, the budget's δ (the gate fills
    it in). A run the budget cannot admit is refused before any data is read, naming the largest
    ``target_epsilon`` that fits. Length: ``steps`` or ``epochs`` (T = ⌈epochs/q⌉; default 10 epochs).
    Sampling: ``sampling_probability`` or ``expected_batch_size`` (q = size/N; default 64).
    ``world_size``: how many processes train the run together (``service.training.distributed``:
    one per GPU on CUDA); the event, the charge and the certificate do not depend on it.
    """

    # Defaults tuned on builtin:digits at ε = 2 (about 92% test accuracy with the default MLP).
    default_learning_rate: ClassVar[float] = 0.5
    default_momentum: ClassVar[float] = 0.0

    model: ModelSpec = field(default_factory=ModelSpec)
    target_epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    target_budget_epsilon: float | None = None
    epochs: float | None = None
    steps: int | None = None
    expected_batch_size: int | None = None
    sampling_probability: float | None = None
    max_grad_norm: float = 1.0
    learning_rate: float = 0.5
    momentum: float = 0.0
    checkpoint_every: int | None = None
    seed: int | None = None
    accountant: str = "rdp"
    num_classes: int | None = None
    world_size: int = 1

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> DpSgdParams:
        """Validate a job's params (errors name the field, e.g. ``params.learning_rate``)."""
        reader = JobParams(params)
        values = cls._read(reader)
        reader.finish()
        return cls(**values)

    @classmethod
    def _read(cls, r: JobParams) -> dict[str, Any]:
        privacy = _read_privacy(r)
        if r.has("steps") and r.has("epochs"):
            raise InvalidParamsError("params.steps", "and params.epochs are exclusive; give one.")
        if r.has("sampling_probability") and r.has("expected_batch_size"):
            raise InvalidParamsError(
                "params.sampling_probability", "and params.expected_batch_size are exclusive; give one."
            )
        values: dict[str, Any] = {
            "model": ModelSpec.read(r),
            **privacy,
            "epochs": r.real("epochs", None, minimum=0, maximum=1e6, exclusive_minimum=True),
            "steps": r.integer("steps", None, minimum=1, maximum=MAX_STEPS),
            "expected_batch_size": r.integer("expected_batch_size", None, minimum=1),
            "sampling_probability": r.real(
                "sampling_probability", None, minimum=0, maximum=1, exclusive_minimum=True
            ),
            "max_grad_norm": r.real("max_grad_norm", 1.0, minimum=0, exclusive_minimum=True),
            "learning_rate": r.real(
                "learning_rate", cls.default_learning_rate, minimum=0, exclusive_minimum=True
            ),
            "momentum": r.real("momentum", cls.default_momentum, minimum=0, maximum=0.999),
            "checkpoint_every": r.integer("checkpoint_every", None, minimum=1, maximum=MAX_STEPS),
            "seed": r.integer("seed", None, minimum=0, maximum=2**62),
            "accountant": r.string("accountant", "rdp", ACCOUNTANTS),
            "num_classes": r.integer("num_classes", None, minimum=2, maximum=100_000),
            "world_size": r.integer("world_size", 1, minimum=1, maximum=MAX_WORLD_SIZE),
        }
        return values

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModelSpec):
                out.update(value.to_json())
            elif f.name == "world_size" and value == 1:
                continue  # the default: a one-process run's params read as before
            elif value is not None:
                out[f.name] = value
        return out


@dataclass(frozen=True, slots=True)
class AdaDpParams(DpSgdParams):
    """DP-SGD's params (``max_grad_norm`` is C of the warm-up; no ``momentum``) plus AdaDp's own.

    ``beta`` local clipping factor β; ``gamma`` RMSProp rate γ of E[g̃²] (line 22);
    ``gamma_prime`` decay γ′ of E′[g²] (line 23); ``local_clipping_threshold`` G;
    ``warmup_steps`` minimum global-clipping steps; ``epsilon0`` ε₀ of the RMSProp denominator.
    """

    beta: float = 2.0
    gamma: float = 0.1
    gamma_prime: float = 0.9
    local_clipping_threshold: float = 0.0
    warmup_steps: int = 20
    epsilon0: float = 1e-8
    debias_second_moment: bool = True
    cap_total_sensitivity: bool = True
    second_moment_floor: float = 1e-12
    relative_second_moment_floor: float = 0.01
    learning_rate: float = 0.02
    default_learning_rate: ClassVar[float] = 0.02
    default_momentum: ClassVar[float] = 0.0

    @classmethod
    def _read(cls, r: JobParams) -> dict[str, Any]:
        if r.has("momentum"):
            raise InvalidParamsError("params.momentum", "is not an adadp param (RMSProp adapts the steps).")
        values = super(AdaDpParams, cls)._read(r)
        if values["world_size"] != 1:  # its per-step noise depends on state no rank shares
            raise InvalidParamsError(
                "params.world_size", f"must be 1 for adadp (one process). Found {values['world_size']}."
            )
        values.update(
            beta=r.real("beta", 2.0, minimum=0, exclusive_minimum=True),
            gamma=r.real("gamma", 0.1, minimum=0, maximum=1, exclusive_minimum=True),
            gamma_prime=r.real("gamma_prime", 0.9, minimum=0, maximum=0.9999),
            local_clipping_threshold=r.real("local_clipping_threshold", 0.0, minimum=0),
            warmup_steps=r.integer("warmup_steps", 20, minimum=1),
            epsilon0=r.real("epsilon0", 1e-8, minimum=0, exclusive_minimum=True),
            debias_second_moment=r.boolean("debias_second_moment", True),
            cap_total_sensitivity=r.boolean("cap_total_sensitivity", True),
            second_moment_floor=r.real("second_moment_floor", 1e-12, minimum=0, exclusive_minimum=True),
            relative_second_moment_floor=r.real("relative_second_moment_floor", 0.01, minimum=0, maximum=1),
        )
        return values

    def to_json(self) -> dict[str, Any]:
        out = super(AdaDpParams, self).to_json()
        out.pop("momentum", None)  # not an AdaDp param
        return out


MAX_CANARIES: Final = 10_000
"""A step widens the private gradient by one coordinate per canary (``privacy_audit``): the
per-example matrix is (B + sampled canaries) × (P + m), which this keeps within memory."""


@dataclass(frozen=True, slots=True)
class PrivacyAuditParams(DpSgdParams):
    """DP-SGD's params — the run audited, as a release would run it — plus the audit's own
    (``service.training.privacy_audit``): ``canaries`` m (each included with probability 1/2)
    and ``confidence`` 1 − β of the lower bound. ``delta`` is required: the δ of the (ε, δ)
    claim the audit tests."""

    canaries: int = 1000
    confidence: float = 0.95

    @classmethod
    def _read(cls, r: JobParams) -> dict[str, Any]:
        values = super(PrivacyAuditParams, cls)._read(r)
        if values["delta"] is None:
            raise InvalidParamsError(
                "params.delta", "is required for an audit: the δ of the (ε, δ) claim it tests."
            )
        values.update(
            canaries=r.integer("canaries", 1000, minimum=2, maximum=MAX_CANARIES),
            confidence=r.real("confidence", 0.95, minimum=0.5, maximum=0.999999),
        )
        return values


PRIVACY_TARGETS: Final = ("target_epsilon", "target_budget_epsilon", "noise_multiplier")


def _read_privacy(r: JobParams) -> dict[str, Any]:
    """Exactly one of ``target_epsilon`` (the run's own ε), ``target_budget_epsilon`` (what the
    dataset charges) and ``noise_multiplier``; ``delta`` optional (the budget's δ). DP-SGD, AdaDp
    and the staged trainers that calibrate σ (pre-trained heads and sums, NaiveGaussian)."""
    given = [name for name in PRIVACY_TARGETS if r.has(name)]
    if len(given) != 1:
        raise InvalidParamsError(
            "params.target_epsilon",
            "or params.target_budget_epsilon or params.noise_multiplier must be given (exactly one). "
            f"Found {given or 'none'}.",
        )
    out = {name: r.real(name, None, minimum=0, exclusive_minimum=True) for name in PRIVACY_TARGETS}
    out["delta"] = r.real("delta", None, minimum=0, maximum=0.5, exclusive_minimum=True)
    return out


# ---------------------------------------------------------------------------------------------
# L2DP-ML and NaiveGaussian
# ---------------------------------------------------------------------------------------------


def _read_epochs(r: JobParams, default: int) -> int | tuple[int, ...]:
    if not r.has("epochs"):
        r.integer("epochs", None)
        return default
    raw = r._params["epochs"]
    if isinstance(raw, list | tuple):
        values = r.integers("epochs", (default,))
        if len(raw) > MAX_TASKS:
            raise InvalidParamsError("params.epochs", f"must list at most {MAX_TASKS} tasks.")
        if any(v > MAX_EPOCHS for v in values):
            raise InvalidParamsError(
                "params.epochs", f"must hold integers in [1, {MAX_EPOCHS}]. Found {raw}."
            )
        return values
    value = r.integer("epochs", default, minimum=1, maximum=MAX_EPOCHS)
    assert value is not None
    return value


def _read_task_order(r: JobParams) -> tuple[int, ...] | None:
    if not r.has("task_order"):
        r.integer("task_order", None)
        return None
    raw = r._params["task_order"]
    if not isinstance(raw, list | tuple) or not 1 <= len(raw) <= MAX_TASKS:
        raise InvalidParamsError("params.task_order", f"must be a list of task indices. Found {raw!r}.")
    out = []
    for item in raw:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise InvalidParamsError("params.task_order", f"must hold task indices >= 0. Found {raw!r}.")
        out.append(item)
    r._read.add("task_order")
    return tuple(out)


def _read_seed(r: JobParams) -> int:
    seed = r.integer("seed", None, minimum=0, maximum=2**62)
    return secrets.randbits(62) if seed is None else seed


def _read_encoder_learning_rate(r: JobParams, analysis: str) -> float:
    """θ1's ϱ: 0.001 by default under ``"paper"``; under ``"sound"`` 0, and nothing else.

    Why (docs/DESIGN-NOTES.md, note "L2DP-ML at a realistic size"): the label coefficients
    Σ_r hπ_r y_rᵀ + χ3 of a batch are computed at every read with the batch's one χ3. If θ1 moved
    between reads (another epoch, a memory replay, a second job with the same seed), two reads
    would publish two coefficients with the same noise, whose difference is noiseless, and ε2 would
    not bound them. With θ1 fixed at its seeded, data-independent initial value, every read of a
    batch computes the same coefficients: one Laplace release, which the ε2 term does bound."""
    if analysis == "paper":
        return r.real("encoder_learning_rate", 0.001, minimum=0) or 0.0
    rate = r.real("encoder_learning_rate", 0.0, minimum=0) or 0.0
    if rate != 0.0:
        raise InvalidParamsError(
            "params.encoder_learning_rate",
            f"must be 0 under analysis 'sound' (θ1 stays at its seeded initial value, so that every "
            f"read of a batch computes the same label coefficients and ε2 bounds them). Found {rate}.",
        )
    return 0.0


MAX_HIDDEN_NOISE_SCALE: Final = 0.5
"""The largest Laplace scale of L2DP-ML's hidden-unit noise a job may ask for without
``noise_check: false``: on 2 tasks of builtin:permuted-synthetic-digits the model was at chance
(≤ 0.12) for every scale ≥ 1.47 and above it (0.27–0.56) only at ≤ 0.27 (bench/l2dp_ml_utility.py)."""


@dataclass(frozen=True, slots=True)
class L2dpMlParams:
    """An L2DP-ML job's params, validated (``L2dpMlTrainer.parse_params``)."""

    epsilon1: float
    epsilon2: float
    input_dim: int
    # |h1| and ϱ tuned without noise on builtin:permuted-synthetic-digits (docs/experiments/
    # lifelong.md): 8 units and ϱ = 0.05 (a gradient step) reached 0.3; 32 and a Newton step 0.66.
    hidden_units: int = 32
    theta1_norm_bound: float = 1.0
    epochs: int | tuple[int, ...] = 1
    task_order: tuple[int, ...] | None = None
    learning_rate: float = 0.5
    encoder_learning_rate: float = 0.0  # "paper": 0.001 by default; "sound": must be 0
    weight_decay: float = 0.0
    num_classes: int | None = None
    seed: int = 0
    # Which analysis of Thm. 2 the run is charged under (``FunctionalMechanismL2DPEvent``):
    # "sound" draws independent input noise per record; "paper" Alg. 2's one shared vector.
    analysis: str = "sound"
    # Refuse at submission a run whose hidden-layer noise swamps the units (``check_batch_size``);
    # false runs it anyway (the accounting experiments do, on purpose).
    noise_check: bool = True

    def hidden_noise_scale(self, batch_size: int) -> float:
        """The Laplace scale 2Δ_R/(ε1|B|) of h̄'s noise (Alg. 2 line 2; Δ_R = d(|h1| + 2)); the
        input noise's is half of it."""
        return 2 * self.input_dim * (self.hidden_units + 2) / (self.epsilon1 * batch_size)

    def check_batch_size(self, batch_size: int) -> None:
        """Refuse (``params.epsilon1``) a run on batches of at most ``batch_size`` records whose
        hidden units, clipped to [−1, 1], would get Laplace noise of scale above
        ``MAX_HIDDEN_NOISE_SCALE``: measured at chance there (docs/experiments/lifelong.md, "Why
        L2DP-ML is near chance"). The message states the batch size or ε1 it needs, and that under
        Thm. 2 a larger |B| raises the batch's ε in proportion (γx, γ ∝ 1/|B|)."""
        scale = self.hidden_noise_scale(batch_size)
        if not self.noise_check or scale <= MAX_HIDDEN_NOISE_SCALE:
            return
        needed = 2 * self.input_dim * (self.hidden_units + 2) / MAX_HIDDEN_NOISE_SCALE
        raise InvalidParamsError(
            "params.epsilon1",
            f"is too small for this dataset: with input_dim = {self.input_dim}, hidden_units = "
            f"{self.hidden_units} and the dataset's largest batch of {batch_size} records, the hidden "
            f"layer's Laplace noise has scale 2Δ_R/(ε1·|B|) = {scale:.3g} against units in [-1, 1] "
            f"(more than {MAX_HIDDEN_NOISE_SCALE}), so the model would be at chance. It needs "
            f"ε1·|B| >= {needed:.6g}: batches of >= {math.ceil(needed / self.epsilon1)} records at "
            f"ε1 = {self.epsilon1:g}, or ε1 >= {needed / batch_size:.4g} at |B| = {batch_size} (Thm. 2 "
            "charges ε1·|B| in proportion, so either raises the batch's ε). Set params.noise_check "
            "to false to run it anyway.",
        )

    @classmethod
    def read(cls, params: Mapping[str, Any]) -> L2dpMlParams:
        r = JobParams(params)
        for required in ("epsilon1", "epsilon2", "input_dim"):
            if not r.has(required):
                raise InvalidParamsError(f"params.{required}", "is required.")
        analysis = r.string("analysis", "sound", ("sound", "paper"))
        eps1 = r.real("epsilon1", None, minimum=0, exclusive_minimum=True)
        eps2 = r.real("epsilon2", None, minimum=0, exclusive_minimum=True)
        d = r.integer("input_dim", None, minimum=1, maximum=1_000_000)
        assert eps1 is not None and eps2 is not None and d is not None
        values = cls(
            epsilon1=eps1,
            epsilon2=eps2,
            input_dim=d,
            hidden_units=r.integer("hidden_units", 32, minimum=1, maximum=4096) or 32,
            theta1_norm_bound=r.real("theta1_norm_bound", 1.0, minimum=0, exclusive_minimum=True) or 1.0,
            epochs=_read_epochs(r, 1),
            task_order=_read_task_order(r),
            learning_rate=r.real("learning_rate", 0.5, minimum=0, exclusive_minimum=True) or 0.5,
            encoder_learning_rate=_read_encoder_learning_rate(r, analysis),
            weight_decay=r.real("weight_decay", 0.0, minimum=0) or 0.0,
            num_classes=r.integer("num_classes", None, minimum=2, maximum=100_000),
            seed=_read_seed(r),
            analysis=analysis,
            noise_check=r.boolean("noise_check", True),
        )
        r.finish()
        return values


PERTURBATIONS: Final = ("input", "functional_mechanism")
"""``l2dp_ml``'s ``perturbation``: ``"functional_mechanism"`` is the sound lifelong learner
(``FunctionalMechanismParams``, ``service.training.functional_mechanism``); ``"input"``, the default
for compatibility, is Alg. 2's input and hidden-layer perturbation (``L2dpMlParams``), kept as the
historical variant (its ``"paper"`` analysis is refused for a job, its ``"sound"`` one is at chance:
docs/experiments/lifelong.md)."""

MAX_FEATURES: Final = 1024


@dataclass(frozen=True, slots=True)
class FunctionalMechanismParams:
    """An ``l2dp_ml`` job with ``perturbation: "functional_mechanism"`` (module
    ``service.training.functional_mechanism``), validated.

    ``noise_multiplier``: σ of the Gaussian mechanism on each batch's coefficients (the noise's
    standard deviation is σ·Δ₂, Δ₂ from ``feature_bound``). ``features``: p, the dimension of the
    seeded random features (one of them the constant bias); ``feature_scale``: the standard
    deviation of the random projection's entries; ``regularization``: λ of the output layer's
    ridge term; ``multi_head``: one head per task (solved from that task's batches only, predicting
    among that task's classes) instead of one shared head; ``memory_per_task``: how many perturbed
    batches of each learnt task the shared head keeps (the episodic memory; absent: all of them).
    Defaults chosen without noise and at ε = 1 on builtin:split-digits (docs/experiments/lifelong.md).
    """

    noise_multiplier: float
    features: int = 64
    feature_scale: float = 0.2
    feature_bound: float = 1.0
    regularization: float = 30.0
    multi_head: bool = False
    memory_per_task: int | None = None
    task_order: tuple[int, ...] | None = None
    num_classes: int | None = None
    seed: int = 0
    perturbation: str = "functional_mechanism"

    @classmethod
    def read(cls, params: Mapping[str, Any]) -> FunctionalMechanismParams:
        r = JobParams(params)
        r.string("perturbation", "functional_mechanism", ("functional_mechanism",))
        if not r.has("noise_multiplier"):
            raise InvalidParamsError("params.noise_multiplier", "is required.")
        sigma = r.real("noise_multiplier", None, minimum=0, exclusive_minimum=True, maximum=1e6)
        assert sigma is not None
        values = cls(
            noise_multiplier=sigma,
            features=r.integer("features", 64, minimum=2, maximum=MAX_FEATURES) or 64,
            feature_scale=r.real("feature_scale", 0.2, minimum=0, exclusive_minimum=True, maximum=1e3) or 0.2,
            feature_bound=r.real("feature_bound", 1.0, minimum=0, exclusive_minimum=True, maximum=1e3) or 1.0,
            regularization=r.real("regularization", 30.0, minimum=0, exclusive_minimum=True, maximum=1e9)
            or 30.0,
            multi_head=r.boolean("multi_head", False),
            memory_per_task=r.integer("memory_per_task", None, minimum=1, maximum=1_000_000),
            task_order=_read_task_order(r),
            num_classes=r.integer("num_classes", None, minimum=2, maximum=100_000),
            seed=_read_seed(r),
        )
        r.finish()
        return values


def read_l2dp_ml(params: Mapping[str, Any]) -> L2dpMlParams | FunctionalMechanismParams:
    """An ``l2dp_ml`` job's params: by ``perturbation`` (``PERTURBATIONS``), the functional
    mechanism's or Alg. 2's."""
    r = JobParams(params)
    perturbation = r.string("perturbation", "input", PERTURBATIONS)
    if perturbation == "functional_mechanism":
        return FunctionalMechanismParams.read(params)
    return L2dpMlParams.read({k: v for k, v in params.items() if k != "perturbation"})


@dataclass(frozen=True, slots=True)
class NaiveGaussianParams:
    """A NaiveGaussian job's params, validated. One σ for every stage; exactly one of
    ``noise_multiplier``, ``target_epsilon`` (the whole run's own ε at ``delta`` by the tight
    accountant: every stage composed, as the first task's memory batch is read by all of them)
    and ``target_budget_epsilon`` (every stage's charge fits a fresh ``sequential``/``rdp`` budget
    of this ε: what such a dataset's Rényi filter charges). ``delta``: absent, the budget's."""

    noise_multiplier: float | None
    target_epsilon: float | None
    delta: float | None
    target_budget_epsilon: float | None
    sampling_probability: float = 0.2
    epochs: int | tuple[int, ...] = 1
    task_order: tuple[int, ...] | None = None
    hidden: int = 32
    max_grad_norm: float = 1.0
    learning_rate: float = 0.5
    num_classes: int | None = None
    seed: int = 0

    @classmethod
    def read(cls, params: Mapping[str, Any]) -> NaiveGaussianParams:
        r = JobParams(params)
        privacy = _read_privacy(r)
        values = cls(
            **privacy,
            sampling_probability=r.real(
                "sampling_probability", 0.2, minimum=0, maximum=1, exclusive_minimum=True
            )
            or 0.2,
            epochs=_read_epochs(r, 1),
            task_order=_read_task_order(r),
            hidden=r.integer("hidden", 32, minimum=1, maximum=4096) or 32,
            max_grad_norm=r.real("max_grad_norm", 1.0, minimum=0, exclusive_minimum=True) or 1.0,
            learning_rate=r.real("learning_rate", 0.5, minimum=0, exclusive_minimum=True) or 0.5,
            num_classes=r.integer("num_classes", None, minimum=2, maximum=100_000),
            seed=_read_seed(r),
        )
        r.finish()
        return values


# ---------------------------------------------------------------------------------------------
# Continual and sliding-window release
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContinualParams:
    mode: str
    epsilon: float
    regularization: float = 1.0
    sampling: bool = False
    base_blocks: int = 1
    max_level: int = 20
    window_levels: int = 3
    max_blocks: int | None = None
    seed: int | None = None
    positive_class: int | None = None

    @property
    def window_blocks(self) -> int:
        return (1 << self.window_levels) - 1

    @classmethod
    def read(cls, params: Mapping[str, Any]) -> ContinualParams:
        """A continual/sliding-window release job's params, validated."""
        p = JobParams(params)
        mode = p.string("mode", "multi_resolution", MODES)
        epsilon = p.real("epsilon", None, minimum=0.0, exclusive_minimum=True, maximum=1e6)
        if epsilon is None:
            raise InvalidParamsError("params.epsilon", "is required (the geometric budget's epsilon).")
        regularization = p.real("regularization", 1.0, minimum=0.0, exclusive_minimum=True, maximum=1e6)
        assert regularization is not None
        sampling = p.boolean("sampling", False)
        base_blocks = p.integer("base_blocks", 1, minimum=1, maximum=2**20)
        assert base_blocks is not None
        if base_blocks & (base_blocks - 1):
            raise InvalidParamsError("params.base_blocks", f"must be a power of two. Found {base_blocks}.")
        max_level = p.integer("max_level", 20, minimum=0, maximum=MAX_LEVEL)
        window_levels = p.integer("window_levels", 3, minimum=1, maximum=MAX_WINDOW_LEVELS)
        max_blocks = p.integer("max_blocks", None, minimum=1)
        seed = p.integer("seed", None, minimum=0, maximum=2**63 - 1)
        positive_class = p.integer("positive_class", None, minimum=0, maximum=2**31 - 1)
        p.finish()
        assert max_level is not None and window_levels is not None
        return cls(
            mode,
            epsilon,
            regularization,
            sampling,
            base_blocks,
            max_level,
            window_levels,
            max_blocks,
            seed,
            positive_class,
        )


# ---------------------------------------------------------------------------------------------
# Pre-trained extractor: cosine classifier and PEFT heads
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExtractorSpec:
    """How the public extractor is trained: feature dimension K, epochs over the public split,
    learning rate (Adam) and seed."""

    feature_dim: int = 32
    epochs: int = 30
    learning_rate: float = 3e-3
    seed: int = 0

    def to_json(self) -> dict[str, int | float]:
        return {
            "feature_dim": self.feature_dim,
            "pretrain_epochs": self.epochs,
            "pretrain_learning_rate": self.learning_rate,
            "extractor_seed": self.seed,
        }


@dataclass(frozen=True, slots=True)
class PretrainedParams:
    """Params shared by the four trainers. Privacy: exactly one of ``target_epsilon`` (σ
    calibrated per stage so that the stage's run has its own ε at ``delta`` by the tight
    accountant, PRV, at most the target: what Opacus users mean), ``target_budget_epsilon`` (σ
    calibrated per stage so that the ledger charges the stage's event at most this much as one
    charge under ``accountant``, which must be the budget's) and ``noise_multiplier``. ``delta``:
    absent, the budget's (the gate fills it in). A run whose stages the budget cannot admit is
    refused before any data is read, naming the largest ``target_epsilon`` that fits."""

    target_epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    target_budget_epsilon: float | None = None
    accountant: str = "rdp"
    num_classes: int | None = None
    seed: int | None = None
    extractor: ExtractorSpec = field(default_factory=ExtractorSpec)

    @classmethod
    def _read(cls, r: JobParams) -> dict[str, Any]:
        privacy = _read_privacy(r)
        feature_dim = r.integer("feature_dim", 32, minimum=2, maximum=4096)
        epochs = r.integer("pretrain_epochs", 30, minimum=1, maximum=10_000)
        lr = r.real("pretrain_learning_rate", 3e-3, minimum=0, maximum=10, exclusive_minimum=True)
        extractor_seed = r.integer("extractor_seed", 0, minimum=0, maximum=2**62)
        assert feature_dim is not None and epochs is not None and lr is not None
        assert extractor_seed is not None
        return {
            **privacy,
            "accountant": r.string("accountant", "rdp", ACCOUNTANTS),
            "num_classes": r.integer("num_classes", None, minimum=2, maximum=100_000),
            "seed": r.integer("seed", None, minimum=0, maximum=2**62),
            "extractor": ExtractorSpec(feature_dim, epochs, lr, extractor_seed),
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PretrainedParams:
        reader = JobParams(params)
        values = cls._read(reader)
        reader.finish()
        return cls(**values)


@dataclass(frozen=True, slots=True)
class HeadParams(PretrainedParams):
    """Params of the DP-SGD heads: ``epochs`` per stage (T = ⌈epochs/q⌉), ``expected_batch_size``
    B (q = B/N_stage), clipping bound ``max_grad_norm`` C, ``learning_rate``, ``momentum``."""

    epochs: float = 10.0
    expected_batch_size: int = 128
    max_grad_norm: float = 1.0
    learning_rate: float = 0.5
    momentum: float = 0.0

    @classmethod
    def _read(cls, r: JobParams) -> dict[str, Any]:
        values = PretrainedParams._read(r)
        values.update(
            epochs=r.real("epochs", HEAD_DEFAULTS["epochs"], minimum=0, maximum=1e5, exclusive_minimum=True),
            expected_batch_size=r.integer(
                "expected_batch_size", int(HEAD_DEFAULTS["expected_batch_size"]), minimum=1, maximum=10**9
            ),
            max_grad_norm=r.real(
                "max_grad_norm", HEAD_DEFAULTS["max_grad_norm"], minimum=0, exclusive_minimum=True
            ),
            learning_rate=r.real(
                "learning_rate", HEAD_DEFAULTS["learning_rate"], minimum=0, exclusive_minimum=True
            ),
            momentum=r.real("momentum", 0.0, minimum=0, maximum=0.999),
        )
        return values


ALGORITHMS: Final = (
    "dp_sgd",
    "adadp",
    "l2dp_ml",
    "continual_release",
    "cosine_classifier",
    "peft_ensemble",
    # Baselines
    "naive_gaussian",
    "peft_naive",
    "peft_full_data",
    # One-run privacy audit of a DP-SGD run (an ε lower bound beside the certified upper bound)
    "dp_sgd_audit",
)
"""Every algorithm a job may name, in the order the API lists them; the first six are the HTTP
contract (docs/ARCHITECTURE.md, "Jobs and the worker"). Each has a trainer
(``service.training.algorithms.TRAINERS``) and a params reader (``PARAMS``)."""

PARAMS: Final[Mapping[str, Callable[[Mapping[str, Any]], Any]]] = {
    "dp_sgd": DpSgdParams.from_params,
    "adadp": AdaDpParams.from_params,
    "dp_sgd_audit": PrivacyAuditParams.from_params,
    "l2dp_ml": read_l2dp_ml,
    "continual_release": ContinualParams.read,
    "cosine_classifier": PretrainedParams.from_params,
    "peft_ensemble": HeadParams.from_params,
    "naive_gaussian": NaiveGaussianParams.read,
    "peft_naive": HeadParams.from_params,
    "peft_full_data": HeadParams.from_params,
}
"""Each algorithm's params reader (the trainer's ``parse_params`` reads through the same one;
``tests/worker/test_job_params.py`` checks every algorithm of ``ALGORITHMS`` has one, and a trainer)."""


def validate(algorithm: str, params: Mapping[str, Any]) -> Any:
    """The trainer's params of a job, validated as its trainer will read them (``InvalidParamsError``
    naming ``params.<key>``). ``params`` holds the trainer's keys only (no ``model_name``)."""
    try:
        reader = PARAMS[algorithm]
    except KeyError:
        raise InvalidParamsError("algorithm", f"has no params declaration. Found {algorithm!r}.") from None
    parsed = reader(params)
    if getattr(parsed, "analysis", "sound") != "sound":
        # The ledger refuses a new charge priced by Thm. 2 as printed (docs/DESIGN-NOTES.md
        # note 21): such a job could only fail at its reservation. "paper" stays a trainer
        # option for experiments outside the ledger (bench/l2dp_ml_utility.py).
        raise InvalidParamsError(
            "params.analysis",
            "must be 'sound' for a job: the ledger refuses a new charge priced by L2DP-ML Thm. 2 as "
            f"printed (docs/DESIGN-NOTES.md note 21). Found {parsed.analysis!r}.",
        )
    return parsed


__all__ = [
    "ACCOUNTANTS",
    "ALGORITHMS",
    "DEFAULT_HIDDEN",
    "HEAD_DEFAULTS",
    "MAX_CANARIES",
    "MAX_EPOCHS",
    "MAX_LAYERS",
    "MAX_LEVEL",
    "MAX_STEPS",
    "MAX_TASKS",
    "MAX_WIDTH",
    "MAX_WINDOW_LEVELS",
    "MODEL_KINDS",
    "MODES",
    "PARAMS",
    "PERTURBATIONS",
    "PRIVACY_TARGETS",
    "AdaDpParams",
    "ContinualParams",
    "DpSgdParams",
    "ExtractorSpec",
    "FunctionalMechanismParams",
    "HeadParams",
    "InvalidParamsError",
    "JobParams",
    "L2dpMlParams",
    "ModelSpec",
    "NaiveGaussianParams",
    "PretrainedParams",
    "PrivacyAuditParams",
    "read_l2dp_ml",
    "validate",
]
