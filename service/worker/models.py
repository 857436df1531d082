"""The models the worker trains: an MLP and a small CNN for 8×8 images, chosen by job params.

Both are built only from layers whose per-example gradients ``torch.func.vmap`` computes exactly
(``Linear``, ``Conv2d``, ``ReLU``, pooling). There is no batch normalisation: it mixes the
examples of a batch, so per-example gradients — and with them DP-SGD's sensitivity — would be
undefined.

Job params (``{"model": "mlp" | "cnn", "hidden": ...}``):

* ``mlp`` — ``hidden`` is an int or a list of ints, the widths of the hidden layers (default 64).
* ``cnn`` — ``hidden`` is the channels of the two 3×3 convolutions (default ``[16, 32]``); each is
  followed by ReLU and 2×2 max pooling, then one linear layer to the classes. It needs inputs
  with an image shape (``LoadedData.image_shape``), e.g. ``(1, 8, 8)`` for the digits.

``JobParams`` reads a job's params with typed getters that name the field in every error and
refuse unknown keys, so a typo (``"epoch"``) fails the job instead of silently training with a
default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from accountant.events import InvalidFieldError

MODEL_KINDS: Final = ("mlp", "cnn")
DEFAULT_HIDDEN: Final[Mapping[str, tuple[int, ...]]] = {"mlp": (64,), "cnn": (16, 32)}
MAX_WIDTH: Final = 65_536
MAX_LAYERS: Final = 16


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


class MLP(nn.Module):
    """Flatten, then ``Linear → ReLU`` per hidden width, then ``Linear`` to the class logits."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class SmallCNN(nn.Module):
    """Two ``Conv3×3 → ReLU → MaxPool2`` blocks and a linear head; flat inputs are unflattened."""

    def __init__(self, image_shape: tuple[int, int, int], channels: Sequence[int], num_classes: int) -> None:
        super().__init__()
        c, h, w = image_shape
        if h < 4 or w < 4:
            raise InvalidParamsError("params.model", f"'cnn' needs images of at least 4×4. Found {h}×{w}.")
        c1, c2 = channels
        self.image_shape = image_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, c1, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Linear(c2 * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        out: torch.Tensor = self.head(self.features(x))
        return out


def build_model(
    spec: ModelSpec,
    *,
    n_features: int,
    num_classes: int,
    image_shape: tuple[int, int, int] | None = None,
) -> nn.Module:
    """The model ``spec`` names for inputs of ``n_features`` (flat) and ``num_classes`` classes."""
    if num_classes < 2:
        raise InvalidParamsError("params.num_classes", f"must be >= 2. Found {num_classes}.")
    if spec.kind == "mlp":
        return MLP(n_features, spec.hidden, num_classes)
    if image_shape is None or math.prod(image_shape) != n_features:
        raise InvalidParamsError(
            "params.model",
            f"'cnn' needs image-shaped inputs; the data has {n_features} flat features and image "
            f"shape {image_shape}.",
        )
    return SmallCNN(image_shape, spec.hidden, num_classes)
