"""Postgres keeps each run's points in partitions of their own: deleting or pruning a run truncates and drops them
(no row-by-row delete of points), and migration 0007 moves an existing database's points into them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from alembic import command
from conftest import LiveServer, start_server
from sqlalchemy import Engine, event, text

from ampwatch.server import db, partitions
from ampwatch.server.settings import Settings


@pytest.fixture
def server(migrated_pg_url: str) -> Iterator[LiveServer]:
    live = start_server(Settings(database_url=migrated_pg_url, delete_chunk_rows=300))
    yield live
    live.stop()


def _send(client: httpx.Client, run_id: str, names: list[str], steps: int, seq: int = 1) -> None:
    client.put(f"/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).raise_for_status()
    points = {n: {"steps": list(range(steps)), "values": [float(s) for s in range(steps)]} for n in names}
    client.post(f"/api/v1/runs/{run_id}/batches", json={"seq": seq, "points": points}).raise_for_status()


def _partitions(engine: Engine) -> dict[str, int]:
    """Each partition of points, with its row count."""
    with engine.connect() as connection:
        tables = connection.scalars(
            text("SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = 'points'::regclass")
        ).all()
        return {t: connection.scalar(text(f"SELECT count(*) FROM {t}")) for t in tables}


def _run_partitions(engine: Engine, run_id: str) -> set[str]:
    """The partitions of its own a run has (not the legacy table)."""
    with engine.connect() as connection:
        ids = connection.scalars(text("SELECT id FROM series WHERE run_id = :r"), {"r": run_id}).all()
    return {partitions.name(i // partitions.SERIES_BLOCK) for i in ids} & set(_partitions(engine))


def test_each_run_has_its_own_partitions_and_deleting_it_truncates_and_drops_them(server: LiveServer) -> None:
    engine = server.app.state.engine
    many = [f"layer{i}/grad_norm" for i in range(300)]  # more series than one block holds: two partitions
    with server.client() as client:
        _send(client, "doomed", ["loss", *many], 20)
        _send(client, "kept", ["loss", "scale"], 50)
        _send(client, "doomed", ["late"], 5, seq=2)  # a series added later joins the run's last block
    doomed, kept = _run_partitions(engine, "doomed"), _run_partitions(engine, "kept")
    assert len(doomed) == 2 and len(kept) == 1 and not doomed & kept
    found = _partitions(engine)
    assert sum(found[t] for t in doomed) == 301 * 20 + 5 and {t: found[t] for t in kept} == {next(iter(kept)): 100}

    statements: list[str] = []

    def seen(_conn, _cursor, statement: str, *_: object) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(engine, "before_cursor_execute", seen)
    try:
        with server.client() as client:
            assert client.delete("/api/v1/runs/doomed").status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert any(s.startswith("TRUNCATE points_p") for s in statements)
    assert not [s for s in statements if s.startswith("DELETE FROM points ")], "points deleted row by row"
    assert set(_partitions(engine)) == kept  # the doomed run's partitions are gone, the kept run's whole
    assert _partitions(engine)[next(iter(kept))] == 100
    with engine.connect() as connection:
        assert (
            connection.scalar(text("SELECT count(*) FROM pg_class WHERE relname = ANY(:t)"), {"t": list(doomed)}) == 0
        )
    with server.client() as client:  # ingest of the kept run goes on, into its partition
        client.post("/api/v1/runs/kept/batches", json={"seq": 2, "points": {"loss": {"steps": [50], "values": [1.0]}}})
        assert len(client.get("/api/v1/runs/kept/series", params={"name": "loss"}).json()["loss"]["steps"]) == 51
    assert _partitions(engine)[next(iter(kept))] == 101


def test_prune_drops_the_runs_partitions_and_sweeps_those_a_failed_drop_left(server: LiveServer) -> None:
    engine = server.app.state.engine
    with server.client() as client:
        _send(client, "old", ["loss"], 10)
        _send(client, "new", ["loss"], 10)
    (old,) = _run_partitions(engine, "old")
    (new,) = _run_partitions(engine, "new")
    with engine.begin() as connection:
        connection.execute(text("UPDATE runs SET last_seen_at = now() - interval '200 days' WHERE id = 'old'"))
        block = connection.scalar(text(f"SELECT nextval('{partitions.BLOCK_SEQUENCE}')"))
        partitions.create(connection, block)  # as a delete whose drop never happened leaves it
    left = partitions.name(block)
    assert set(_partitions(engine)) == {old, new, left}
    admin = httpx.Client(base_url=server.url, timeout=30)
    reply = admin.post("/api/v1/runs/prune", json={"older_than_s": 90 * 86400})
    assert reply.status_code == 200 and [r["id"] for r in reply.json()["runs"]] == ["old"]
    assert _partitions(engine) == {new: 10}


def test_upgrading_from_0006_keeps_the_old_table_as_a_partition_until_its_last_run_is_gone(pg_url: str) -> None:
    engine = db.make_engine(pg_url)
    db.upgrade(engine, "0006")
    runs = {"a": ["loss", "scale", "skipped"], "b": ["loss", "grad_norm"], "c": []}
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', now())"))
        for run in runs:
            connection.execute(
                text(
                    "INSERT INTO runs (id, project_id, name, status, health, config, environment, created_at,"
                    " last_seen_at) VALUES (:r, 1, :r, 'running', 'ok', '{}', '{}', now(), now())"
                ),
                {"r": run},
            )
        # series ids interleaved between the runs, as runs ingesting side by side leave them
        order = [("a", "loss"), ("b", "loss"), ("a", "scale"), ("b", "grad_norm"), ("a", "skipped")]
        for i, (run, name) in enumerate(order, start=1):
            connection.execute(
                text("INSERT INTO series (id, run_id, name) VALUES (:i, :r, :n)"), {"i": i, "r": run, "n": name}
            )
            rows = [{"i": i, "k": k, "s": s, "v": None if s == 3 else s * i + k} for k in (0, 1) for s in range(100)]
            connection.execute(text("INSERT INTO points VALUES (:i, :k, :s, :v)"), rows)
            connection.execute(
                text("INSERT INTO point_blocks VALUES (:i, 0, 0, 0, 0.0, 99, :m, 99), (:i, 1, 0, 0, 1.0, 99, :m, 99)"),
                {"i": i, "m": 99.0 * i},
            )
    content = (
        "SELECT s.run_id, s.name, p.rank, p.step, p.value FROM points p JOIN series s ON s.id = p.series_id"
        " ORDER BY 1, 2, 3, 4"
    )
    rollups = (
        "SELECT s.run_id, s.name, b.rank, b.max_value FROM point_blocks b JOIN series s ON s.id = b.series_id"
        " ORDER BY 1, 2, 3"
    )
    with engine.connect() as connection:
        before, before_blocks = connection.execute(text(content)).all(), connection.execute(text(rollups)).all()
    assert len(before) == 5 * 200

    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text(content)).all() == before
        assert connection.execute(text(rollups)).all() == before_blocks
        assert connection.scalar(text("SELECT relkind FROM pg_class WHERE relname = 'points'")) == "p"
    assert _partitions(engine) == {partitions.LEGACY: 1000}  # the old table, as it was, a partition of points

    server = start_server(Settings(database_url=pg_url, delete_chunk_rows=50))
    try:
        with server.client() as client:  # an old run's new series and a new run's get partitions of their own
            _send(client, "a", ["lr"], 10)
            _send(client, "d", ["loss"], 10)
            series = client.get("/api/v1/runs/a/series", params={"name": ["loss", "lr"]}).json()
            assert series["loss"]["steps"] == list(range(100)) and series["loss"]["values"][3] == "NaN"
            assert series["lr"]["steps"] == list(range(10))
            a, d = _run_partitions(engine, "a"), _run_partitions(engine, "d")
            assert len(a) == len(d) == 1 and a != d
            assert _partitions(engine) == {partitions.LEGACY: 1000, next(iter(a)): 10, next(iter(d)): 10}
            assert client.delete("/api/v1/runs/b").status_code == 200  # row by row from the legacy table
            assert _partitions(engine) == {partitions.LEGACY: 600, next(iter(a)): 10, next(iter(d)): 10}
            with engine.begin() as connection:
                connection.execute(text("UPDATE runs SET last_seen_at = now() - interval '1 year' WHERE id = 'a'"))
            reply = client.post("/api/v1/runs/prune", json={"older_than_s": 86400})
            assert [r["id"] for r in reply.json()["runs"]] == ["a"]
    finally:
        server.stop()
    assert _partitions(engine) == {next(iter(d)): 10}  # the legacy table went with its last run

    with engine.begin() as connection:
        config = db.alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, "0006")
    with engine.connect() as connection:
        assert connection.scalar(text("SELECT relkind FROM pg_class WHERE relname = 'points'")) == "r"
        assert connection.scalar(text("SELECT count(*) FROM points")) == 10
    engine.dispose()
