"""The networks the worker trains (torch): an MLP and a small CNN for 8×8 images, chosen by job
params. Called ``nets``: ``service/db/models.py`` is the ORM, ``service/api/model_registry.py`` the model
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
    client: LedgerClient,
    name: str,
    version: int,
    *,
    trusted_keys: Mapping[str, PublicKey] | None = None,
    module: Any = None,
    require_certified: bool = True,
) -> Any:
    """The released ``version`` of model ``name``, read through ``client``, its bytes checked
    before anything is loaded.

    **Trained by the service's worker**: a module in eval mode, ready to predict, rebuilt from the
    architecture the version records (``model_spec``), with the downloaded weights. Feed it the
    source's records after ``model_spec["preprocessing"]`` (``{"kind": "scale", "divide_by":
    16}`` for the digits: raw pixel values / 16), flattened, float32; it answers class logits. The
    module's ``model_spec`` attribute holds the spec.

    **Trained outside and registered** (``register_model_version``; ``model_spec.kind`` is
    ``external``): the registry has only the free-text architecture, so nothing can be rebuilt
    from it. ``torch`` and ``safetensors`` artifacts answer their state dict (read with
    ``weights_only``: nothing but tensors is unpickled), or, given ``module`` (your ``nn.Module``
    of the registered architecture), that module with the weights loaded strictly, in eval mode,
    ``model_spec`` set; ``onnx`` and ``bytes`` artifacts answer the checked bytes (``module`` is
    then refused: ``model_not_loadable``).

    The bytes are checked twice, nothing loaded otherwise: their SHA-256 must be the one the
    registry recorded for the version (``LedgerError`` ``artifact_mismatch``) and the one the
    version's *signed certificate* states for the release ``{name, version}``
    (``service.client.certified_artifact``; ``artifact_not_certified``). A registration whose
    certificate names no artifact (the trainer did not set ``ReleaseGate.artifact_sha256``) has
    only the registry's record to vouch for its bytes: refused unless ``require_certified=False``.
    ``trusted_keys``: the signing keys you pinned (``service.verification.signing.keys_from_json``);
    default: the keys the server lists.

    Here, not on ``LedgerClient``: it needs torch, and the client imports no training code. A
    worker's version that records no architecture (published before it was recorded, or by a
    staged trainer) raises ``LedgerError`` ``model_not_loadable``."""
    answer = client.get_model_version(name, version)
    found = answer.get("model_spec")
    spec: dict[str, Any] = found if isinstance(found, dict) else {}
    external = spec.get("kind") == "external"
    if not external and spec.get("builder") != "service.training.nets.build_model":
        raise LedgerError(
            f"model {name!r} version {version} records no architecture to rebuild it from "
            f"(algorithm {answer.get('algorithm')!r}); download its weights with download_artifact.",
            code="model_not_loadable",
        )
    fmt = (answer.get("artifact") or {}).get("format") or "torch"
    if external and module is not None and fmt not in ("torch", "safetensors"):
        raise LedgerError(
            f"model {name!r} version {version} is a {fmt!r} artifact, not a state dict: "
            "load_model answers its checked bytes; call it without module.",
            code="model_not_loadable",
        )
    artifact = client.download_artifact(name, version)
    recorded = (answer.get("artifact") or {}).get("sha256")
    if recorded != artifact.sha256:
        raise LedgerError(
            f"model {name!r} version {version}: the downloaded bytes have SHA-256 "
            f"{artifact.sha256}, the registry records {recorded}; nothing was loaded.",
            code="artifact_mismatch",
        )
    keys = trusted_keys
    if keys is None:
        keys = keys_from_json(client.signing_keys(), "the server's signing keys")
    try:
        certified_artifact(answer, artifact, keys)
    except LedgerError as exc:
        # Only the one gap a registration may have (no artifact named by its certificate) may be
        # waived; a bad signature or other bytes never are.
        if require_certified or "names no artifact" not in str(exc):
            raise
    if not external:
        return load_released(spec, artifact.content, artifact.format or "torch")
    if fmt not in ("torch", "safetensors"):
        return artifact.content
    state = load_state(artifact.content, fmt)
    if module is None:
        return state
    module.load_state_dict(state, strict=True)
    module.eval()
    setattr(module, "model_spec", dict(spec))  # noqa: B010 (nn.Module's __setattr__ is typed for tensors)
    return module
