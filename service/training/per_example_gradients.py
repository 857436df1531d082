"""Per-example gradients with ``torch.func``, traced once into a plain aten graph when they are hot.

The gradients are defined as ``vmap(grad(loss of one example))`` through ``functional_call`` —
the ``torch.func`` recipe issue 4 asks for and Opacus's hooks are checked against. Run eagerly,
that program pays the transforms' dispatch on every op of every call: each op passes the grad
and the vmap layers, the backward runs the autograd engine inside ``grad``, and ``grad``/``vmap``
flatten and rebuild their inputs as pytrees. On the models the worker trains (a 64-wide MLP,
batches of about 64) that fixed cost is about 0.6 ms a call, twice a whole non-private SGD step.

So a hot program is **traced**: ``make_fx`` runs the same ``vmap(grad(functional_call))``
program once on fake tensors, with the batch size symbolic, and records the aten ops it
dispatches to — ``mm``, ``bmm`` for the per-example outer products, ``threshold_backward``, ...
— into an FX graph; later calls run that graph, for every batch size (the Poisson sample's size
changes at every step). The graph is the same ops on the same shapes as the eager program, so
its values are the eager values bit for bit (``tests/service/training/test_per_example_gradients.py``
checks equality, not closeness), and tracing changes speed, never a result or a guarantee. One
rewrite is made on the graph: a per-example outer product that ``vmap`` wrote as a ``bmm`` with
a contraction of length 1 runs as a broadcast ``mul`` — the same single products, 3× faster
(``_outer_products_as_mul``).

* **When.** Tracing costs about 0.5 s, so a program is traced only once it is hot: after
  ``TRACE_AFTER`` eager calls of its architecture in the process. Short runs (tests, small jobs)
  stay eager; a worker's graphs live for the process, shared by every job on that architecture.
* **Which programs stay eager.** Batches of 0 and 1 (a symbolic size is assumed to be at least
  2); models with tied weights; a program the tracer rejects; and one whose trace had to fix the
  batch size — the CNN's: a convolution's per-example weight gradient is a grouped convolution
  with one group per example. (Tracing the CNN once per batch size was measured: the traces,
  ≈ 0.1 s each for the ≈ 50 sizes a run meets, cost more than they saved.)
* **Which architecture.** Graphs are cached under the model's signature: its class, ``repr``,
  training flag, the names, shapes and dtypes of all its parameters and buffers, the classes, the
  feature shape, dtype and device. Every parameter and buffer is an *input* of the graph (those
  not in ``params`` are passed from the module), so no weight is ever baked into a graph. As a
  guard against two models sharing a signature, an instance checks its first traced answer
  against the eager one and stays eager for good if they differ (logged).

The loss of one example is ⟨log_softmax(logits), −one_hot(y)⟩ (cross-entropy as one ``mul`` and
one ``sum``; the −one_hot rows come from a cached matrix), and each example reaches the model
shaped as a batch of one, ``(1, *features)``. The model must have no batch-dependent buffers (no
batch norm).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functional_call, grad, vmap
from torch.fx.experimental import symbolic_shapes

log = logging.getLogger(__name__)

Params = dict[str, torch.Tensor]

# Eager calls of one architecture before its trace (≈ 0.5 s, the cost of ≈ 600 eager calls of
# the MLP): enough that a test's few-step run never traces, few enough that a real run (hundreds
# to thousands of steps) spends most of its steps in the graph. A process setting: tests and
# bench/training.py change it (``sys.maxsize``: never trace).
TRACE_AFTER = 64


def flatten_per_example(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``{name: (B, *shape)}`` as one ``(B, P)`` matrix (one copy), in the mapping's order."""
    return torch.cat([g.flatten(1) if g.dim() > 1 else g.unsqueeze(1) for g in grads.values()], dim=1)


@dataclass
class _Trace:
    """The graph of one architecture, shared by every instance with its signature."""

    calls: int = 0
    graph: fx.GraphModule | None = None
    eager_only: bool = False  # the trace failed or fixed the batch size
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _CallKind:
    """One instance's calls of one kind: the architecture's trace, the module's tensors that
    ``params`` leaves out (graph inputs after ``params``), and whether the instance has checked
    the graph's first answer against its own eager one."""

    trace: _Trace
    other_names: list[str]
    verified: bool = False


_TRACES: dict[tuple[Any, ...], _Trace] = {}
_TRACES_LOCK = threading.Lock()


def _trace_for(signature: tuple[Any, ...]) -> _Trace:
    with _TRACES_LOCK:
        trace = _TRACES.get(signature)
        if trace is None:
            trace = _TRACES[signature] = _Trace()
        return trace


class PerExampleGradients:
    """``f(params, features, labels) -> {name: (B, *shape)}``: per-example cross-entropy gradients.

    ``params`` maps parameter names to tensors (all of the model's, or a subset; the others keep
    their module values). ``flat`` gives the same gradients as one ``(B, P)`` matrix. Hot
    programs run as a traced graph (module docstring); ``trace_after`` overrides the process's
    ``TRACE_AFTER`` for this instance (0: trace at the first call that can be traced).

    ``functional_call`` swaps tensors into ``model`` for the duration of an eager call or a trace,
    so those are serialised (a lock); traced graphs run without it.
    """

    def __init__(self, model: nn.Module, num_classes: int, *, trace_after: int | None = None) -> None:
        self.model = model
        self.num_classes = num_classes
        self.trace_after = TRACE_AFTER if trace_after is None else trace_after
        self._tie_weights = len(list(model.named_parameters(remove_duplicate=False))) != len(
            list(model.named_parameters())
        )

        def loss_of_one(params: Params, x: torch.Tensor, negative_target: torch.Tensor) -> torch.Tensor:
            logits = functional_call(model, params, (x,), tie_weights=self._tie_weights)
            return (F.log_softmax(logits, dim=1) * negative_target).sum()

        self._per_example: Callable[..., Params] = vmap(grad(loss_of_one), in_dims=(None, 0, 0))
        self._negative_eye: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._kinds: dict[tuple[Any, ...], _CallKind] = {}
        # Tied weights would make graph inputs alias; a failed check (``flat``) makes it final.
        self._eager_only = self._tie_weights

    # -- the two forms ----------------------------------------------------------------------

    def __call__(
        self, params: Mapping[str, torch.Tensor], features: torch.Tensor, labels: torch.Tensor
    ) -> Params:
        """Per-parameter form: views of ``flat``'s rows, shaped ``(B, *parameter shape)``."""
        flat = self.flat(params, features, labels)
        out: Params = {}
        offset = 0
        for name, p in params.items():
            out[name] = flat[:, offset : offset + p.numel()].view(flat.shape[0], *p.shape)
            offset += p.numel()
        return out

    def flat(
        self, params: Mapping[str, torch.Tensor], features: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """The per-example gradients as one ``(B, P)`` matrix, parameters in ``params``' order.

        Row i is example i's whole gradient, so its norm, the clip and the clipped sum are one
        op each (``dp_sgd.noisy_mean_gradient_flat``). An empty batch gives a ``(0, P)`` matrix.
        """
        if features.shape[0] == 0:
            first = next(iter(params.values()))
            return first.new_zeros((0, sum(t.numel() for t in params.values())))
        x = features.unsqueeze(1)
        targets = self._negative_one_hot(labels, features)
        if features.shape[0] < 2 or self._eager_only:
            return self._eager(params, x, targets)
        kind = self._kind(params, x)
        others = [self._module_tensor(name) for name in kind.other_names]
        graph = self._graph(kind, params, others, x, targets)
        if graph is None:
            return self._eager(params, x, targets)
        with torch.no_grad():
            out: torch.Tensor = graph(*params.values(), *others, x, targets)
        if not kind.verified:
            expected = self._eager(params, x, targets)
            if not torch.equal(out, expected):
                log.warning("a traced per-example gradient differs from the eager one; eager from now on")
                self._eager_only = True
                return expected
            kind.verified = True
        return out

    def is_traced(self, params: Mapping[str, torch.Tensor], features: torch.Tensor) -> bool:
        """Whether calls like ``(params, features)`` with 2 examples or more run the graph."""
        if self._eager_only:
            return False
        trace = self._kind(params, features.unsqueeze(1)).trace
        with trace.lock:
            return trace.graph is not None

    # -- eager and traced ---------------------------------------------------------------------

    def _eager(
        self, params: Mapping[str, torch.Tensor], x: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        with self._lock:
            return flatten_per_example(self._per_example(params, x, targets))

    def _kind(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> _CallKind:
        """This instance's record of calls like this one (params' names, shapes; features)."""
        key = (tuple((name, t.shape, t.dtype) for name, t in params.items()), x.shape[1:], x.dtype, x.device)
        kind = self._kinds.get(key)
        if kind is None:
            model = self.model
            others = {name: t.detach() for name, t in model.named_parameters() if name not in params}
            others.update((name, t) for name, t in model.named_buffers() if name not in params)
            tensors = [(name, tuple(t.shape), t.dtype, str(t.device)) for name, t in params.items()]
            tensors += [(name, tuple(t.shape), t.dtype, str(t.device)) for name, t in others.items()]
            signature = (
                type(model).__module__,
                type(model).__qualname__,
                repr(model),
                model.training,
                len(params),
                tuple(tensors),
                self.num_classes,
                tuple(x.shape[1:]),
                x.dtype,
                str(x.device),
            )
            kind = self._kinds[key] = _CallKind(_trace_for(signature), list(others))
        return kind

    def _module_tensor(self, name: str) -> torch.Tensor:
        try:
            return self.model.get_parameter(name).detach()
        except AttributeError:
            return self.model.get_buffer(name)

    def _graph(
        self,
        kind: _CallKind,
        params: Mapping[str, torch.Tensor],
        others: list[torch.Tensor],
        x: torch.Tensor,
        targets: torch.Tensor,
    ) -> fx.GraphModule | None:
        """The architecture's graph, traced now if it has just become hot; ``None``: run eagerly."""
        trace = kind.trace
        with trace.lock:
            trace.calls += 1
            if trace.graph is None and not trace.eager_only and trace.calls > self.trace_after:
                trace.graph = self._trace(params, kind.other_names, others, x, targets)
                trace.eager_only = trace.graph is None
            return trace.graph

    def _trace(
        self,
        params: Mapping[str, torch.Tensor],
        other_names: list[str],
        others: list[torch.Tensor],
        x: torch.Tensor,
        targets: torch.Tensor,
    ) -> fx.GraphModule | None:
        """``make_fx`` of the eager program with a symbolic batch size; ``None`` if it cannot be."""
        from torch.fx.experimental.proxy_tensor import make_fx

        names = [*params, *other_names]

        def program(*args: torch.Tensor) -> torch.Tensor:
            per_example = self._per_example(dict(zip(names, args[:-2], strict=True)), args[-2], args[-1])
            return flatten_per_example({name: per_example[name] for name in params})

        try:
            with self._lock:
                graph = make_fx(program, tracing_mode="symbolic")(*params.values(), *others, x, targets)
        except Exception:  # an op without a tracing rule, data-dependent control flow, ...
            log.warning("per-example gradients cannot be traced; they run eagerly", exc_info=True)
            return None
        features = [n for n in graph.graph.nodes if n.op == "placeholder"][-2].meta["val"]
        if symbolic_shapes.is_concrete_int(features.shape[0]):
            log.info("the per-example gradients' trace fixed the batch size; they run eagerly")
            return None
        return _outer_products_as_mul(graph)

    def _negative_one_hot(self, labels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """−one_hot(labels) as ``(B, 1, C)`` rows, with ``like``'s dtype and device."""
        eye = self._negative_eye
        if eye is None or eye.dtype != like.dtype or eye.device != like.device:
            eye = -torch.eye(self.num_classes, dtype=like.dtype, device=like.device).unsqueeze(1)
            self._negative_eye = eye
        return eye.index_select(0, labels)


def _outer_products_as_mul(graph: fx.GraphModule) -> fx.GraphModule:
    """Rewrite each ``bmm`` whose contraction has length 1 as a broadcast ``mul``.

    That is how ``vmap`` writes a linear layer's per-example weight gradient: the outer product
    (B, m, 1) × (B, 1, n). Each output element is one product either way — one rounding, no sum
    — so the values are the same bit for bit, and the ``mul`` is about 3× faster on CPU (a
    matrix-multiply kernel with k = 1 wastes its blocking).
    """
    changed = False
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.bmm.default:
            contraction = node.args[0].meta["val"].shape[-1]
            if isinstance(contraction, int) and contraction == 1:
                node.target = torch.ops.aten.mul.Tensor
                changed = True
    if changed:
        graph.recompile()
    return graph
