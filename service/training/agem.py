"""A-gem's projected gradient, the episodic memory of fixed batches, and the lifelong metrics.

Shared by the L2DP-ML trainer, the NaiveGaussian baseline (``service.training.lifelong_baselines``) and the
noiseless A-gem baseline of ``ledger experiment lifelong``.

* **Projection** (lifelong-dp-l2dp-ml.txt, Eq. 2; Alg. 2 line 15; Chaudhry et al. 2019):
  g̃ = g − (gᵀg_ref / g_refᵀg_ref)·g_ref, where g is the gradient on a batch of the current task
  and g_ref the gradient on a batch drawn from the episodic memory. A-gem applies it when the
  step would increase the memory loss (gᵀg_ref < 0): that is the constraint of Eq. 1/Eq. 14,
  L(θᵗ, 𝕄) ≤ L(θᵗ⁻¹, 𝕄), to first order. The paper writes Eq. 2 without the condition;
  ``always=True`` applies it unconditionally.
* **Episodic memory** (Alg. 2 lines 17–18): after each task one random batch of that task joins
  the memory; the batches are the ledger's fixed, disjoint batches, chosen before any data is
  read (from the seed), so the choice leaks nothing.
* **Metrics** (lifelong-dp-l2dp-ml.txt, "Evaluation Metrics", after Chaudhry et al. 2018):
  with a_{τ,t} the test accuracy on task t of the model released after task τ,
  average accuracy_τ = (1/τ) Σ_{t≤τ} a_{τ,t} and
  average forgetting_τ = (1/(τ−1)) Σ_{t<τ} max_{l∈{1..τ−1}} (a_{l,t} − a_{τ,t}).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "agem_project",
    "average_accuracy",
    "average_forgetting",
    "choose_memory_batches",
    "flatten",
    "unflatten",
]


def agem_project(g: torch.Tensor, g_ref: torch.Tensor, *, always: bool = False) -> torch.Tensor:
    """A-gem's g̃ for flat gradients ``g`` and ``g_ref`` (module docstring).

    Unchanged when g_ref = 0 (no direction to project away) or, unless ``always``, when
    gᵀg_ref ≥ 0 (the step does not increase the memory loss).
    """
    if g.shape != g_ref.shape or g.ndim != 1:
        raise ValueError(f"g and g_ref must be flat and of one shape. Found {g.shape} and {g_ref.shape}.")
    dot = torch.dot(g, g_ref)
    norm2 = torch.dot(g_ref, g_ref)
    if norm2 == 0 or (not always and dot >= 0):
        return g
    return g - (dot / norm2) * g_ref


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' entries as one flat vector (in order)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut back into tensors shaped like ``like``."""
    out = []
    offset = 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def choose_memory_batches(seed: int, task_batches: Sequence[Sequence[str]]) -> list[str]:
    """Alg. 2 line 17: for each task (in training order) one of its batches, drawn uniformly
    with a generator derived from ``seed`` alone (no data is read)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6A67656D]))
    chosen = []
    for batches in task_batches:
        if not batches:
            raise ValueError("every task needs at least one batch.")
        chosen.append(batches[int(rng.integers(len(batches)))])
    return chosen


def average_accuracy(accuracies: Sequence[Mapping[int, float]], tau: int) -> float:
    """(1/τ) Σ_{t≤τ} a_{τ,t}; ``accuracies[l-1][t]`` = a_{l,t} (tasks and τ 1-based, in the
    order they were learnt)."""
    row = accuracies[tau - 1]
    return float(np.mean([row[t] for t in range(1, tau + 1)]))


def average_forgetting(accuracies: Sequence[Mapping[int, float]], tau: int) -> float | None:
    """(1/(τ−1)) Σ_{t<τ} max_{l<τ} (a_{l,t} − a_{τ,t}); ``None`` for τ = 1 (nothing learnt
    before). a_{l,t} for l < t is the accuracy on a task not yet learnt; the paper's max runs
    over l ∈ {1..τ−1}, and we keep only l ≥ t, as Chaudhry et al. (2018) define it."""
    if tau < 2:
        return None
    now = accuracies[tau - 1]
    values = [max(accuracies[k - 1][t] - now[t] for k in range(t, tau)) for t in range(1, tau)]
    return float(np.mean(values))
