"""Deleting a run and pruning old runs: admins only, everything of the run goes, other runs stay whole."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest
from conftest import LiveServer, start_server
from sqlalchemy import text

from ampwatch.server import auth, db
from ampwatch.server.settings import Settings

OWNED = {  # every table holding rows of a run, and how to count them
    "runs": "SELECT count(*) FROM runs WHERE id = :r",
    "series": "SELECT count(*) FROM series WHERE run_id = :r",
    "points": "SELECT count(*) FROM points JOIN series ON series.id = points.series_id WHERE series.run_id = :r",
    "point_blocks": "SELECT count(*) FROM point_blocks JOIN series ON series.id = series_id WHERE series.run_id = :r",
    "point_feed": "SELECT count(*) FROM point_feed WHERE run_id = :r",
    "events": "SELECT count(*) FROM events WHERE run_id = :r",
    "batches": "SELECT count(*) FROM batches WHERE run_id = :r",
    "alerts": "SELECT count(*) FROM alerts WHERE run_id = :r",
    "alert_flips": "SELECT count(*) FROM alert_flips JOIN alerts ON alerts.id = alert_id WHERE alerts.run_id = :r",
    "run_liveness": "SELECT count(*) FROM run_liveness WHERE run_id = :r",
}


@pytest.fixture
def guarded(migrated_db_url: str) -> Iterator[tuple[LiveServer, dict[str, str]]]:
    """A server with an admin, a read and an ingest token (made before it starts: it reads them at once)."""
    engine = db.make_engine(migrated_db_url)
    with db.session_factory(engine)() as session:
        tokens = {role: auth.create_token(session, name=role, role=role) for role in auth.ROLES}
    engine.dispose()
    # (a run goes in many transactions)
    server = start_server(Settings(database_url=migrated_db_url, delete_chunk_rows=300))
    yield server, tokens
    server.stop()


def _client(server: LiveServer, token: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {token}"})


def _send(agent: httpx.Client, run_id: str, project: str, steps: int) -> None:
    """A run of `steps` steps on two ranks, with a NaN loss (a firing alert) and events, in several batches."""
    agent.put(f"/api/v1/runs/{run_id}", json={"project": project, "name": run_id}).raise_for_status()
    for rank in (0, 1):
        for seq, first in enumerate(range(0, steps, 500), start=1):
            span = list(range(first, min(first + 500, steps)))
            loss = [math.nan if s == 7 else 1.0 / (s + 1) for s in span]
            events = (
                [{"step": 7, "type": "nonfinite_loss", "severity": "critical", "message": "NaN"}] if first == 0 else []
            )
            body = {
                "seq": seq,
                "rank": rank,
                "events": events,
                "points": {
                    "loss": {"steps": span, "values": [str(v) if math.isnan(v) else v for v in loss]},
                    "scale": {"steps": span, "values": [65536.0] * len(span)},
                },
            }
            agent.post(f"/api/v1/runs/{run_id}/batches", json=body).raise_for_status()


def _owned(server: LiveServer, run_id: str) -> dict[str, int]:
    with server.app.state.engine.connect() as connection:
        return {table: connection.scalar(text(sql), {"r": run_id}) for table, sql in OWNED.items()}


def test_an_admin_deletes_a_run_and_all_it_has_in_chunks_and_other_runs_stay(
    guarded: tuple[LiveServer, dict[str, str]], wait_for
) -> None:
    server, tokens = guarded
    with _client(server, tokens["ingest"]) as agent:
        _send(agent, "doomed", "p", 2000)
        _send(agent, "kept", "p", 600)
    wait_for(lambda: _owned(server, "doomed")["alerts"] >= 1, what="the NaN alert")
    before_kept = _owned(server, "kept")
    assert all(_owned(server, "doomed").values()), _owned(server, "doomed")
    for role in ("read", "ingest"):
        with _client(server, tokens[role]) as client:
            assert client.delete("/api/v1/runs/doomed").status_code == 403
    with _client(server, tokens["admin"]) as admin:
        reply = admin.delete("/api/v1/runs/doomed")
        assert reply.status_code == 200, reply.text
        (gone,) = reply.json()["runs"]
        assert reply.json()["deleted"] is True and gone["id"] == "doomed" and gone["project"] == "p"
        assert set(gone) == {"id", "project", "name", "created_at"}
        assert admin.get("/api/v1/runs/doomed").status_code == 404
        assert admin.delete("/api/v1/runs/doomed").status_code == 404
        assert [r["id"] for r in admin.get("/api/v1/runs").json()] == ["kept"]
    assert set(_owned(server, "doomed").values()) == {0}
    # (the background evaluator may still add alerts to the kept run: its data is what must be untouched)
    data = ("runs", "series", "points", "point_blocks", "point_feed", "events", "batches")
    assert {t: _owned(server, "kept")[t] for t in data} == {t: before_kept[t] for t in data}
    assert _owned(server, "kept")["alerts"] >= 1
    with _client(server, tokens["ingest"]) as agent:  # the deleted run's agent, still sending: told it is gone
        body = {"seq": 99, "points": {"loss": {"steps": [1], "values": [1.0]}}}
        assert agent.post("/api/v1/runs/doomed/batches", json=body).status_code == 404


def test_prune_removes_runs_not_heard_from_for_long_by_project_and_a_dry_run_removes_nothing(
    guarded: tuple[LiveServer, dict[str, str]],
) -> None:
    server, tokens = guarded
    with _client(server, tokens["ingest"]) as agent:
        for run_id, project in (("old-a", "a"), ("old-b", "b"), ("new-a", "a")):
            _send(agent, run_id, project, 10)
    with server.app.state.engine.begin() as connection:  # two runs last heard from 100 days ago
        stamp = db.now().replace(year=db.now().year - 1)
        connection.execute(text("UPDATE runs SET last_seen_at = :t WHERE id LIKE 'old-%'"), {"t": stamp})
    with _client(server, tokens["admin"]) as admin:

        def prune(**body: object) -> dict:
            reply = admin.post("/api/v1/runs/prune", json={"older_than_s": 90 * 86400, **body})
            assert reply.status_code == 200, reply.text
            return reply.json()

        dry = prune(dry_run=True)
        assert dry["deleted"] is False and sorted(r["id"] for r in dry["runs"]) == ["old-a", "old-b"]
        assert len(admin.get("/api/v1/runs").json()) == 3
        done = prune(project="a")
        assert done["deleted"] is True and [r["id"] for r in done["runs"]] == ["old-a"]
        assert done["runs"][0]["project"] == "a" and done["runs"][0]["name"] == "old-a"
        assert sorted(r["id"] for r in admin.get("/api/v1/runs").json()) == ["new-a", "old-b"]
        assert [r["id"] for r in prune(project=None)["runs"]] == ["old-b"]
        assert prune() == {"runs": [], "deleted": True}
        assert admin.post("/api/v1/runs/prune", json={"older_than_s": -1}).status_code == 422
    with _client(server, tokens["read"]) as reader:
        assert reader.post("/api/v1/runs/prune", json={"older_than_s": 0, "dry_run": True}).status_code == 403
    assert set(_owned(server, "old-a").values()) == {0}


def test_the_delete_button_is_for_admins_and_only_from_the_dashboard_itself(
    guarded: tuple[LiveServer, dict[str, str]],
) -> None:
    server, tokens = guarded
    with _client(server, tokens["ingest"]) as agent:
        _send(agent, "r1", "p", 10)
    with _client(server, tokens["read"]) as reader:
        assert "delete-run" not in reader.get("/runs/r1").text
        assert reader.post("/runs/r1/delete").status_code == 403
    with _client(server, tokens["admin"]) as admin:
        assert 'action="/runs/r1/delete"' in admin.get("/runs/r1").text
        assert admin.post("/runs/r1/delete", headers={"Origin": "https://evil.example"}).status_code == 403
        reply = admin.post("/runs/r1/delete", headers={"Origin": server.url, "Sec-Fetch-Site": "same-origin"})
        assert reply.status_code == 303 and reply.headers["location"].startswith("/?project=p&msg=deleted")
        assert admin.get("/api/v1/runs/r1").status_code == 404
        assert "deleted run r1" in admin.get(reply.headers["location"]).text
