"""A watched model, scaler and optimizer behave as the user's own: copies (an EMA's deepcopy), whole-module
`torch.save`, checkpoints loaded with `weights_only=True`, TorchScript, torch.compile, hand-written optimizers and
sparse gradients."""

from __future__ import annotations

import collections
import copy
import io
import math
import pickle
import time
from typing import Any

import _memory
import _runs
import pytest
import torch

import ampwatch


class _FrozenBackbone(torch.nn.Module):
    """Linear probing: the backbone only ever runs under no_grad; a head that returns its own Parameter too."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(8, 8).requires_grad_(False)
        self.prompt = torch.nn.Parameter(torch.zeros(1, 8))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.backbone(x)
        return self.head(features + self.prompt)


def _copies(model: torch.nn.Module) -> torch.nn.Module:
    """deepcopy, pickle and whole-module torch.save of `model` (each raises if it cannot); the deep copy."""
    pickle.dumps(model)
    saved = io.BytesIO()
    torch.save(model, saved)
    return copy.deepcopy(model)


def test_a_watched_model_copies_and_saves_whole_at_any_time_and_its_copies_are_not_watched(memory) -> None:
    torch.manual_seed(0)
    model = _FrozenBackbone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    run = ampwatch.init("guest", "copies", transport=memory)
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    _copies(model)  # before any forward (the first-forward check's hook is on)
    probe = run._recorder._probe
    ema = None
    for step in range(300):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        if step == 5:
            x[0, 0] = float("nan")  # a bad batch: the NaN-origin probe arms
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if probe.armed and ema is None:
            ema = _copies(model)  # while the probe's hooks are on every leaf module
        if ema is not None and step > 40:
            break
        time.sleep(0.005)  # (the sender reads the skip and arms the probe a few steps later)
    assert ema is not None, "the probe never armed"
    _copies(model)  # after 40 steps under no_grad for the backbone
    run.finish()
    assert not model.prompt._backward_hooks  # (a leaf's hooks stay for good: the probe puts none there)
    flags = len(probe.forward), len(probe.backward)
    with torch.no_grad():
        before = ema(torch.ones(2, 8))
    ema(torch.ones(2, 8)).sum().backward()
    assert (len(probe.forward), len(probe.backward)) == flags  # the copy's forwards do not feed the finished run
    saved = io.BytesIO()
    torch.save(ema, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(torch.ones(2, 8)), before)


def test_a_watched_scaler_in_a_checkpoint_loads_with_weights_only(memory) -> None:
    from torch.amp.grad_scaler import GradScaler, _refresh_per_optimizer_state

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    run = ampwatch.init("guest", "checkpoint", transport=memory)
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    saved = io.BytesIO()
    torch.save({"scaler": scaler}, saved)
    saved.seek(0)
    with torch.serialization.safe_globals([GradScaler, _refresh_per_optimizer_state, collections.defaultdict]):
        loaded = torch.load(saved, weights_only=True)["scaler"]  # (torch's default)
    assert type(loaded) is GradScaler and loaded.state_dict() == scaler.state_dict()
    run.finish()


class _FoldingSGD(torch.optim.Optimizer):
    """A hand-written optimizer that folds weight decay into the gradient in place (a common idiom)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.add_(p, alpha=0.1)
                p.add_(p.grad, alpha=-group["lr"])


def test_without_a_scaler_the_norm_is_the_gradients_before_the_optimizer_step_changes_them(memory) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    folding = _FoldingSGD(model.parameters())
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adamw.register_step_post_hook(lambda optimizer, args, kwargs: optimizer.zero_grad())  # zero_grad folded into step()
    expected = []
    with ampwatch.init("guest", "prehook", transport=memory) as run:
        for optimizer in (folding, adamw):
            run.watch(model=model, optimizer=optimizer)
            for _ in range(10):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)).float(), torch.randn(4, 1))
                loss.backward()
                expected.append(math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters())))
                optimizer.step()
                optimizer.zero_grad()
    series = memory.series(run.id, "grad_norm")["grad_norm"]
    assert series["steps"] == list(range(20))
    assert [round(v, 4) for v in series["values"]] == [round(v, 4) for v in expected]


def test_a_torchscript_model_is_watched_without_module_hooks(memory, caplog) -> None:
    torch.manual_seed(0)
    model = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    caplog.set_level("WARNING", logger="ampwatch")
    with ampwatch.init("guest", "script", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(12):
            _runs.clipped_step(model, optimizer, scaler, torch.randn(4, 8))
    assert "TorchScript model takes no hooks" in caplog.text
    data = memory.series(run.id, ["loss", "scale", "grad_norm"])
    assert {name: series["steps"] for name, series in data.items()} == dict.fromkeys(
        ("loss", "scale", "grad_norm"), list(range(12))
    )


def _compiled_step_params(watched: bool) -> list[torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    run = ampwatch.init("guest", "compile", transport=_memory.MemoryTransport()) if watched else None
    if run is not None:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
    compiled = torch.compile(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(compiled(torch.ones(4, 8)).float(), torch.zeros(4, 1))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if run is not None:
        run.finish()
    return [p.detach().clone() for p in model.parameters()]


def test_a_compiled_model_computes_bitwise_the_same_watched() -> None:
    # (the agent's first-forward hook broke the traced graph in two, which inductor then computed differently)
    assert all(torch.equal(a, b) for a, b in zip(_compiled_step_params(False), _compiled_step_params(True)))


@pytest.mark.parametrize("two_optimizers", [False, True])
def test_sparse_embedding_gradients_count_in_the_norm(memory, two_optimizers: bool) -> None:
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1)
    model = torch.nn.Sequential(embedding, head)
    if two_optimizers:
        optimizers = [
            torch.optim.SparseAdam(list(embedding.parameters()), lr=1e-2),
            torch.optim.SGD(head.parameters(), lr=1e-2),
        ]
    else:
        optimizers = [torch.optim.SGD(model.parameters(), lr=1e-2)]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    expected = []
    with ampwatch.init("guest", "sparse", transport=memory) as run:
        run.watch(model=model, optimizer=optimizers, scaler=scaler)
        for _ in range(8):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randint(0, 50, (4, 3))).float().pow(2).mean()
            scaler.scale(loss).backward()
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
            grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in model.parameters()]
            expected.append(math.sqrt(sum(g.double().pow(2).sum().item() for g in grads)))
            for optimizer in optimizers:
                scaler.step(optimizer)
            scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad()
    series = memory.series(run.id, "grad_norm")["grad_norm"]
    assert series["steps"] == list(range(8))
    assert [round(v, 4) for v in series["values"]] == [round(v, 4) for v in expected]


class _Branchy(torch.nn.Module):
    """Its first layer is used on even steps only: on odd steps the clip is over the parameters that have gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.extra, self.body = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.body(self.extra(x) if step % 2 == 0 else x)


def test_a_clip_over_the_parameters_that_have_gradients_is_the_norm_of_every_step(memory) -> None:
    torch.manual_seed(0)
    model = _Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    clipped = []
    with ampwatch.init("guest", "clip-subset", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(12):
            if step == 9:
                model.extra.requires_grad_(False)  # frozen from now on
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8), step).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            clipped.append(
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e3).item()
            )
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    series = memory.series(run.id, "grad_norm")["grad_norm"]
    assert series["steps"] == list(range(12))
    assert [round(v, 5) for v in series["values"]] == [round(v, 5) for v in clipped]
