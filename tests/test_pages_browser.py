"""The dashboard in a real headless Chromium, reading one real CPU training run (tests/test_pages_live.py
has the live updates, zooming and hostile input)."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import _browser as ui
import httpx
import pytest
import uvicorn

from ampwatch.server import Settings, create_app
from ampwatch.server.demo import NAN_STEP_FRACTION, train

STEPS = 100
NAN_STEP = int(STEPS * NAN_STEP_FRACTION)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    """One server with one real training run, shared by the tests that only read it: (base URL, the run)."""
    db = tmp_path_factory.mktemp("demo") / "ampwatch.db"
    with ui.socket_port() as port:
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


def test_runs_page_lists_a_run_from_a_real_training_loop(demo: Any, page: Any) -> None:
    url, run = demo
    page.goto(f"{url}/")
    page.wait_for_selector("#runs[data-live='open']", timeout=10_000)
    ui.shot(page, "runs.png")
    row = ui.row(page, run["id"])
    assert (row["project"], row["name"], row["status"], row["health"]) == (
        "demo",
        run["name"],
        "finished",
        run["health"],
    )
    assert row["last_step"] == str(STEPS - 1)
    assert row["scale"].startswith("2") and row["skip_rate"].endswith("%"), row
    link = page.locator(f"tr[data-run-id='{run['id']}'] a")
    assert link.get_attribute("href") == f"/runs/{run['id']}"
    page.goto(f"{url}/?status=running")
    assert page.locator(f"tr[data-run-id='{run['id']}']").count() == 0  # filtered out: the run finished


def test_run_page_charts_every_series_and_the_layer_heatmap_from_a_real_training_loop(demo: Any, page: Any) -> None:
    url, run = demo
    ui.open_run(page, url, run["id"])
    ui.shot(page, "run.png")
    assert page.locator("h1").inner_text() == f"demo / {run['name']}"
    for chart_id in ui.CHARTS:
        chart = ui.chart(page, chart_id)
        assert chart["plotly"], chart_id
        assert chart["points"] == STEPS, chart_id
        assert chart["traces"][0]["x"] == list(range(STEPS)), chart_id
        assert chart["lines"] >= 1, f"{chart_id}: no line was drawn"
    assert "skipped step" in ui.chart(page, "chart-scale")["legend"]
    heat = ui.chart(page, "chart-layers")
    layers = [n.removeprefix("grad_norm/") for n in run["series"] if n.startswith("grad_norm/")]
    assert heat["plotly"] and heat["layers"] == len(layers) >= 4 and heat["columns"] >= 4
    assert heat["traces"][0]["type"] == "heatmap" and set(heat["traces"][0]["y"]) == set(layers)
    assert page.locator("#chart-layers .hm image, #chart-layers .heatmaplayer image").count() >= 1, (
        "the heatmap was painted"
    )
    spans = [s for s in ui.chart(page, "chart-loss")["shapes"] if s["fill"] and "201, 42, 42" in s["fill"]]
    assert spans, "skipped steps are shaded"
    facts = dict(zip(page.locator("#runtime dt").all_inner_texts(), page.locator("#runtime dd").all_inner_texts()))
    assert facts["world size"] == "1" and facts["device"] == "CPU" and facts["torch"] != "–"


def test_loss_scale_is_charted_on_a_log2_axis_with_power_of_two_ticks_and_grad_norm_on_a_log_axis(
    demo: Any, page: Any
) -> None:
    url, run = demo
    ui.open_run(page, url, run["id"])
    scale = ui.yaxis(page, "chart-scale")
    assert scale["type"] == "log" and len(scale["tickvals"]) >= 2, scale
    for value, label in zip(scale["tickvals"], scale["ticktext"], strict=True):
        exponent = round(math.log2(value))
        assert value == 2.0**exponent and label == f"2<sup>{exponent}</sup>", (value, label)
    assert scale["drawn"] and all(re.fullmatch(r"2-?\d+", t) for t in scale["drawn"]), scale["drawn"]
    assert scale["superscripts"] == len(scale["drawn"]), "each exponent is drawn raised"
    assert ui.yaxis(page, "chart-grad_norm")["type"] == "log"


def test_nan_loss_of_a_real_training_loop_is_a_marker_on_the_loss_chart(demo: Any, page: Any) -> None:
    url, run = demo
    loss = httpx.get(f"{url}/api/v1/runs/{run['id']}/series", params={"name": "loss"}).json()["loss"]
    assert loss["values"][NAN_STEP] == "NaN"  # the training really produced it
    ui.open_run(page, url, run["id"])
    ui.shot(page, "run-loss-nan.png", "#chart-loss")
    chart = ui.chart(page, "chart-loss")
    markers = {t["name"]: t["x"] for t in chart["traces"] if t["meta"] == "nonfinite"}
    assert NAN_STEP in markers.get("NaN", []), chart["traces"]
    assert "NaN" in chart["legend"]
    assert chart["strip_points"] == chart["nonfinite"] >= 1


def test_clicking_an_event_moves_every_chart_to_its_step(demo: Any, page: Any) -> None:
    url, run = demo
    ui.open_run(page, url, run["id"])
    before = ui.chart(page, "chart-loss")["range"]
    item = page.locator(f"#timeline li.ev[data-step='{NAN_STEP}']").first
    item.locator("button").click()
    page.wait_for_function(
        "document.getElementById('charts').dataset.view !== undefined && "
        "Number(document.getElementById('charts').dataset.view.split(',')[1]) < 90",
        timeout=10_000,
    )
    ui.shot(page, "run-event-jump.png")
    ranges = {chart_id: ui.chart(page, chart_id)["range"] for chart_id in (*ui.CHARTS, "chart-layers")}
    loss = ranges["chart-loss"]
    assert loss[0] < NAN_STEP < loss[1] and loss[1] - loss[0] < (before[1] - before[0]) / 2, (before, loss)
    assert all(r == loss for r in ranges.values()), ranges
    cursor = [s for s in ui.chart(page, "chart-grad_norm")["shapes"] if s["meta"] == "cursor"]
    assert [s["x0"] for s in cursor] == [NAN_STEP]
    assert "active" in (item.get_attribute("class") or "")


def test_a_link_with_a_step_opens_the_run_page_zoomed_to_that_step(demo: Any, page: Any) -> None:
    url, run = demo
    ui.open_run(page, url, run["id"])
    full = ui.chart(page, "chart-loss")["range"]
    page.goto(f"{url}/runs/{run['id']}?step={NAN_STEP}")  # the link an alert notification carries
    page.wait_for_selector("#charts[data-loaded='true']", timeout=15_000)
    page.wait_for_function("document.getElementById('charts').dataset.view !== undefined", timeout=10_000)
    loss = ui.chart(page, "chart-loss")["range"]
    assert loss[0] < NAN_STEP < loss[1] and loss[1] - loss[0] < (full[1] - full[0]) / 2, (full, loss)
    item = page.locator(f"#timeline li.ev[data-step='{NAN_STEP}']").first
    assert "active" in (item.get_attribute("class") or "")


def test_tables_work_with_javascript_off(demo: Any, browser: Any) -> None:
    url, run = demo
    with ui.context_page(browser, java_script_enabled=False) as page:
        page.goto(f"{url}/?sort=name&order=asc")
        cells = page.locator(f"tr[data-run-id='{run['id']}'] td[data-field='last_step']").all_inner_texts()
        assert cells == [str(STEPS - 1)]
        page.goto(f"{url}/runs/{run['id']}")
        ui.shot(page, "run-no-js.png")
        assert page.locator("#timeline li.ev").count() == len(httpx.get(f"{url}/api/v1/runs/{run['id']}/events").json())
        assert page.locator("table.kv th", has_text="growth_interval").count() == 1
        assert page.locator("#run-alerts tr[data-state=firing]", has_text="nonfinite_loss").count() == 1
