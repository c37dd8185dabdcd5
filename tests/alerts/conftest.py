"""Real parts for the alerting tests: a webhook receiver and an SMTP server on loopback, servers with
alert settings (in a thread, or as `ampwatch server` subprocesses), and a training script to run and kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ampwatch.server import Settings


@dataclass
class Received:
    at: float  # time.time() when the request arrived
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Receiver:
    """A real HTTP server that records webhook requests; `replies` scripts the answers (status, headers, delay)."""

    url: str
    received: list[Received] = field(default_factory=list)
    replies: list[tuple[int, dict[str, str], float]] = field(default_factory=list)
    echo_path: bool = False  # answer with the request's path as the body (as a receiver that quotes a bad token does)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bodies(self, path: str = "/hook", **match: Any) -> list[dict[str, Any]]:
        with self.lock:
            found = [r.body for r in self.received if r.path == path]
        return [b for b in found if all(_dig(b, k) == v for k, v in match.items())]

    def wait(self, count: int, timeout_s: float = 20.0, path: str = "/hook", **match: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.bodies(path, **match)
            if len(found) >= count:
                return found
            time.sleep(0.02)
        raise AssertionError(f"expected {count} requests to {path} matching {match}, got {self.bodies(path)}")

    def notified(self, count: int, timeout_s: float = 20.0, path: str = "/hook") -> list[tuple[str, str, str]]:
        """(status, run id, rule) of every alert notified, a grouped message counting each of its alerts,
        once there are at least `count`."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [
                (b["status"], b["run"]["id"], a["rule"])
                for b in self.bodies(path)
                for a in b.get("alerts", [b["alert"]])
            ]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)


def _dig(body: dict[str, Any], dotted: str) -> Any:
    value: Any = body
    for key in dotted.split("__"):
        value = value.get(key) if isinstance(value, dict) else None
    return value


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A webhook receiver on a loopback port: `receiver.url + '/hook'`."""
    state = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            with state.lock:
                state.received.append(Received(time.time(), self.path, json.loads(raw or b"{}"), dict(self.headers)))
                status, headers, delay_s = state.replies.pop(0) if state.replies else (200, {}, 0.0)
            time.sleep(delay_s)  # a slow channel, when a test asks for one
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            reply = self.path.encode() if state.echo_path else b"ok"
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def alert_server(
    migrated_sqlite_url: str, receiver: Receiver, live_server_factory: Callable[..., Any]
) -> Callable[..., Any]:
    """Start a real uvicorn server whose alerts go to `receiver` (SQLite); keyword arguments are settings."""

    def start(**overrides: Any) -> Any:
        values = {
            "database_url": migrated_sqlite_url,
            "alert_webhook_url": f"{receiver.url}/hook",
            "alert_eval_interval_s": 0.1,
            **overrides,
        }
        # A setting this version of Settings lacks (e.g. alert_url_scope, read with getattr) is set on the copy.
        unknown = {k: v for k, v in values.items() if k not in Settings.model_fields}
        return live_server_factory(Settings(**values).model_copy(update=unknown))  # stopped after the test

    return start


TRAINING_SCRIPT = """
import os, sys, time, torch, ampwatch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
hang = sys.argv[1] if len(sys.argv) > 1 else ""
run = ampwatch.init("alerts", "subprocess")
run.watch(model=model, optimizer=optimizer, scaler=scaler)
print(run.id, flush=True)
step = 0
while True:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    step += 1
    time.sleep(0.01)
    while hang and step >= 40 and not os.path.exists(hang):
        time.sleep(0.05)  # hung (as in a collective), while the agent's thread keeps heartbeating
"""


@pytest.fixture
def training(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen, str]]]:
    """Start a training subprocess against `url`; returns it and its run id. Killed afterwards."""
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    started: list[subprocess.Popen] = []

    def start(url: str, *args: str) -> tuple[subprocess.Popen, str]:
        env = {
            **os.environ,
            "AMPWATCH_URL": url,
            "AMPWATCH_HEARTBEAT_INTERVAL_S": "0.2",
            "AMPWATCH_FLUSH_INTERVAL_S": "0.05",
        }
        process = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None
        return process, process.stdout.readline().strip()

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page; a script error on it fails the test."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    fresh = context.new_page()
    errors: list[str] = []
    fresh.on("pageerror", lambda error: errors.append(str(error)))
    yield fresh
    context.close()
    assert not errors, errors
