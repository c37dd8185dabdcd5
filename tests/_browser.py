"""What the browser tests share: a page that fails on any script error, screenshots, and readers of what
Plotly drew. Imported as `_browser` (pytest puts tests/ on the path)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
HOSTILE_RUN = "<script>window.__pwned=1</script>"
HOSTILE_PROJECT = '<img src=x onerror="window.__pwned=2">'
HOSTILE_SERIES = "<b>bold</b><img src=x onerror=window.__pwned=3>"  # Plotly would format <b> and keep <img> as text
CHARTS = ("chart-loss", "chart-scale", "chart-grad_norm", "chart-lr")


@contextmanager
def context_page(browser: Any, **options: Any) -> Iterator[Any]:
    # Playwright's wait_for_function compiles its predicate with eval, which the pages' CSP forbids;
    # tests/test_security_browser.py loads the pages with the CSP enforced.
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True, **options)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    page.on("console", lambda msg: msg.type == "error" and errors.append(f"console: {msg.text}"))
    page.requests = []
    page.on("request", lambda request: page.requests.append(request.url))
    page.expected_errors = []  # type: ignore[attr-defined]  # (text of errors a test causes on purpose)
    yield page
    context.close()
    assert not [e for e in errors if not any(x in e for x in page.expected_errors)], errors


class socket_port:
    """A free loopback port (closed again before the server binds it)."""

    def __enter__(self) -> int:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def shot(page: Any, name: str, selector: str | None = None) -> None:
    """Screenshots for a person to look at (test-artifacts/ is uploaded by CI, ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    if selector:
        page.locator(selector).screenshot(path=str(ARTIFACTS / name))
    else:
        page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def open_run(page: Any, url: str, run_id: str) -> None:
    page.goto(f"{url}/runs/{run_id}")
    page.wait_for_selector("#charts[data-loaded='true']", timeout=15_000)


def chart(page: Any, chart_id: str) -> dict[str, Any]:
    """What Plotly drew in one chart: traces, drawn lines, legend, points in the non-finite strip, the x range."""
    return page.evaluate(
        """(id) => {
          const el = document.getElementById(id);
          return {
            plotly: el.classList.contains("js-plotly-plot"),
            points: Number(el.dataset.points), nonfinite: Number(el.dataset.nonfinite),
            layers: Number(el.dataset.layers), columns: Number(el.dataset.columns),
            traces: (el.data || []).map((t) => ({ name: t.name, type: t.type, meta: t.meta || null,
                                                 x: Array.from(t.x || []), y: Array.from(t.y || []) })),
            lines: Array.from(el.querySelectorAll(".scatterlayer .js-line"))
                     .filter((p) => (p.getAttribute("d") || "").length > 8).length,
            legend: Array.from(el.querySelectorAll(".legendtext")).map((t) => t.textContent),
            strip_points: el.querySelectorAll(".subplot.xy2 .point").length,
            range: el.layout && el.layout.xaxis.range ? Array.from(el.layout.xaxis.range) : null,
            shapes: (el.layout && el.layout.shapes || []).map((s) => ({
              type: s.type, x0: s.x0, x1: s.x1, meta: s.meta || null, fill: s.fillcolor || null })),
          };
        }""",
        chart_id,
    )


def register(url: str, run_id: str, project: str, name: str) -> None:
    reply = httpx.put(f"{url}/api/v1/runs/{run_id}", json={"project": project, "name": name}, timeout=10)
    assert reply.status_code == 200, reply.text


def post(
    url: str,
    run_id: str,
    seq: int,
    points: dict[str, Any],
    events: list[dict[str, Any]] | None = None,
    status: str | None = None,
) -> None:
    body = {"seq": seq, "points": points, "events": events or [], "status": status}
    reply = httpx.post(f"{url}/api/v1/runs/{run_id}/batches", json=body, timeout=10)
    assert reply.status_code == 200 and reply.json()["stored"], reply.text


def assert_inert(page: Any) -> None:
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    scripts = page.evaluate("Array.from(document.scripts).map((s) => s.src || s.textContent)")
    assert not [s for s in scripts if "__pwned" in s]


def row(page: Any, run_id: str) -> dict[str, str]:
    return page.evaluate(
        """(id) => Object.fromEntries(Array.from(document.querySelectorAll(`tr[data-run-id="${id}"] td[data-field]`))
                     .map((td) => [td.dataset.field, td.innerText.trim()]))""",
        run_id,
    )


def yaxis(page: Any, chart_id: str) -> dict[str, Any]:
    """A chart's y axis as Plotly laid it out, and the tick labels it drew (superscripts as their own tspan)."""
    return page.evaluate(
        """(id) => {
          const el = document.getElementById(id), axis = el._fullLayout.yaxis;
          const drawn = Array.from(el.querySelectorAll(".yaxislayer-above .ytick text"));
          return { type: axis.type, tickvals: Array.from(axis.tickvals || []),
                   ticktext: Array.from(axis.ticktext || []),
                   // Plotly pads a <sup> with zero-width spaces
                   drawn: drawn.map((t) => t.textContent.replaceAll("\u200b", "")),
                   superscripts: drawn.filter((t) => t.querySelector("tspan")).length };
        }""",
        chart_id,
    )
