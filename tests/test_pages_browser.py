"""The dashboard in a real headless Chromium, fed by real CPU training loops and the real ingest API."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import uvicorn

from ampwatch.server import Settings, create_app
from ampwatch.server.demo import NAN_STEP_FRACTION, train

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
STEPS = 100
NAN_STEP = int(STEPS * NAN_STEP_FRACTION)
HOSTILE_RUN = "<script>window.__pwned=1</script>"
HOSTILE_PROJECT = '<img src=x onerror="window.__pwned=2">'
HOSTILE_SERIES = "<b>bold</b><img src=x onerror=window.__pwned=3>"  # Plotly would format <b> and keep <img> as text
CHARTS = ("chart-loss", "chart-scale", "chart-grad_norm", "chart-lr")


@contextmanager
def _context_page(browser: Any, **options: Any) -> Iterator[Any]:
    # Playwright's wait_for_function compiles its predicate with eval, which the pages' CSP forbids;
    # tests/test_security_browser.py loads the pages with the CSP enforced.
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True, **options)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    page.on("console", lambda msg: msg.type == "error" and errors.append(f"console: {msg.text}"))
    page.requests = []  # type: ignore[attr-defined]
    page.on("request", lambda request: page.requests.append(request.url))  # type: ignore[attr-defined]
    yield page
    context.close()
    assert not errors, errors


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page; any script error or failed request on it fails the test."""
    with _context_page(browser) as fresh:
        yield fresh


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """One server with one real training run, shared by the tests that only read it: (base URL, the run)."""
    db = tmp_path_factory.mktemp("demo") / "ampwatch.db"
    with socket_port() as port:
        settings = Settings(database_url=f"sqlite:///{db}", host="127.0.0.1", port=port)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as env:  # module scope: the autouse per-test environment is not in force yet
        for name in [n for n in os.environ if n.startswith("AMPWATCH_")]:
            env.delenv(name)
        env.setenv("AMPWATCH_FLUSH_INTERVAL_S", "0.05")
        run_id = train(url, steps=STEPS).rsplit("/", 1)[1]
    yield url, httpx.get(f"{url}/api/v1/runs/{run_id}", timeout=10).json()
    server.should_exit = True
    thread.join(timeout=15)
    app.state.engine.dispose()


class socket_port:
    """A free loopback port (closed again before the server binds it)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def _shot(page: Any, name: str, selector: str | None = None) -> None:
    """Screenshots for a person to look at (test-artifacts/ is uploaded by CI, ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    if selector:
        page.locator(selector).screenshot(path=str(ARTIFACTS / name))
    else:
        page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def _open_run(page: Any, url: str, run_id: str) -> None:
    page.goto(f"{url}/runs/{run_id}")
    page.wait_for_selector("#charts[data-loaded='true']", timeout=15_000)


def _chart(page: Any, chart_id: str) -> dict[str, Any]:
    """What Plotly drew in one chart: traces, drawn lines, legend, points in the non-finite strip, the x range."""
    return page.evaluate(
        """(id) => {
          const el = document.getElementById(id);
          return {
            plotly: el.classList.contains("js-plotly-plot"),
            points: Number(el.dataset.points), nonfinite: Number(el.dataset.nonfinite),
            layers: Number(el.dataset.layers), columns: Number(el.dataset.columns),
            traces: (el.data || []).map((t) => ({ name: t.name, type: t.type, meta: t.meta || null, x: Array.from(t.x || []),
                                                 y: Array.from(t.y || []) })),
            lines: Array.from(el.querySelectorAll(".scatterlayer .js-line")).filter((p) => (p.getAttribute("d") || "").length > 8).length,
            legend: Array.from(el.querySelectorAll(".legendtext")).map((t) => t.textContent),
            strip_points: el.querySelectorAll(".subplot.xy2 .point").length,
            range: el.layout && el.layout.xaxis.range ? Array.from(el.layout.xaxis.range) : null,
            shapes: (el.layout && el.layout.shapes || []).map((s) => ({ type: s.type, x0: s.x0, x1: s.x1, meta: s.meta || null, fill: s.fillcolor || null })),
          };
        }""",
        chart_id,
    )


def _register(url: str, run_id: str, project: str, name: str) -> None:
    reply = httpx.put(f"{url}/api/v1/runs/{run_id}", json={"project": project, "name": name}, timeout=10)
    assert reply.status_code == 200, reply.text


def _post(url: str, run_id: str, seq: int, points: dict[str, Any], events: list[dict[str, Any]] | None = None) -> None:
    body = {"seq": seq, "points": points, "events": events or []}
    reply = httpx.post(f"{url}/api/v1/runs/{run_id}/batches", json=body, timeout=10)
    assert reply.status_code == 200 and reply.json()["stored"], reply.text


def _assert_inert(page: Any) -> None:
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    scripts = page.evaluate("Array.from(document.scripts).map((s) => s.src || s.textContent)")
    assert not [s for s in scripts if "__pwned" in s]


def _row(page: Any, run_id: str) -> dict[str, str]:
    return page.evaluate(
        """(id) => Object.fromEntries(Array.from(document.querySelectorAll(`tr[data-run-id="${id}"] td[data-field]`))
                     .map((td) => [td.dataset.field, td.innerText.trim()]))""",
        run_id,
    )


def test_runs_page_lists_a_run_from_a_real_training_loop(demo: Any, page: Any) -> None:
    url, run = demo
    page.goto(f"{url}/")
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    _shot(page, "runs.png")
    row = _row(page, run["id"])
    assert (row["project"], row["name"], row["status"], row["health"]) == ("demo", run["name"], "finished", run["health"])
    assert row["last_step"] == str(STEPS - 1)
    assert row["scale"].startswith("2") and row["skip_rate"].endswith("%"), row
    link = page.locator(f"tr[data-run-id='{run['id']}'] a")
    assert link.get_attribute("href") == f"/runs/{run['id']}"
    page.goto(f"{url}/?status=running")
    assert page.locator(f"tr[data-run-id='{run['id']}']").count() == 0  # filtered out: the run finished


def test_run_page_charts_every_series_and_the_layer_heatmap_from_a_real_training_loop(demo: Any, page: Any) -> None:
    url, run = demo
    _open_run(page, url, run["id"])
    _shot(page, "run.png")
    assert page.locator("h1").inner_text() == f"demo / {run['name']}"
    for chart_id in CHARTS:
        chart = _chart(page, chart_id)
        assert chart["plotly"], chart_id
        assert chart["points"] == STEPS, chart_id
        assert chart["traces"][0]["x"] == list(range(STEPS)), chart_id
        assert chart["lines"] >= 1, f"{chart_id}: no line was drawn"
    assert "skipped step" in _chart(page, "chart-scale")["legend"]
    heat = _chart(page, "chart-layers")
    layers = [n.removeprefix("grad_norm/") for n in run["series"] if n.startswith("grad_norm/")]
    assert heat["plotly"] and heat["layers"] == len(layers) >= 4 and heat["columns"] >= 4
    assert heat["traces"][0]["type"] == "heatmap" and set(heat["traces"][0]["y"]) == set(layers)
    assert page.locator("#chart-layers .hm image, #chart-layers .heatmaplayer image").count() >= 1, "the heatmap was painted"
    spans = [s for s in _chart(page, "chart-loss")["shapes"] if s["fill"] and "201, 42, 42" in s["fill"]]
    assert spans, "skipped steps are shaded"
    facts = dict(zip(page.locator("#runtime dt").all_inner_texts(), page.locator("#runtime dd").all_inner_texts()))
    assert facts["world size"] == "1" and facts["device"] == "CPU" and facts["torch"] != "–"


def _yaxis(page: Any, chart_id: str) -> dict[str, Any]:
    """A chart's y axis as Plotly laid it out, and the tick labels it drew (superscripts as their own tspan)."""
    return page.evaluate(
        """(id) => {
          const el = document.getElementById(id), axis = el._fullLayout.yaxis;
          const drawn = Array.from(el.querySelectorAll(".yaxislayer-above .ytick text"));
          return { type: axis.type, tickvals: Array.from(axis.tickvals || []), ticktext: Array.from(axis.ticktext || []),
                   drawn: drawn.map((t) => t.textContent.replaceAll("\u200b", "")),  // Plotly pads a <sup> with zero-width spaces
                   superscripts: drawn.filter((t) => t.querySelector("tspan")).length };
        }""",
        chart_id,
    )


def test_loss_scale_is_charted_on_a_log2_axis_with_power_of_two_ticks_and_grad_norm_on_a_log_axis(demo: Any, page: Any) -> None:
    url, run = demo
    _open_run(page, url, run["id"])
    scale = _yaxis(page, "chart-scale")
    assert scale["type"] == "log" and len(scale["tickvals"]) >= 2, scale
    for value, label in zip(scale["tickvals"], scale["ticktext"], strict=True):
        exponent = round(math.log2(value))
        assert value == 2.0**exponent and label == f"2<sup>{exponent}</sup>", (value, label)
    assert scale["drawn"] and all(re.fullmatch(r"2-?\d+", t) for t in scale["drawn"]), scale["drawn"]
    assert scale["superscripts"] == len(scale["drawn"]), "each exponent is drawn raised"
    assert _yaxis(page, "chart-grad_norm")["type"] == "log"


def test_grad_spike_events_are_star_markers_on_the_grad_norm_chart_also_when_they_arrive_live(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    _register(url, "spiky-1", "spikes", "grad spikes")
    norms = [1.0] * 20
    norms[12] = 40.0
    spike = {"step": 12, "type": "grad_spike", "severity": "warning", "message": "grad norm 40x its median"}
    _post(url, "spiky-1", 1, {"grad_norm": {"steps": list(range(20)), "values": norms}}, [spike])
    _open_run(page, url, "spiky-1")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    stars = [t for t in _chart(page, "chart-grad_norm")["traces"] if t["name"] == "spike"]
    assert [(t["x"], t["y"]) for t in stars] == [([12], [40.0])], stars
    assert page.evaluate("document.getElementById('chart-grad_norm').data.find((t) => t.name === 'spike').marker.symbol") == "star"
    late = {"step": 25, "type": "grad_spike", "severity": "warning", "message": "grad norm 30x its median"}
    more = list(range(20, 30))
    _post(url, "spiky-1", 2, {"grad_norm": {"steps": more, "values": [30.0 if s == 25 else 1.0 for s in more]}}, [late])
    page.wait_for_function("document.getElementById('chart-grad_norm').data.some((t) => t.name === 'spike' && t.x.length === 2)",
                           timeout=10_000)  # fmt: skip
    _shot(page, "run-grad-spikes.png", "#chart-grad_norm")
    [star] = [t for t in _chart(page, "chart-grad_norm")["traces"] if t["name"] == "spike"]
    assert (star["x"], star["y"]) == ([12, 25], [40.0, 30.0])
    assert "spike" in _chart(page, "chart-grad_norm")["legend"]


def test_nan_loss_of_a_real_training_loop_is_a_marker_on_the_loss_chart(demo: Any, page: Any) -> None:
    url, run = demo
    loss = httpx.get(f"{url}/api/v1/runs/{run['id']}/series", params={"name": "loss"}).json()["loss"]
    assert loss["values"][NAN_STEP] == "NaN"  # the training really produced it
    _open_run(page, url, run["id"])
    _shot(page, "run-loss-nan.png", "#chart-loss")
    chart = _chart(page, "chart-loss")
    markers = {t["name"]: t["x"] for t in chart["traces"] if t["meta"] == "nonfinite"}
    assert NAN_STEP in markers.get("NaN", []), chart["traces"]
    assert "NaN" in chart["legend"]
    assert chart["strip_points"] == chart["nonfinite"] >= 1


def test_clicking_an_event_moves_every_chart_to_its_step(demo: Any, page: Any) -> None:
    url, run = demo
    _open_run(page, url, run["id"])
    before = _chart(page, "chart-loss")["range"]
    item = page.locator(f"#timeline li.ev[data-step='{NAN_STEP}']").first
    item.locator("button").click()
    page.wait_for_function("document.getElementById('charts').dataset.view !== undefined && "
                           "Number(document.getElementById('charts').dataset.view.split(',')[1]) < 90", timeout=10_000)
    _shot(page, "run-event-jump.png")
    ranges = {chart_id: _chart(page, chart_id)["range"] for chart_id in (*CHARTS, "chart-layers")}
    loss = ranges["chart-loss"]
    assert loss[0] < NAN_STEP < loss[1] and loss[1] - loss[0] < (before[1] - before[0]) / 2, (before, loss)
    assert all(r == loss for r in ranges.values()), ranges
    cursor = [s for s in _chart(page, "chart-grad_norm")["shapes"] if s["meta"] == "cursor"]
    assert [s["x0"] for s in cursor] == [NAN_STEP]
    assert "active" in (item.get_attribute("class") or "")


def test_a_link_with_a_step_opens_the_run_page_zoomed_to_that_step(demo: Any, page: Any) -> None:
    url, run = demo
    _open_run(page, url, run["id"])
    full = _chart(page, "chart-loss")["range"]
    page.goto(f"{url}/runs/{run['id']}?step={NAN_STEP}")  # the link an alert notification carries
    page.wait_for_selector("#charts[data-loaded='true']", timeout=15_000)
    page.wait_for_function("document.getElementById('charts').dataset.view !== undefined", timeout=10_000)
    loss = _chart(page, "chart-loss")["range"]
    assert loss[0] < NAN_STEP < loss[1] and loss[1] - loss[0] < (full[1] - full[0]) / 2, (full, loss)
    item = page.locator(f"#timeline li.ev[data-step='{NAN_STEP}']").first
    assert "active" in (item.get_attribute("class") or "")


def test_zooming_one_chart_zooms_all_and_reads_the_range_at_full_resolution(sqlite_server: Any, page: Any) -> None:
    url, n = sqlite_server.url, 20_000
    _register(url, "long-1", "long", "twenty thousand steps")
    steps = list(range(n))
    _post(url, "long-1", 1, {"loss": {"steps": steps, "values": [1.0 + (s % 97) / 97 for s in steps]},
                             "lr": {"steps": steps, "values": [1e-3] * n}})  # fmt: skip
    _open_run(page, url, "long-1")
    assert _chart(page, "chart-loss")["points"] <= 2000
    page.evaluate("Plotly.relayout(document.getElementById('chart-loss'), {'xaxis.range': [12000, 12100]})")
    page.wait_for_function("Number(document.getElementById('chart-lr').dataset.points) > 100 && "
                           "Number(document.getElementById('chart-lr').dataset.points) < 400", timeout=10_000)
    for chart_id in ("chart-loss", "chart-lr"):
        chart = _chart(page, chart_id)
        assert chart["range"] == [12000, 12100], chart_id
        assert set(range(12000, 12101)) <= set(chart["traces"][0]["x"]), f"{chart_id}: the zoomed range at full resolution"
    page.evaluate("Plotly.relayout(document.getElementById('chart-lr'), {'xaxis.autorange': true})")
    page.wait_for_function("Number(document.getElementById('chart-loss').dataset.points) > 1000 && "
                           "Number(document.getElementById('charts').dataset.view.split(',')[1]) > 19000", timeout=10_000)


def test_point_sent_after_the_page_opened_arrives_over_sse_without_reload(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    _register(url, "live-1", "live", "streaming")
    _post(url, "live-1", 1, {"loss": {"steps": [0, 1], "values": [1.0, "NaN"]}})
    _open_run(page, url, "live-1")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    assert (_chart(page, "chart-loss")["points"], _chart(page, "chart-loss")["nonfinite"]) == (2, 1)
    page.evaluate("window.__same_document = true")
    reads = len([u for u in page.requests if "/series" in u])
    sent = time.monotonic()
    event = {"step": 3, "type": "loss_spike", "severity": "warning", "message": "loss 5x its median"}
    _post(url, "live-1", 2, {"loss": {"steps": [2, 3], "values": [0.5, "Infinity"]}, "lr": {"steps": [2, 3], "values": [0.1, 0.1]}}, [event])
    page.wait_for_function("document.getElementById('chart-loss').dataset.points === '4'", timeout=10_000)
    latency_s = time.monotonic() - sent
    page.wait_for_selector("#timeline li.ev[data-step='3']", timeout=5_000)
    _shot(page, "run-live.png")
    chart = _chart(page, "chart-loss")
    assert page.evaluate("window.__same_document") is True
    assert len([u for u in page.requests if "/series" in u]) == reads, "the point came over the stream, not a re-read"
    assert chart["traces"][0]["x"] == [0, 1, 2, 3] and chart["nonfinite"] == 2
    assert {t["name"] for t in chart["traces"] if t["meta"] == "nonfinite"} == {"NaN", "+Inf"}
    assert page.locator("#run-step").inner_text() == "3"
    assert _chart(page, "chart-lr")["traces"][0]["x"] == [2, 3]
    page.locator("#timeline li.ev[data-step='3'] button").click()  # a live event moves the charts like any other
    page.wait_for_function("document.getElementById('chart-loss').layout.shapes.some((s) => s.meta === 'cursor' && s.x0 === 3)")
    assert latency_s < 2.0, f"{latency_s:.2f} s from the send to the chart"


def test_runs_page_updates_rows_and_adds_new_runs_live(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    _register(url, "row-1", "live", "first")
    _post(url, "row-1", 1, {"loss": {"steps": [0], "values": [1.0]}})
    page.goto(f"{url}/?project=live")
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    _post(url, "row-1", 2, {"scale": {"steps": [1, 2], "values": [1024.0, 512.0]}, "skipped": {"steps": [1, 2], "values": [0, 1]}})
    _register(url, "row-2", "live", "second")
    _post(url, "row-2", 1, {"loss": {"steps": [7], "values": [1.0]}})
    _register(url, "elsewhere", "other", "not in this project")
    _post(url, "elsewhere", 1, {"loss": {"steps": [7], "values": [1.0]}})
    page.wait_for_function("document.querySelector(\"tr[data-run-id='row-1'] td[data-field='last_step']\").innerText === '2'", timeout=10_000)
    page.wait_for_selector("tr[data-run-id='row-2']", timeout=10_000)
    _shot(page, "runs-live.png")
    live = _row(page, "row-1")
    assert (live["scale"], live["skip_rate"]) == ("2⁹", "50.0 %")
    assert page.locator("tr[data-run-id='elsewhere']").count() == 0
    page.reload()
    assert _row(page, "row-1") == live, "a live row reads the same as the server's"
    assert page.locator("tbody tr").first.get_attribute("data-run-id") == "row-2"


def test_compare_overlays_a_series_from_several_runs(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    for i in range(3):
        _register(url, f"cmp-{i}", "cmp", f"seed {i}")
        _post(url, f"cmp-{i}", 1, {"loss": {"steps": [0, 1, 2, 3], "values": [2.0 - i * 0.1, 1.5, "NaN" if i == 1 else 1.0, 0.9]}})
    page.goto(f"{url}/")
    for i in (0, 1):
        page.locator(f"tr[data-run-id='cmp-{i}'] input[type=checkbox]").check()
    page.get_by_role("button", name="Compare selected runs").click()
    page.wait_for_selector("#compare-chart[data-traces='2']", timeout=10_000)
    _shot(page, "compare.png")
    chart = _chart(page, "compare-chart")
    lines = [t for t in chart["traces"] if t["meta"] is None]
    assert sorted(t["name"] for t in lines) == ["cmp / seed 0", "cmp / seed 1"]
    assert [t["x"] for t in chart["traces"] if t["meta"] == "nonfinite"] == [[2]]


def test_tables_work_with_javascript_off(demo: Any, browser: Any) -> None:
    url, run = demo
    with _context_page(browser, java_script_enabled=False) as page:
        page.goto(f"{url}/?sort=name&order=asc")
        cells = page.locator(f"tr[data-run-id='{run['id']}'] td[data-field='last_step']").all_inner_texts()
        assert cells == [str(STEPS - 1)]
        page.goto(f"{url}/runs/{run['id']}")
        _shot(page, "run-no-js.png")
        assert page.locator("#timeline li.ev").count() == len(httpx.get(f"{url}/api/v1/runs/{run['id']}/events").json())
        assert page.locator("table.kv th", has_text="growth_interval").count() == 1
        assert page.locator("#run-alerts tr[data-state=firing]", has_text="nonfinite_loss").count() == 1


def test_hostile_run_project_series_config_and_event_text_render_inert_on_every_page(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    config = {HOSTILE_SERIES: HOSTILE_PROJECT, "note": [HOSTILE_RUN]}
    reply = httpx.put(f"{url}/api/v1/runs/xss-1", json={"project": HOSTILE_PROJECT, "name": HOSTILE_RUN, "config": config}, timeout=10)
    assert reply.status_code == 200, reply.text
    points = {"loss": {"steps": [0, 1], "values": [1.0, 0.5]}, HOSTILE_SERIES: {"steps": [0, 1], "values": [1.0, 2.0]},
              f"grad_norm/{HOSTILE_SERIES}": {"steps": [0, 1], "values": [1.0, 2.0]}}  # fmt: skip
    event = {"step": 1, "type": "loss_spike", "severity": "warning", "message": HOSTILE_RUN, "details": {"why": HOSTILE_PROJECT}}
    _post(url, "xss-1", 1, points, [event])
    page.goto(f"{url}/")
    _shot(page, "runs-hostile.png")
    assert [_row(page, "xss-1")[k] for k in ("project", "name")] == [HOSTILE_PROJECT, HOSTILE_RUN]
    _assert_inert(page)
    _open_run(page, url, "xss-1")
    _shot(page, "run-hostile.png")
    assert page.locator("h1").inner_text() == f"{HOSTILE_PROJECT} / {HOSTILE_RUN}"
    assert page.title().startswith(HOSTILE_RUN)
    assert page.evaluate("document.querySelector('#chart-extra .gtitle').textContent") == HOSTILE_SERIES
    assert HOSTILE_SERIES in page.evaluate("Array.from(document.querySelectorAll('#chart-layers .ytick text')).map((t) => t.textContent)")
    assert HOSTILE_RUN in page.locator("#timeline").inner_text()  # the event message, as text
    config_text = page.locator("table.kv").first.inner_text()
    assert HOSTILE_SERIES in config_text and HOSTILE_PROJECT in config_text and f'["{HOSTILE_RUN}"]' in config_text
    _assert_inert(page)
    page.goto(f"{url}/compare?" + urlencode({"run": "xss-1", "series": HOSTILE_SERIES}))
    page.wait_for_selector("#compare-chart[data-traces='1']", timeout=10_000)
    _assert_inert(page)


def test_late_points_and_layer_norms_arrive_live_in_place(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    _register(url, "late-1", "live", "late points")
    steps = list(range(10))
    layers = {f"grad_norm/blocks.{i}": {"steps": steps, "values": [0.1 * (i + 1)] * 10} for i in range(3)}
    _post(url, "late-1", 1, {"loss": {"steps": steps, "values": [1.0] * 10}, **layers})
    _open_run(page, url, "late-1")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    assert _chart(page, "chart-layers")["columns"] == 10
    reads = len([u for u in page.requests if "/series" in u or "/heatmap" in u])
    more = list(range(10, 20))
    grown = {f"grad_norm/blocks.{i}": {"steps": more, "values": [0.1 * (i + 1)] * 10} for i in range(3)}
    grown["grad_norm/blocks.1"]["values"][5] = "NaN"  # step 15
    _post(url, "late-1", 2, {"loss": {"steps": more, "values": [0.5] * 10}, **grown})
    page.wait_for_function("document.getElementById('chart-layers').dataset.columns === '20'", timeout=10_000)
    # A spool replayed after an outage: steps far behind the page's last one, one value replaced by NaN.
    _post(url, "late-1", 3, {"loss": {"steps": [3, 4], "values": ["NaN", 0.75]}})
    page.wait_for_function("document.getElementById('chart-loss').dataset.nonfinite === '1'", timeout=10_000)
    _shot(page, "run-late-points.png")
    loss = _chart(page, "chart-loss")
    assert loss["traces"][0]["x"] == list(range(20)) and loss["traces"][0]["y"][3:5] == [None, 0.75]
    heat = _chart(page, "chart-layers")
    assert heat["traces"][0]["x"][-1] == 19 and any(t["meta"] == "nonfinite" and t["x"] == [15] for t in heat["traces"])
    assert len([u for u in page.requests if "/series" in u or "/heatmap" in u]) == reads, "all of it came over the stream"


def test_rank_picker_charts_and_streams_the_chosen_rank(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    _register(url, "ddp-1", "ddp", "two ranks")
    for rank, values in ((0, [1.0, 1.5]), (1, [5.0, 6.0])):
        body = {"seq": 1, "rank": rank, "points": {"loss": {"steps": [0, 1], "values": values}}}
        assert httpx.post(f"{url}/api/v1/runs/ddp-1/batches", json=body, timeout=10).json()["stored"]
    _open_run(page, url, "ddp-1")
    assert page.locator("#rank option").all_inner_texts() == ["0", "1"]
    assert _chart(page, "chart-loss")["traces"][0]["y"] == [1.0, 1.5]
    page.select_option("#rank", "1")
    page.wait_for_url("**/runs/ddp-1?rank=1", timeout=10_000)
    page.wait_for_selector("#charts[data-loaded='true'][data-live='open']", timeout=15_000)
    assert _chart(page, "chart-loss")["traces"][0]["y"] == [5.0, 6.0]
    for rank, value in ((0, 2.0), (1, 7.0)):
        body = {"seq": 2, "rank": rank, "points": {"loss": {"steps": [2], "values": [value]}}}
        assert httpx.post(f"{url}/api/v1/runs/ddp-1/batches", json=body, timeout=10).json()["stored"]
    page.wait_for_function("document.getElementById('chart-loss').dataset.points === '3'", timeout=10_000)
    time.sleep(0.5)  # rank 0's point, were it streamed here, would have come by now
    _shot(page, "run-rank-1.png")
    assert _chart(page, "chart-loss")["traces"][0]["y"] == [5.0, 6.0, 7.0]
    assert page.locator("#rank").input_value() == "1"
    assert httpx.get(f"{url}/api/v1/runs/ddp-1", timeout=10).json()["ranks"] == [0, 1]


def test_zooming_the_compare_chart_reads_every_run_at_full_resolution(sqlite_server: Any, page: Any) -> None:
    url, n = sqlite_server.url, 20_000
    for i in range(2):
        _register(url, f"zoom-{i}", "cmp", f"long {i}")
        _post(url, f"zoom-{i}", 1, {"loss": {"steps": list(range(n)), "values": [1.0 + i + (s % 89) / 89 for s in range(n)]}})
    page.goto(f"{url}/compare?" + urlencode([("run", "zoom-0"), ("run", "zoom-1"), ("series", "loss")]))
    page.wait_for_selector("#compare-chart[data-traces='2']", timeout=10_000)
    assert int(page.locator("#compare-chart").get_attribute("data-points") or 0) <= 2 * 2000
    page.evaluate("Plotly.relayout(document.getElementById('compare-chart'), {'xaxis.range': [12000, 12100]})")
    page.wait_for_function("document.getElementById('compare-chart').dataset.view === '12000,12100'", timeout=10_000)
    _shot(page, "compare-zoomed.png")
    chart = _chart(page, "compare-chart")
    assert chart["range"] == [12000, 12100]
    for trace in [t for t in chart["traces"] if t["meta"] is None]:
        assert set(range(12000, 12101)) <= set(trace["x"]), f"{trace['name']}: the zoomed range at full resolution"
    page.evaluate("Plotly.relayout(document.getElementById('compare-chart'), {'xaxis.autorange': true})")
    page.wait_for_function("Number(document.getElementById('compare-chart').dataset.view.split(',')[1]) > 19000", timeout=10_000)
