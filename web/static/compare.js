// The compare page: one series of several runs on one chart, each run's NaN / ±Inf markers in its own color.
// Zooming reads every run again over the zoomed range only, at full resolution where it fits, like the run page.
"use strict";

(() => {
  const el = document.getElementById("compare-chart");
  const rows = Array.from(document.querySelectorAll("#compare-runs tr[data-run-id]"));
  if (!el || !rows.length || typeof Plotly === "undefined") return;
  const COLORS = ["#3b5bdb", "#e8590c", "#2b8a3e", "#ae3ec9", "#0c8599", "#c92a2a", "#5c940d", "#862e9c"];
  const MAX_POINTS = 2000;
  const name = el.dataset.series;
  let full = null, drawing = 0, timer = null, asked = 0;

  async function series(runId, range) {
    const within = range ? `&start_step=${Math.max(0, Math.floor(range[0]))}&end_step=${Math.max(0, Math.ceil(range[1]))}` : "";
    const url = `/api/v1/runs/${encodeURIComponent(runId)}/series?name=${encodeURIComponent(name)}&max_points=${MAX_POINTS}${within}`;
    const reply = await fetch(url);
    if (!reply.ok) throw new Error(`${url}: HTTP ${reply.status}`);
    return (await reply.json())[name];
  }

  /** Read every run over `range` (padded a quarter each side, so a small pan needs no read) or whole; draw at `range`. */
  async function show(range) {
    const ticket = ++asked;
    const pad = range ? Math.max(1, range[1] - range[0]) * 0.25 : 0;
    const data = await Promise.all(rows.map((r) => series(r.dataset.runId, range && [range[0] - pad, range[1] + pad])));
    if (ticket !== asked) return; // a newer zoom came in meanwhile
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
    if (!range) {
      const steps = data.flatMap((s) => (s.steps.length ? [s.steps[0], s.steps[s.steps.length - 1]] : []));
      const margin = steps.length ? Math.max(0.5, (Math.max(...steps) - Math.min(...steps)) * 0.01) : 0;
      full = steps.length ? [Math.min(...steps) - margin, Math.max(...steps) + margin] : null;
    }
    const layout = AW.layout(title, wide ? AW.logTicks(ys, 10) : {}, marks, !ys.length, range || full, { height: 420 });
    if (!el.data) el.replaceChildren();
    drawing += 1;
    try {
      await AW.plot(el, traces, Object.assign(layout, { showlegend: true }));
    } finally {
      drawing -= 1;
    }
    el.dataset.traces = String(data.length);
    el.dataset.points = String(data.reduce((n, s) => n + s.steps.length, 0));
    el.dataset.view = (range || full || []).map(Math.round).join(",");
    if (!el._awBound) {
      el._awBound = true;
      el.on("plotly_relayout", zoomed);
    }
  }

  function zoomed(ev) {
    if (drawing) return;
    let range;
    if ("xaxis.range[0]" in ev) range = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
    else if (Array.isArray(ev["xaxis.range"])) range = ev["xaxis.range"].slice();
    else if (ev["xaxis.autorange"]) range = null;
    else return;
    clearTimeout(timer);
    timer = setTimeout(() => show(range).catch(report), 250);
  }

  function report(e) {
    console.error("ampwatch", e);
  }

  show(null).catch(report);
})();
