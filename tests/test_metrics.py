"""`GET /metrics`: the Prometheus text format read with prometheus-client's own parser, from a real server (SQLite,
then Postgres) fed by a real watched torch loop; per-run gauges only while the run runs; open streams; the
read-token rule."""

from __future__ import annotations

import math
import threading
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cli_client import Loop

import ampwatch
from ampwatch.server import Settings, auth, create_app


def _scrape(client: httpx.Client, **headers: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    reply = client.get("/metrics", headers=headers)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def _run_value(samples: dict[Any, float], metric: str, run_id: str, **extra: str) -> float | None:
    for (sample, labels), value in samples.items():
        found = dict(labels)
        if sample == metric and found.get("run") == run_id and all(found.get(k) == v for k, v in extra.items()):
            return value
    return None


def test_metrics_show_ingest_health_and_gauges_of_running_runs_only(live_server, wait_for) -> None:
    http = live_server.client()
    run = ampwatch.init("vision", name="resnet", url=live_server.url)
    Loop(run).steps(range(30), nan_at=29)  # the last loss is NaN
    wait_for(lambda: http.get(f"/api/v1/runs/{run.id}").json().get("last_step") == 29, what="every step stored")
    wait_for(lambda: http.get("/api/v1/alerts", params={"state": "firing"}).json(), what="the NaN alert")
    assert run.flush()  # (all of the agent's points are in: the counts below move only by this test's own batches)
    series = http.get(f"/api/v1/runs/{run.id}/series", params={"name": ["scale", "skipped"]}).json()

    samples = _scrape(http)
    labels = {"project": "vision", "name": "resnet"}
    assert _run_value(samples, "ampwatch_run_last_step", run.id, **labels) == 29
    assert math.isnan(_run_value(samples, "ampwatch_run_loss", run.id))
    assert _run_value(samples, "ampwatch_run_loss_scale", run.id) == series["scale"]["values"][-1]
    skip_rate = sum(1 for v in series["skipped"]["values"] if v) / len(series["skipped"]["steps"])
    assert skip_rate > 0 and _run_value(samples, "ampwatch_run_skip_rate", run.id) == pytest.approx(skip_rate)
    assert _run_value(samples, "ampwatch_run_alerts_firing", run.id, severity="critical") == 1
    assert _run_value(samples, "ampwatch_run_alerts_firing", run.id, severity="warning") == 0
    assert samples[("ampwatch_runs", (("status", "running"),))] == 1

    stored = samples[("ampwatch_ingest_batches_total", (("outcome", "stored"),))]
    assert stored >= 2 and samples[("ampwatch_ingest_points_total", ())] >= 30 * 3  # loss, scale, skipped at least
    assert samples[("ampwatch_ingest_batch_seconds_count", ())] == stored
    assert samples[("ampwatch_ingest_batch_seconds_bucket", (("le", "+Inf"),))] == stored

    # A batch sent again is a duplicate; a malformed one is rejected (neither stores points).
    batch = {"seq": 10_000, "points": {"extra": {"steps": [1], "values": [1.0]}}}
    for _ in range(2):
        assert http.post(f"/api/v1/runs/{run.id}/batches", json=batch).status_code == 200
    assert http.post(f"/api/v1/runs/{run.id}/batches", json={"seq": 0}).status_code == 422
    again = _scrape(http)
    assert again[("ampwatch_ingest_batches_total", (("outcome", "duplicate"),))] == 1
    assert again[("ampwatch_ingest_batches_total", (("outcome", "rejected"),))] == 1
    assert again[("ampwatch_ingest_points_total", ())] == samples[("ampwatch_ingest_points_total", ())] + 1

    run.finish()
    ended = _scrape(http)
    assert _run_value(ended, "ampwatch_run_last_step", run.id) is None  # bounded cardinality: running runs only
    assert not [k for k in ended if k[0].startswith("ampwatch_run_")]
    assert ended[("ampwatch_runs", (("status", "finished"),))] == 1
    http.close()


def test_open_streams_are_counted_while_open(sqlite_server, wait_for) -> None:
    with ampwatch.init("p", name="streamed", url=sqlite_server.url) as run:
        Loop(run).steps(range(3))
    http = sqlite_server.client()
    streams = ("ampwatch_streams_open", (("stream", "run"),))
    assert _scrape(http)[streams] == 0
    opened, close = threading.Event(), threading.Event()

    def follow() -> None:
        with httpx.Client(base_url=sqlite_server.url, timeout=30) as sse:
            with sse.stream("GET", f"/api/v1/runs/{run.id}/stream") as reply:
                assert reply.status_code == 200
                opened.set()
                close.wait(30)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert opened.wait(15)
    assert _scrape(http)[streams] == 1
    close.set()
    reader.join(15)
    wait_for(lambda: _scrape(http)[streams] == 0, timeout_s=35, what="the stream counted as closed")
    http.close()


def test_metrics_need_a_read_token_once_tokens_exist(sqlite_server, monkeypatch) -> None:
    monkeypatch.setattr(sqlite_server.app.state.tokens, "refresh_s", 0.0)  # tokens re-read per request
    with sqlite_server.app.state.sessions() as session:
        read = auth.create_token(session, name="prometheus", role="read")
        ingest = auth.create_token(session, name="agent", role="ingest")
    with sqlite_server.client() as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {ingest}"}).status_code == 403
        assert ("ampwatch_runs", (("status", "running"),)) in _scrape(http, Authorization=f"Bearer {read}")


def test_each_app_has_its_own_registry(sqlite_server, tmp_path) -> None:
    other = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'other.db'}"))  # no duplicate-metric error
    assert other.state.metrics.registry is not sqlite_server.app.state.metrics.registry
    other.state.engine.dispose()
