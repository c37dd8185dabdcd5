"""The dashboard live, in a real headless Chromium: points and rows arriving over SSE, zooming at full
resolution, the rank picker, compare, and hostile names rendered inert."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlencode

import _browser as ui
import httpx


def test_grad_spike_events_are_star_markers_on_the_grad_norm_chart_also_when_they_arrive_live(
    sqlite_server: Any, page: Any
) -> None:
    url = sqlite_server.url
    ui.register(url, "spiky-1", "spikes", "grad spikes")
    norms = [1.0] * 20
    norms[12] = 40.0
    spike = {"step": 12, "type": "grad_spike", "severity": "warning", "message": "grad norm 40x its median"}
    ui.post(url, "spiky-1", 1, {"grad_norm": {"steps": list(range(20)), "values": norms}}, [spike])
    ui.open_run(page, url, "spiky-1")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    stars = [t for t in ui.chart(page, "chart-grad_norm")["traces"] if t["name"] == "spike"]
    assert [(t["x"], t["y"]) for t in stars] == [([12], [40.0])], stars
    assert (
        page.evaluate("document.getElementById('chart-grad_norm').data.find((t) => t.name === 'spike').marker.symbol")
        == "star"
    )
    late = {"step": 25, "type": "grad_spike", "severity": "warning", "message": "grad norm 30x its median"}
    more = list(range(20, 30))
    ui.post(
        url, "spiky-1", 2, {"grad_norm": {"steps": more, "values": [30.0 if s == 25 else 1.0 for s in more]}}, [late]
    )
    page.wait_for_function(
        "document.getElementById('chart-grad_norm').data.some((t) => t.name === 'spike' && t.x.length === 2)",
        timeout=10_000,
    )
    ui.shot(page, "run-grad-spikes.png", "#chart-grad_norm")
    [star] = [t for t in ui.chart(page, "chart-grad_norm")["traces"] if t["name"] == "spike"]
    assert (star["x"], star["y"]) == ([12, 25], [40.0, 30.0])
    assert "spike" in ui.chart(page, "chart-grad_norm")["legend"]


def test_zooming_one_chart_zooms_all_and_reads_the_range_at_full_resolution(sqlite_server: Any, page: Any) -> None:
    url, n = sqlite_server.url, 20_000
    ui.register(url, "long-1", "long", "twenty thousand steps")
    steps = list(range(n))
    ui.post(
        url,
        "long-1",
        1,
        {
            "loss": {"steps": steps, "values": [1.0 + (s % 97) / 97 for s in steps]},
            "lr": {"steps": steps, "values": [1e-3] * n},
        },
    )
    ui.open_run(page, url, "long-1")
    assert ui.chart(page, "chart-loss")["points"] <= 2000
    page.evaluate("Plotly.relayout(document.getElementById('chart-loss'), {'xaxis.range': [12000, 12100]})")
    page.wait_for_function(
        "Number(document.getElementById('chart-lr').dataset.points) > 100 && "
        "Number(document.getElementById('chart-lr').dataset.points) < 400",
        timeout=10_000,
    )
    for chart_id in ("chart-loss", "chart-lr"):
        chart = ui.chart(page, chart_id)
        assert chart["range"] == [12000, 12100], chart_id
        assert set(range(12000, 12101)) <= set(chart["traces"][0]["x"]), (
            f"{chart_id}: the zoomed range at full resolution"
        )
    page.evaluate("Plotly.relayout(document.getElementById('chart-lr'), {'xaxis.autorange': true})")
    page.wait_for_function(
        "Number(document.getElementById('chart-loss').dataset.points) > 1000 && "
        "Number(document.getElementById('charts').dataset.view.split(',')[1]) > 19000",
        timeout=10_000,
    )


def test_point_sent_after_the_page_opened_arrives_over_sse_without_reload(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "live-1", "live", "streaming")
    ui.post(url, "live-1", 1, {"loss": {"steps": [0, 1], "values": [1.0, "NaN"]}})
    ui.open_run(page, url, "live-1")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    assert (ui.chart(page, "chart-loss")["points"], ui.chart(page, "chart-loss")["nonfinite"]) == (2, 1)
    page.evaluate("window.__same_document = true")
    reads = len([u for u in page.requests if "/series" in u])
    sent = time.monotonic()
    event = {"step": 3, "type": "loss_spike", "severity": "warning", "message": "loss 5x its median"}
    ui.post(
        url,
        "live-1",
        2,
        {"loss": {"steps": [2, 3], "values": [0.5, "Infinity"]}, "lr": {"steps": [2, 3], "values": [0.1, 0.1]}},
        [event],
    )
    page.wait_for_function("document.getElementById('chart-loss').dataset.points === '4'", timeout=10_000)
    latency_s = time.monotonic() - sent
    page.wait_for_selector("#timeline li.ev[data-step='3']", timeout=5_000)
    ui.shot(page, "run-live.png")
    chart = ui.chart(page, "chart-loss")
    assert page.evaluate("window.__same_document") is True
    assert len([u for u in page.requests if "/series" in u]) == reads, "the point came over the stream, not a re-read"
    assert chart["traces"][0]["x"] == [0, 1, 2, 3] and chart["nonfinite"] == 2
    assert {t["name"] for t in chart["traces"] if t["meta"] == "nonfinite"} == {"NaN", "+Inf"}
    assert page.locator("#run-step").inner_text() == "3"
    assert ui.chart(page, "chart-lr")["traces"][0]["x"] == [2, 3]
    page.locator("#timeline li.ev[data-step='3'] button").click()  # a live event moves the charts like any other
    page.wait_for_function(
        "document.getElementById('chart-loss').layout.shapes.some((s) => s.meta === 'cursor' && s.x0 === 3)"
    )
    assert latency_s < 2.0, f"{latency_s:.2f} s from the send to the chart"


def test_runs_page_updates_rows_and_adds_new_runs_live(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "row-1", "live", "first")
    ui.post(url, "row-1", 1, {"loss": {"steps": [0], "values": [1.0]}})
    page.goto(f"{url}/?project=live")
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    ui.post(
        url,
        "row-1",
        2,
        {"scale": {"steps": [1, 2], "values": [1024.0, 512.0]}, "skipped": {"steps": [1, 2], "values": [0, 1]}},
    )
    ui.register(url, "row-2", "live", "second")
    ui.post(url, "row-2", 1, {"loss": {"steps": [7], "values": [1.0]}})
    ui.register(url, "elsewhere", "other", "not in this project")
    ui.post(url, "elsewhere", 1, {"loss": {"steps": [7], "values": [1.0]}})
    page.wait_for_function(
        "document.querySelector(\"tr[data-run-id='row-1'] td[data-field='last_step']\").innerText === '2'",
        timeout=10_000,
    )
    page.wait_for_selector("tr[data-run-id='row-2']", timeout=10_000)
    ui.shot(page, "runs-live.png")
    live = ui.row(page, "row-1")
    assert (live["scale"], live["skip_rate"]) == ("2⁹", "50.0 %")
    assert page.locator("tr[data-run-id='elsewhere']").count() == 0
    page.reload()
    assert ui.row(page, "row-1") == live, "a live row reads the same as the server's"
    assert page.locator("tbody tr").first.get_attribute("data-run-id") == "row-2"


def test_a_run_that_leaves_the_runs_pages_status_filter_leaves_the_page_live(sqlite_server: Any, page: Any) -> None:
    # (the runs stream never said so: a finished run stayed on a status=running page, shown as running)
    url = sqlite_server.url
    for run_id in ("going", "staying"):
        ui.register(url, run_id, "filtered", run_id)
        ui.post(url, run_id, 1, {"loss": {"steps": [0], "values": [1.0]}})
    page.goto(f"{url}/?project=filtered&status=running")
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    ui.post(url, "going", 2, {}, status="finished")
    page.wait_for_selector("tr[data-run-id='going']", state="detached", timeout=10_000)
    assert ui.row(page, "staying")["status"] == "running"
    ui.post(url, "staying", 2, {}, status="crashed")
    page.wait_for_selector("tr.none", timeout=10_000)
    live = page.locator("#runs tbody").inner_text()
    page.reload()
    assert page.locator("#runs tbody").inner_text() == live == "No run matches these filters.", (
        "the page reads as after a reload"
    )


def test_compare_overlays_a_series_from_several_runs(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    for i in range(3):
        ui.register(url, f"cmp-{i}", "cmp", f"seed {i}")
        ui.post(
            url,
            f"cmp-{i}",
            1,
            {"loss": {"steps": [0, 1, 2, 3], "values": [2.0 - i * 0.1, 1.5, "NaN" if i == 1 else 1.0, 0.9]}},
        )
    page.goto(f"{url}/")
    for i in (0, 1):
        page.locator(f"tr[data-run-id='cmp-{i}'] input[type=checkbox]").check()
    page.get_by_role("button", name="Compare selected runs").click()
    page.wait_for_selector("#compare-chart[data-traces='2']", timeout=10_000)
    ui.shot(page, "compare.png")
    chart = ui.chart(page, "compare-chart")
    lines = [t for t in chart["traces"] if t["meta"] is None]
    assert sorted(t["name"] for t in lines) == ["cmp / seed 0", "cmp / seed 1"]
    assert [t["x"] for t in chart["traces"] if t["meta"] == "nonfinite"] == [[2]]


def test_compare_over_decades_is_a_log_axis_whose_ticks_read_as_numbers(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    for i in range(2):
        ui.register(url, f"dec-{i}", "dec", f"seed {i}")
        ui.post(url, f"dec-{i}", 1, {"loss": {"steps": [0, 1, 2, 3], "values": [100.0 + i, 1.0, 0.01, 0.001]}})
    page.goto(f"{url}/compare?run=dec-0&run=dec-1&series=loss")
    page.wait_for_selector("#compare-chart[data-traces='2']", timeout=10_000)
    axis = ui.yaxis(page, "compare-chart")
    assert axis["type"] == "log" and axis["tickvals"] == [10.0**k for k in range(-3, 4)], axis
    assert axis["drawn"] == ["0.001", "0.01", "0.1", "1", "10", "100"], "one label a decade, as numbers, no minor ones"


def test_hostile_run_project_series_config_and_event_text_render_inert_on_every_page(
    sqlite_server: Any, page: Any
) -> None:
    url = sqlite_server.url
    config = {ui.HOSTILE_SERIES: ui.HOSTILE_PROJECT, "note": [ui.HOSTILE_RUN]}
    reply = httpx.put(
        f"{url}/api/v1/runs/xss-1",
        json={"project": ui.HOSTILE_PROJECT, "name": ui.HOSTILE_RUN, "config": config},
        timeout=10,
    )
    assert reply.status_code == 200, reply.text
    points = {
        "loss": {"steps": [0, 1], "values": [1.0, 0.5]},
        ui.HOSTILE_SERIES: {"steps": [0, 1], "values": [1.0, 2.0]},
        f"grad_norm/{ui.HOSTILE_SERIES}": {"steps": [0, 1], "values": [1.0, 2.0]},
    }
    event = {
        "step": 1,
        "type": "loss_spike",
        "severity": "warning",
        "message": ui.HOSTILE_RUN,
        "details": {"why": ui.HOSTILE_PROJECT},
    }
    ui.post(url, "xss-1", 1, points, [event])
    page.goto(f"{url}/")
    ui.shot(page, "runs-hostile.png")
    assert [ui.row(page, "xss-1")[k] for k in ("project", "name")] == [ui.HOSTILE_PROJECT, ui.HOSTILE_RUN]
    ui.assert_inert(page)
    ui.open_run(page, url, "xss-1")
    ui.shot(page, "run-hostile.png")
    assert page.locator("h1").inner_text() == f"{ui.HOSTILE_PROJECT} / {ui.HOSTILE_RUN}"
    assert page.title().startswith(ui.HOSTILE_RUN)
    assert page.evaluate("document.querySelector('#chart-extra .gtitle').textContent") == ui.HOSTILE_SERIES
    assert ui.HOSTILE_SERIES in page.evaluate(
        "Array.from(document.querySelectorAll('#chart-layers .ytick text')).map((t) => t.textContent)"
    )
    assert ui.HOSTILE_RUN in page.locator("#timeline").inner_text()  # the event message, as text
    config_text = page.locator("table.kv").first.inner_text()
    assert (
        ui.HOSTILE_SERIES in config_text
        and ui.HOSTILE_PROJECT in config_text
        and f'["{ui.HOSTILE_RUN}"]' in config_text
    )
    ui.assert_inert(page)
    page.goto(f"{url}/compare?" + urlencode({"run": "xss-1", "series": ui.HOSTILE_SERIES}))
    page.wait_for_selector("#compare-chart[data-traces='1']", timeout=10_000)
    ui.assert_inert(page)


def test_late_points_and_layer_norms_arrive_live_in_place(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "late-1", "live", "late points")
    steps = list(range(10))
    layers = {f"grad_norm/blocks.{i}": {"steps": steps, "values": [0.1 * (i + 1)] * 10} for i in range(3)}
    ui.post(url, "late-1", 1, {"loss": {"steps": steps, "values": [1.0] * 10}, **layers})
    ui.open_run(page, url, "late-1")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    assert ui.chart(page, "chart-layers")["columns"] == 10
    reads = len([u for u in page.requests if "/series" in u or "/heatmap" in u])
    more = list(range(10, 20))
    grown = {f"grad_norm/blocks.{i}": {"steps": more, "values": [0.1 * (i + 1)] * 10} for i in range(3)}
    grown["grad_norm/blocks.1"]["values"][5] = "NaN"  # step 15
    ui.post(url, "late-1", 2, {"loss": {"steps": more, "values": [0.5] * 10}, **grown})
    page.wait_for_function("document.getElementById('chart-layers').dataset.columns === '20'", timeout=10_000)
    # A spool replayed after an outage: steps far behind the page's last one, one value replaced by NaN.
    ui.post(url, "late-1", 3, {"loss": {"steps": [3, 4], "values": ["NaN", 0.75]}})
    page.wait_for_function("document.getElementById('chart-loss').dataset.nonfinite === '1'", timeout=10_000)
    ui.shot(page, "run-late-points.png")
    loss = ui.chart(page, "chart-loss")
    assert loss["traces"][0]["x"] == list(range(20)) and loss["traces"][0]["y"][3:5] == [None, 0.75]
    heat = ui.chart(page, "chart-layers")
    # (the heatmap's x are its cells' edges: the last cell is step 19's, up to the step after it)
    assert heat["traces"][0]["x"][-2:] == [19, 20] and any(
        t["meta"] == "nonfinite" and t["x"] == [15] for t in heat["traces"]
    )
    assert len([u for u in page.requests if "/series" in u or "/heatmap" in u]) == reads, (
        "all of it came over the stream"
    )


def test_rank_picker_charts_and_streams_the_chosen_rank(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "ddp-1", "ddp", "two ranks")
    for rank, values in ((0, [1.0, 1.5]), (1, [5.0, 6.0])):
        body = {"seq": 1, "rank": rank, "points": {"loss": {"steps": [0, 1], "values": values}}}
        assert httpx.post(f"{url}/api/v1/runs/ddp-1/batches", json=body, timeout=10).json()["stored"]
    ui.open_run(page, url, "ddp-1")
    assert page.locator("#rank option").all_inner_texts() == ["0", "1"]
    assert ui.chart(page, "chart-loss")["traces"][0]["y"] == [1.0, 1.5]
    page.select_option("#rank", "1")
    page.wait_for_url("**/runs/ddp-1?rank=1", timeout=10_000)
    page.wait_for_selector("#charts[data-loaded='true'][data-live='open']", timeout=15_000)
    assert ui.chart(page, "chart-loss")["traces"][0]["y"] == [5.0, 6.0]
    for rank, value in ((0, 2.0), (1, 7.0)):
        body = {"seq": 2, "rank": rank, "points": {"loss": {"steps": [2], "values": [value]}}}
        assert httpx.post(f"{url}/api/v1/runs/ddp-1/batches", json=body, timeout=10).json()["stored"]
    page.wait_for_function("document.getElementById('chart-loss').dataset.points === '3'", timeout=10_000)
    time.sleep(0.5)  # rank 0's point, were it streamed here, would have come by now
    ui.shot(page, "run-rank-1.png")
    assert ui.chart(page, "chart-loss")["traces"][0]["y"] == [5.0, 6.0, 7.0]
    assert page.locator("#rank").input_value() == "1"
    assert httpx.get(f"{url}/api/v1/runs/ddp-1", timeout=10).json()["ranks"] == [0, 1]


def test_zooming_the_compare_chart_reads_every_run_at_full_resolution(sqlite_server: Any, page: Any) -> None:
    url, n = sqlite_server.url, 20_000
    for i in range(2):
        ui.register(url, f"zoom-{i}", "cmp", f"long {i}")
        ui.post(
            url,
            f"zoom-{i}",
            1,
            {"loss": {"steps": list(range(n)), "values": [1.0 + i + (s % 89) / 89 for s in range(n)]}},
        )
    page.goto(f"{url}/compare?" + urlencode([("run", "zoom-0"), ("run", "zoom-1"), ("series", "loss")]))
    page.wait_for_selector("#compare-chart[data-traces='2']", timeout=10_000)
    assert int(page.locator("#compare-chart").get_attribute("data-points") or 0) <= 2 * 2000
    page.evaluate("Plotly.relayout(document.getElementById('compare-chart'), {'xaxis.range': [12000, 12100]})")
    page.wait_for_function("document.getElementById('compare-chart').dataset.view === '12000,12100'", timeout=10_000)
    ui.shot(page, "compare-zoomed.png")
    chart = ui.chart(page, "compare-chart")
    assert chart["range"] == [12000, 12100]
    for trace in [t for t in chart["traces"] if t["meta"] is None]:
        assert set(range(12000, 12101)) <= set(trace["x"]), f"{trace['name']}: the zoomed range at full resolution"
    page.evaluate("Plotly.relayout(document.getElementById('compare-chart'), {'xaxis.autorange': true})")
    page.wait_for_function(
        "Number(document.getElementById('compare-chart').dataset.view.split(',')[1]) > 19000", timeout=10_000
    )


def test_runs_page_shows_a_non_finite_scale_live_and_after_reload(sqlite_server: Any, page: Any) -> None:
    # The runs stream wrote a bare Infinity (not JSON: every run of that message lost its live update) and a
    # stored NaN scale read as "no scale" ("–").
    url = sqlite_server.url
    for run_id in ("inf-scale", "nan-scale", "healthy"):
        ui.register(url, run_id, "odd", run_id)
        ui.post(url, run_id, 1, {"loss": {"steps": [0], "values": [1.0]}})
    page.goto(f"{url}/?project=odd")
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    ui.post(url, "inf-scale", 2, {"scale": {"steps": [1], "values": ["Infinity"]}})
    ui.post(url, "nan-scale", 2, {"scale": {"steps": [1], "values": ["NaN"]}})
    ui.post(url, "healthy", 2, {"scale": {"steps": [1, 2], "values": [1024.0, 1024.0]}})
    page.wait_for_function(
        "document.querySelector(\"tr[data-run-id='healthy'] td[data-field='last_step']\").innerText === '2'",
        timeout=10_000,
    )
    page.wait_for_function(
        "document.querySelector(\"tr[data-run-id='nan-scale'] td[data-field='scale']\").innerText === 'NaN'",
        timeout=10_000,
    )
    live = {run_id: ui.row(page, run_id)["scale"] for run_id in ("inf-scale", "nan-scale", "healthy")}
    assert live == {"inf-scale": "+Inf", "nan-scale": "NaN", "healthy": "2¹⁰"}
    page.reload()
    assert {run_id: ui.row(page, run_id)["scale"] for run_id in live} == live, (
        "a live row reads the same as the server's"
    )


def test_run_page_goes_live_again_after_an_answer_that_is_not_a_stream(
    sqlite_url: str, live_server_factory: Any, page: Any
) -> None:
    # A browser gives up on an EventSource for good after a 502 (a proxy during a deploy) or the server's 503: the
    # page stayed "reconnecting" until reloaded. And a page opened while the server called the run crashed never
    # went live, though a crashed run comes back when it reports again.
    from ampwatch.server.settings import Settings

    # Streams end (and the browser reconnects) every second.
    url = live_server_factory(Settings(database_url=sqlite_url, stream_lifetime_s=1.0)).url
    ui.register(url, "bumpy", "live", "bumpy")
    ui.post(url, "bumpy", 1, {"loss": {"steps": [0, 1], "values": [1.0, 1.0]}}, status="crashed")
    refused: list[str] = []
    page.expected_errors.append("the server responded with a status of 502 (Bad Gateway)")

    def bad_gateway(route: Any) -> None:
        refused.append(route.request.url)
        route.fulfill(status=502, body="bad gateway")

    ui.open_run(page, url, "bumpy")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    refusal = page.expect_response(lambda r: "/runs/bumpy/stream" in r.url and r.status == 502, timeout=10_000)
    with refusal:  # (the stream's next connection, once its 1 s is over, is refused)
        page.route("**/api/v1/runs/bumpy/stream*", bad_gateway)
    page.wait_for_selector("#charts[data-live='reconnecting']", timeout=10_000)
    page.unroute("**/api/v1/runs/bumpy/stream*")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    ui.post(url, "bumpy", 2, {"loss": {"steps": [2], "values": [0.5]}}, status="running")
    page.wait_for_function("document.getElementById('chart-loss').dataset.points === '3'", timeout=10_000)
    assert refused, "the stream was refused once"


def test_run_page_shows_a_new_alert_as_its_event_arrives(sqlite_server: Any, page: Any) -> None:
    # The banner came from a poll every 5 s, and the alerts table and the "firing" badge only from a reload.
    url = sqlite_server.url
    ui.register(url, "alerted", "live", "alerted")
    ui.post(url, "alerted", 1, {"loss": {"steps": [0, 1], "values": [1.0, 1.0]}})
    ui.open_run(page, url, "alerted")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    page.wait_for_timeout(300)  # (the first read of the alerts is done)
    assert page.locator("#run-firing").count() == 0 and page.locator("#run-alerts tbody tr").count() == 0
    event = {
        "step": 2,
        "type": "nonfinite_loss",
        "severity": "critical",
        "message": "NaN loss at step 2.",
        "details": {"loss": "NaN"},
    }
    ui.post(url, "alerted", 2, {"loss": {"steps": [2], "values": ["NaN"]}}, [event])
    page.wait_for_selector("#run-alerts tr[data-state='firing']", timeout=3_000)  # (well before the next 5 s poll)
    assert page.locator("#run-firing").inner_text() == "1 firing alert"
    assert "CRITICAL firing: NaN loss in live/alerted at step 2" in page.locator("#alert-banner").inner_text()
    live = page.locator("#run-alerts").inner_text()
    page.reload()
    page.wait_for_selector("#run-alerts tr[data-state='firing']")
    assert page.locator("#run-alerts").inner_text() == live, "the live table reads as the server writes it"


def test_a_plan_trigger_arriving_live_says_the_plan_on_the_timeline(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "planned", "live", "planned")
    ui.post(url, "planned", 1, {"loss": {"steps": [0, 1], "values": [1.0, 1.0]}})
    ui.open_run(page, url, "planned")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    checkpoint = {"step": 1, "type": "checkpoint", "severity": "info", "message": "saved", "details": {"path": "c1"}}
    collapse = {"step": 3, "type": "scale_collapse", "severity": "critical", "message": "The scale collapsed."}
    ui.post(url, "planned", 2, {"loss": {"steps": [2, 3], "values": [1.0, "NaN"]}}, [checkpoint, collapse])
    said = page.locator("#timeline li.ev[data-step='3'] .ev-plan")
    said.wait_for(timeout=10_000)
    assert said.inner_text().startswith("Rollback plan: Trouble began at step 3 (scale_collapse)")
    assert "restore the checkpoint at step 1 (c1)" in said.inner_text()
    assert said.locator("a").get_attribute("href") == "/api/v1/runs/planned/plan"  # (no plan section: loaded before)
    assert page.locator("#timeline li.ev[data-step='1'] .ev-plan").count() == 0
