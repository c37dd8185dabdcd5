"""Real parts for the alerting tests: a webhook receiver and an SMTP server on loopback, servers with
alert settings (in a thread, or as `ampwatch server` subprocesses), and a training script to run and kill."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from ampwatch.server import Settings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Received:
    at: float  # time.time() when the request arrived
    path: str
    body: dict[str, Any]


@dataclass
class Receiver:
    """A real HTTP server that records webhook requests; `replies` scripts the answers (status, headers, delay)."""

    url: str
    received: list[Received] = field(default_factory=list)
    replies: list[tuple[int, dict[str, str], float]] = field(default_factory=list)
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
                state.received.append(Received(time.time(), self.path, json.loads(raw or b"{}")))
                status, headers, delay_s = state.replies.pop(0) if state.replies else (200, {}, 0.0)
            time.sleep(delay_s)  # a slow channel, when a test asks for one
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

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
def alert_server(sqlite_url: str, receiver: Receiver, live_server_factory: Callable[..., Any]) -> Callable[..., Any]:
    """Start a real uvicorn server whose alerts go to `receiver` (SQLite); keyword arguments are settings."""

    def start(**overrides: Any) -> Any:
        values = {"database_url": sqlite_url, "alert_webhook_url": f"{receiver.url}/hook", "alert_eval_interval_s": 0.1,
                  **overrides}  # fmt: skip
        return live_server_factory(Settings(**values))  # the root conftest's: stopped after the test

    return start


class ServerProcess:
    """`ampwatch server` as a subprocess (the real CLI), with alert settings in its environment."""

    def __init__(self, db_url: str, env: dict[str, str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.log_path = log_path
        command = [sys.executable, "-m", "ampwatch._cli", "server", "--port", str(self.port), "--db", db_url]
        self.process = subprocess.Popen(command, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not start:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()


@pytest.fixture
def server_processes(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start `ampwatch server` subprocesses; all are stopped afterwards."""
    started: list[ServerProcess] = []

    def start(db_url: str, **env: str) -> ServerProcess:
        process = ServerProcess(db_url, env, tmp_path / f"server-{len(started)}.log")
        started.append(process)
        process.wait_ready()
        return process

    yield start
    for process in started:
        process.stop()


TRAINING_SCRIPT = '''
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
'''


@pytest.fixture
def training(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen, str]]]:
    """Start a training subprocess against `url`; returns it and its run id. Killed afterwards."""
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    started: list[subprocess.Popen] = []

    def start(url: str, *args: str) -> tuple[subprocess.Popen, str]:
        env = {**os.environ, "AMPWATCH_URL": url, "AMPWATCH_HEARTBEAT_INTERVAL_S": "0.2", "AMPWATCH_FLUSH_INTERVAL_S": "0.05"}
        process = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None
        return process, process.stdout.readline().strip()

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)
