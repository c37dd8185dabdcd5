"""Shared helpers for the benchmarks: a real `ampwatch server` subprocess and scratch databases."""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_PG_ADMIN_URL = os.environ.get("AMPWATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of `values` (q in 0..100); NaN for an empty list."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, int(round(q / 100 * len(ordered) + 0.5)) - 1))
    return ordered[k]


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def postgres_problem(admin_url: str) -> str | None:
    """None when Postgres answers at `admin_url`, else why not."""
    try:
        import psycopg
    except ImportError as error:
        return f"psycopg is not installed ({error})"
    try:
        with psycopg.connect(_libpq(admin_url), connect_timeout=3):
            return None
    except psycopg.Error as error:
        return str(error).strip()


@contextlib.contextmanager
def scratch_database(backend: str, pg_admin_url: str = DEFAULT_PG_ADMIN_URL) -> Iterator[str]:
    """A fresh, empty database URL for `backend` ('sqlite' or 'postgres'), removed afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="ampwatch-bench-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'bench.db'}"
        return
    import psycopg

    name = f"ampwatch_bench_{secrets.token_hex(6)}"
    with psycopg.connect(_libpq(pg_admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = pg_admin_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(_libpq(pg_admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Server:
    """`ampwatch server` in a subprocess on a loopback port; always stopped by `stop()`."""

    def __init__(
        self, db_url: str, log_path: Path, port: int | None = None, cpus: set[int] | None = None, nice: int = 0
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = [
            sys.executable,
            "-m",
            "ampwatch._cli",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--db",
            db_url,
        ]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        if cpus:  # before it starts any thread: they all inherit these
            os.sched_setaffinity(self.process.pid, cpus)
        if nice:
            os.setpriority(os.PRIO_PROCESS, self.process.pid, nice)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until `/healthz` answers 200; raise with the server's log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down cleanly), SIGKILL after 10 s."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 10 ms resolution), NaN where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_cpu_s(threads: frozenset[Any]) -> float:
    """CPU seconds the threads have used so far (ns resolution; an ended thread counts 0)."""
    total = 0.0
    for thread in threads:
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError):
            pass
    return total


@contextlib.contextmanager
def on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """This thread on `cpus` for the block: the threads and processes it starts there keep them (None: as is)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
