"""Server-side downsampling and zoom of `GET /runs/{id}/series`, and the layer heatmap, on SQLite and Postgres."""

from __future__ import annotations

import random
from typing import Any

import pytest

N = 20_000
NAN_AT, SPIKE_AT, DIP_AT, INF_AT, NINF_AT = 3_333, 7_777, 12_345, 15_000, 15_001


def _values() -> list[Any]:
    rng = random.Random(5)
    values: list[Any] = [1.0 + rng.random() * 1e-3 for _ in range(N)]
    values[NAN_AT], values[SPIKE_AT], values[DIP_AT] = "NaN", 1e6, -1e6
    values[INF_AT], values[NINF_AT] = "Infinity", "-Infinity"
    return values


@pytest.fixture
def http(live_server):  # type: ignore[no-untyped-def]
    with live_server.client() as client:
        assert client.put("/api/v1/runs/r1", json={"project": "p", "name": "long"}).status_code == 200
        body = {"seq": 1, "points": {"loss": {"steps": list(range(N)), "values": _values()}}}
        assert client.post("/api/v1/runs/r1/batches", json=body).json()["stored"]
        yield client


def _get(http, **params: Any) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    reply = http.get("/api/v1/runs/r1/series", params={"name": "loss", **params})
    assert reply.status_code == 200, reply.text
    return reply.json()["loss"]


def _finite(values: list[Any]) -> list[float]:
    return [v for v in values if not isinstance(v, str)]


def test_a_lone_nan_spike_dip_and_infinities_survive_any_max_points(http) -> None:  # type: ignore[no-untyped-def]
    truth = _values()
    for max_points in (4, 5, 7, 64, 999, 4_000, 19_999):
        got = _get(http, max_points=max_points)
        kept = dict(zip(got["steps"], got["values"]))
        assert (kept[NAN_AT], kept[SPIKE_AT], kept[DIP_AT]) == ("NaN", 1e6, -1e6), max_points
        assert (kept[INF_AT], kept[NINF_AT]) == ("Infinity", "-Infinity"), max_points
        assert len(_finite(got["values"])) <= max_points
        assert got["steps"] == sorted(set(got["steps"])) and got["steps"][0] == 0 and got["steps"][-1] == N - 1
        assert all(truth[s] == v for s, v in kept.items()), "every returned point is a real point"


def test_each_bucket_keeps_its_true_minimum_and_maximum(http) -> None:  # type: ignore[no-untyped-def]
    max_points = 402
    got = _get(http, max_points=max_points)
    kept = dict(zip(got["steps"], got["values"]))
    width = -(-N // ((max_points - 2) // 2))
    truth = _values()
    for lo in range(0, N, width):
        bucket = [v for v in truth[lo : lo + width] if not isinstance(v, str)]
        shown = [kept[s] for s in range(lo, min(N, lo + width)) if s in kept and not isinstance(kept[s], str)]
        assert max(shown) == max(bucket) and min(shown) == min(bucket), lo


def test_a_zoomed_range_comes_back_at_full_resolution_and_only_that_range(http) -> None:  # type: ignore[no-untyped-def]
    got = _get(http, max_points=1_000, start_step=7_500, end_step=8_000)
    assert got["steps"] == list(range(7_500, 8_001))
    assert got["values"][SPIKE_AT - 7_500] == 1e6
    wider = _get(http, max_points=100, start_step=3_000, end_step=9_000)
    assert wider["steps"][0] == 3_000 and wider["steps"][-1] == 9_000
    assert {NAN_AT, SPIKE_AT} <= set(wider["steps"]) and DIP_AT not in wider["steps"]
    assert _get(http, start_step=N + 5) == {"steps": [], "values": []}


def test_a_bucket_whose_extreme_is_infinite_also_keeps_its_finite_extremes(http) -> None:  # type: ignore[no-untyped-def]
    got = _get(http, max_points=4, start_step=14_000, end_step=16_000)  # one bucket, from -Infinity to +Infinity
    assert {"Infinity", "-Infinity"} <= set(got["values"])
    finite = _finite(got["values"])
    truth = [v for v in _values()[14_000:16_001] if not isinstance(v, str)]
    assert max(finite) == max(truth) and min(finite) == min(truth) and len(finite) <= 4


def test_a_sparse_series_comes_back_whole(http) -> None:  # type: ignore[no-untyped-def]
    steps = list(range(0, 1_000_000, 5_000))
    http.post("/api/v1/runs/r1/batches", json={"seq": 2, "points": {"lr": {"steps": steps, "values": [0.5] * len(steps)}}})
    got = http.get("/api/v1/runs/r1/series", params={"name": "lr", "max_points": 1_000}).json()["lr"]
    assert got["steps"] == steps


def test_the_heatmap_puts_layers_in_model_order_with_bucket_maxima_and_nan_cells(http) -> None:  # type: ignore[no-untyped-def]
    layers = ["blocks.10.mlp", "blocks.2.mlp", "embed"]
    points = {f"grad_norm/{m}": {"steps": list(range(0, 100, 5)), "values": [float(i) for i in range(20)]} for m in layers}
    points["grad_norm/blocks.2.mlp"]["values"][7] = "NaN"  # step 35
    points["grad_norm/embed"]["values"][19] = "Infinity"  # step 95
    http.post("/api/v1/runs/r1/batches", json={"seq": 3, "points": points})
    grid = http.get("/api/v1/runs/r1/heatmap", params={"columns": 10}).json()
    assert grid["layers"] == ["blocks.2.mlp", "blocks.10.mlp", "embed"]
    assert (grid["steps"], grid["width"]) == (list(range(0, 100, 10)), 10)
    assert grid["values"][1] == [float(i) for i in range(1, 20, 2)]
    assert grid["values"][0][3] == "NaN" and grid["values"][0][2] == 5.0
    assert grid["values"][2][9] == "Infinity"
    zoomed = http.get("/api/v1/runs/r1/heatmap", params={"columns": 100, "start_step": 30, "end_step": 40}).json()
    assert (zoomed["steps"], zoomed["values"][0]) == (list(range(30, 41)), [6.0, None, None, None, None, "NaN", None, None, None, None, 8.0])


def test_a_long_range_read_in_two_halves_at_once_gives_the_same_points(http, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from ampwatch.server import series

    whole = [_get(http, max_points=m) for m in (4, 101, 2_000)]
    monkeypatch.setattr(series, "PARALLEL_STEPS", 1_000)  # the server runs in this process
    assert [_get(http, max_points=m) for m in (4, 101, 2_000)] == whole
