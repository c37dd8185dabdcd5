"""Three real `ampwatch server` processes on one Postgres behind a real nginx on loopback, with the nginx
settings the compose profile ships: a real agent trains through nginx, one replica is SIGKILLed mid-run, and
nothing acknowledged is lost or stored twice, live streams of one replica see what another ingested, and the
NaN alert is delivered once."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from _runs import assert_every_step_once, clipped_step
from conftest import ServerProcess, free_port
from test_stream import sse

import ampwatch
from ampwatch.server.deploy import write_loopback_nginx

STEPS, NAN_STEP, KILL_STEP = 300, 60, 150


@pytest.fixture
def hooks() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A webhook receiver on loopback: its URL and the bodies it got."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers.get("content-length", 0)))))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", bodies
    server.shutdown()
    server.server_close()


def nginx_in_front(replicas: list[ServerProcess], folder: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """Debian's nginx on a loopback port, balancing over `replicas` with the shipped locations."""
    port = free_port()
    config = write_loopback_nginx(folder, port, [r.port for r in replicas])
    nginx = subprocess.Popen(
        [
            shutil.which("nginx") or "/usr/sbin/nginx",
            "-p",
            str(folder),
            "-c",
            str(config),
            "-g",
            "daemon off;",
        ],
        stderr=subprocess.STDOUT,
        stdout=open(folder / "out.log", "wb"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert nginx.poll() is None, (folder / "out.log").read_text() + (folder / "error.log").read_text()
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return url, nginx
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("nginx did not start")


def test_three_replicas_behind_nginx_lose_nothing_when_one_is_killed_and_share_streams_and_alerts(
    pg_url: str,
    server_processes: Callable[..., ServerProcess],
    hooks: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    wait_for: Any,
) -> None:
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        pytest.skip("nginx is not installed (.ci/run installs Debian's)")
    hook_url, bodies = hooks
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "60")
    env = {"AMPWATCH_ALERT_WEBHOOK_URL": hook_url, "AMPWATCH_ALERT_EVAL_INTERVAL_S": "0.2"}
    replicas = [server_processes(pg_url, **env) for _ in range(3)]
    url, nginx = nginx_in_front(replicas, tmp_path)
    watcher = replicas[2]  # never killed: its stream must see what the others ingested
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu")
        with ampwatch.init("scale", "through-nginx", url=url) as run:
            run.watch(model=model, optimizer=optimizer, scaler=scaler)
            wait_for(lambda: httpx.get(f"{watcher.url}/api/v1/runs/{run.id}").status_code == 200, what="the run")
            everything = {"after_step": -1}  # (what was stored before the stream opened, too)
            with sse(httpx.Client(base_url=watcher.url), f"/api/v1/runs/{run.id}/stream", params=everything) as stream:
                for step in range(STEPS):
                    if step == KILL_STEP:
                        replicas[0].kill()  # SIGKILL: whatever it was storing dies with it
                    x = torch.randn(8, 4)
                    if step == NAN_STEP:
                        x[0, 0] = float("nan")
                    clipped_step(model, optimizer, scaler, x)
                    run.log({"step_seen": float(step)}, step=step)
                seen: set[int] = set()

                def every_step(data: dict[str, Any]) -> bool:
                    seen.update(data["points"].get("step_seen", {}).get("steps", []))
                    return seen >= set(range(STEPS))

                stream.until(every_step, timeout_s=30)
        # Every acknowledged point stored exactly once, the run finished, nothing left in the agent's spool.
        assert_every_step_once(url, run.id, STEPS)
        # A batch written straight into one replica reaches a live stream of another, and one through nginx
        # (which must not buffer it).
        path = f"/api/v1/runs/{run.id}/stream"
        with sse(httpx.Client(base_url=watcher.url), path) as direct, sse(httpx.Client(base_url=url), path) as proxied:
            probe = {"seq": 1, "rank": 0, "points": {"probe": {"steps": [STEPS + 5], "values": ["-Infinity"]}}}
            httpx.post(f"{replicas[1].url}/api/v1/runs/{run.id}/batches", json=probe, timeout=30).raise_for_status()
            for stream in (direct, proxied):
                got = stream.until(lambda d: "probe" in d["points"], timeout_s=10)[-1]["data"]["points"]["probe"]
                assert got == {"steps": [STEPS + 5], "values": ["-Infinity"]}

        # The NaN loss: one alert, notified once, whichever of the three processes saw it.
        def firing() -> list[dict[str, Any]]:
            return [
                b
                for b in list(bodies)
                for a in b.get("alerts", [b.get("alert", {})])
                if a.get("rule") == "nonfinite_loss" and b.get("status") == "firing"
            ]

        wait_for(lambda: firing(), what="the NaN alert's notification")
        with httpx.Client(base_url=url, timeout=30) as http:
            (alert,) = [
                a for a in http.get("/api/v1/alerts", params={"run_id": run.id}).json() if a["rule"] == "nonfinite_loss"
            ]
            flips = http.get(f"/api/v1/alerts/{alert['id']}").json()["flips"]
        assert [f["new_state"] for f in flips][:1] == ["firing"]
        assert [d["status"] for d in flips[0]["deliveries"]] == ["delivered"]
        assert len(firing()) == 1, firing()
    finally:
        nginx.terminate()
        nginx.wait(10)
