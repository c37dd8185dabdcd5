"""Nothing lost: batches the server could not take wait on disk and arrive exactly once."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

import _runs
import ampwatch
from ampwatch._spool import Spool
from ampwatch.server import Settings


def _series(server, run_id: str) -> dict:  # type: ignore[no-untyped-def]
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}/series", params={"name": ["loss", "step_seen"]}).json()


def test_a_server_down_for_the_middle_third_of_a_run_loses_nothing(db_url, server_processes, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "30")
    holder = {"server": server_processes(db_url)}  # `ampwatch server`, a real process
    port = holder["server"].port
    run = ampwatch.init("spool", "outage", url=holder["server"].url)

    def outage(step: int) -> None:
        if step == 100:
            holder["server"].kill()  # SIGKILL: the middle third happens with nobody listening
        if step == 200:
            holder["server"] = server_processes(db_url, port)  # back where it was
        if 100 <= step < 200:
            time.sleep(0.005)

    _runs.train(run, range(300), outage)
    run.finish()
    _runs.assert_every_step_once(holder["server"].url, run.id, 300)


def test_batches_the_server_takes_at_once_never_touch_the_disk(sqlite_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0.02")  # several batches in this short run
    written: list[int] = []
    put = Spool.put  # a spy, not a mock: the real write still happens if the agent asks for one
    monkeypatch.setattr(Spool, "put", lambda self, seq, data: written.append(seq) or put(self, seq, data))
    with ampwatch.init("spool", "at-once", url=sqlite_server.url) as run:
        _runs.train(run, range(40), lambda step: time.sleep(0.005))
    _runs.assert_every_step_once(sqlite_server.url, run.id, 40)
    assert written == []  # (the outage tests show that batches the server did not take are on disk)


def test_offline_mode_spools_and_sync_uploads_exactly_once(sqlite_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    spool_dir = os.environ["AMPWATCH_SPOOL_DIR"]
    with ampwatch.init("spool", "offline", url=sqlite_server.url) as run:
        _runs.train(run, range(50))
    with sqlite_server.client() as http:
        assert http.get("/api/v1/runs").json() == []  # nothing was sent
    assert list(Path(spool_dir).iterdir())
    command = [shutil.which("ampwatch") or "ampwatch", "sync", spool_dir, "--url", sqlite_server.url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "spool/offline" in done.stdout and "uploaded" in done.stdout
    assert _series(sqlite_server, run.id)["step_seen"]["steps"] == list(range(50))
    with sqlite_server.client() as http:
        assert http.get(f"/api/v1/runs/{run.id}").json()["status"] == "finished"
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing to upload" in again.stdout
    assert _series(sqlite_server, run.id)["step_seen"]["steps"] == list(range(50))


def test_a_run_that_ends_while_the_server_is_gone_is_uploaded_later(sqlite_url, request, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "0.5")
    start_server = request.getfixturevalue("live_server_factory")
    server = start_server(Settings(database_url=sqlite_url))
    run = ampwatch.init("spool", "server-gone", url=server.url)

    def vanish(step: int) -> None:
        if step == 10:
            server.stop()

    _runs.train(run, range(40), vanish)
    run.finish()  # gives up after its timeout: the rest waits on disk
    spool_dir = os.environ["AMPWATCH_SPOOL_DIR"]
    assert any(Path(spool_dir).rglob("[0-9]*.json"))
    back = start_server(Settings(database_url=sqlite_url))
    done = subprocess.run([shutil.which("ampwatch") or "ampwatch", "sync", spool_dir, "--url", back.url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _series(back, run.id)["step_seen"]["steps"] == list(range(40))


def test_sync_says_so_when_the_server_does_not_answer(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    with ampwatch.init("spool", "nowhere", url="http://127.0.0.1:9") as run:
        run.log({"x": 1.0})
    monkeypatch.setattr("ampwatch._sync.GIVE_UP_AFTER_S", 1.0)
    from ampwatch._sync import sync

    assert sync(Path(os.environ["AMPWATCH_SPOOL_DIR"]), None, None) == 1


def test_a_429_with_retry_after_is_honoured_and_the_batch_arrives_once(sqlite_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "30")  # two 1 s waits before the batch can go through
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    # A throttling front for the real server: it answers the first two batch posts with 429 + Retry-After and
    # forwards everything else (ampwatch itself never sends 429; a proxy or load balancer in front may).
    seen: list[tuple[float, int]] = []

    class Throttle(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.command == "POST":
                seen.append((time.monotonic(), len(seen)))
                if len(seen) <= 2:
                    self.send_response(429)
                    self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            reply = httpx.request(self.command, sqlite_server.url + self.path, content=body, headers={"Content-Type": "application/json"})
            self.send_response(reply.status_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply.content)))
            self.end_headers()
            self.wfile.write(reply.content)

        do_PUT = do_POST = _forward

        def log_message(self, *args: object) -> None:
            pass

    front = ThreadingHTTPServer(("127.0.0.1", 0), Throttle)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    try:
        run = ampwatch.init("spool", "throttled", url=f"http://127.0.0.1:{front.server_address[1]}")
        _runs.train(run, range(20))
        run.finish()
    finally:
        front.shutdown()
    assert len(seen) >= 3
    assert seen[1][0] - seen[0][0] >= 0.95 and seen[2][0] - seen[1][0] >= 0.95  # waited as told, not its own backoff
    data = _series(sqlite_server, run.id)
    assert data["step_seen"]["steps"] == list(range(20))
