"""The runs list at scale: vitals kept at ingest, keyset pages, and a fixed number of SQL statements per request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from conftest import LiveServer, start_server
from sqlalchemy import event

from ampwatch.server import ingestion
from ampwatch.server.schemas import BatchIn, RunIn
from ampwatch.server.settings import Settings


def _fill(server: LiveServer, first: int, count: int) -> None:
    """Runs `first`.. `first + count - 1`, each with a scale, skipped steps, a loss and an event (every
    fourth a NaN loss, which fires a critical alert), stored
    by the ingest functions themselves (the HTTP route adds nothing the list depends on, and is 10× slower)."""
    with server.app.state.sessions() as session:
        for i in range(first, first + count):
            run_id = f"run-{i:04d}"
            ingestion.register_run(session, run_id=run_id, body=RunIn(project=f"p{i % 3}", name=f"exp-{i}"))
            steps = list(range(10))
            batch = BatchIn(
                seq=1,
                points={
                    "loss": {"steps": steps, "values": [1.0] * 10},
                    "scale": {"steps": steps, "values": [2.0**16] * 10},
                    "skipped": {"steps": steps, "values": [float(s % 5 == 0) for s in steps]},
                },
                events=[
                    {"step": 3, "type": "nonfinite_loss", "severity": "critical", "message": "NaN loss"}
                    if i % 4 == 0
                    else {"step": 3, "type": "grad_spike", "severity": "warning", "message": "x"}
                ],
            )
            ingestion.ingest_batch(session, run_id=run_id, batch=batch)


@contextmanager
def _statements(server: LiveServer) -> Iterator[list[str]]:
    """The SQL statements requests run meanwhile: not the background alert threads' (`ampwatch-*`), nor the
    access-token cache's refresh (every few seconds, whatever the request)."""
    seen: list[str] = []

    def count(_conn, _cursor, statement: str, *_: object) -> None:
        if not threading.current_thread().name.startswith("ampwatch-") and "api_tokens" not in statement:
            seen.append(statement)

    engine = server.app.state.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def _cost(server: LiveServer, client: httpx.Client, path: str) -> int:
    with _statements(server) as seen:
        assert client.get(path).status_code == 200
    return len(seen)


@pytest.fixture
def quiet_server(migrated_db_url: str) -> Iterator[LiveServer]:
    server = start_server(Settings(database_url=migrated_db_url, alert_eval_interval_s=3600))
    yield server
    server.stop()


PATHS = (
    "/",
    "/?sort=step&order=asc&project=p1",
    "/api/v1/runs",
    "/api/v1/runs?limit=5&sort=health",
    "/compare?run=run-0001&run=run-0002",
    "/alerts",
)


def test_a_page_of_runs_costs_the_same_statements_at_10_and_200_runs(quiet_server: LiveServer) -> None:
    _fill(quiet_server, 0, 10)
    with quiet_server.client() as client:
        client.get("/")  # (first requests fill caches: the rules, the tokens)
        small = {path: _cost(quiet_server, client, path) for path in PATHS}
        _fill(quiet_server, 10, 190)
        large = {path: _cost(quiet_server, client, path) for path in PATHS}
        assert len(client.get("/api/v1/runs").json()) == 100  # (the first page, as a client that does not page sees it)
    assert large == small
    assert max(small.values()) <= 8, small


def test_pages_follow_the_cursor_through_every_run_once_in_order(quiet_server: LiveServer) -> None:
    _fill(quiet_server, 0, 23)
    with quiet_server.client() as client:
        for sort, order in (
            ("started", "desc"),
            ("step", "asc"),
            ("name", "asc"),
            ("health", "desc"),
            ("project", "asc"),
        ):
            seen, url = [], f"/api/v1/runs?limit=7&sort={sort}&order={order}"
            while url:
                reply = client.get(url)
                assert reply.status_code == 200, reply.text
                seen += [r["id"] for r in reply.json()]
                assert len(reply.json()) <= 7
                url = reply.links.get("next", {}).get("url")
                if url:
                    assert reply.headers["x-next-cursor"] in url
            assert sorted(seen) == sorted(f"run-{i:04d}" for i in range(23)), (sort, seen)
            every = client.get(f"/api/v1/runs?limit=1000&sort={sort}&order={order}").json()
            assert seen == [r["id"] for r in every]  # the pages, joined, are the one long list
        assert client.get("/api/v1/runs?limit=7&sort=name&order=asc").headers.get("x-next-cursor")
        cursor = client.get("/api/v1/runs?limit=7").headers["x-next-cursor"]
        assert client.get(f"/api/v1/runs?limit=7&sort=name&cursor={cursor}").status_code == 400  # another sort's
        assert client.get("/api/v1/runs?cursor=garbage!").status_code == 400
        last = client.get("/api/v1/runs?limit=23")
        assert "x-next-cursor" not in last.headers and len(last.json()) == 23


def test_the_list_shows_the_vitals_kept_at_ingest(quiet_server: LiveServer) -> None:
    _fill(quiet_server, 0, 1)
    with quiet_server.app.state.sessions() as session:  # a later batch: a NaN scale, and steps 10..1509 skipped 1 in 10
        steps = list(range(10, 1510))
        skipped = {"steps": steps, "values": [float(s % 10 == 0) for s in steps]}
        batch = BatchIn(seq=2, points={"scale": {"steps": [10], "values": ["NaN"]}, "skipped": skipped})
        ingestion.ingest_batch(session, run_id="run-0000", batch=batch)
        late = BatchIn(seq=3, points={"scale": {"steps": [5], "values": [1.0]}})  # an older step: not the latest
        ingestion.ingest_batch(session, run_id="run-0000", batch=late)
    with quiet_server.client() as client:
        (run,) = client.get("/api/v1/runs").json()
        page = client.get("/").text
    assert run["scale"] == "NaN" and run["skip_rate"] == pytest.approx(0.1) and run["health"] == "critical"
    assert run["last_step"] == 1509 and run["firing_by_severity"] == {"critical": 1, "warning": 0, "info": 0}
    assert run["firing"] == 1 and '<td data-field="scale" class="num">NaN</td>' in page and "1 firing" in page
