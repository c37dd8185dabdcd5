"""Nothing lost: batches the server could not take wait on disk and arrive exactly once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import _runs
import httpx

import ampwatch
from ampwatch._spool import Spool
from ampwatch.server import Settings


def _series(server, run_id: str, names: tuple[str, ...] = ("loss", "step_seen")) -> dict:
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}/series", params={"name": list(names)}).json()


def test_a_server_down_for_the_middle_third_of_a_run_loses_nothing(db_url, server_processes, monkeypatch) -> None:
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


def test_batches_the_server_takes_at_once_never_touch_the_disk(sqlite_server, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0.02")  # several batches in this short run
    written: list[int] = []
    put = Spool.put  # a spy, not a mock: the real write still happens if the agent asks for one
    monkeypatch.setattr(Spool, "put", lambda self, seq, data: written.append(seq) or put(self, seq, data))
    with ampwatch.init("spool", "at-once", url=sqlite_server.url) as run:
        _runs.train(run, range(40), lambda step: time.sleep(0.005))
    _runs.assert_every_step_once(sqlite_server.url, run.id, 40)
    assert written == []  # (the outage tests show that batches the server did not take are on disk)


def test_offline_mode_spools_and_sync_uploads_exactly_once(sqlite_server, monkeypatch) -> None:
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


def test_a_run_that_ends_while_the_server_is_gone_is_uploaded_later(sqlite_url, request, monkeypatch) -> None:
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
    done = subprocess.run(
        [shutil.which("ampwatch") or "ampwatch", "sync", spool_dir, "--url", back.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert _series(back, run.id)["step_seen"]["steps"] == list(range(40))


def test_a_damaged_run_file_is_skipped_and_the_other_runs_are_uploaded(sqlite_server, monkeypatch) -> None:
    """An empty run.json (the spool does not fsync: a power loss can leave one) stops that run's upload alone."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    runs = []
    for name in ("first", "second"):
        with ampwatch.init("spool", name, url=sqlite_server.url) as run:
            _runs.train(run, range(10))
        runs.append(run)
    spool_dir = Path(os.environ["AMPWATCH_SPOOL_DIR"])
    damaged = sorted(spool_dir.iterdir())[0]  # (the first one sync comes to)
    (damaged / "run.json").write_text("")
    done = subprocess.run(
        [shutil.which("ampwatch") or "ampwatch", "sync", str(spool_dir), "--url", sqlite_server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and f"{damaged}: its run.json cannot be read" in done.stderr
    uploaded = next(r for r in runs if not damaged.name.startswith(r.id))
    assert _series(sqlite_server, uploaded.id)["step_seen"]["steps"] == list(range(10))


def test_sync_says_so_when_the_server_does_not_answer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    with ampwatch.init("spool", "nowhere", url="http://127.0.0.1:9") as run:
        run.log({"x": 1.0})
    monkeypatch.setattr("ampwatch._sync.GIVE_UP_AFTER_S", 1.0)
    from ampwatch._sync import sync

    assert sync(Path(os.environ["AMPWATCH_SPOOL_DIR"]), None, None) == 1


def test_sync_keeps_and_reports_what_the_server_refuses_and_takes_a_run_folder(
    sqlite_url, live_server_factory, monkeypatch
) -> None:
    # It said "uploaded", exited 0 and deleted the spool of a batch the server refused (a body or point limit).
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    # Batches of the whole run at its end, whatever the machine's speed: some hold more points than the server takes.
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "60")
    server = live_server_factory(Settings(database_url=sqlite_url, max_batch_points=50))
    with ampwatch.init("spool", "too-big", url=server.url) as run:
        _runs.train(run, range(30))
    spool_dir = Path(os.environ["AMPWATCH_SPOOL_DIR"])
    [folder] = list(spool_dir.iterdir())
    ampwatch_cli = shutil.which("ampwatch") or "ampwatch"
    missing = subprocess.run(
        [ampwatch_cli, "sync", str(spool_dir / "typo")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "no such folder" in missing.stderr
    done = subprocess.run(
        [ampwatch_cli, "sync", str(folder), "--url", server.url], capture_output=True, text=True, timeout=120
    )
    refused = re.search(r"refused (\d+) \(see the error above\), kept in (.+) as \.bad files", done.stderr)
    assert done.returncode == 1 and refused and "(413)" in done.stderr, (done.stdout, done.stderr)
    assert refused[2] == str(folder) and int(refused[1]) == len(list(folder.glob("[0-9]*.bad"))) > 0, (
        "each refused batch is kept"
    )


class _Front:
    """A front for the real server (a proxy or load balancer, as users may have): `on_post(path, count)` says how
    to answer the count-th batch post (None: forward it; else a status, with `Retry-After: 1` for 429); `delay_s`
    slows every batch post. ampwatch itself never answers that way."""

    def __init__(self, target: str, on_post: Any = None, delay_s: float = 0.0) -> None:
        self.posts: list[float] = []  # monotonic times of the batch posts
        self.puts = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status = None
                if self.command == "POST":
                    front.posts.append(time.monotonic())
                    time.sleep(delay_s)
                    status = on_post(self.path, len(front.posts)) if on_post else None
                else:
                    front.puts += 1
                if status is not None:
                    self.send_response(status)
                    if status == 429:
                        self.send_header("Retry-After", "1")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                reply = httpx.request(
                    self.command, target + self.path, content=body, headers={"Content-Type": "application/json"}
                )
                self.send_response(reply.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            do_PUT = do_POST = _forward

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def __enter__(self) -> _Front:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()


def test_a_429_with_retry_after_is_honoured_and_the_batch_arrives_once(sqlite_server, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "30")  # two 1 s waits before the batch can go through
    with _Front(sqlite_server.url, lambda path, count: 429 if count <= 2 else None) as front:
        run = ampwatch.init("spool", "throttled", url=front.url)
        _runs.train(run, range(20))
        run.finish()
    seen = front.posts
    assert len(seen) >= 3
    assert seen[1] - seen[0] >= 0.95 and seen[2] - seen[1] >= 0.95  # waited as told, not its own backoff
    data = _series(sqlite_server, run.id)
    assert data["step_seen"]["steps"] == list(range(20))


def test_a_backlog_still_being_delivered_at_finish_leaves_the_last_steps_on_disk(sqlite_server, monkeypatch) -> None:
    """The sender catches up on what an earlier process of the run left (a slow server: 0.25 s a batch) when the
    run finishes; finish() gives up after its timeout, and the steps recorded meanwhile, and the end of the run,
    wait in the spool with the rest (they used to wait in memory behind the backlog, and were lost)."""
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "2")
    monkeypatch.setenv("AMPWATCH_RUN_ID", "backlog")
    folder = Path(os.environ["AMPWATCH_SPOOL_DIR"]) / "backlog.0"
    with _Front(sqlite_server.url, delay_s=0.25) as front:
        Spool.create(
            folder.parent,
            "backlog",
            0,
            {
                "run_id": "backlog",
                "rank": 0,
                "url": front.url,
                "doc": {"project": "spool", "name": "backlog", "config": {}, "environment": {}},
            },
            1 << 30,
        )
        for seq in range(1, 41):  # 10 s of batches at this server's pace
            (folder / f"{seq:012d}.json").write_text(
                f'{{"rank": 0, "seq": {seq}, "points": {{}}, "events": [], "status": null}}'
            )
        run = ampwatch.init("spool", "backlog", url=front.url)
        time.sleep(0.6)  # (the sender is busy with the backlog)
        _runs.train(run, range(20))
        run.finish()
        assert len(front.posts) < 40  # (it was still catching up)
    done = subprocess.run(
        [shutil.which("ampwatch") or "ampwatch", "sync", str(folder.parent), "--url", sqlite_server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert _series(sqlite_server, run.id)["step_seen"]["steps"] == list(range(20))
    with sqlite_server.client() as http:
        assert http.get(f"/api/v1/runs/{run.id}").json()["status"] == "finished"


def test_a_front_that_answers_404_to_every_batch_is_retried_with_backoff(sqlite_server, monkeypatch) -> None:
    """Registration goes through but every batch gets 404 (another service behind the same address): the agent
    registers again once, then backs off, rather than looping as fast as the server answers."""
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "2")
    with _Front(sqlite_server.url, lambda path, count: 404) as front:
        run = ampwatch.init("spool", "lost", url=front.url)
        _runs.train(run, range(5))
        started = time.monotonic()
        run.finish()
        assert time.monotonic() - started < 8
    assert 1 <= len(front.posts) <= 8 and front.puts <= 9  # (2 s of backoff from 0.25 s on, doubling: a few tries)
    assert any(Path(os.environ["AMPWATCH_SPOOL_DIR"]).rglob("[0-9]*.json"))  # what was not taken waits on disk


def test_a_batch_the_server_rejects_is_counted_as_dropped(sqlite_server, monkeypatch, caplog) -> None:
    """A 4xx that no retry can mend (here 422, as for a batch the server cannot parse) loses that batch: finish()
    says so, and the next batch's `dropped_records` counts it."""
    with _Front(sqlite_server.url, lambda path, count: 422 if count == 1 else None) as front:
        run = ampwatch.init("spool", "rejected", url=front.url)
        run.log({"x": 1.0}, step=0)
        assert run._worker.flush(10)  # (private: the first batch alone)
        run.log({"x": 2.0}, step=1)
        with caplog.at_level("WARNING", logger="ampwatch"):
            run.finish()
    assert "1 batch(es)" in caplog.text and "rejected" in caplog.text
    data = _series(sqlite_server, run.id, ("x", "dropped_records", "dropped_records/rejected"))
    assert data["x"]["steps"] == [1] and data["dropped_records"]["values"] == [1.0]
    assert data["dropped_records/rejected"]["values"] == [1.0]
    assert "rejected: 1" in caplog.text


def test_sync_while_an_offline_run_still_writes_uploads_what_is_there_and_keeps_the_folder(
    sqlite_server, monkeypatch
) -> None:
    """ampwatch sync run while an offline run goes on (to watch it from elsewhere) uploads its batches so far and
    leaves the folder to the run, which writes on; a sync after the run ends uploads the rest and removes it."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0.05")
    spool_dir = os.environ["AMPWATCH_SPOOL_DIR"]
    command = [shutil.which("ampwatch") or "ampwatch", "sync", spool_dir, "--url", sqlite_server.url]
    run = ampwatch.init("spool", "watched-while-offline", url=sqlite_server.url)
    _runs.train(run, range(10))
    assert run._worker.flush(10)  # (private: the first ten steps are on disk)
    during = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert during.returncode == 0 and "still writes there" in during.stdout, during.stdout + during.stderr
    assert _series(sqlite_server, run.id)["step_seen"]["steps"] == list(range(10))
    _runs.train(run, range(10, 20))
    run.finish()
    after = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0 and "still writes" not in after.stdout, after.stdout + after.stderr
    assert _series(sqlite_server, run.id)["step_seen"]["steps"] == list(range(20))
    assert not list(Path(spool_dir).iterdir())


def test_a_relaunched_offline_run_with_batches_left_on_disk_leaves_the_cpu_alone(monkeypatch) -> None:
    """Offline, what an earlier process of the run left in the spool is never sent: the sender must not keep waking
    up for it (it spun, holding the GIL the training thread needs)."""
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    monkeypatch.setenv("AMPWATCH_RUN_ID", "relaunched-offline")
    with ampwatch.init("spool", "relaunched") as first:
        first.log({"x": 1.0}, step=0)
    run = ampwatch.init("spool", "relaunched")
    run.log({"x": 2.0}, step=1)
    time.sleep(0.2)
    started = time.process_time()
    time.sleep(1.0)
    busy = time.process_time() - started
    run.finish()
    assert busy < 0.3, busy


def test_a_zero_flush_interval_still_delivers(sqlite_server, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0")
    run = ampwatch.init("spool", "no-interval", url=sqlite_server.url)
    _runs.train(run, range(10))
    run.finish()
    assert _series(sqlite_server, run.id)["step_seen"]["steps"] == list(range(10))


def test_a_file_system_without_locks_still_spools(monkeypatch) -> None:
    """Lustre without `-o flock`, some NFS mounts: flock fails with ENOSYS or ENOLCK. The spool works without its
    lock (only `ampwatch sync` can then not tell a live run's folder). Simulated, as no such file system is here."""
    import errno

    import ampwatch._spool as spool_module

    def no_locks(*args: object) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(spool_module.fcntl, "flock", no_locks)
    monkeypatch.setenv("AMPWATCH_MODE", "offline")
    with ampwatch.init("spool", "no-locks") as run:
        run.log({"x": 1.0}, step=0)
    assert run._worker.dropped == run._worker.outbox.dropped == 0  # (private: nothing counted lost)
    assert len(list(Path(os.environ["AMPWATCH_SPOOL_DIR"]).rglob("[0-9]*.json"))) == 1


def test_a_wrong_server_url_is_named_in_what_the_agent_logs(sqlite_server, caplog, monkeypatch, wait_for) -> None:
    # Both said only "the server is unreachable or busy" (after "PUT /api/v1/runs/... rejected (404)" for the second).
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "1")
    said = ("unknown url type: localhost", "rejected (404)")
    # no scheme; the API's path, not the server's base
    for url, words in zip(("localhost:18620", sqlite_server.url + "/api/v1"), said, strict=True):
        with ampwatch.init("spool", "wrong-url", url=url) as run:
            run.log({"x": 1.0}, step=0)
            wait_for(lambda words=words: words in caplog.text, 30, words)  # (the agent's first exchange, under load)
    assert "the server is unreachable or busy (<urlopen error unknown url type: localhost" in caplog.text
    assert "rejected (404)" in caplog.text and "is AMPWATCH_URL the server's base URL" in caplog.text
