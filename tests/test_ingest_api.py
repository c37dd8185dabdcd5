"""The ingest endpoints reject bad input with a clear 4xx and store nothing partial; re-sends store once."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re

import pytest

from ampwatch._protocol import BATCH_FORMAT, BATCH_FORMATS
from ampwatch._transport import HttpTransport, packed
from ampwatch.server import Settings
from ampwatch.server.values import downsample

GOOD = {"seq": 1, "points": {"loss": {"steps": [0, 1, 2], "values": [1.0, "NaN", 0.5]}}}


@pytest.fixture
def http(live_server):
    with live_server.client() as client:
        assert (
            client.put("/api/v1/runs/r1", json={"project": "p", "name": "run one", "config": {"lr": 0.1}}).status_code
            == 200
        )
        yield client


def _stored(http) -> tuple[dict, list]:
    return http.get("/api/v1/runs/r1/series").json(), http.get("/api/v1/runs/r1/events").json()


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"seq": 1, "points": {', 422, "JSON decode error"),
        ({"seq": "first"}, 422, "seq"),
        ({"seq": 1, "points": {"loss": {"steps": [0, 1], "values": [1.0, "lots"]}}}, 422, "values"),
        ({"seq": 1, "points": {"loss": {"steps": [0, 1], "values": [1.0]}}}, 422, "steps has 2 items but values has 1"),
        ({"seq": 1, "points": {"loss": {"steps": [-1], "values": [1.0]}}}, 422, "steps"),
        ({"seq": 0}, 422, "seq"),
        ({"seq": 1, "surprise": True}, 422, "surprise"),
        ({"seq": 1, "status": "exploded"}, 422, "status"),
        (
            {"seq": 1, "points": {"loss": {"steps": "not base64!", "values": [1.0]}}},
            422,
            "a packed series must be base64",
        ),
        ({"seq": 1, "points": {"loss": {"steps": [0], "values": "AAAA"}}}, 422, "8-byte numbers"),
        (
            {"seq": 1, "points": {"loss": {"steps": packed([-1], "q"), "values": [1.0]}}},
            422,
            "greater than or equal to 0",
        ),
        (
            {"seq": 1, "points": {"loss": {"steps": packed([0, 1], "q"), "values": packed([1.0], "d")}}},
            422,
            "steps has 2 items",
        ),
    ],
)
def test_bad_batches_get_a_clear_422_and_store_nothing(http, body, status: int, says: str) -> None:
    if isinstance(body, bytes):
        reply = http.post("/api/v1/runs/r1/batches", content=body, headers={"content-type": "application/json"})
    else:
        reply = http.post("/api/v1/runs/r1/batches", json=body)
    assert reply.status_code == status, reply.text
    assert says in reply.text
    assert _stored(http) == ({}, [])


def test_a_batch_with_good_points_and_one_bad_event_stores_nothing_partial(http) -> None:
    bad_event = {"step": 1, "type": "not_an_event_type", "severity": "critical", "message": "x"}
    reply = http.post("/api/v1/runs/r1/batches", json={**GOOD, "events": [bad_event]})
    assert reply.status_code == 422 and "type" in reply.text
    nan_details = (
        b'{"seq": 1, "events": [{"step": 1, "type": "nonfinite_loss", "severity": "critical", "message": "m", '
        b'"details": {"loss": NaN}}]}'
    )
    reply = http.post("/api/v1/runs/r1/batches", content=nan_details, headers={"content-type": "application/json"})
    assert reply.status_code == 422 and "non-finite numbers must be sent as the strings" in reply.text
    assert _stored(http) == ({}, [])


def test_packed_series_are_stored_exactly_beside_json_lists(http) -> None:
    """The agent sends steps and values as base64 of little-endian int64/float64: the values arrive exactly,
    NaN, infinities and subnormals included, and a batch may mix packed series with plain lists."""
    values = [0.1, math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308, 2**-24]
    steps = [0, 1, 2, 3, 4, 5, 6, 2**62]
    body = {
        "seq": 1,
        "points": {
            "loss": {"steps": packed(steps, "q"), "values": packed(values, "d")},
            "lr": {"steps": [0], "values": [0.5]},
        },
    }
    assert http.post("/api/v1/runs/r1/batches", json=body).json() == {"stored": True, "points": 9}
    series = _stored(http)[0]
    assert series["loss"]["steps"] == steps
    assert series["loss"]["values"] == [
        0.1,
        "NaN",
        "Infinity",
        "-Infinity",
        -0.0,
        5e-324,
        1.7976931348623157e308,
        2**-24,
    ]
    assert series["lr"] == {"steps": [0], "values": [0.5]}


def test_a_batch_for_an_unknown_run_gets_404_saying_how_to_register(http) -> None:
    reply = http.post("/api/v1/runs/nobody/batches", json=GOOD)
    assert reply.status_code == 404
    assert "PUT /api/v1/runs/nobody" in reply.json()["detail"]
    assert http.put("/api/v1/runs/bad id!", json={"project": "p", "name": "n"}).status_code == 422


def test_an_oversized_body_gets_413_before_parsing(live_server) -> None:
    assert live_server.app.state.settings.max_body_bytes  # the limit is wired from settings
    big = {"seq": 1, "points": {"x": {"steps": list(range(3_000_000)), "values": [0.5] * 3_000_000}}}
    with live_server.client() as http:
        http.put("/api/v1/runs/r1", json={"project": "p", "name": "n"})
        reply = http.post("/api/v1/runs/r1/batches", json=big)
        assert reply.status_code == 413
        assert "larger than the limit" in reply.json()["detail"]
        assert http.get("/api/v1/runs/r1/series").json() == {}


def test_a_resent_batch_is_stored_once(http) -> None:
    event = {"step": 1, "type": "nonfinite_loss", "severity": "critical", "message": "NaN loss"}
    first = http.post("/api/v1/runs/r1/batches", json={**GOOD, "events": [event]})
    again = http.post("/api/v1/runs/r1/batches", json={**GOOD, "events": [event]})
    assert again.json() == {"stored": False, "points": 0}
    series, events = _stored(http)
    assert series == {"loss": {"steps": [0, 1, 2], "values": [1.0, "NaN", 0.5]}}
    assert [e["message"] for e in events] == ["NaN loss"]
    # (a critical event: the reply names it, for agents that stop on one)
    critical = {"id": events[0]["id"], "step": 1, "rank": 0, "type": "nonfinite_loss", "message": "NaN loss"}
    assert first.json() == {"stored": True, "points": 3, "critical": critical}
    run = http.get("/api/v1/runs/r1").json()
    assert (run["health"], run["last_step"], run["series"]) == ("critical", 2, ["loss"])


def test_registering_a_run_twice_keeps_its_data(http) -> None:
    http.post("/api/v1/runs/r1/batches", json=GOOD)
    assert http.put("/api/v1/runs/r1", json={"project": "p", "name": "renamed"}).status_code == 200
    assert http.get("/api/v1/runs/r1").json()["name"] == "renamed"
    assert _stored(http)[0]["loss"]["steps"] == [0, 1, 2]


def test_read_api_filters_and_404s(http) -> None:
    http.put("/api/v1/runs/r2", json={"project": "other", "name": "two"})
    assert [r["id"] for r in http.get("/api/v1/runs", params={"project": "p"}).json()] == ["r1"]
    assert {r["id"] for r in http.get("/api/v1/runs").json()} == {"r1", "r2"}
    for path in ("/api/v1/runs/zzz", "/api/v1/runs/zzz/series", "/api/v1/runs/zzz/events"):
        assert http.get(path).status_code == 404
    assert http.get("/api/v1/alerts").json() == []
    assert http.get("/api/v1/alerts", params={"state": "exploded"}).status_code == 422
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/openapi.json").json()["info"]["title"] == "ampwatch"
    assert http.get("/docs").status_code == 200


def test_max_points_keeps_a_lone_nan_and_a_lone_spike(http) -> None:
    n = 10_000
    values: list = [1.0 + (i % 7) * 1e-3 for i in range(n)]
    values[3_333], values[7_777], values[9_001] = "NaN", 1e6, "-Infinity"
    http.post(
        "/api/v1/runs/r1/batches", json={"seq": 1, "points": {"loss": {"steps": list(range(n)), "values": values}}}
    )
    for max_points in (4, 50, 1000):
        got = http.get("/api/v1/runs/r1/series", params={"name": "loss", "max_points": max_points}).json()["loss"]
        kept = dict(zip(got["steps"], got["values"]))
        assert kept[3_333] == "NaN" and kept[7_777] == 1e6 and kept[9_001] == "-Infinity"
        assert len([v for v in got["values"] if not isinstance(v, str)]) <= max_points
        assert got["steps"] == sorted(got["steps"]) and got["steps"][0] == 0 and got["steps"][-1] == n - 1


def test_downsample_returns_short_series_unchanged_and_keeps_extremes() -> None:
    assert downsample([1, 2], [0.5, None], 10) == ([1, 2], [0.5, None])
    steps = list(range(100))
    values = [float(i % 10) for i in steps]
    values[42] = -50.0
    _, kept = downsample(steps, values, 10)
    assert -50.0 in kept and 9.0 in kept and len(kept) <= 10


def test_a_step_repeated_within_a_batch_keeps_its_last_value(http) -> None:
    batch = {"seq": 1, "points": {"x": {"steps": [0, 1, 1, 2, 1], "values": [1.0, 2.0, 3.0, 4.0, "NaN"]}}}
    assert http.post("/api/v1/runs/r1/batches", json=batch).status_code == 200
    assert _stored(http)[0] == {"x": {"steps": [0, 1, 2], "values": [1.0, "NaN", 4.0]}}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/api/v1/runs/r1/batches", {"seq": 1, "points": {"x": {"steps": [2**63], "values": [1.0]}}}),
        ("post", "/api/v1/runs/r1/batches", {"seq": 2**63}),
        ("post", "/api/v1/runs/r1/batches", {"seq": 1, "rank": 2**31}),
        (
            "post",
            "/api/v1/runs/r1/batches",
            {
                "seq": 1,
                "events": [{"step": 0, "type": "nonfinite_loss", "severity": "critical", "message": "m", "time": 1e20}],
            },
        ),
        ("get", "/api/v1/runs/r1/series?rank=100000000000000000000", None),
        ("get", "/api/v1/alerts/100000000000000000000", None),
        ("get", "/api/v1/alert-rules/99999999999", None),
    ],
)
def test_out_of_range_numbers_get_a_4xx_not_a_500(http, method: str, path: str, body) -> None:
    reply = http.post(path, json=body) if method == "post" else http.get(path)
    assert 400 <= reply.status_code < 500, (reply.status_code, reply.text)


def test_a_long_run_shows_its_newest_events(http) -> None:
    events = [{"step": i, "type": "skipped_step", "severity": "info", "message": f"skip {i}"} for i in range(1200)]
    events.append({"step": 1200, "type": "nonfinite_loss", "severity": "critical", "message": "the NaN that matters"})
    assert http.post("/api/v1/runs/r1/batches", json={"seq": 1, "events": events}).status_code == 200
    shown = http.get("/api/v1/runs/r1/events").json()
    assert shown[-1]["message"] == "the NaN that matters"
    assert [e["step"] for e in shown] == sorted(e["step"] for e in shown)


def test_setting_a_required_rule_field_to_null_gets_422(http) -> None:
    # Found by schemathesis: this was a NOT NULL violation, a 500.
    rule = http.get("/api/v1/alert-rules").json()[0]
    reply = http.patch(f"/api/v1/alert-rules/{rule['id']}", json={"severity": None})
    assert reply.status_code == 422 and "severity cannot be null" in reply.text
    assert http.get(f"/api/v1/alert-rules/{rule['id']}").json()["severity"] == rule["severity"]


def test_a_run_lists_the_ranks_that_sent_batches(http) -> None:
    assert http.get("/api/v1/runs/r1").json()["ranks"] == []
    for rank in (3, 0, 3, 1):
        http.post("/api/v1/runs/r1/batches", json={**GOOD, "rank": rank, "seq": 1 + rank})
    assert http.get("/api/v1/runs/r1").json()["ranks"] == [0, 1, 3]
    rank_3 = http.get("/api/v1/runs/r1/series", params={"name": "loss", "rank": 3}).json()["loss"]
    assert rank_3 == {"steps": [0, 1, 2], "values": [1.0, "NaN", 0.5]}


def test_a_batch_over_the_point_limit_gets_413_and_stores_nothing(live_server_factory, sqlite_url) -> None:
    server = live_server_factory(Settings(database_url=sqlite_url, max_batch_points=100))
    batch = {
        "seq": 1,
        "points": {
            "a": {"steps": list(range(60)), "values": [1.0] * 60},
            "b": {"steps": list(range(60)), "values": [2.0] * 60},
        },
    }
    with server.client() as http:
        http.put("/api/v1/runs/r1", json={"project": "p", "name": "n"}).raise_for_status()
        reply = http.post("/api/v1/runs/r1/batches", json=batch)
        assert reply.status_code == 413
        assert "120 points; the limit is 100" in reply.json()["detail"]
        assert http.get("/api/v1/runs/r1/series").json() == {}


def test_nul_characters_never_hold_up_a_run(http) -> None:
    # Postgres text cannot hold NUL: a batch it refused was a 500, retried by the agent forever, holding up the rest.
    reply = http.post("/api/v1/runs/r1/batches", json={"seq": 1, "points": {"a\x00b": {"steps": [0], "values": [1.0]}}})
    assert reply.status_code == 422 and "names cannot contain NUL characters" in reply.text
    assert http.put("/api/v1/runs/r2", json={"project": "p", "name": "n\x00"}).status_code == 422
    event = {
        "step": 3,
        "type": "run_crashed",
        "severity": "critical",
        "message": "bad\x00byte",
        "details": {"k\x00": ["v\x00"]},
    }
    assert http.post("/api/v1/runs/r1/batches", json={**GOOD, "events": [event]}).status_code == 200
    assert (
        http.put("/api/v1/runs/r1", json={"project": "p", "name": "run one", "config": {"path": "a\x00b"}}).status_code
        == 200
    )
    (stored,) = http.get("/api/v1/runs/r1/events").json()
    assert (stored["message"], stored["details"]) == ("bad\ufffdbyte", {"k\ufffd": ["v\ufffd"]})
    assert http.get("/api/v1/runs/r1").json()["config"] == {"path": "a\ufffdb"}
    assert http.get("/api/v1/runs/r1/series").json()["loss"]["steps"] == [0, 1, 2]


def test_a_batch_of_empty_series_stores_nothing_and_is_acknowledged(http) -> None:
    for seq, empty in enumerate(([], ""), start=1):  # (a list, and packed: SQLite answered 500 to both)
        reply = http.post(
            "/api/v1/runs/r1/batches", json={"seq": seq, "points": {"x": {"steps": empty, "values": empty}}}
        )
        assert reply.status_code == 200 and reply.json() == {"stored": True, "points": 0}, reply.text
    assert http.get("/api/v1/runs/r1/series").json() == {"x": {"steps": [], "values": []}}


def test_ranks_registering_one_run_at_once_all_get_200(http, live_server) -> None:
    # The project exists, so nothing made the ranks' transactions wait for each other: on Postgres, all but one
    # failed on the run's primary key (a 500, retried after a backoff).
    def register(run_id: str) -> int:
        with live_server.client() as client:
            return client.put(f"/api/v1/runs/{run_id}", json={"project": "p", "name": "ddp"}).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for round_ in range(5):
            codes = list(pool.map(register, [f"ddp{round_}"] * 8))
            assert codes == [200] * 8, codes
    assert sorted(
        r["id"] for r in http.get("/api/v1/runs", params={"project": "p"}).json() if r["id"].startswith("ddp")
    ) == [f"ddp{i}" for i in range(5)]


def test_a_run_keeps_its_project_when_registered_again_under_another(http) -> None:
    reply = http.put("/api/v1/runs/r1", json={"project": "other", "name": "run one"})
    assert reply.status_code == 200 and reply.json()["project"] == "p"
    assert http.get("/api/v1/runs/r1").json()["project"] == "p"
    assert http.get("/api/v1/runs", params={"project": "other"}).json() == []


def test_steps_up_to_the_largest_bigint_chart_downsampled(http) -> None:
    last = 2**63 - 1  # one past it overflowed the bucket bounds on Postgres (a 500)
    steps = list(range(last - 999, last + 1))
    points = {
        "loss": {"steps": steps, "values": [float(i % 7) for i in range(1000)]},
        "grad_norm/a": {"steps": steps, "values": [1.0] * 1000},
    }
    assert http.post("/api/v1/runs/r1/batches", json={"seq": 1, "points": points}).status_code == 200
    for max_points in (100, 10):
        reply = http.get("/api/v1/runs/r1/series", params={"name": "loss", "max_points": max_points})
        assert reply.status_code == 200, reply.text
        assert reply.json()["loss"]["steps"][-1] == last and max(reply.json()["loss"]["values"]) == 6.0
    grid = http.get("/api/v1/runs/r1/heatmap", params={"columns": 100})
    assert grid.status_code == 200 and grid.json()["layers"] == ["a"], grid.text


def test_a_batch_with_more_series_than_postgres_takes_parameters_is_stored(http) -> None:
    many = 66_000  # Postgres binds at most 65 535 parameters a statement: one per name was a 500
    points = {f"grad_norm/l.{i}": {"steps": [0], "values": [float(i)]} for i in range(many)}
    # (66 000 series in one batch: tens of seconds on a loaded 2-core machine, beyond the client's usual 30 s)
    reply = http.post("/api/v1/runs/r1/batches", json={"seq": 1, "points": points}, timeout=180)
    assert reply.status_code == 200 and reply.json()["points"] == many, reply.text
    last = http.get("/api/v1/runs/r1/series", params={"name": f"grad_norm/l.{many - 1}"}).json()
    assert last == {f"grad_norm/l.{many - 1}": {"steps": [0], "values": [float(many - 1)]}}


def test_every_event_of_a_long_run_can_be_paged_through(http) -> None:
    events = [{"step": i, "type": "skipped_step", "severity": "info", "message": f"skip {i}"} for i in range(1500)]
    assert http.post("/api/v1/runs/r1/batches", json={"seq": 1, "events": events}).status_code == 200
    assert len(http.get("/api/v1/runs/r1/events").json()) == 1000  # the newest, by default
    assert [e["step"] for e in http.get("/api/v1/runs/r1/events", params={"limit": 3}).json()] == [1497, 1498, 1499]
    seen, after = [], 0
    while page := http.get("/api/v1/runs/r1/events", params={"after_id": after, "limit": 400}).json():
        seen += [e["step"] for e in page]
        after = page[-1]["id"]
    assert seen == list(range(1500))


def test_runs_sort_by_health_by_severity_and_put_runs_without_steps_last_on_every_database(http) -> None:
    # (health sorted as text: critical < ok < warning; a run with no step came first on Postgres, last on SQLite)
    for name, health, step in (("a", "critical", 10), ("b", "ok", 500), ("c", "warning", 7), ("d", "ok", None)):
        http.put(f"/api/v1/runs/s-{name}", json={"project": "sorted", "name": name}).raise_for_status()
        if step is not None:
            events = (
                [{"step": step, "type": "grad_spike", "severity": health, "message": "m"}] if health != "ok" else []
            )
            body = {"seq": 1, "points": {"loss": {"steps": [step], "values": [1.0]}}, "events": events}
            http.post(f"/api/v1/runs/s-{name}/batches", json=body).raise_for_status()

    def order(sort: str, direction: str) -> list[str]:
        page = http.get("/", params={"project": "sorted", "sort": sort, "order": direction}).text
        return [run_id.removeprefix("s-") for run_id in re.findall(r'<tr data-run-id="([^"]+)"', page)]

    assert (order("health", "desc"), order("health", "asc")) == (["a", "c", "b", "d"], ["b", "d", "c", "a"])
    assert (order("step", "desc"), order("step", "asc")) == (["b", "a", "c", "d"], ["c", "a", "b", "d"])


@pytest.mark.parametrize("version", [None, BATCH_FORMAT])
def test_a_batch_without_a_format_or_with_the_current_one_is_stored(http, version) -> None:
    """A body without `format` is an older agent's (version 1); the current agent names its version."""
    body = GOOD if version is None else {**GOOD, "format": version}
    assert http.post("/api/v1/runs/r1/batches", json=body).json() == {"stored": True, "points": 3}
    assert _stored(http)[0]["loss"]["steps"] == [0, 1, 2]


@pytest.mark.parametrize("version", [max(BATCH_FORMATS) + 1, 0, "1", True, 1.0])
def test_a_batch_format_the_server_does_not_take_gets_a_422_naming_the_ones_it_takes(http, version) -> None:
    """A newer agent's format is refused as a whole, saying which versions this server takes, not stored in part
    (its fields may mean something else)."""
    reply = http.post("/api/v1/runs/r1/batches", json={**GOOD, "format": version, "novel": {}})
    assert reply.status_code == 422, reply.text
    (error,) = reply.json()["detail"]  # (said alone: not drowned in errors about fields it does not know)
    assert f"batch format {version!r} is not one this server takes" in error["msg"]
    assert f"it takes format {', '.join(map(str, BATCH_FORMATS))}" in error["msg"]
    assert _stored(http) == ({}, [])


def test_the_agent_names_its_batch_format(live_server) -> None:
    """Every batch the agent sends says its format version, and a real server stores it."""
    import ampwatch

    sent: list[dict] = []

    class Recording(HttpTransport):
        def send(self, method: str, path: str, body: bytes):
            if path.endswith("/batches"):
                sent.append(json.loads(body))
            return super().send(method, path, body)

    with ampwatch.init("p", "format", transport=Recording(live_server.url, None, 5.0)) as run:
        for step in range(3):
            run.log({"x": float(step)}, step=step)
        assert run.flush(30.0)
    assert sent and all(batch["format"] == BATCH_FORMAT for batch in sent)
    with live_server.client() as http:
        assert http.get(f"/api/v1/runs/{run.id}/series").json()["x"]["steps"] == [0, 1, 2]
