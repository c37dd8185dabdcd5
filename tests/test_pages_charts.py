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
