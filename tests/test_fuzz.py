"""Schemathesis generates requests from the OpenAPI schema against a real server: none may get a 5xx.

The alert channels are fuzzed too, "send test" included, so the server would connect to whatever URL or SMTP
host was generated: it runs with `alert_url_scope=loopback` (no DNS lookup, nothing but this machine), and a
guard in this process (an audit hook: the server runs in a thread here) blocks and records any connection or
name lookup for another address, and the test fails if there was one. Left out: the live streams (open by
design for 30 s each; tests/test_stream.py covers them).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ampwatch.server import Settings

_guard: dict[str, Any] = {"on": False, "blocked": []}


def _is_loopback(host: Any) -> bool:
    if not isinstance(host, str):
        return isinstance(host, bytes) and _is_loopback(host.decode(errors="replace"))
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _is_name(host: Any) -> bool:
    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host).split("%")[0])
        return False
    except ValueError:
        return True


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _guard["on"]:
        return
    if event == "socket.getaddrinfo" and args[0] is not None and _is_name(args[0]) and not _is_loopback(args[0]):
        _guard["blocked"].append((event, args[0]))
        raise socket.gaierror(f"test guard: no name lookup for {args[0]!r}")
    if event == "socket.connect" and isinstance(args[1], tuple) and not _is_loopback(args[1][0]):
        _guard["blocked"].append((event, args[1][0]))
        raise ConnectionRefusedError(f"test guard: no connection to {args[1][0]!r}")


@pytest.fixture
def loopback_only() -> Iterator[list[tuple[str, Any]]]:
    """While the test runs, this process may connect to and look up loopback only; what was blocked."""
    if not _guard.get("installed"):
        sys.addaudithook(_audit)  # audit hooks cannot be removed: it is switched off after the test instead
        _guard["installed"] = True
    _guard["blocked"] = []
    _guard["on"] = True
    yield _guard["blocked"]
    _guard["on"] = False


def test_the_guard_blocks_and_records_a_connection_elsewhere(loopback_only) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("192.0.2.1", 9), timeout=1)  # TEST-NET-1: blocked before any packet leaves
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("example.com", 80)
    assert loopback_only == [("socket.connect", "192.0.2.1"), ("socket.getaddrinfo", "example.com")]


def test_generated_requests_never_get_a_server_error(sqlite_url, live_server_factory, loopback_only, tmp_path) -> None:
    command = shutil.which("schemathesis")
    if command is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    settings = Settings(database_url=sqlite_url, alert_delivery_timeout_s=1.0)
    server = live_server_factory(settings.model_copy(update={"alert_url_scope": "loopback"}))
    with server.client() as http:  # a run and a channel to aim at, so id-scoped operations get past their 404
        http.put("/api/v1/runs/r1", json={"project": "p", "name": "n"}).raise_for_status()
        http.post(
            "/api/v1/alert-channels", json={"name": "c", "kind": "webhook", "url": f"{server.url}/nowhere"}
        ).raise_for_status()
        refused = http.post(
            "/api/v1/alert-channels", json={"name": "x", "kind": "webhook", "url": "https://example.com/x"}
        )
        assert refused.status_code == 422  # the scope holds before fuzzing starts
    done = subprocess.run(
        [
            command,
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "10",
            "--exclude-path-regex",
            "stream",
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # it keeps a cache folder where it runs
    )
    assert done.returncode == 0, done.stdout[-4000:]  # schemathesis exits non-zero on any 5xx
    assert "generated" in done.stdout and "alert-channels" in done.stdout  # it really fuzzed the channels
    assert loopback_only == []  # and the server never tried to reach beyond this machine
