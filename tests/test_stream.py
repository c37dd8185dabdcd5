"""Live streams over Server-Sent Events, read by a real HTTP client from a real server (SQLite and Postgres)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest


class SSE:
    """A minimal `text/event-stream` reader: one parsed event per `next()`, failing after `timeout_s` of silence."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.iter_lines()

    def next(self, event: str, timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        for line in self.lines:
            if time.monotonic() > deadline:
                break
            if line == "":
                if fields.get("event") == event:
                    return {"id": fields.get("id"), "data": json.loads(fields["data"])}
                fields = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(":")
                fields[key] = (
                    fields.get(key, "") + value.removeprefix(" ") if key == "data" else value.removeprefix(" ")
                )
        raise AssertionError(f"no {event!r} event within {timeout_s} s")

    def until(self, predicate: Any, event: str = "update", timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Events up to and including the first for which `predicate(data)` holds."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen.append(self.next(event, timeout_s=deadline - time.monotonic()))
            if predicate(seen[-1]["data"]):
                return seen
        raise AssertionError(f"condition not met; got {seen}")


@contextmanager
def sse(http: httpx.Client, path: str, **kwargs: Any) -> Iterator[SSE]:
    with http.stream("GET", path, timeout=httpx.Timeout(10.0, read=10.0), **kwargs) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield SSE(response)


@pytest.fixture
def http(live_server):
    with live_server.client() as client:
        assert client.put("/api/v1/runs/r1", json={"project": "p", "name": "live"}).status_code == 200
        yield client


def _post(
    http: httpx.Client, seq: int, points: dict[str, Any], events: list[dict[str, Any]] | None = None, rank: int = 0
) -> None:
    reply = http.post(
        "/api/v1/runs/r1/batches", json={"seq": seq, "rank": rank, "points": points, "events": events or []}
    )
    assert reply.status_code == 200 and reply.json()["stored"], reply.text


def _merged(updates: list[dict[str, Any]], name: str) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for u in updates:
        series = u["data"]["points"].get(name, {"steps": [], "values": []})
        out.update(zip(series["steps"], series["values"]))
    return out


def test_a_point_posted_after_the_stream_opened_arrives_with_its_event(http) -> None:
    _post(http, 1, {"loss": {"steps": [0, 1, 2], "values": [3.0, 2.5, 2.0]}})
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": 2, "after_event": 0}) as stream:
        event = {"step": 4, "type": "nonfinite_loss", "severity": "critical", "message": "NaN loss at step 4"}
        _post(
            http,
            2,
            {
                "loss": {"steps": [3, 4], "values": [1.5, "NaN"]},
                "scale": {"steps": [3, 4], "values": [65536.0, 32768.0]},
            },
            [event],
        )
        updates = stream.until(lambda d: 4 in d["points"].get("loss", {}).get("steps", []) and d["events"])
    loss = _merged(updates, "loss")
    assert {k: v for k, v in loss.items() if k > 2} == {3: 1.5, 4: "NaN"}
    assert _merged(updates, "scale") == {3: 65536.0, 4: 32768.0}
    last = updates[-1]["data"]
    assert [e["message"] for e in last["events"]] == ["NaN loss at step 4"]
    assert (last["run"]["last_step"], last["run"]["health"]) == (4, "critical")
    assert updates[-1]["id"].startswith("2/")  # the second stored batch with points


def test_a_reconnecting_client_resumes_from_last_event_id_and_gets_what_it_missed(http) -> None:
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": -1}) as stream:
        _post(http, 1, {"loss": {"steps": [0, 1], "values": [3.0, 2.0]}})
        last_id = stream.until(lambda d: 1 in d["points"].get("loss", {}).get("steps", []))[-1]["id"]
    assert last_id.startswith("1/")
    # While nobody listens: a late point at the cursor's own step (another series), and newer points.
    _post(http, 2, {"lr": {"steps": [1], "values": [0.1]}, "loss": {"steps": [2, 3], "values": [1.0, "Infinity"]}})
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": 100}, headers={"Last-Event-ID": last_id}) as stream:
        updates = stream.until(lambda d: 3 in d["points"].get("loss", {}).get("steps", []))
    assert _merged(updates, "lr") == {1: 0.1}
    assert {k: v for k, v in _merged(updates, "loss").items() if k >= 2} == {2: 1.0, 3: "Infinity"}


def test_a_stream_sends_only_its_rank(http) -> None:
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": -1, "rank": 1}) as stream:
        _post(http, 1, {"loss": {"steps": [0], "values": [9.0]}}, rank=0)
        _post(http, 1, {"loss": {"steps": [0], "values": [1.0]}}, rank=1)
        updates = stream.until(lambda d: bool(d["points"]))
    assert _merged(updates, "loss") == {0: 1.0}


def test_a_stream_far_behind_is_told_to_reset(http) -> None:
    from ampwatch.server.routers.stream import RESET_STEPS

    _post(http, 1, {"loss": {"steps": [0, RESET_STEPS + 10], "values": [1.0, 2.0]}})
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": 0}) as stream:
        first = stream.next("update")["data"]
        _post(http, 2, {"loss": {"steps": [RESET_STEPS + 11], "values": [3.0]}})
        after = stream.until(lambda d: bool(d["points"]))
    assert first["reset"] is True and first["points"] == {}
    # After a reset the stream goes on from the run's end; that last step itself may come again (the client keeps one).
    assert _merged(after, "loss")[RESET_STEPS + 11] == 3.0 and min(_merged(after, "loss")) >= RESET_STEPS + 10


def test_streams_of_an_unknown_run_get_404(http) -> None:
    assert http.get("/api/v1/runs/nobody/stream").status_code == 404


def test_the_runs_stream_sends_a_run_that_changed_with_its_vitals(http) -> None:
    http.put("/api/v1/runs/other", json={"project": "elsewhere", "name": "quiet"})
    with sse(http, "/api/v1/stream/runs", params={"project": "p"}) as stream:
        skipped = [1.0, 0.0, 0.0, 1.0]
        http.post("/api/v1/runs/other/batches", json={"seq": 1, "points": {"loss": {"steps": [7], "values": [1.0]}}})
        _post(
            http,
            1,
            {
                "scale": {"steps": [0, 1, 2, 3], "values": [65536.0, 32768.0, 32768.0, 16384.0]},
                "skipped": {"steps": [0, 1, 2, 3], "values": skipped},
            },
        )
        runs = stream.until(lambda d: any(r["id"] == "r1" and r["last_step"] == 3 for r in d), event="runs")
    row = next(r for r in runs[-1]["data"] if r["id"] == "r1")
    assert (row["project"], row["status"], row["scale"], row["skip_rate"], row["firing"]) == (
        "p",
        "running",
        16384.0,
        0.5,
        0,
    )
    assert all(r["id"] != "other" for m in runs for r in m["data"]), "the project filter holds"


def test_the_runs_stream_says_when_a_run_leaves_its_status_filter_also_to_a_stream_opened_after(http) -> None:
    # (the stream compared the filtered list with itself: a run that finished just dropped out of it, unsaid)
    _post(http, 1, {"loss": {"steps": [0], "values": [1.0]}})
    before = http.get("/api/v1/runs/r1").json()["last_seen_at"]
    with sse(http, "/api/v1/stream/runs", params={"project": "p", "status": "running"}) as stream:
        _post(http, 2, {"loss": {"steps": [1], "values": [1.0]}})
        stream.until(lambda d: any(r["id"] == "r1" and r["last_step"] == 1 for r in d), event="runs")
        assert http.post("/api/v1/runs/r1/batches", json={"seq": 3, "status": "finished"}).status_code == 200
        runs = stream.until(lambda d: any(r["id"] == "r1" and not r["in_filter"] for r in d), event="runs")
    row = next(r for r in runs[-1]["data"] if r["id"] == "r1")
    assert (row["status"], row["in_filter"], row["last_step"]) == ("finished", False, 1)
    # A browser reconnecting from before the change (its Last-Event-ID) is told too.
    with sse(http, "/api/v1/stream/runs", params={"project": "p", "status": "running", "since": before}) as stream:
        first = stream.next("runs")["data"]
    assert [(r["id"], r["status"], r["in_filter"]) for r in first] == [("r1", "finished", False)]


def test_many_open_streams_do_not_starve_other_requests(sqlite_server) -> None:
    import contextlib

    import httpx

    with sqlite_server.client() as http:
        http.put("/api/v1/runs/busy", json={"project": "p", "name": "n"})
        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(httpx.Client(base_url=sqlite_server.url, timeout=5)) for _ in range(20)]
            for client in clients:  # more open streams than the connection pool has connections
                assert stack.enter_context(client.stream("GET", "/api/v1/runs/busy/stream")).status_code == 200
            reply = http.get("/api/v1/runs", timeout=5)
            assert reply.status_code == 200
            posted = http.post(
                "/api/v1/runs/busy/batches",
                json={"seq": 1, "points": {"x": {"steps": [0], "values": [1.0]}}},
                timeout=5,
            )
            assert posted.status_code == 200


def test_points_written_far_behind_the_stream_arrive_live(http) -> None:
    _post(http, 1, {"loss": {"steps": list(range(100)), "values": [1.0] * 100}})
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": 99}) as stream:
        _post(http, 2, {"loss": {"steps": [100, 101], "values": [0.9, 0.8]}})
        stream.until(lambda d: 101 in d["points"].get("loss", {}).get("steps", []))
        # A spool replayed after an outage: old steps, a series the stream never saw, a value replaced.
        _post(
            http,
            3,
            {"loss": {"steps": [10, 11], "values": [5.0, "NaN"]}, "lr": {"steps": [10, 11], "values": [0.1, 0.2]}},
        )
        _post(http, 1, {"loss": {"steps": [3], "values": [7.0]}}, rank=1)  # a slower rank, behind rank 0
        late = stream.until(lambda d: 10 in d["points"].get("loss", {}).get("steps", []))
    assert _merged(late, "loss") == {10: 5.0, 11: "NaN"}
    assert _merged(late, "lr") == {10: 0.1, 11: 0.2}
    with sse(http, "/api/v1/runs/r1/stream", params={"after_position": 4, "rank": 1}) as stream:
        _post(http, 2, {"loss": {"steps": [2], "values": [6.0]}}, rank=1)
        assert _merged(stream.until(lambda d: bool(d["points"])), "loss") == {2: 6.0}


def test_a_batch_committing_late_is_streamed_and_numbered_after_the_one_before_it(live_server, monkeypatch) -> None:
    import threading

    from ampwatch.server import ingestion

    held, release = threading.Event(), threading.Event()
    on_batch = ingestion.alerts.on_batch

    def slow_on_batch(session, **kwargs):
        if kwargs.get("new_step") == 50:  # batch A stalls before its commit, holding its feed position
            held.set()
            release.wait(10)
        return on_batch(session, **kwargs)

    monkeypatch.setattr(ingestion.alerts, "on_batch", slow_on_batch)  # the server runs in this process
    with live_server.client() as http:
        http.put("/api/v1/runs/r1", json={"project": "p", "name": "race"})
        with sse(http, "/api/v1/runs/r1/stream", params={"after_step": -1}) as stream:
            a = threading.Thread(
                target=_post, args=(live_server.client(), 1, {"loss": {"steps": [50], "values": [5.0]}})
            )
            a.start()
            assert held.wait(10)
            b = threading.Thread(
                target=_post, args=(live_server.client(), 2, {"loss": {"steps": [60], "values": [6.0]}})
            )
            b.start()
            b.join(1.0)
            assert b.is_alive(), "batch B waits for A's commit"
            release.set()
            a.join(10)
            b.join(10)
            updates = stream.until(_all_of({50, 60}))
    assert _merged(updates, "loss") == {50: 5.0, 60: 6.0}


def _all_of(steps: set[int]) -> Any:
    """A predicate that holds once every one of `steps` came in the updates seen so far."""
    seen: set[int] = set()

    def check(data: dict[str, Any]) -> bool:
        seen.update(data["points"].get("loss", {}).get("steps", []))
        return steps <= seen

    return check


def test_an_event_committed_after_a_newer_one_is_still_streamed(pg_url: str, live_server_factory) -> None:
    from sqlalchemy import create_engine, text

    from ampwatch.server import Settings

    server = live_server_factory(Settings(database_url=pg_url))
    insert = text(
        "INSERT INTO events (run_id, step, rank, type, severity, message, details, time)"
        " VALUES ('r1', :step, 0, 'grad_spike', 'warning', :m, '{}', now()) RETURNING id"
    )
    engine = create_engine(pg_url)
    with server.client() as http:
        http.put("/api/v1/runs/r1", json={"project": "p", "name": "events"})
        with sse(http, "/api/v1/runs/r1/stream") as stream, engine.connect() as slow, engine.connect() as fast:
            slow_id = slow.execute(insert, {"step": 1, "m": "slow"}).scalar()  # its transaction stays open
            fast_id = fast.execute(insert, {"step": 2, "m": "fast"}).scalar()
            fast.commit()
            stream.until(lambda d: [e["id"] for e in d["events"]] == [fast_id])
            slow.commit()
            late = stream.until(lambda d: bool(d["events"]))
    engine.dispose()
    assert slow_id < fast_id
    assert [(e["id"], e["message"]) for e in late[-1]["data"]["events"]] == [(slow_id, "slow")]


def test_a_batch_stored_while_a_stream_opens_is_not_missed(live_server, http, monkeypatch) -> None:
    """The request loads the run (last step 99); batch 2 commits before the stream reads its feed position.
    Its steps must be in the stream's catch-up range or after its position, not fall between the two."""
    from ampwatch.server import queries

    _post(http, 1, {"loss": {"steps": list(range(100)), "values": [1.0] * 100}})
    feed_position = queries.feed_position

    def batch_lands_first(session, **kwargs):
        monkeypatch.setattr(queries, "feed_position", feed_position)  # once
        with live_server.client() as other:  # the server runs in this process: this is another request
            _post(other, 2, {"loss": {"steps": [100, 101], "values": [0.9, 0.8]}})
        return feed_position(session, **kwargs)

    monkeypatch.setattr(queries, "feed_position", batch_lands_first)
    with sse(http, "/api/v1/runs/r1/stream", params={"after_step": 99}) as stream:
        seen = stream.until(lambda d: 101 in d["points"].get("loss", {}).get("steps", []), timeout_s=8)
    assert _merged(seen, "loss") == {100: 0.9, 101: 0.8}
