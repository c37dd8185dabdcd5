// The compare page: one series of several runs on one chart, each run's NaN / ±Inf markers in its own color.
"use strict";

(() => {
  const el = document.getElementById("compare-chart");
  const rows = Array.from(document.querySelectorAll("#compare-runs tr[data-run-id]"));
  if (!el || !rows.length || typeof Plotly === "undefined") return;
  const COLORS = ["#3b5bdb", "#e8590c", "#2b8a3e", "#ae3ec9", "#0c8599", "#c92a2a", "#5c940d", "#862e9c"];
  const name = el.dataset.series;

  async function series(runId) {
    const url = `/api/v1/runs/${encodeURIComponent(runId)}/series?name=${encodeURIComponent(name)}&max_points=2000`;
    const reply = await fetch(url);
    if (!reply.ok) throw new Error(`${url}: HTTP ${reply.status}`);
    return (await reply.json())[name];
  }

  async function main() {
    const data = await Promise.all(rows.map((r) => series(r.dataset.runId)));
    const traces = [], marks = { "NaN": [], "Infinity": [], "-Infinity": [] }, ys = [];
    data.forEach((s, i) => {
      const color = COLORS[i % COLORS.length], label = AW.esc(rows[i].dataset.label);
      const { x, y, marks: own } = AW.split(s);
      ys.push(...y);
      Object.keys(marks).forEach((k) => marks[k].push(...own[k]));
      traces.push({ x, y, type: "scatter", mode: x.length < 60 ? "lines+markers" : "lines", name: label,
                    line: { width: 1.5, color }, marker: { size: 4 }, connectgaps: false });
      traces.push(...AW.markerTraces(own, `${label} `, color));
      rows[i].querySelector("th").style.borderLeft = `4px solid ${color}`;
    });
    const title = `${AW.esc(name)} — ${rows.length} run${rows.length === 1 ? "" : "s"}`;
    const positive = ys.filter((v) => typeof v === "number" && v > 0);
    const wide = positive.length && Math.max(...positive) / Math.min(...positive) >= 100;
    const steps = data.flatMap((s) => (s.steps.length ? [s.steps[0], s.steps[s.steps.length - 1]] : []));
    const pad = steps.length ? Math.max(0.5, (Math.max(...steps) - Math.min(...steps)) * 0.01) : 0;
    const view = steps.length ? [Math.min(...steps) - pad, Math.max(...steps) + pad] : null;
    const layout = AW.layout(title, wide ? { type: "log" } : {}, marks, !ys.length, view, { height: 420 });
    el.replaceChildren();
    el.dataset.traces = String(data.length);
    el.dataset.points = String(data.reduce((n, s) => n + s.steps.length, 0));
    await Plotly.react(el, traces, Object.assign(layout, { showlegend: true }), AW.CONFIG);
  }

  main().catch((e) => console.error("ampwatch", e));
})();
