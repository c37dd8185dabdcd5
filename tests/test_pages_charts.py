"""What the run page's charts draw where steps meet: the per-layer heatmap's cells (a norm every N steps, then every
step while the NaN probe is armed) and its step axis against the other charts; the line at each resume's first step,
from a real save/resume loop and live. In a real headless Chromium against a real server."""

from __future__ import annotations

from typing import Any

import _browser as ui

# Plotly's own geometry: the x edges it computed for the heatmap's cells, and each chart's plot area in pixels.
HEAT_EDGES = "Array.from(document.getElementById('chart-layers').calcdata[0][0].x)"
PLOT_AREA = "(id) => { const s = document.getElementById(id)._fullLayout._size; return [s.l, s.w]; }"


def _sparse_then_per_step(url: str, run_id: str) -> None:
    """What the agent records for a watched model: per-layer norms every 50 steps, then, from the NaN at 480 that
    armed the probe, every step."""
    ui.register(url, run_id, "heat", "sparse then per step")
    steps = list(range(500))
    sampled = list(range(0, 451, 50)) + list(range(480, 500))
    layers = {
        f"grad_norm/blocks.{i}": {"steps": sampled, "values": ["NaN" if s == 480 else 0.5 + i for s in sampled]}
        for i in range(3)
    }
    ui.post(url, run_id, 1, {"loss": {"steps": steps, "values": [1.0] * 500}, **layers})


def test_heatmap_cells_begin_at_the_step_their_norms_were_taken_with_no_gap_before_the_per_step_cells(
    sqlite_server: Any, page: Any
) -> None:
    url = sqlite_server.url
    _sparse_then_per_step(url, "heat-1")
    ui.open_run(page, url, "heat-1")
    ui.shot(page, "run-heatmap-cells.png", "#chart-layers")
    heat = ui.chart(page, "chart-layers")
    edges = page.evaluate(HEAT_EDGES)
    grid = page.evaluate("fetch('/api/v1/runs/heat-1/heatmap?columns=300').then((r) => r.json())")
    width = grid["width"]
    kept = [s for j, s in enumerate(grid["steps"]) if any(row[j] is not None for row in grid["values"])]
    assert heat["columns"] == len(kept) and width == 2 and kept[:10] == list(range(0, 451, 50))
    assert edges == [*kept, 500], edges  # each cell from its own step to the next; the last to the run's end

    def cell_of(step: int) -> int:
        return kept[max(j for j in range(len(kept)) if edges[j] <= step < edges[j + 1])]

    assert cell_of(470) == 450  # (drawn from centers, the NaN cell at 480 reached back to 465.5: a blank gap)
    assert cell_of(480) == 480 and cell_of(449) == 400 and cell_of(0) == 0
    [nan] = [t for t in heat["traces"] if t["meta"] == "nonfinite"]
    assert set(nan["x"]) == {480 + (width - 1) / 2}  # the NaN marker at the step it was taken


def test_heatmap_shares_the_step_axis_of_the_charts_above_and_below_it(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    _sparse_then_per_step(url, "heat-2")
    ui.open_run(page, url, "heat-2")
    areas = {chart_id: page.evaluate(PLOT_AREA, chart_id) for chart_id in ("chart-loss", "chart-layers", "chart-lr")}
    assert areas["chart-layers"] == areas["chart-loss"] == areas["chart-lr"], areas  # (a step is at one x on all)
    assert ui.chart(page, "chart-layers")["range"] == ui.chart(page, "chart-loss")["range"]


def _resume_marks(page: Any, chart_id: str) -> tuple[list[float], list[float]]:
    """A chart's resume lines (their steps) and the steps of its "resumed" labels."""
    drawn = page.evaluate(
        """(id) => { const l = document.getElementById(id).layout;
                     return [(l.shapes || []).filter((s) => s.meta === "resume").map((s) => s.x0),
                             (l.annotations || []).filter((a) => a.text === "resumed").map((a) => a.x)]; }""",
        chart_id,
    )
    return drawn[0], drawn[1]


def test_each_resume_of_a_real_save_resume_loop_is_a_line_on_every_chart(
    sqlite_server: Any, page: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    from test_resume import _launch

    monkeypatch.setenv("AMPWATCH_RUN_ID", "resumed-twice")
    checkpoint = tmp_path / "ckpt.pt"
    _launch(sqlite_server, checkpoint, range(0, 20))
    _launch(sqlite_server, checkpoint, range(20, 35), resume_step=20)
    _launch(sqlite_server, checkpoint, range(35, 50), resume_step=35)
    checkpoint.unlink()
    _launch(sqlite_server, checkpoint, range(0, 5))  # (a relaunch without resume_step: held back, no resume line)
    ui.open_run(page, sqlite_server.url, "resumed-twice")
    ui.shot(page, "run-resumed.png")
    for chart_id in (*ui.CHARTS, "chart-layers"):
        assert _resume_marks(page, chart_id) == ([20, 35], [20, 35]), chart_id
    assert page.locator("#resume-key").is_visible()
    # Zoomed in (an event's step), the lines stay with their steps.
    page.locator("#timeline li.ev[data-step='35'] button").first.click()
    page.wait_for_function("Number(document.getElementById('charts').dataset.view.split(',')[0]) >= 10", timeout=10_000)
    loss = ui.chart(page, "chart-loss")
    assert [s["x0"] for s in loss["shapes"] if s["meta"] == "resume"] == [20, 35] and 10 <= loss["range"][0] < 20


def test_a_resume_that_arrives_live_adds_its_line(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "live-resume", "resume", "live")
    ui.post(url, "live-resume", 1, {"loss": {"steps": list(range(10)), "values": [1.0] * 10}})
    ui.open_run(page, url, "live-resume")
    page.wait_for_selector("#charts[data-live='open']", timeout=10_000)
    assert _resume_marks(page, "chart-loss") == ([], []) and not page.locator("#resume-key").is_visible()
    resumed = {  # (as the agent's init(..., resume_step=10) records it)
        "step": 10,
        "type": "amp_config",
        "severity": "info",
        "message": "Resumed at step 10: this launch's steps continue the run's numbering from there.",
        "details": {"check": "resumed", "step": 10},
    }
    other_rank = {**resumed, "step": 12, "rank": 1}  # (the page shows rank 0)
    ui.post(url, "live-resume", 2, {"loss": {"steps": list(range(10, 20)), "values": [0.5] * 10}}, [resumed])
    ui.post(url, "live-resume", 3, {}, [other_rank])
    page.wait_for_function(
        "(document.getElementById('chart-loss').layout.shapes || []).some((s) => s.meta === 'resume')", timeout=10_000
    )
    page.wait_for_selector("#timeline li.ev[data-step='12']", timeout=10_000)
    assert _resume_marks(page, "chart-loss") == ([10], [10]) and page.locator("#resume-key").is_visible()
    assert ui.chart(page, "chart-loss")["points"] == 20


# Each drawn chart's card, its drawn SVG (both [left, top, right, bottom]), the width its card gives a plot, and
# the size Plotly laid the plot out at.
GEOMETRY = """() => Array.from(document.querySelectorAll(".js-plotly-plot")).map((el) => {
  const box = (r) => [r.left, r.top, r.right, r.bottom].map(Math.round), style = getComputedStyle(el);
  return { id: el.id || el.dataset.series, card: box(el.getBoundingClientRect()),
           svg: box(el.querySelector(".main-svg").getBoundingClientRect()),
           inner: el.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
           width: el._fullLayout.width, height: el._fullLayout.height };
})"""
# Plotly has laid every chart out again at its new width (it does so 100 ms after its card's width changed).
RELAID = """(before) => Array.from(document.querySelectorAll(".js-plotly-plot"))
                .every((el, i) => el._fullLayout.width !== before[i])"""
FILLED = """() => Array.from(document.querySelectorAll(".js-plotly-plot"))
                .every((el) => Math.abs(el._fullLayout.width - parseFloat(getComputedStyle(el).width)) <= 1)"""
WIDTHS = (1200, 1000, 1600)  # narrower, narrower with the timeline below the charts (under 1100 px), wider


def _assert_laid_out(charts: list[dict[str, Any]], heights: dict[str, float], at: str) -> None:
    """Each chart fills its card's width and keeps the height it was drawn at, inside its card; no cards overlap."""
    for c in charts:
        assert abs(c["width"] - c["inner"]) <= 1, f"{at}: {c['id']} is {c['width']} px wide in a {c['inner']} px card"
        assert abs(c["height"] - heights[c["id"]]) <= 2, (
            f"{at}: {c['id']} is {c['height']} px high, was {heights[c['id']]}"
        )
        card, svg = c["card"], c["svg"]
        assert card[0] <= svg[0] and card[1] <= svg[1] and svg[2] <= card[2] and svg[3] <= card[3], (
            f"{at}: {c['id']} drawn at {c['svg']}, its card at {c['card']}"
        )
    for i, a in enumerate(charts):
        for b in charts[i + 1 :]:
            assert not _overlap(a["card"], b["card"]), f"{at}: {a['id']} {a['card']} overlaps {b['id']} {b['card']}"


def _overlap(a: list[int], b: list[int]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_charts_keep_their_height_and_fill_their_card_when_the_window_is_resized(sqlite_server: Any, page: Any) -> None:
    url = sqlite_server.url
    ui.register(url, "resized", "resize", "window")
    steps = list(range(40))
    series = ("loss", "scale", "grad_norm", "tokens")  # (no lr: an empty chart, 110 px high)
    points = {name: {"steps": steps, "values": [1.0 + s for s in steps]} for name in series}
    points |= {f"grad_norm/blocks.{i}": {"steps": steps, "values": [0.5 + i] * 40} for i in range(3)}
    ui.post(url, "resized", 1, points)
    pages = {  # (the heights each page draws some of its charts at)
        "run": (
            f"{url}/runs/resized",
            "#charts[data-loaded='true']",
            {"chart-loss": 250, "chart-lr": 110, "tokens": 250},
        ),
        "compare": (
            f"{url}/compare?run=resized&series=loss",
            "#compare-chart[data-traces='1']",
            {"compare-chart": 420},
        ),
    }
    for kind, (address, ready, heights) in pages.items():
        page.set_viewport_size({"width": 1400, "height": 900})
        page.goto(address)
        page.wait_for_selector(ready, timeout=15_000)
        loaded = page.evaluate(GEOMETRY)
        drawn = {c["id"]: c["height"] for c in loaded}
        assert len(drawn) == (6 if kind == "run" else 1) and heights.items() <= drawn.items(), drawn
        _assert_laid_out(loaded, drawn, f"{kind} page at load")
        if kind == "run":  # a series that arrives live gets a card beside the other one's, which narrows
            ui.post(url, "resized", 2, {"momentum": {"steps": steps, "values": [0.9] * 40}})
            page.wait_for_selector("#chart-extra [data-series='momentum'].js-plotly-plot", timeout=10_000)
            page.wait_for_function(FILLED, timeout=10_000)  # (the plot beside it, once Plotly has laid it out again)
            drawn["momentum"] = 250
            _assert_laid_out(page.evaluate(GEOMETRY), drawn, "run page with a live series")
        for width in WIDTHS:
            before = [c["width"] for c in page.evaluate(GEOMETRY)]
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_function(RELAID, arg=before, timeout=10_000)
            _assert_laid_out(page.evaluate(GEOMETRY), drawn, f"{kind} page at {width} px")
        ui.shot(page, f"{kind}-resized.png")
