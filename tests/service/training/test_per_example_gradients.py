"""Per-example gradients (service.training.per_example_gradients): the traced graphs are the eager
``torch.func`` program, bit for bit, and they are used only when hot."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from service.training import per_example_gradients  # noqa: E402
from service.training.data import load_data  # noqa: E402
from service.training.dp_sgd import DpSgdTrainer, ModelState  # noqa: E402
from service.training.nets import ModelSpec, build_model  # noqa: E402
from service.training.per_example_gradients import PerExampleGradients  # noqa: E402


def _model(kind: str, hidden: tuple[int, ...], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelSpec(kind, hidden), n_features=64, num_classes=10, image_shape=(1, 8, 8))


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, 64, generator=generator), torch.randint(0, 10, (size,), generator=generator)


@pytest.mark.parametrize(("kind", "hidden"), [("mlp", (32, 16)), ("cnn", (4, 8))])
def test_traced_gradients_are_the_eager_ones_bit_for_bit(kind: str, hidden: tuple[int, ...]) -> None:
    model = _model(kind, hidden)
    params = _params(model)
    traced = PerExampleGradients(model, 10, trace_after=0)
    for size in (7, 13, 7, 2, 1):
        x, y = _batch(size, size)
        expected = traced._eager(params, x.unsqueeze(1), traced._negative_one_hot(y, x))
        assert torch.equal(traced.flat(params, x, y), expected), (kind, size)
    assert traced.flat(params, x[:0], y[:0]).shape == (0, expected.shape[1])
    # The MLP has one graph for every batch size; the CNN's trace fixes the size (a grouped
    # convolution with one group per example), so it stays eager.
    assert traced.is_traced(params, x) == (kind == "mlp")


@pytest.mark.parametrize("trace_after", [None, 0])
@pytest.mark.parametrize(("kind", "hidden"), [("mlp", (32, 16)), ("cnn", (4, 8))])
def test_per_example_gradients_equal_single_example_backward_passes(
    kind: str, hidden: tuple[int, ...], trace_after: int | None
) -> None:
    """Issue 4's oracle, eagerly and traced (the CNN's trace fixes the batch size: eager)."""
    model = _model(kind, hidden, seed=3).double()
    params = _params(model)
    gradients = PerExampleGradients(model, 10, trace_after=trace_after)
    x, y = _batch(9, 4)
    x = x.double()
    gradients(params, x, y)  # with trace_after=0: traces, and checks the graph against eager
    if trace_after == 0:
        assert gradients.is_traced(params, x) == (kind == "mlp")
    grads = gradients(params, x, y)
    for i in range(9):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(grads[name][i], p.grad, atol=1e-6, rtol=1e-6)


def test_a_program_is_traced_only_once_it_is_hot() -> None:
    model = _model("mlp", (27,))  # a width no other test uses: its graphs are this test's own
    params = _params(model)
    gradients = PerExampleGradients(model, 10, trace_after=5)
    x, y = _batch(11, 0)
    for _ in range(5):
        gradients.flat(params, x, y)
    assert not gradients.is_traced(params, x)
    gradients.flat(params, x, y)
    assert gradients.is_traced(params, x)
    # A new instance of the architecture (a new job) finds the graph already made.
    assert PerExampleGradients(_model("mlp", (27,), seed=9), 10).is_traced(params, x)


class _Scaled(nn.Module):
    """A model whose behaviour depends on an attribute its ``repr`` does not show."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) * self.scale
        return out


def test_an_instance_whose_trace_would_be_wrong_stays_eager() -> None:
    """Two models with one signature but different programs: the second's first traced answer
    differs from its eager one, so it never uses the graph, and its answers stay right."""
    torch.manual_seed(0)
    first, second = _Scaled(1.0), _Scaled(3.0)
    second.load_state_dict(first.state_dict())
    params = _params(first)
    x, y = _batch(6, 1)
    PerExampleGradients(first, 10, trace_after=0).flat(params, x, y)  # traces scale = 1
    gradients = PerExampleGradients(second, 10, trace_after=0)
    expected = gradients._eager(params, x.unsqueeze(1), gradients._negative_one_hot(y, x))
    for _ in range(3):
        assert torch.equal(gradients.flat(params, x, y), expected)
    assert not gradients.is_traced(params, x)


def test_params_left_out_are_graph_inputs_not_constants() -> None:
    """Differentiate the last layer only: the first layer's weights, which differ between two
    models of one architecture, reach the shared graph as inputs at every call."""
    x, y = _batch(8, 2)
    for seed in (0, 1):
        model = _model("mlp", (19,), seed=seed)
        head = {name: p.detach() for name, p in model.named_parameters() if name.startswith("net.3.")}
        gradients = PerExampleGradients(model, 10, trace_after=0)
        got = gradients(head, x, y)
        assert gradients.is_traced(head, x)
        expected = gradients._eager(head, x.unsqueeze(1), gradients._negative_one_hot(y, x))
        assert torch.equal(gradients.flat(head, x, y), expected)
        assert list(got) == list(head)


def test_tracing_changes_a_training_run_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same seeded DP-SGD run, eagerly and with its per-example gradients traced after five
    calls, releases identical weights."""
    data = load_data("builtin:digits")
    trainer = DpSgdTrainer(device="cpu")
    params = {"noise_multiplier": 1.0, "steps": 40, "seed": 5, "hidden": [23], "expected_batch_size": 32}
    states: list[ModelState] = []
    for trace_after in (10**9, 5):
        monkeypatch.setattr(per_example_gradients, "TRACE_AFTER", trace_after)
        plan = trainer.plan(params, data.n_records)
        trainer.train(data, plan, on_checkpoint=lambda s, m, e: states.append(m) is None)
    traced_model = trainer.initial_model(data, plan.params, 5)
    x = torch.from_numpy(data.train_arrays()[0][:4])
    assert PerExampleGradients(traced_model, 10).is_traced(_params(traced_model), x)
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
