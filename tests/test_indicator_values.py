"""The leading indicators' values (see `ampwatch._indicators`): what each series holds at an interval step, computed
here by hand from the same loop; Adam's lag over an interval against a simulated moment; which of a weight's
columns count; and that nothing of them is in place between interval steps. What the diagnosis makes of them is
tests/test_leading_indicators.py's."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import _runs
import pytest
import torch

import ampwatch

INTERVAL = 10  # AMPWATCH_LAYER_NORM_INTERVAL in these tests


@pytest.fixture(autouse=True)
def _interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", str(INTERVAL))


def test_adams_lag_is_taken_for_each_of_several_optimizers(memory) -> None:
    """Two Adam optimizers, one per layer (as a GAN's or a body-and-head split has): each layer's lag every interval
    step after its first, each against its own moment."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizers = [torch.optim.Adam(model[0].parameters()), torch.optim.Adam(model[2].parameters())]
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=model, optimizer=optimizers)
        for _ in range(41):
            model(torch.randn(32, 8)).pow(2).mean().backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    series = memory.series(run.id)
    for layer in ("0", "2"):  # (from the interval step after the first that took the layer's update)
        assert series[f"adam_lag/{layer}"]["steps"] == series[f"update_ratio/{layer}"]["steps"][1:] != [], layer
        assert all(0 < v < 20 for v in series[f"adam_lag/{layer}"]["values"]), series[f"adam_lag/{layer}"]


def test_adams_lag_over_an_interval_is_how_far_the_squared_gradients_ran_ahead() -> None:
    """Adam's moment driven by known squared gradients: of a steady size, the interval's lag is 1 (exactly, from the
    first steps on); growing by r a step, it is what the moment cannot follow, ~(e^r - beta2) / (1 - beta2); after a
    jump of 100x, it says so at once and falls as the moment catches up."""
    from ampwatch._indicator_values import _interval_lag as lag

    def moments(squares: list[float], beta2: float) -> list[float]:
        v, out = 0.0, [0.0]
        for g2 in squares:
            v = beta2 * v + (1 - beta2) * g2
            out.append(v)  # (out[n]: after step n)
        return out

    steady = moments([4.0] * 60, 0.999)
    assert lag(steady[11] / steady[1], 0.999, 1, 11) == pytest.approx(1.0, rel=1e-9)
    assert lag(steady[60] / steady[50], 0.999, 50, 60) == pytest.approx(1.0, rel=1e-9)
    growing = moments([1.05 ** (2 * j) for j in range(1, 3001)], 0.99)  # (long enough for the bias correction to go)
    assert lag(growing[3000] / growing[2990], 0.99, 2990, 3000) == pytest.approx((1.05**2 - 0.99) / 0.01, rel=1e-6)
    jump = moments([1.0] * 2000 + [100.0] * 500, 0.999)
    lags = [lag(jump[n + 10] / jump[n], 0.999, n, n + 10) for n in (1990, 2000, 2100, 2490)]
    assert lags[0] == pytest.approx(1.0, rel=1e-6) and lags[1] > 50 and lags[1] > lags[2] > lags[3] > 1


def test_a_columns_lag_counts_only_for_an_input_that_was_silent() -> None:
    """A weight's column whose second moment was far below its weight's other columns' (an input that wakes) lags on
    its own; an active column's growth, however large, is the layer's to say."""
    from ampwatch._indicators import _column_growth

    now = torch.tensor([30.0, 1.0, 5e-3])
    assert _column_growth(torch, now, torch.tensor([1.0, 1.0, 1e-4])).item() == pytest.approx(50.0)
    assert _column_growth(torch, now, torch.tensor([1.0, 1.0, 1.0])).item() == 0.0
    assert _column_growth(torch, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])).item() == 0.0  # (a dead input)
    assert _column_growth(torch, torch.tensor([1.0, 1e-3]), torch.tensor([1.0, 0.0])).item() == math.inf


def test_only_the_columns_of_the_models_inputs_count(memory) -> None:
    """An input feature that was silent and wakes lags in its own column of the layer that reads it; a hidden unit that
    was dead and revives is silent and wakes in the next layer's column just as much, but that is the model's own
    learning, whose Adam steps settle: its layer's lag is the layer's whole."""
    from ampwatch._indicator_values import _interval_lag as lag

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight[0], model[0].bias[0] = 0.0, -1.0  # (hidden unit 0: dead, no gradient reaches it)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    moments: dict[int, tuple[float, torch.Tensor, float]] = {}  # step -> the head's (sum, columns, n)
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        for step in range(21):
            if step == 15:
                with torch.no_grad():
                    model[0].bias[0] = 1.0  # (it revives)
            inputs = torch.randn(32, 8)
            inputs[:, 0] *= 1 if step >= 15 else 1e-3  # (and input 0 wakes)
            model(inputs).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step in (10, 20):
                state = [optimizer.state[p] for p in model[2].parameters()]
                total = sum(s["exp_avg_sq"].sum().item() for s in state)
                moments[step] = (total, state[0]["exp_avg_sq"].sum(0), state[0]["step"].item())
    (then, columns_then, n_then), (now, columns_now, n_now) = moments[10], moments[20]
    assert columns_then[0] == 0 < columns_now[0]  # (the revived unit's column: silent, then not)
    lags = dict(zip(*memory.series(run.id)["adam_lag/2"].values()))
    assert lags[20] == pytest.approx(lag(now / then, 0.99, n_then, n_now), rel=1e-4)
    assert memory.series(run.id)["adam_lag/0"]["values"][-1] > 10 * lags[20]  # (the input's column counts)


def test_the_models_inputs_are_each_calls_own(memory) -> None:
    """Micro-batches whose next input is made before this one's forward: an earlier call's input, freed, lends its
    memory to this call's activations (where the allocator reuses it, as glibc does the blocks this large it maps
    whole), which must not make their layers the inputs' layers."""
    torch.manual_seed(0)
    width = 256  # (a batch of inputs as large as an activation: 256 KiB, which the allocator maps and unmaps whole)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)
    )
    optimizer = torch.optim.Adam(model.parameters())
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        for _ in range(21):
            micro = [torch.randn(width, width) for _ in range(2)]  # (both made before the first forward)
            while micro:
                model(micro.pop(0)).pow(2).mean().backward()  # (the first, freed after it, lends its memory)
            optimizer.step()
            optimizer.zero_grad()
        assert run._recorder._indicators._readers == {"0"}


class _Wrapper(torch.nn.Module):
    """A LightningModule's shape: the loop calls `net` itself, never this module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


class _Dict(torch.nn.Module):
    """Takes its batch as a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.body(batch["x"]).relu())


class _Propagate(torch.nn.Module):
    def forward(self, adjacency: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adjacency, features)


class _Graph(torch.nn.Module):
    """A graph convolution: a sparse adjacency beside the features, and a leaf called with it first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.propagate, self.head = torch.nn.Linear(8, 8), _Propagate(), torch.nn.Linear(8, 1)

    def forward(self, features: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        return self.head(self.propagate(adjacency, self.lin(features)))


@pytest.mark.parametrize(
    "model, call, readers",
    [
        (_Wrapper, lambda m, x: m.net(x), {"net.0"}),
        (_Dict, lambda m, x: m({"x": x}), {"body"}),
        (_Graph, lambda m, x: m(x, torch.eye(len(x)).to_sparse()), {"lin"}),
    ],
    ids=["submodule-called", "dict-batch", "sparse-beside"],
)
def test_the_models_inputs_are_what_the_forward_pass_begins_with(memory, model, call, readers) -> None:
    """Wherever the loop enters the model, with whatever it passes: the leaves that read the batch are found, and a
    sparse tensor among the arguments costs no leaf its fp16_range."""
    torch.manual_seed(0)
    net = model()
    optimizer = torch.optim.Adam(net.parameters())
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=net, optimizer=optimizer)
        for _ in range(11):
            call(net, torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert run._recorder._indicators._readers == readers
    leaves = {n for n, m in net.named_modules() if n and not list(m.children())}
    assert {f"fp16_range/{n}" for n in leaves} <= set(memory.run(run.id)["series"])


def test_the_indicators_are_the_values_they_name(memory) -> None:
    """At an interval step, computed here by hand from the same loop: each leaf's largest output over 65 504, each
    layer's ||Δθ||/||θ||, and Adam's lag over the interval from its exp_avg_sq's growth since the interval step before
    (the layer's whole, or an input's column that was silent then, where that is larger; the growth turned into the
    lag by the agent's own formula, which the test above checks against Adam's moment)."""
    from ampwatch._indicator_values import _interval_lag as lag

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    largest: dict[str, float] = {}
    expected: dict[str, float] = {}
    moments: dict[int, dict[str, tuple[float, list[torch.Tensor], float]]] = {}  # step -> layer -> (sum, columns, n)

    def track(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: torch.Tensor) -> None:
            largest[name] = max(largest.get(name, 0.0), output.detach().abs().max().item())

        return hook

    for name, module in model.named_children():
        module.register_forward_hook(track(name))
    layers = {"0": model[0], "2": model[2]}
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer)
        for step in range(21):
            largest.clear()
            for micro in range(2):  # (two micro-batches: the largest of both forwards)
                inputs = torch.randn(4, 8) * (1 + micro)
                inputs[:, 0] *= 1 if step >= 15 else 0.05  # (an input near silent until step 15: its column wakes)
                model(inputs).pow(2).mean().backward()
            if step == 20:
                before = {n: [p.detach().clone() for p in m.parameters()] for n, m in layers.items()}
            optimizer.step()
            optimizer.zero_grad()
            if step in (10, 20):
                moments[step] = {
                    n: (
                        sum(optimizer.state[p]["exp_avg_sq"].sum().item() for p in m.parameters()),
                        [optimizer.state[p]["exp_avg_sq"].sum(0) for p in m.parameters() if p.dim() >= 2],
                        optimizer.state[m.weight]["step"].item(),
                    )
                    for n, m in layers.items()
                }
        for name in largest:
            expected[f"fp16_range/{name}"] = largest[name] / 65504
        for name, module in layers.items():
            delta = sum((a - p.detach()).pow(2).sum().item() for a, p in zip(before[name], module.parameters()))
            weight = sum(p.detach().pow(2).sum().item() for p in module.parameters())
            expected[f"update_ratio/{name}"] = math.sqrt(delta) / math.sqrt(weight)
            (then, columns_then, n_then), (now, columns_now, n_now) = moments[10][name], moments[20][name]
            whole = lag(now / then, 0.99, n_then, n_now)
            silent = [
                lag(float(b / a), 0.99, n_then, n_now)
                for a_all, b_all in zip(columns_then, columns_now)
                for a, b in zip(a_all, b_all)
                if a < 0.01 * a_all.mean() and name == "0"  # (the layer that reads the model's inputs)
            ]
            expected[f"adam_lag/{name}"] = max([whole, *silent])
            if name == "0":
                assert silent and max(silent) > 10 * whole  # (the waking column, not the layer, counts)
    series = memory.series(run.id)
    for name, value in expected.items():
        steps, values = series[name]["steps"], series[name]["values"]
        assert steps[-1] == 20 and values[-1] == pytest.approx(value, rel=1e-4), name
    assert "update_ratio/1" not in series and "adam_lag/1" not in series  # (Tanh has no parameters)


def test_the_hooks_are_in_place_only_for_the_interval_steps(memory) -> None:
    """Between interval steps nothing of the indicators runs: no forward hook on the model, no step hook on the
    optimizer beyond the agent's own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    seen: dict[int, tuple[int, int]] = {}
    with ampwatch.init("leading", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(3 * INTERVAL + 1):
            seen[step] = (
                len(model[0]._forward_hooks) + len(model[1]._forward_hooks),
                len(optimizer._optimizer_step_pre_hooks),
            )
            _runs.clipped_step(model, optimizer, scaler, torch.randn(4, 8))
        after = (len(model[0]._forward_hooks), len(optimizer._optimizer_step_pre_hooks))
    due = [step for step, hooks in seen.items() if hooks != (0, 0)]
    assert due == [0, INTERVAL, 2 * INTERVAL, 3 * INTERVAL] and seen[INTERVAL] == (2, 1), seen
    assert after == (0, 0)
