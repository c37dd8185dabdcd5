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
def http(live_server):
    with live_server.client() as client:
        assert client.put("/api/v1/runs/r1", json={"project": "p", "name": "long"}).status_code == 200
        body = {"seq": 1, "points": {"loss": {"steps": list(range(N)), "values": _values()}}}
        assert client.post("/api/v1/runs/r1/batches", json=body).json()["stored"]
        yield client


def _get(http, **params: Any) -> dict[str, Any]:
    reply = http.get("/api/v1/runs/r1/series", params={"name": "loss", **params})
    assert reply.status_code == 200, reply.text
    return reply.json()["loss"]


def _finite(values: list[Any]) -> list[float]:
    return [v for v in values if not isinstance(v, str)]


def test_a_lone_nan_spike_dip_and_infinities_survive_any_max_points(http) -> None:
    truth = _values()
    for max_points in (4, 5, 7, 64, 999, 4_000, 19_999):
        got = _get(http, max_points=max_points)
        kept = dict(zip(got["steps"], got["values"]))
        assert (kept[NAN_AT], kept[SPIKE_AT], kept[DIP_AT]) == ("NaN", 1e6, -1e6), max_points
        assert (kept[INF_AT], kept[NINF_AT]) == ("Infinity", "-Infinity"), max_points
        assert len(_finite(got["values"])) <= max_points
        assert got["steps"] == sorted(set(got["steps"])) and got["steps"][0] == 0 and got["steps"][-1] == N - 1
        assert all(truth[s] == v for s, v in kept.items()), "every returned point is a real point"


def test_each_bucket_keeps_its_true_minimum_and_maximum(http) -> None:
    from ampwatch.server.models import BLOCK_STEPS

    max_points = 802  # buckets of 50 steps, narrower than a block: read from the points (rollups: the test below)
    assert -(-N // ((max_points - 2) // 2)) < BLOCK_STEPS
    got = _get(http, max_points=max_points)
    kept = dict(zip(got["steps"], got["values"]))
    width = -(-N // ((max_points - 2) // 2))
    truth = _values()
    for lo in range(0, N, width):
        bucket = [v for v in truth[lo : lo + width] if not isinstance(v, str)]
        shown = [kept[s] for s in range(lo, min(N, lo + width)) if s in kept and not isinstance(kept[s], str)]
        assert max(shown) == max(bucket) and min(shown) == min(bucket), lo


def test_a_zoomed_range_comes_back_at_full_resolution_and_only_that_range(http) -> None:
    got = _get(http, max_points=1_000, start_step=7_500, end_step=8_000)
    assert got["steps"] == list(range(7_500, 8_001))
    assert got["values"][SPIKE_AT - 7_500] == 1e6
    wider = _get(http, max_points=100, start_step=3_000, end_step=9_000)
    assert wider["steps"][0] == 3_000 and wider["steps"][-1] == 9_000
    assert {NAN_AT, SPIKE_AT} <= set(wider["steps"]) and DIP_AT not in wider["steps"]
    assert _get(http, start_step=N + 5) == {"steps": [], "values": []}


def test_a_bucket_whose_extreme_is_infinite_also_keeps_its_finite_extremes(http) -> None:
    got = _get(http, max_points=4, start_step=14_000, end_step=16_000)  # one bucket, from -Infinity to +Infinity
    assert {"Infinity", "-Infinity"} <= set(got["values"])
    finite = _finite(got["values"])
    truth = [v for v in _values()[14_000:16_001] if not isinstance(v, str)]
    assert max(finite) == max(truth) and min(finite) == min(truth) and len(finite) <= 4


def test_a_sparse_series_comes_back_whole(http) -> None:
    steps = list(range(0, 1_000_000, 5_000))
    http.post(
        "/api/v1/runs/r1/batches", json={"seq": 2, "points": {"lr": {"steps": steps, "values": [0.5] * len(steps)}}}
    )
    got = http.get("/api/v1/runs/r1/series", params={"name": "lr", "max_points": 1_000}).json()["lr"]
    assert got["steps"] == steps


def test_a_sparse_series_with_a_dense_burst_comes_back_whole_when_its_points_fit(http) -> None:
    # (a layer norm every 100 steps, and every step while the NaN probe was armed: the span of steps, not the
    # number of points, was held against max_points, so the burst came back thinned, zoomed in or not)
    steps = sorted(set(range(0, 100_001, 100)) | set(range(50_000, 50_200)))
    values = [1.0 + (s % 7) / 10 for s in steps]
    http.post(
        "/api/v1/runs/r1/batches", json={"seq": 2, "points": {"grad_norm/l.0": {"steps": steps, "values": values}}}
    )
    for zoom in ({}, {"start_step": 40_000, "end_step": 60_000}):
        got = http.get("/api/v1/runs/r1/series", params={"name": "grad_norm/l.0", "max_points": 2_000, **zoom}).json()
        lo, hi = zoom.get("start_step", 0), zoom.get("end_step", 100_000)
        assert got["grad_norm/l.0"]["steps"] == [s for s in steps if lo <= s <= hi], zoom


def test_the_heatmap_puts_layers_in_model_order_with_bucket_maxima_and_nan_cells(http) -> None:
    layers = ["blocks.10.mlp", "blocks.2.mlp", "embed"]
    points = {
        f"grad_norm/{m}": {"steps": list(range(0, 100, 5)), "values": [float(i) for i in range(20)]} for m in layers
    }
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
    assert (zoomed["steps"], zoomed["values"][0]) == (
        list(range(30, 41)),
        [6.0, None, None, None, None, "NaN", None, None, None, None, 8.0],
    )


def test_a_long_range_read_in_two_halves_at_once_gives_the_same_points(http, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampwatch.server import series

    whole = [_get(http, max_points=m) for m in (4, 101, 2_000)]
    monkeypatch.setattr(series, "PARALLEL_STEPS", 1_000)  # the server runs in this process
    assert [_get(http, max_points=m) for m in (4, 101, 2_000)] == whole


def test_a_coarse_chart_read_from_block_rollups_keeps_every_bucket_true_extremes(http) -> None:
    from ampwatch.server.models import BLOCK_STEPS
    from ampwatch.server.series import block_buckets

    truth = _values()
    for max_points, start, end in ((42, 0, N - 1), (30, 1_001, 17_777), (9, 127, 12_800)):
        buckets = (max_points - 2) // 2
        assert -(-(end - start + 1) // buckets) >= BLOCK_STEPS, "this case is charted from the rollups"
        got = _get(http, max_points=max_points, start_step=start, end_step=end)
        kept = dict(zip(got["steps"], got["values"]))
        assert (got["steps"][0], got["steps"][-1]) == (start, end) and len(_finite(got["values"])) <= max_points
        assert all(truth[s] == v for s, v in kept.items()), "every returned point is a real point"
        assert {s for s in range(start, end + 1) if isinstance(truth[s], str)} <= set(kept), (
            "every non-finite point is kept"
        )
        edges = block_buckets(start, end, buckets)
        assert edges[0][0] == start and edges[-1][1] == end and len(edges) <= buckets
        assert all(b[0] == a[1] + 1 for a, b in zip(edges, edges[1:])), "the buckets tile the range"
        for lo, hi in edges:
            bucket = [v for v in truth[lo : hi + 1] if not isinstance(v, str)]
            shown = [kept[s] for s in range(lo, hi + 1) if s in kept and not isinstance(kept[s], str)]
            assert max(shown) == max(bucket) and min(shown) == min(bucket), (max_points, lo, hi)


def _blocks_now(live_server, series_name: str) -> dict[int, tuple[Any, ...]]:
    from sqlalchemy import text

    with live_server.app.state.sessions() as session:
        rows = session.execute(
            text(
                "SELECT b.block, b.min_step, b.min_value, b.max_step, b.max_value, b.last_step FROM point_blocks b"
                " JOIN series s ON s.id = b.series_id WHERE s.name = :name AND b.rank = 0"
            ),
            {"name": series_name},
        ).all()
    return {r[0]: tuple(r[1:]) for r in rows}


def _blocks_of(points: dict[int, Any]) -> dict[int, tuple[Any, ...]]:
    """The rollups the points call for: per block of finite values, (min step, min, max step, max, last step)."""
    from ampwatch.server.models import BLOCK_STEPS

    out: dict[int, tuple[Any, ...]] = {}
    for block in sorted({s // BLOCK_STEPS for s in points}):
        finite = [(v, s) for s, v in points.items() if s // BLOCK_STEPS == block and not isinstance(v, str)]
        if finite:
            low, high = min(finite), min(finite, key=lambda p: (-p[0], p[1]))
            out[block] = (low[1], low[0], high[1], high[0], max(s for _, s in finite))
    return out


def test_rollups_stay_exact_through_out_of_order_replayed_and_overwriting_batches(live_server) -> None:
    rng = random.Random(7)
    truth: dict[int, Any] = {}
    with live_server.client() as http:
        http.put("/api/v1/runs/r2", json={"project": "p", "name": "messy"})
        chunks = [list(range(a, min(a + 300, 4_000))) for a in range(0, 4_000, 300)]
        rng.shuffle(chunks)  # out of order: later steps first, then the gaps before them
        seq = 0
        for steps in chunks:
            values: list[Any] = [round(rng.random(), 6) for _ in steps]
            if 1_000 in steps:
                values[steps.index(1_000)] = 500.0  # a spike...
            if 2_050 in steps:
                values[steps.index(2_050)] = "Infinity"
            seq += 1
            body = {"seq": seq, "points": {"gn": {"steps": steps, "values": values}}}
            assert http.post("/api/v1/runs/r2/batches", json=body).json()["stored"]
            assert not http.post("/api/v1/runs/r2/batches", json=body).json()["stored"], "a replay is not stored again"
            truth.update(zip(steps, values))
        overwrite = {1_000: 0.25, 1_001: "NaN", 2_050: 0.5, 3_999: -3.0, 3_998: 0.1}  # the spike is taken back
        body = {
            "seq": seq + 1,
            "points": {"gn": {"steps": list(overwrite) + [2_050], "values": list(overwrite.values()) + [0.75]}},
        }
        assert http.post("/api/v1/runs/r2/batches", json=body).json()["stored"]
        truth.update(overwrite)
        truth[2_050] = 0.75  # a step given twice in one batch keeps its last value
        all_nan = {"seq": seq + 2, "points": {"gn": {"steps": list(range(4_096, 4_224)), "values": ["NaN"] * 128}}}
        assert http.post("/api/v1/runs/r2/batches", json=all_nan).json()["stored"]
        truth.update(dict.fromkeys(range(4_096, 4_224), "NaN"))
        assert _blocks_now(live_server, "gn") == _blocks_of(truth)
        got = http.get("/api/v1/runs/r2/series", params={"name": "gn", "max_points": 12}).json()["gn"]
    assert 500.0 not in got["values"], "a replaced spike is gone from the chart"
    finite = [v for v in truth.values() if not isinstance(v, str)]
    assert max(finite) in got["values"] and min(finite) == -3.0 and -3.0 in got["values"]
    assert got["values"].count("NaN") == 129  # 1_001 and the all-NaN block


def test_a_coarse_heatmap_is_read_from_the_rollups_in_whole_blocks(http) -> None:
    from ampwatch.server.models import BLOCK_STEPS

    rng = random.Random(3)
    steps = list(range(0, 2_560, 5))  # every 5 steps, as the agent records per-layer norms every N steps
    truth = {m: [round(rng.lognormvariate(0, 1), 6) for _ in steps] for m in ("a", "b")}
    truth["a"][40], truth["b"][300], truth["b"][301] = "NaN", "Infinity", 1e9  # steps 200, 1500, 1505
    points = {f"grad_norm/{m}": {"steps": steps, "values": v} for m, v in truth.items()}
    assert http.post("/api/v1/runs/r1/batches", json={"seq": 9, "points": points}).json()["stored"]
    for params in ({"columns": 5}, {"columns": 2, "start_step": 300, "end_step": 1_500}):
        grid = http.get("/api/v1/runs/r1/heatmap", params=params).json()
        width, first = grid["width"], grid["steps"][0]
        assert width % BLOCK_STEPS == 0 and first % BLOCK_STEPS == 0 and first <= params.get("start_step", 0)
        assert grid["steps"] == list(range(first, first + width * len(grid["steps"]), width))
        assert grid["steps"][-1] + width > params.get("end_step", 2_555), "the cells cover the range"
        for row, m in zip(grid["values"], ("a", "b")):
            for k, cell in enumerate(row):
                inside = [v for s, v in zip(steps, truth[m]) if first + k * width <= s < first + (k + 1) * width]
                bad = [v for v in inside if isinstance(v, str)]
                assert cell == (bad[0] if bad else max(inside)), (params, m, k)
