"""`ampwatch demo`: a server on SQLite plus a small CPU training that goes unstable on purpose."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from typing import Any

import uvicorn

from ampwatch.server import auth
from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings

# Where the demo's story turns: fractions of its steps, and one offset.
NAN_STEP_FRACTION = 0.35  # a corrupt sample: NaN loss, GradScaler skips, parameters intact
NAN_AGAIN_AFTER = 5  # steps later, the same again: the probe the first armed names the input batch as the origin
SPIKE_FRACTION = 0.55  # a target jump: gradient explosion without a skip
OVERFLOW_FRACTION = 0.80  # a layer's weights blow up: fp16 overflow every step, the scale collapses


def run_demo(settings: Settings, *, steps: int, step_delay_s: float, serve_after: bool) -> int:
    """Serve, train with the agent attached, print where to look; serve on until Ctrl-C unless told not to."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print(
            "ampwatch demo trains a small model with PyTorch, which is not installed: pip install torch",
            file=sys.stderr,
        )
        return 2
    app = create_app(settings)
    problem = auth.exposure_problem(settings, app.state.tokens)
    if problem:
        print(f"ampwatch demo: {problem}", file=sys.stderr)
        return 2
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=3)
    )
    thread = threading.Thread(target=server.run, name="ampwatch-demo-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            print(
                f"could not start the server on {settings.host}:{settings.port} (in use? try --port)", file=sys.stderr
            )
            return 1
        time.sleep(0.05)
    print(f"ampwatch dashboard: {settings.base_url}/", flush=True)
    run_url = train(settings.base_url, steps=steps, step_delay_s=step_delay_s)
    print(f"Run page: {run_url}", flush=True)
    _print_diagnoses(run_url)
    if serve_after:
        print("Training finished; the dashboard stays up. Press Ctrl-C to stop.", flush=True)
        try:
            thread.join()
        except KeyboardInterrupt:
            pass
    server.should_exit = True
    thread.join(timeout=10)
    return 0


def _print_diagnoses(run_url: str | None) -> None:
    if not run_url:
        return
    api = run_url.replace("/runs/", "/api/v1/runs/") + "/events"
    with urllib.request.urlopen(api, timeout=10) as reply:
        events: list[dict[str, Any]] = json.load(reply)
    print(f"What ampwatch diagnosed ({len(events)} events):")
    for event in events:
        print(f"  step {event['step']:>4}  {event['severity']:<8} {event['type']:<15} {event['message'][:110]}")


def _model() -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self, width_in: int, width_out: int) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(width_in, width_out)
            self.act = torch.nn.GELU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.fc(x))

    class DemoNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(32, 64), Block(64, 64), Block(64, 64)])
            self.head = torch.nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return DemoNet()


def train(url: str, *, steps: int, step_delay_s: float = 0.0, seed: int = 0) -> str | None:
    """An fp16-autocast regression on the CPU that meets, in turn: start-up calibration, occasional
    overflow skips (short growth interval), two corrupt batches, a gradient explosion, and finally a
    layer whose weights blew up, so fp16 overflows at any scale and the loss scale collapses."""
    import torch

    import ampwatch

    torch.manual_seed(seed)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=25)
    target = torch.randn(32, 1)
    turns = {
        name: int(steps * f)
        for name, f in [("nan", NAN_STEP_FRACTION), ("spike", SPIKE_FRACTION), ("overflow", OVERFLOW_FRACTION)]
    }
    turns["nan_again"] = turns["nan"] + NAN_AGAIN_AFTER
    config = {
        "lr": 3e-3,
        "dtype": "float16",
        "growth_interval": 25,
        "steps": steps,
        **{f"{k}_at": v for k, v in turns.items()},
    }
    with ampwatch.init(project="demo", name=f"unstable-{time.strftime('%H%M%S')}", url=url, config=config) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            x = torch.randn(64, 32)
            y = x @ target
            if step in (turns["nan"], turns["nan_again"]):
                x[3, 7] = float("nan")  # a corrupt sample, as from a broken data shard
            if step == turns["spike"]:
                y = y * 30  # mislabelled batch: a gradient explosion, no overflow
            if step == turns["overflow"]:
                with torch.no_grad():
                    model.blocks[2].fc.weight.mul_(3e4)  # weights gone huge: fp16 overflows from here on
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step == turns["nan"] and run._worker is not None:
                # Wait for the agent to read this step (it arms its NaN-origin probe then) before the next bad batch,
                # which a live run's slower steps would give it time for anyway: the demo's story is the same each time.
                run._worker.flush(5.0)
            if step_delay_s:
                time.sleep(step_delay_s)
            elif step == turns["overflow"]:
                time.sleep(0.3)  # even at full speed, let the agent arm its NaN-origin probe as in a live run
    return run.url
