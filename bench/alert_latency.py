"""Alert latency: from the NaN step in a training loop to the webhook request arriving.

Starts `ampwatch server` (a subprocess, SQLite or Postgres) with `AMPWATCH_ALERT_WEBHOOK_URL` pointing at a
webhook receiver in this process. Each trial is a new run of a small fp16-autocast CPU training loop with
the agent attached (its default flush interval unless --flush-interval): some healthy steps, then one step
whose batch holds a NaN, then healthy steps until the notification arrives. The clock starts just before
that step's forward pass and stops when the receiver has the request.

    python bench/alert_latency.py                       # 20 trials on SQLite
    python bench/alert_latency.py --backend postgres --trials 40

Target (the product's, docs/benchmarks.md): < 2 s at the 95th percentile.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, percentile, scratch_database  # noqa: E402

TARGET_P95_S = 2.0


class Receiver:
    """A webhook receiver on loopback: the arrival time of the first firing notification per run."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                at = time.time()
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                if body.get("status") == "firing" and body["alert"]["rule"] == "nonfinite_loss":
                    with receiver.changed:
                        receiver.arrived.setdefault(body["run"]["id"], at)
                        receiver.changed.notify_all()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def trial(url: str, receiver: Receiver, index: int, healthy_steps: int, step_s: float, timeout_s: float) -> float:
    """One run; seconds from the NaN step's start to the webhook's arrival (inf when it never came)."""
    import torch

    import ampwatch

    torch.manual_seed(index)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    started = None
    with ampwatch.init("bench", f"latency-{index}", url=url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        step = 0
        while True:
            x = torch.randn(16, 32)
            if step == healthy_steps:
                x[0, 0] = float("nan")
                started = time.time()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            step += 1
            time.sleep(step_s)  # the rest of a real step (data loading, a bigger model)
            if started is not None and (run.id in receiver.arrived or time.time() - started > timeout_s):
                break
    assert started is not None
    return receiver.arrived.get(run.id, float("inf")) - started


def main() -> int:
    """Run the trials and print each latency and the percentiles."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--healthy-steps", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=10.0, help="extra time per training step")
    parser.add_argument("--flush-interval", type=float, default=None, help="AMPWATCH_FLUSH_INTERVAL_S for the agent")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    logging.getLogger("ampwatch").setLevel(logging.CRITICAL)  # the agent logs each NaN it diagnoses; not news here
    if args.flush_interval is not None:
        os.environ["AMPWATCH_FLUSH_INTERVAL_S"] = str(args.flush_interval)
    receiver = Receiver()
    os.environ["AMPWATCH_ALERT_WEBHOOK_URL"] = receiver.url  # the server subprocess inherits it
    with scratch_database(args.backend) as db_url, tempfile.TemporaryDirectory() as tmp:
        with Server(db_url, Path(tmp) / "server.log") as server:
            server.wait_ready()
            latencies = []
            for i in range(args.trials):
                latencies.append(trial(server.url, receiver, i, args.healthy_steps, args.step_ms / 1000, args.timeout))
                print(f"trial {i + 1:>3}: {latencies[-1] * 1000:8.0f} ms", flush=True)
    p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
    flush = os.environ.get("AMPWATCH_FLUSH_INTERVAL_S", "0.2 (default)")
    print(f"\nNaN step → webhook, {args.backend}, agent flush interval {flush} s, {len(latencies)} trials:")
    print(f"  p50 {p50 * 1000:.0f} ms   p95 {p95 * 1000:.0f} ms   max {max(latencies) * 1000:.0f} ms")
    print(f"  target p95 < {TARGET_P95_S:.0f} s: {'met' if p95 < TARGET_P95_S else 'NOT met'}")
    return 0 if p95 < TARGET_P95_S else 1


if __name__ == "__main__":
    sys.exit(main())
