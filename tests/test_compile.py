"""torch.compile: a compiled model is watched as the model it compiles is, and the armed NaN-origin probe leaves its
graph alone. The models compile with the `aot_eager` backend (a real dynamo and AOTAutograd graph, without
inductor's C++ build): whether hooks run inside the graph is dynamo's doing, whatever the backend."""

from __future__ import annotations

from typing import Any

import torch

import ampwatch

BAD = (4, 12)  # steps whose batch holds a value fp16 cannot: the first layer's output overflows, the batch is finite


def _train(
    server: Any, *, watch: str | None, steps: int = 20, ddp: bool = False
) -> tuple[list[torch.Tensor], str | None]:
    """A standard fp16 loop over a compiled model; `watch`: "compiled" (watch the compiled model), "model" (watch the
    model, then compile it) or None (no agent); `ddp`: the compiled model in DistributedDataParallel, as nanoGPT has it.
    Returns the parameters after the loop, and the run's id."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    run = ampwatch.init("compile", transport=server) if watch else None
    if run is not None and watch == "model":
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
    compiled = torch.compile(model, backend="aot_eager")
    if ddp:
        compiled = torch.nn.parallel.DistributedDataParallel(compiled)
    if run is not None and watch == "compiled":
        run.watch(model=compiled, optimizer=optimizer, scaler=scaler)
    for step in range(steps):
        x = torch.randn(16, 8)
        if step in BAD:
            x[0, 0] = 1e30
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(compiled(x).float(), torch.zeros(16, 1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if step == BAD[0] and run is not None:
            assert run.flush()  # the sender sees the non-finite step and arms the probe before the loop goes on
    if run is not None:
        run.finish()
    return [p.detach().clone() for p in model.parameters()], run.id if run is not None else None


def _events(server: Any, run_id: str) -> list[dict[str, Any]]:
    return server.events(run_id)


def test_a_compiled_model_is_named_as_the_origin_and_its_layers_as_the_model_s(memory) -> None:
    plain, _ = _train(memory, watch=None)
    params, run_id = _train(memory, watch="compiled")
    assert all(torch.equal(a, b) for a, b in zip(plain, params))  # (the armed probe's hooks stay outside the graph)
    events = _events(memory, run_id)
    assert [e["step"] for e in events if e["type"] == "nonfinite_loss" and "origin" not in e["details"]][:1] == [BAD[0]]
    [origin] = [e for e in events if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"], origin["details"]["phase"]) == (
        BAD[1],
        "(compiled model)",
        "forward",
    )
    assert "the input batch was finite and the output of the compiled model was not" in origin["message"]
    assert "without torch.compile" in origin["message"]
    names = set(memory.run(run_id)["series"])
    assert {"grad_norm/0", "grad_norm/2"} <= names and not [n for n in names if "_orig_mod" in n], names


def test_ddp_of_a_compiled_model_is_probed_outside_the_graph_and_named_as_the_model(memory, tmp_path) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        _, run_id = _train(memory, watch="compiled", ddp=True)
    finally:
        torch.distributed.destroy_process_group()
    [origin] = [e for e in _events(memory, run_id) if "origin" in e["details"]]
    assert (origin["step"], origin["details"]["origin"]) == (BAD[1], "(compiled model)")
    names = set(memory.run(run_id)["series"])
    assert {"grad_norm/0", "grad_norm/2"} <= names and not [n for n in names if "module" in n], names


def test_a_model_compiled_after_watch_is_said_to_hide_its_forward_from_the_probe(memory) -> None:
    _, run_id = _train(memory, watch="model", steps=12)
    events = _events(memory, run_id)
    assert [e["step"] for e in events if e["type"] == "nonfinite_loss"][:1] == [BAD[0]]
    [blind] = [e for e in events if e["details"].get("probe") == "no forward seen"]
    assert (blind["type"], blind["severity"]) == ("amp_config", "warning") and blind["step"] > BAD[0]
    assert "compiled after watch()" in blind["message"] and "pass the compiled model to watch()" in blind["message"]
    assert not [e for e in events if "origin" in e["details"]]
