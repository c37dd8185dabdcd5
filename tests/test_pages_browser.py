"""The dashboard in a real headless Chromium, fed by real CPU training loops and the real ingest API."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ampwatch.server.demo import NAN_STEP_FRACTION, train

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
# Read at import: the autouse `_agent_env` fixture clears AMPWATCH_* variables before each test.
REQUIRE_BROWSER = bool(os.environ.get("AMPWATCH_REQUIRE_BROWSER"))
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
STEPS = 100
NAN_STEP = int(STEPS * NAN_STEP_FRACTION)
HOSTILE_RUN = "<script>window.__pwned=1</script>"
HOSTILE_PROJECT = '<img src=x onerror="window.__pwned=2">'
HOSTILE_SERIES = "<b>bold</b><img src=x onerror=window.__pwned=3>"  # Plotly would format <b> and keep <img> as text
CHARTS = ("chart-loss", "chart-scale", "chart-grad_norm")


def _unavailable(message: str) -> None:
    if REQUIRE_BROWSER:
        pytest.fail(f"{message} (AMPWATCH_REQUIRE_BROWSER is set)")
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module: Debian's `chromium`, since Playwright cannot download its own here."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Python Playwright is not installed: pip install playwright")
    if not os.path.exists(CHROMIUM):
        _unavailable(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page; any script error or failed request on it fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    page.on("console", lambda msg: msg.type == "error" and errors.append(f"console: {msg.text}"))
    yield page
    context.close()
    assert not errors, errors


def _shot(page: Any, name: str, selector: str | None = None) -> None:
    """Screenshots for a person to look at (test-artifacts/ is uploaded by CI, ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    if selector:
        page.locator(selector).screenshot(path=str(ARTIFACTS / name))
    else:
        page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def _trained_run(server: Any) -> dict[str, Any]:
    """A real fp16-autocast CPU training with the agent attached; its bad batch makes a NaN loss at NAN_STEP."""
    run_id = train(server.url, steps=STEPS).rsplit("/", 1)[1]
    with server.client() as http:
        return http.get(f"/api/v1/runs/{run_id}").json()


def _open_run(page: Any, server: Any, run_id: str) -> None:
    page.goto(f"{server.url}/runs/{run_id}")
    page.wait_for_selector("#charts[data-loaded='true']", timeout=15_000)


def _chart(page: Any, chart_id: str) -> dict[str, Any]:
    """What Plotly drew in one chart: its traces, its drawn lines, legend and points in the non-finite strip."""
    return page.evaluate(
        """(id) => {
          const el = document.getElementById(id);
          return {
            plotly: el.classList.contains("js-plotly-plot"),
            points: Number(el.dataset.points), nonfinite: Number(el.dataset.nonfinite),
            traces: (el.data || []).map((t) => ({ name: t.name, meta: t.meta || null, x: Array.from(t.x) })),
            lines: Array.from(el.querySelectorAll(".scatterlayer .js-line")).filter((p) => (p.getAttribute("d") || "").length > 20).length,
            legend: Array.from(el.querySelectorAll(".legendtext")).map((t) => t.textContent),
            strip_points: el.querySelectorAll(".subplot.xy2 .point").length,
          };
        }""",
        chart_id,
    )


def _register(server: Any, run_id: str, project: str, name: str) -> None:
    with server.client() as http:
        reply = http.put(f"/api/v1/runs/{run_id}", json={"project": project, "name": name})
        assert reply.status_code == 200, reply.text


def _post(server: Any, run_id: str, seq: int, points: dict[str, Any]) -> None:
    with server.client() as http:
        reply = http.post(f"/api/v1/runs/{run_id}/batches", json={"seq": seq, "points": points})
        assert reply.status_code == 200 and reply.json()["stored"], reply.text


def _assert_inert(page: Any) -> None:
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    scripts = page.evaluate("Array.from(document.scripts).map((s) => s.src || s.textContent)")
    assert not [s for s in scripts if "__pwned" in s]


def test_runs_page_lists_a_run_from_a_real_training_loop(sqlite_server: Any, page: Any) -> None:
    run = _trained_run(sqlite_server)
    page.goto(f"{sqlite_server.url}/")
    row = page.locator(f"tr[data-run-id='{run['id']}']")
    cells = row.locator("td").all_inner_texts()
    _shot(page, "runs.png")
    assert row.is_visible()
    assert cells[:5] == ["demo", run["name"], "finished", run["health"], str(STEPS - 1)]
    assert row.get_by_role("link", name=run["name"]).get_attribute("href") == f"/runs/{run['id']}"


def test_run_page_charts_loss_scale_and_grad_norm_from_a_real_training_loop(sqlite_server: Any, page: Any) -> None:
    run = _trained_run(sqlite_server)
    _open_run(page, sqlite_server, run["id"])
    _shot(page, "run.png")
    assert page.locator("h1").inner_text() == f"demo / {run['name']}"
    for chart_id in CHARTS:
        chart = _chart(page, chart_id)
        assert chart["plotly"], chart_id
        assert chart["points"] == STEPS, chart_id
        assert chart["traces"][0]["x"] == list(range(STEPS)), chart_id
        assert chart["lines"] >= 1, f"{chart_id}: no line was drawn"
    assert "skipped step" in _chart(page, "chart-scale")["legend"]


def test_nan_loss_of_a_real_training_loop_is_a_marker_on_the_loss_chart(sqlite_server: Any, page: Any) -> None:
    run = _trained_run(sqlite_server)
    with sqlite_server.client() as http:
        loss = http.get(f"/api/v1/runs/{run['id']}/series", params={"name": "loss"}).json()["loss"]
    assert loss["values"][NAN_STEP] == "NaN"  # the training really produced it
    _open_run(page, sqlite_server, run["id"])
    _shot(page, "run-loss-nan.png", "#chart-loss")
    chart = _chart(page, "chart-loss")
    markers = {t["name"]: t["x"] for t in chart["traces"] if t["meta"] == "nonfinite"}
    assert NAN_STEP in markers.get("NaN", []), chart["traces"]
    assert "NaN" in chart["legend"]
    assert chart["strip_points"] == chart["nonfinite"] >= 1


def test_point_sent_after_the_page_opened_appears_without_reload(sqlite_server: Any, page: Any) -> None:
    _register(sqlite_server, "live-1", "live", "streaming")
    _post(sqlite_server, "live-1", 1, {"loss": {"steps": [0, 1], "values": [1.0, "NaN"]}})
    _open_run(page, sqlite_server, "live-1")
    assert (_chart(page, "chart-loss")["points"], _chart(page, "chart-loss")["nonfinite"]) == (2, 1)
    page.evaluate("window.__same_document = true")
    _post(sqlite_server, "live-1", 2, {"loss": {"steps": [2, 3], "values": [0.5, "Infinity"]}})
    page.wait_for_function("document.getElementById('chart-loss').dataset.points === '4'", timeout=10_000)
    _shot(page, "run-live.png")
    chart = _chart(page, "chart-loss")
    assert page.evaluate("window.__same_document") is True
    assert chart["traces"][0]["x"] == [0, 1, 2, 3] and chart["nonfinite"] == 2
    assert {t["name"] for t in chart["traces"] if t["meta"] == "nonfinite"} == {"NaN", "+Inf"}
    assert page.locator("#run-step").inner_text() == "3"


def test_hostile_run_project_and_series_names_render_inert_on_both_pages(sqlite_server: Any, page: Any) -> None:
    _register(sqlite_server, "xss-1", HOSTILE_PROJECT, HOSTILE_RUN)
    points = {"loss": {"steps": [0, 1], "values": [1.0, 0.5]}, HOSTILE_SERIES: {"steps": [0, 1], "values": [1.0, 2.0]}}
    _post(sqlite_server, "xss-1", 1, points)
    page.goto(f"{sqlite_server.url}/")
    _shot(page, "runs-hostile.png")
    row = page.locator("tr[data-run-id='xss-1']")
    assert row.locator("td").all_inner_texts()[:2] == [HOSTILE_PROJECT, HOSTILE_RUN]
    _assert_inert(page)
    _open_run(page, sqlite_server, "xss-1")
    _shot(page, "run-hostile.png")
    assert page.locator("h1").inner_text() == f"{HOSTILE_PROJECT} / {HOSTILE_RUN}"
    assert page.title().startswith(HOSTILE_RUN)
    assert page.evaluate("document.querySelector('#chart-extra .gtitle').textContent") == HOSTILE_SERIES
    _assert_inert(page)
