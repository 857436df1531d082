"""The frozen pre-trained feature extractor of DP continual learning with pre-trained models.

The paper (``dp-continual-learning-pretrained.txt``, Sec. 3 and App. C) uses a ViT-B pre-trained
on ImageNet-21K, *assumed public*, as a frozen feature extractor f_θ: the private tasks only
ever reach it through forward passes. Nothing is downloaded here. The stand-in is a small CNN
trained, non-privately, on the source's **public split** (``builtin:split-digits?...&public=P``:
P images held out of every task, never ledgered, declared public by the operator — the same
distribution as the private tasks and disjoint records, as ImageNet is for CIFAR in the paper).
It never sees a private record, so it costs no privacy; once trained it is frozen.

Architecture: ``Conv3×3(16) → ReLU → Conv3×3(32) → ReLU → MaxPool2 → Linear(→ K)``; the feature is
the K-vector, unit-normalised (the paper normalises features to unit norm, Eq. 2–3). Pre-training
fits a cosine-softmax classifier on it (logits = s·⟨f̂(x), ŵ_c⟩), so the geometry it learns is
the one the cosine classifier and the linear heads use.

Determinism and caching: training is seeded (``ExtractorSpec.seed``, with torch's global
generator left untouched) and its inputs are the public records, so the same source and spec give
the same extractor. Trained extractors are memoised per process (key: a digest of the public
records and the spec): every job of an experiment, and every stage of a job, shares one.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Final

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from service.contract.job_params import ExtractorSpec
from service.training.data import TaskSplit

COSINE_SCALE: Final = 16.0
"""s in the pre-training logits s·cos(f(x), w_c): a temperature, so softmax can saturate."""
_BATCH: Final = 64
_CACHE_SIZE: Final = 8


class FeatureExtractor(nn.Module):
    """f_θ: image → K-vector (not yet normalised; ``unit_features`` normalises)."""

    def __init__(self, image_shape: tuple[int, int, int], feature_dim: int) -> None:
        super().__init__()
        c, h, w = image_shape
        self.image_shape = image_shape
        self.feature_dim = feature_dim
        self.body = nn.Sequential(
            nn.Conv2d(c, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * (h // 2) * (w // 2), feature_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x.reshape(x.shape[0], *self.image_shape))
        return out


def unit_features(extractor: FeatureExtractor, x: torch.Tensor, *, chunk: int = 4096) -> torch.Tensor:
    """f_θ(x)/‖f_θ(x)‖₂ for a batch of flat images, without gradients (the extractor is frozen).

    Every row has norm 1 (a zero feature, which a ReLU-free linear output makes a measure-zero
    event, is mapped to the unit vector e₁), so one record moves a sum of features by at most 1.
    """
    outputs = []
    with torch.no_grad():
        for start in range(0, x.shape[0], chunk):
            f = extractor(x[start : start + chunk])
            norms = torch.linalg.vector_norm(f, dim=1, keepdim=True)
            zero = norms.squeeze(1) == 0
            f = f / norms.clamp_min(torch.finfo(f.dtype).tiny)
            if bool(zero.any()):
                f[zero] = 0.0
                f[zero, 0] = 1.0
            outputs.append(f)
    if not outputs:
        return x.new_zeros((0, extractor.feature_dim))
    return torch.cat(outputs)


def _digest(
    public: TaskSplit, image_shape: tuple[int, int, int], num_classes: int, spec: ExtractorSpec
) -> str:
    h = hashlib.sha256()
    h.update(repr((image_shape, num_classes, spec)).encode())
    h.update("\0".join(public.record_ids).encode())
    h.update(np.ascontiguousarray(public.features).tobytes())
    h.update(np.ascontiguousarray(public.labels).tobytes())
    return h.hexdigest()


_cache: dict[str, dict[str, torch.Tensor]] = {}
_lock = threading.Lock()


def pretrained_extractor(
    public: TaskSplit,
    *,
    image_shape: tuple[int, int, int],
    num_classes: int,
    spec: ExtractorSpec,
    device: torch.device,
) -> FeatureExtractor:
    """The extractor pre-trained on ``public`` (memoised per process), frozen, in eval mode."""
    key = _digest(public, image_shape, num_classes, spec)
    with _lock:
        state = _cache.get(key)
        if state is None:
            state = _train(public, image_shape=image_shape, num_classes=num_classes, spec=spec)
            if len(_cache) >= _CACHE_SIZE:
                _cache.pop(next(iter(_cache)))
            _cache[key] = state
    extractor = FeatureExtractor(image_shape, spec.feature_dim)
    extractor.load_state_dict(state)
    extractor.requires_grad_(False)
    return extractor.to(device).eval()


def _train(
    public: TaskSplit, *, image_shape: tuple[int, int, int], num_classes: int, spec: ExtractorSpec
) -> dict[str, torch.Tensor]:
    """Non-private training on the public split (CPU, seeded, deterministic)."""
    if len(public) == 0:
        raise ValueError("the public split is empty: there is nothing to pre-train on.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        extractor = FeatureExtractor(image_shape, spec.feature_dim)
        classifier = nn.Parameter(torch.randn(num_classes, spec.feature_dim) / spec.feature_dim**0.5)
        optimizer = torch.optim.Adam([*extractor.parameters(), classifier], lr=spec.learning_rate)
        x = torch.from_numpy(np.ascontiguousarray(public.features, dtype=np.float32))
        y = torch.from_numpy(np.ascontiguousarray(public.labels, dtype=np.int64))
        order = torch.Generator().manual_seed(spec.seed)
        for _ in range(spec.epochs):
            permutation = torch.randperm(len(y), generator=order)
            for start in range(0, len(y), _BATCH):
                idx = permutation[start : start + _BATCH]
                features = F.normalize(extractor(x[idx]), dim=1)
                logits = COSINE_SCALE * features @ F.normalize(classifier, dim=1).T
                loss = F.cross_entropy(logits, y[idx])
                optimizer.zero_grad()
                torch.autograd.backward(loss)
                optimizer.step()
    return {name: t.detach().clone() for name, t in extractor.state_dict().items()}


__all__ = ["ExtractorSpec", "FeatureExtractor", "pretrained_extractor", "unit_features"]
