// Chart drawing shared by the run and compare pages (global `AW`). Non-finite values are never dropped:
// each NaN / +Inf / -Inf is a marker at its step, drawn in a strip above the plot (axis y2) because it has
// no place on the value axis, with a faint line down through the plot so the step lines up with the curve.
"use strict";

const AW = (() => {
  const MAX_GUIDES = 200; // vertical guide lines per chart; markers themselves are never capped
  const NONFINITE = {
    "Infinity": { y: 0.8, symbol: "triangle-up", color: "#e8590c", label: "+Inf" },
    "NaN": { y: 0.5, symbol: "x", color: "#c92a2a", label: "NaN" },
    "-Infinity": { y: 0.2, symbol: "triangle-down", color: "#7048e8", label: "-Inf" },
  };
  const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';
  const CONFIG = { displaylogo: false, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
  const SKIP_FILL = "rgba(201, 42, 42, 0.10)";
  const RESUME = "#1971c2";
  const MAX_RESUMES = 100; // resume lines (and labels) per chart

  // A card whose width changes (the window's, or a new card in a grid beside it) has its plot laid out again.
  // Plotly then takes the element's computed size, height too: `plot` gives each element its layout's height.
  const resized = new ResizeObserver((entries) => entries.forEach(({ target, contentRect }) => {
    if (target._fullLayout && contentRect.width > 0 && Math.abs(contentRect.width - target._fullLayout.width) > 1) {
      Plotly.Plots.resize(target).catch(() => {}); // (it refuses a plot hidden since: the next width change will do)
    }
  }));

  /** Draw (or redraw) `el` as `layout.height` px high, as wide as its card, and keep it as wide as the card. */
  function plot(el, traces, layout) {
    el.style.height = `${layout.height}px`;
    if (!el._awSized) { el._awSized = true; resized.observe(el); }
    return Plotly.react(el, traces, layout, CONFIG);
  }

  /** Plotly renders a subset of HTML in titles, legends and ticks: user-chosen names must stay text. */
  function esc(text) {
    return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function num(v) {
    if (typeof v !== "number") return String(v);
    const a = Math.abs(v);
    return a !== 0 && (a >= 1e5 || a < 1e-3) ? v.toExponential(2).replace("e+", "e") : String(+v.toPrecision(4));
  }

  function split(series) {
    const x = [], y = [], marks = { "NaN": [], "Infinity": [], "-Infinity": [] };
    series.steps.forEach((step, i) => {
      const v = series.values[i];
      x.push(step);
      if (typeof v === "string") { y.push(null); marks[v].push(step); } else { y.push(v); }
    });
    return { x, y, marks };
  }

  function extent(values) {
    let lo = Infinity, hi = -Infinity;
    values.forEach((v) => { if (typeof v === "number") { lo = Math.min(lo, v); hi = Math.max(hi, v); } });
    return lo <= hi ? [lo, hi] : null;
  }

  /** Ticks for a log axis that read as numbers: powers of two for the loss scale, 1-2-5 or 1-3 per decade otherwise. */
  function logTicks(values, base) {
    const span = extent(values.filter((v) => v > 0));
    if (!span) return {};
    const log = (v) => Math.log(v) / Math.log(base);
    const lo = Math.floor(log(span[0]) + 1e-9), hi = Math.ceil(log(span[1]) - 1e-9);
    const every = Math.max(1, Math.ceil((hi - lo) / 8));
    const mults = base === 2 || hi - lo > 4 ? [1] : hi - lo > 2 ? [1, 3] : [1, 2, 5];
    const tickvals = [], ticktext = [];
    for (let k = lo; k <= hi; k += every) {
      mults.forEach((m) => {
        tickvals.push(m * base ** k);
        ticktext.push(base === 2 ? `2<sup>${k}</sup>` : num(m * base ** k));
      });
    }
    return { type: "log", tickvals, ticktext };
  }

  /** A y axis for the finite values: log when asked (or when `auto` and they span decades), padded when flat. */
  function valueAxis(y, log) {
    const span = extent(y);
    if (!span) return {};
    const wide = span[0] > 0 && span[1] / span[0] >= 100;
    if ((log === 2 || log === 10 || (log === "auto" && wide)) && span[1] > 0) return logTicks(y, log === 2 ? 2 : 10);
    if (span[0] !== span[1]) return {};
    const pad = Math.abs(span[0]) / 2 || 1;
    return { range: [span[0] - pad, span[1] + pad] };
  }

  function markerTraces(marks, prefix = "", color = null) {
    return Object.entries(marks).filter(([, steps]) => steps.length).map(([kind, steps]) => ({
      x: steps, y: steps.map(() => NONFINITE[kind].y), yaxis: "y2", mode: "markers", type: "scatter",
      name: prefix + NONFINITE[kind].label, hovertemplate: `${prefix}${NONFINITE[kind].label} at step %{x}<extra></extra>`,
      marker: { symbol: NONFINITE[kind].symbol, size: 10, color: color || NONFINITE[kind].color,
                line: { width: 1.5, color: color || NONFINITE[kind].color } },
      meta: "nonfinite", cliponaxis: false, showlegend: !prefix,
    }));
  }

  function guides(marks) {
    return Object.entries(marks).flatMap(([kind, steps]) => steps.slice(0, MAX_GUIDES).map((step) => ({
      type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 0.86, layer: "below",
      line: { color: NONFINITE[kind].color, width: 1, dash: "dot" }, opacity: 0.6,
    })));
  }

  /** Shaded spans of skipped optimizer steps, and the step an event points at. */
  function overlays(spans, cursor, flagged) {
    const top = flagged ? 0.86 : 1;
    const shaded = spans.map(([a, b]) => ({ type: "rect", xref: "x", yref: "paper", x0: a - 0.5, x1: b + 0.5, y0: 0, y1: top,
                                            layer: "below", fillcolor: SKIP_FILL, line: { width: 0 } }));
    const mark = cursor == null ? [] : [{ type: "line", xref: "x", yref: "paper", x0: cursor, x1: cursor, y0: 0, y1: 1,
                                          line: { color: "#1d2433", width: 1.5, dash: "dash" }, meta: "cursor" }];
    return [...shaded, ...mark];
  }

  function hasMarks(marks) {
    return Object.values(marks).some((steps) => steps.length);
  }

  /** Whole steps only: a tick per step while a handful are shown, Plotly's own choice beyond. */
  function stepTicks(range) {
    const few = range[1] - range[0] < 12;
    return { "xaxis.tickmode": few ? "linear" : "auto", "xaxis.dtick": few ? 1 : null, "xaxis.tick0": few ? 0 : null };
  }

  function unflat(updates) {
    return Object.fromEntries(Object.entries(updates).filter(([, v]) => v !== null).map(([k, v]) => [k.replace("xaxis.", ""), v]));
  }

  /** A line at the first step of each launch that resumed the run from a checkpoint. */
  function resumeLines(resumes) {
    return (resumes || []).slice(-MAX_RESUMES).map((step) => ({
      type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 1, meta: "resume",
      line: { color: RESUME, width: 1.5, dash: "dash" },
    }));
  }

  /** Their labels, at the foot of the plot (the non-finite strip is at its top); the full sentence on hover. */
  function resumeLabels(resumes) {
    return (resumes || []).slice(-MAX_RESUMES).map((step) => ({
      text: "resumed", x: step, xref: "x", yref: "paper", y: 0, yanchor: "bottom", xanchor: "left", xshift: 2,
      showarrow: false, font: { size: 10, color: RESUME }, bgcolor: "rgba(255, 255, 255, 0.8)",
      hovertext: `resumed at step ${step}: the steps from here are a later launch's, continuing the run`,
    }));
  }

  /** Every shape of a chart: the non-finite strip and its guides, skipped-step spans, resume lines, the event cursor. */
  function shapes(marks, spans, cursor, resumes) {
    const flagged = hasMarks(marks);
    const strip = { type: "rect", xref: "paper", yref: "paper", x0: 0, x1: 1, y0: 0.88, y1: 1, layer: "below",
                    fillcolor: "#fff5f5", line: { width: 0 } };
    return [...(flagged ? [strip, ...guides(marks)] : []), ...resumeLines(resumes), ...overlays(spans || [], cursor, flagged)];
  }

  function layout(title, yaxis, marks, empty, view, extra = {}) {
    const flagged = hasMarks(marks);
    const label = { text: "non-finite", xref: "paper", yref: "paper", x: 0, xanchor: "right", xshift: -6, y: 0.94,
                    showarrow: false, font: { size: 10, color: "#c92a2a" } };
    const notice = { text: extra.notice || "no data yet", xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
                     font: { size: 13, color: "#6b7385" } };
    return {
      title: { text: title, x: 0.01, xanchor: "left", y: 0.97, font: { size: 14, color: "#1d2433" } },
      font: { family: FONT, size: 12, color: "#4a5163" },
      margin: { l: 64, r: 20, t: 40, b: 36 }, height: extra.height || (empty ? 110 : 250),
      legend: { orientation: "h", x: 1, xanchor: "right", y: 1.0, yanchor: "bottom", bgcolor: "rgba(0,0,0,0)" },
      xaxis: { title: { text: "step", standoff: 4 }, zeroline: false, gridcolor: "#eef0f5", visible: !empty,
               range: view ? view.slice() : undefined, autorange: !view, ...(view ? unflat(stepTicks(view)) : {}) },
      yaxis: Object.assign({ zeroline: false, gridcolor: "#eef0f5", domain: [0, flagged ? 0.86 : 1], visible: !empty }, yaxis),
      yaxis2: { domain: [0.88, 1], range: [0, 1], visible: false, fixedrange: true },
      shapes: shapes(marks, extra.spans, extra.cursor, empty ? [] : extra.resumes),
      annotations: [...(flagged ? [label] : []), ...(empty ? [notice] : resumeLabels(extra.resumes))],
      hovermode: "x unified", paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fff",
    };
  }

  /** One series as a line with its non-finite markers; `opts`: title, log, color, extra traces, view, spans, cursor. */
  function line(el, series, opts = {}) {
    const { x, y, marks } = split(series || { steps: [], values: [] });
    const main = { x, y, type: "scatter", mode: x.length < 60 ? "lines+markers" : "lines", name: esc(opts.name || el.dataset.series),
                   line: { width: 1.5, color: opts.color || "#3b5bdb" }, marker: { size: 4 }, connectgaps: false };
    const traces = [main, ...(opts.extra || []), ...markerTraces(marks)];
    const yaxis = valueAxis(y, opts.log);
    const title = esc(opts.title || el.dataset.title) + (opts.log === "auto" && yaxis.type === "log" ? " (log axis)" : "");
    const shown = Object.assign(layout(title, yaxis, marks, !x.length, opts.view, opts), { showlegend: traces.length > 1 });
    el.dataset.points = String(x.length);
    el.dataset.nonfinite = String(marks["NaN"].length + marks["Infinity"].length + marks["-Infinity"].length);
    el._aw = { marks, empty: !x.length };
    return plot(el, traces, shown);
  }

  /** A layer × step grid (`GET /runs/{id}/heatmap`) colored by log10 of each cell's largest value; NaN and ±Inf
   *  cells are markers on top, since no color can say "not a number". */
  function heatmap(el, full, opts = {}) {
    // Columns where no layer has a value are left out, so a norm recorded every N steps fills the N steps after it.
    const keep = full.steps.map((_, j) => full.values.some((row) => row[j] !== null));
    const grid = { ...full, steps: full.steps.filter((_, j) => keep[j]),
                   values: full.values.map((row) => row.filter((_, j) => keep[j])) };
    const half = (grid.width - 1) / 2;
    const x = grid.steps.map((s) => s + half); // (where each cell's values were taken: its markers go there)
    const edges = cellEdges(grid.steps, grid.width, opts.until);
    const layers = grid.layers.map(esc);
    const z = grid.values.map((row) => row.map((v) => (typeof v === "number" && v > 0 ? Math.log10(v) : null)));
    const text = grid.values.map((row) => row.map((v, j) => {
      const a = grid.steps[j], b = a + grid.width - 1;
      return `${v === null ? "no value" : num(v)} · step${a === b ? " " + a : `s ${a}–${b}`}`;
    }));
    const rows = Math.max(1, layers.length);
    const height = layers.length ? Math.min(640, Math.max(220, 70 + 18 * rows)) : 110;
    // The color scale sits in the top margin, under the title: beside the plot it would narrow it, and a step would
    // no longer be at the same x as on the charts above and below. (A title of its own would move the chart's.)
    const colorbar = { orientation: "h", thickness: 8, len: 0.3, x: 1, xanchor: "right", yref: "container",
                       y: 1 - 28 / height, yanchor: "top", ypad: 0, tickfont: { size: 10 } };
    const heat = { type: "heatmap", x: edges, y: layers, z, text, colorscale: "Viridis", zsmooth: false, ygap: 1,
                   hovertemplate: "%{y}<br>max %{text}<extra></extra>", name: "grad norm", colorbar };
    const traces = [heat, ...cellMarkers(grid, x, layers)];
    const shown = layout(esc(opts.title || el.dataset.title), {}, {}, !layers.length, opts.view, { ...opts, spans: [], height });
    Object.assign(shown, { hovermode: "closest", showlegend: false, margin: { l: 64, r: 20, t: 64, b: 36 } });
    Object.assign(shown.yaxis, { autorange: "reversed", automargin: true, tickfont: { size: 10 }, gridcolor: "rgba(0,0,0,0)" });
    el.dataset.layers = String(layers.length);
    el.dataset.columns = String(grid.steps.length);
    el._aw = { marks: {}, empty: !layers.length };
    return plot(el, traces, shown);
  }

  /** Where each kept column's cell begins and the last one ends (Plotly takes n + 1 x values as cell edges). A cell
   *  begins at its own first step and reaches the next kept column: given only centers, Plotly would split every
   *  gap between two columns in half, drawing each sample half a gap before it was taken, and the first cell of a
   *  run of per-step samples (the NaN probe's) across half the gap before it. The last cell is as wide as the
   *  gap before it (the sampling interval), but ends at `until` (the step after the run's last) when that is sooner. */
  function cellEdges(steps, width, until) {
    if (!steps.length) return [];
    const last = steps[steps.length - 1];
    const interval = steps.length > 1 ? last - steps[steps.length - 2] : width;
    const end = Math.max(last + width, Math.min(last + interval, until == null ? last + width : until));
    return [...steps, end];
  }

  function cellMarkers(grid, x, layers) {
    const byKind = {};
    grid.values.forEach((row, i) => row.forEach((v, j) => {
      if (typeof v !== "string") return;
      (byKind[v] = byKind[v] || { x: [], y: [] }).x.push(x[j]);
      byKind[v].y.push(layers[i]);
    }));
    return Object.entries(byKind).map(([kind, at]) => ({
      ...at, type: "scatter", mode: "markers", name: NONFINITE[kind].label, meta: "nonfinite",
      marker: { symbol: NONFINITE[kind].symbol, size: 9, color: "#fff", line: { width: 2, color: NONFINITE[kind].color } },
      hovertemplate: `%{y}<br>${NONFINITE[kind].label} near step %{x:.0f}<extra></extra>`,
    }));
  }

  return { esc, num, split, extent, logTicks, line, heatmap, layout, shapes, stepTicks, markerTraces, plot, NONFINITE };
})();
