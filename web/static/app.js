// Run page charts. Non-finite values are never dropped: each NaN / +Inf / -Inf is a marker at its step,
// drawn in a strip above the plot (axis y2) because it has no place on the value axis, with a faint
// line down through the plot so the step lines up with the curve.
"use strict";

const MAX_POINTS = 4000;
const MAX_GUIDES = 200; // vertical guide lines per chart; markers themselves are never capped
const NONFINITE = {
  "Infinity": { y: 0.8, symbol: "triangle-up", color: "#e8590c", label: "+Inf" },
  "NaN": { y: 0.5, symbol: "x", color: "#c92a2a", label: "NaN" },
  "-Infinity": { y: 0.2, symbol: "triangle-down", color: "#7048e8", label: "-Inf" },
};
const STANDARD = new Set(["loss", "scale", "skipped", "grad_norm"]);
const FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';

/** Plotly renders a subset of HTML in titles and legends: user-chosen names must stay text. */
function esc(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function num(v) {
  return v >= 1e5 || v < 1e-3 ? v.toExponential(0).replace("e+", "e") : String(+v.toPrecision(3));
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
  const span = extent(values);
  if (!span || span[0] <= 0) return {};
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
  if (log === 2 || log === 10 || (log === "auto" && wide)) return logTicks(y, log === 2 ? 2 : 10);
  if (span[0] !== span[1]) return {};
  const pad = Math.abs(span[0]) / 2 || 1;
  return { range: [span[0] - pad, span[1] + pad] };
}

function markerTraces(marks) {
  return Object.entries(marks).filter(([, steps]) => steps.length).map(([kind, steps]) => ({
    x: steps, y: steps.map(() => NONFINITE[kind].y), yaxis: "y2", mode: "markers", type: "scatter",
    name: NONFINITE[kind].label, hovertemplate: `${NONFINITE[kind].label} at step %{x}<extra></extra>`,
    marker: { symbol: NONFINITE[kind].symbol, size: 10, color: NONFINITE[kind].color, line: { width: 1.5, color: NONFINITE[kind].color } },
    meta: "nonfinite", cliponaxis: false,
  }));
}

function guides(marks) {
  return Object.entries(marks).flatMap(([kind, steps]) => steps.slice(0, MAX_GUIDES).map((step) => ({
    type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 0.86, layer: "below",
    line: { color: NONFINITE[kind].color, width: 1, dash: "dot" }, opacity: 0.6,
  })));
}

/** Every chart of the page autoranges to the same steps, so they line up one above the other. */
function stepAxis(steps) {
  if (!steps) return {};
  const pad = Math.max(0.5, (steps[1] - steps[0]) * 0.005), lo = steps[0] - pad, hi = steps[1] + pad;
  return { autorangeoptions: { include: [lo, hi], minallowed: lo, maxallowed: hi }, dtick: hi - lo < 12 ? 1 : undefined };
}

function layout(title, yaxis, marks, empty, steps) {
  const flagged = Object.values(marks).some((steps) => steps.length);
  const strip = { type: "rect", xref: "paper", yref: "paper", x0: 0, x1: 1, y0: 0.88, y1: 1, layer: "below",
                  fillcolor: "#fff5f5", line: { width: 0 } };
  const label = { text: "non-finite", xref: "paper", yref: "paper", x: 0, xanchor: "right", xshift: -6, y: 0.94,
                  showarrow: false, font: { size: 10, color: "#c92a2a" } };
  const notice = { text: "no data yet", xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false,
                   font: { size: 13, color: "#6b7385" } };
  return {
    title: { text: title, x: 0.01, xanchor: "left", y: 0.97, font: { size: 14, color: "#1d2433" } },
    font: { family: FONT, size: 12, color: "#4a5163" },
    margin: { l: 64, r: 20, t: 40, b: 40 }, height: 270,
    legend: { orientation: "h", x: 1, xanchor: "right", y: 1.0, yanchor: "bottom", bgcolor: "rgba(0,0,0,0)" },
    xaxis: Object.assign({ title: { text: "step", standoff: 4 }, zeroline: false, gridcolor: "#eef0f5", visible: !empty },
                         stepAxis(steps)),
    yaxis: Object.assign({ zeroline: false, gridcolor: "#eef0f5", domain: [0, flagged ? 0.86 : 1], visible: !empty }, yaxis),
    yaxis2: { domain: [0.88, 1], range: [0, 1], visible: false, fixedrange: true },
    shapes: flagged ? [strip, ...guides(marks)] : [],
    annotations: [...(flagged ? [label] : []), ...(empty ? [notice] : [])],
    hovermode: "x unified", paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fff",
    uirevision: "keep", // a refresh keeps the user's zoom
  };
}

function draw(el, series, opts = {}) {
  const { x, y, marks } = split(series || { steps: [], values: [] });
  const main = { x, y, type: "scatter", mode: x.length < 60 ? "lines+markers" : "lines", name: esc(el.dataset.series),
                 line: { width: 1.5, color: opts.color || "#3b5bdb" }, marker: { size: 4 }, connectgaps: false };
  const traces = [main, ...(opts.extra || []), ...markerTraces(marks)];
  const config = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
  const yaxis = valueAxis(y, opts.log);
  const title = esc(el.dataset.title) + (opts.log === "auto" && yaxis.type === "log" ? " (log axis)" : "");
  const shown = Object.assign(layout(title, yaxis, marks, !x.length, opts.steps), { showlegend: traces.length > 1 });
  el.dataset.points = String(x.length);
  el.dataset.nonfinite = String(marks["NaN"].length + marks["Infinity"].length + marks["-Infinity"].length);
  Plotly.react(el, traces, shown, config);
}

function skippedMarkers(scale, skipped) {
  if (!scale || !skipped || !skipped.steps.length) return [];
  const at = new Map(scale.steps.map((s, i) => [s, scale.values[i]]));
  const steps = skipped.steps.filter((s, i) => skipped.values[i] === 1);
  return [{ x: steps, y: steps.map((s) => at.get(s)), mode: "markers", type: "scatter", name: "skipped step",
            marker: { symbol: "circle-open", size: 8, color: "#c92a2a", line: { width: 1.5 } }, cliponaxis: false,
            hovertemplate: "skipped at step %{x}<extra></extra>" }];
}

function chartFor(holder, name) {
  let el = holder.querySelector(`[data-series="${CSS.escape(name)}"]`);
  if (!el) {
    el = Object.assign(document.createElement("div"), { className: "chart" });
    Object.assign(el.dataset, { series: name, title: name });
    holder.appendChild(el);
  }
  return el;
}

function setBadge(id, text, className) {
  const el = document.getElementById(id);
  el.textContent = text;
  if (className) el.className = className;
}

async function refresh(root) {
  const id = root.dataset.runId;
  const run = await (await fetch(`/api/v1/runs/${id}`)).json();
  const extra = run.series.filter((n) => !STANDARD.has(n) && !n.startsWith("grad_norm/"));
  const names = ["loss", "scale", "skipped", "grad_norm", ...extra];
  const query = names.map((n) => `name=${encodeURIComponent(n)}`).join("&");
  const data = await (await fetch(`/api/v1/runs/${id}/series?${query}&max_points=${MAX_POINTS}`)).json();
  const steps = extent(names.flatMap((n) => (data[n] ? data[n].steps : [])));
  draw(document.getElementById("chart-loss"), data.loss, { steps, log: "auto" });
  draw(document.getElementById("chart-scale"), data.scale,
       { steps, log: 2, color: "#2b8a3e", extra: skippedMarkers(data.scale, data.skipped) });
  draw(document.getElementById("chart-grad_norm"), data.grad_norm, { steps, log: 10, color: "#7048e8" });
  const holder = document.getElementById("chart-extra");
  extra.forEach((name) => draw(chartFor(holder, name), data[name], { steps, log: "auto", color: "#a05a2c" }));
  setBadge("run-status", run.status, `status status-${run.status}`);
  setBadge("run-health", run.health, `badge health-${run.health}`);
  setBadge("run-step", run.last_step ?? "–");
  root.dataset.status = run.status;
  root.dataset.loaded = "true";
}

async function main() {
  const root = document.getElementById("charts");
  if (!root || typeof Plotly === "undefined") return;
  await refresh(root);
  // Until live streaming lands, a running run is re-read every two seconds (one request chain at a time).
  while (root.dataset.status === "running") {
    await new Promise((resolve) => setTimeout(resolve, 2000));
    await refresh(root).catch((e) => console.error("ampwatch refresh failed", e));
  }
}

main().catch((e) => console.error("ampwatch", e));
