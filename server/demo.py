"""`ampwatch demo`: a server on SQLite plus a small CPU training that goes unstable on purpose."""

from __future__ import annotations

import sys
import threading
import time

import uvicorn

from ampwatch.server.app import create_app
from ampwatch.server.settings import Settings

NAN_STEP_FRACTION = 0.6  # where the demo feeds its bad batch


def run_demo(settings: Settings, *, steps: int, step_delay_s: float, serve_after: bool) -> int:
    """Serve, train with the agent attached, print where to look; serve on until Ctrl-C unless told not to."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("ampwatch demo trains a small model with PyTorch, which is not installed: pip install torch", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="ampwatch-demo-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            print(f"could not start the server on {settings.host}:{settings.port} (in use? try --port)", file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"ampwatch dashboard: {settings.base_url}/", flush=True)
    run_url = train(settings.base_url, steps=steps, step_delay_s=step_delay_s)
    print(f"Run page: {run_url}", flush=True)
    if serve_after:
        print("Training finished; the dashboard stays up. Press Ctrl-C to stop.", flush=True)
        try:
            thread.join()
        except KeyboardInterrupt:
            pass
    server.should_exit = True
    thread.join(timeout=10)
    return 0


def train(url: str, *, steps: int, step_delay_s: float = 0.0, seed: int = 0) -> str | None:
    """An fp16-autocast regression on the CPU. A short growth interval makes the loss scale climb into
    fp16 overflow now and then (skipped steps, back-off); one bad batch turns the loss into NaN."""
    import torch

    import ampwatch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=25)
    target = torch.randn(32, 1)
    bad_step = int(steps * NAN_STEP_FRACTION)
    config = {"lr": 3e-3, "dtype": "float16", "growth_interval": 25, "steps": steps, "bad_batch_at": bad_step}
    with ampwatch.init(project="demo", name=f"unstable-{time.strftime('%H%M%S')}", url=url, config=config) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            x = torch.randn(64, 32) * 4
            if step == bad_step:
                x[3, 7] = float("nan")  # one corrupt sample, as from a broken data shard
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), x @ target)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            run.log({"lr": optimizer.param_groups[0]["lr"]}, step=step)
            if step_delay_s:
                time.sleep(step_delay_s)
    return run.url
