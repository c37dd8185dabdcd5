"""Loopback ports for the test servers, safe under pytest-xdist. Imported as `_ports` (pytest puts tests/ on the
path), so one process has one counter even when `conftest` is imported twice (as a plugin and by a test file)."""

from __future__ import annotations

import os
import secrets
import socket


def _port_block() -> range:
    """This process's own ports, below the kernel's ephemeral range (32768 up): parallel workers (xdist's `gwN`)
    never hand out the same port, and no outgoing connection takes one between `free_port()` and its bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker[2:].isdigit() else 0
    start = 20000 + (index % 12) * 1000
    return range(start, start + 1000)


_PORTS = _port_block()
_next = [secrets.randbelow(len(_PORTS))]  # a random start: two test runs on one machine rarely meet


def free_port() -> int:
    """A loopback port nothing listens on, not handed out again by this process for the next 999 calls (a server
    restarted on its old port finds it still free)."""
    for _ in range(len(_PORTS)):
        port = _PORTS[_next[0] % len(_PORTS)]
        _next[0] += 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")
