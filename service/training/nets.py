"""The networks the worker trains (torch): an MLP and a small CNN for 8×8 images, chosen by job
params. Called ``nets``: ``service/db/models.py`` is the ORM, ``service/api/models.py`` the model
registry's routes.

Both are built only from layers whose per-example gradients ``torch.func.vmap`` computes exactly
(``Linear``, ``Conv2d``, ``ReLU``, pooling). There is no batch normalisation: it mixes the
examples of a batch, so per-example gradients — and with them DP-SGD's sensitivity — would be
undefined.

Job params (``{"model": "mlp" | "cnn", "hidden": ...}``):

* ``mlp`` — ``hidden`` is an int or a list of ints, the widths of the hidden layers (default 64).
* ``cnn`` — ``hidden`` is the channels of the two 3×3 convolutions (default ``[16, 32]``); each is
  followed by ReLU and 2×2 max pooling, then one linear layer to the classes. It needs inputs
  with an image shape (``LoadedData.image_shape``), e.g. ``(1, 8, 8)`` for the digits.

The params (``ModelSpec``) and their typed reader (``JobParams``) are declared in the torch-free
``service.contract.job_params``, which the API checks a job against when it is submitted; they are
re-exported here.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from service.client import LedgerClient, LedgerError, certified_artifact
from service.contract.job_params import (  # noqa: F401  (re-exported: declared in the torch-free module)
    DEFAULT_HIDDEN,
    MAX_LAYERS,
    MAX_WIDTH,
    MODEL_KINDS,
    InvalidParamsError,
    JobParams,
    ModelSpec,
)
from service.verification.signing import PublicKey, keys_from_json


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


def load_state(content: bytes, fmt: str) -> dict[str, torch.Tensor]:
    """A released artifact's state dict, as the worker wrote it (``fmt``: "safetensors", or
    "torch": a ``torch.save`` read with ``weights_only``, so nothing but tensors is unpickled)."""
    if fmt == "safetensors":
        try:
            from safetensors.torch import load as load_safetensors  # type: ignore[import-not-found]
        except ImportError as exc:
            raise ImportError("this version's weights are safetensors: pip install safetensors") from exc
        state: dict[str, torch.Tensor] = load_safetensors(content)
        return state
    loaded: dict[str, torch.Tensor] = torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
    return loaded


def load_released(spec: Mapping[str, Any], content: bytes, fmt: str) -> nn.Module:
    """A released version rebuilt: the network its ``model_spec`` names
    (``DpSgdTrainer.model_spec``), its weights loaded from ``content`` (``fmt``: "safetensors"
    or "torch", a ``torch.save`` of the state dict read with ``weights_only``, so nothing but
    tensors is unpickled), in eval mode, with the spec as ``model_spec``."""
    module = build_model(
        ModelSpec(kind=str(spec["model"]), hidden=tuple(int(w) for w in spec["hidden"])),
        n_features=int(spec["n_features"]),
        num_classes=int(spec["num_classes"]),
        image_shape=None if spec.get("image_shape") is None else tuple(spec["image_shape"]),
    )
    module.load_state_dict(load_state(content, fmt))
    module.eval()
    setattr(module, "model_spec", dict(spec))  # noqa: B010 (a Module's __setattr__ is typed for tensors)
    return module


def load_model(
    client: LedgerClient, name: str, version: int, *, trusted_keys: Mapping[str, PublicKey] | None = None
) -> nn.Module:
    """The released ``version`` of model ``name``, read through ``client``, as a module in eval
    mode, ready to predict: rebuilt from the architecture the version records (``model_spec``),
    with the downloaded weights, whose SHA-256 must be the one the version's *signed certificate*
    states for the release ``{name, version}`` (``service.client.certified_artifact``;
    ``LedgerError`` ``artifact_not_certified`` otherwise, nothing loaded). ``trusted_keys``: the
    signing keys you pinned (``service.verification.signing.keys_from_json``); default: the keys
    the server lists.

    Feed it the source's records after ``model_spec["preprocessing"]`` (``{"kind": "scale",
    "divide_by": 16}`` for the digits: raw pixel values / 16), flattened, float32; it answers
    class logits. The module's ``model_spec`` attribute holds the spec.

    Here, not on ``LedgerClient``: it needs torch, and the client imports no training code. A
    version that records no architecture (published before it was recorded, or by a staged
    trainer) raises ``LedgerError`` ``model_not_loadable``."""
    answer = client.get_model_version(name, version)
    spec = answer.get("model_spec")
    if not isinstance(spec, dict) or spec.get("builder") != "service.training.nets.build_model":
        raise LedgerError(
            f"model {name!r} version {version} records no architecture to rebuild it from "
            f"(algorithm {answer.get('algorithm')!r}); download its weights with download_artifact.",
            code="model_not_loadable",
        )
    artifact = client.download_artifact(name, version)
    keys = trusted_keys
    if keys is None:
        keys = keys_from_json(client.signing_keys(), "the server's signing keys")
    certified_artifact(answer, artifact, keys)
    return load_released(spec, artifact.content, artifact.format or "torch")
