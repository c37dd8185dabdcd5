// Run page charts. Non-finite values are never dropped: each NaN / +Inf / -Inf is a marker at its
// step, drawn on an overlay axis (y2, 0..1) because it has no place on the value axis.
"use strict";

const MAX_POINTS = 4000;
const NONFINITE = {
  "NaN": { y: 0.94, symbol: "x", color: "#d62728", label: "NaN" },
  "Infinity": { y: 0.94, symbol: "triangle-up", color: "#ff7f0e", label: "+Inf" },
  "-Infinity": { y: 0.06, symbol: "triangle-down", color: "#9467bd", label: "-Inf" },
};
const STANDARD = new Set(["loss", "scale", "skipped", "grad_norm"]);

function split(series) {
  const x = [], y = [], marks = { "NaN": [], "Infinity": [], "-Infinity": [] };
  series.steps.forEach((step, i) => {
    const v = series.values[i];
    x.push(step);
    if (typeof v === "string") { y.push(null); marks[v].push(step); } else { y.push(v); }
  });
  return { x, y, marks };
}

function markerTraces(marks) {
  return Object.entries(marks).filter(([, steps]) => steps.length).map(([kind, steps]) => ({
    x: steps, y: steps.map(() => NONFINITE[kind].y), yaxis: "y2", mode: "markers", type: "scatter",
    name: NONFINITE[kind].label, hovertemplate: `${NONFINITE[kind].label} at step %{x}<extra></extra>`,
    marker: { symbol: NONFINITE[kind].symbol, size: 10, color: NONFINITE[kind].color, line: { width: 2 } },
    meta: "nonfinite",
  }));
}

function log2Ticks(values) {
  const finite = values.filter((v) => typeof v === "number" && v > 0);
  if (!finite.length) return {};
  const lo = Math.floor(Math.log2(Math.min(...finite))), hi = Math.ceil(Math.log2(Math.max(...finite)));
  const step = Math.max(1, Math.ceil((hi - lo + 1) / 8));
  const tickvals = [], ticktext = [];
  for (let k = lo; k <= hi; k += step) { tickvals.push(2 ** k); ticktext.push(`2^${k}`); }
  return { tickvals, ticktext };
}

function layout(title, yaxis) {
  return {
    title: { text: title, x: 0, xanchor: "left", font: { size: 14 } },
    margin: { l: 60, r: 16, t: 36, b: 36 }, height: 260, showlegend: true,
    legend: { orientation: "h", x: 1, xanchor: "right", y: 1.12 },
    xaxis: { title: { text: "step" }, zeroline: false },
    yaxis: Object.assign({ zeroline: false }, yaxis),
    yaxis2: { overlaying: "y", range: [0, 1], visible: false, fixedrange: true },
    hovermode: "x unified", paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fff",
  };
}

function draw(el, title, series, opts = {}) {
  const { x, y, marks } = split(series);
  const main = { x, y, type: "scatter", mode: x.length < 60 ? "lines+markers" : "lines", name: opts.name || el.dataset.series,
                 line: { width: 1.5, color: opts.color || "#1f77b4" }, connectgaps: false };
  const traces = [main, ...(opts.extra || []), ...markerTraces(marks)];
  const yaxis = opts.log ? Object.assign({ type: "log" }, opts.ticks || {}) : {};
  el.dataset.points = String(x.length);
  el.dataset.nonfinite = String(marks["NaN"].length + marks["Infinity"].length + marks["-Infinity"].length);
  Plotly.react(el, traces, layout(title, yaxis), { displaylogo: false, responsive: true });
}

function skippedMarkers(scale, skipped) {
  if (!skipped || !skipped.steps.length) return [];
  const at = new Map(scale.steps.map((s, i) => [s, scale.values[i]]));
  const steps = skipped.steps.filter((s, i) => skipped.values[i] === 1);
  return [{ x: steps, y: steps.map((s) => at.get(s)), mode: "markers", type: "scatter", name: "skipped step",
            marker: { symbol: "circle-open", size: 8, color: "#d62728" },
            hovertemplate: "skipped at step %{x}<extra></extra>" }];
}

async function refresh(root) {
  const id = root.dataset.runId;
  const run = await (await fetch(`/api/v1/runs/${id}`)).json();
  const extra = run.series.filter((n) => !STANDARD.has(n) && !n.startsWith("grad_norm/"));
  const names = ["loss", "scale", "skipped", "grad_norm", ...extra];
  const query = names.map((n) => `name=${encodeURIComponent(n)}`).join("&");
  const data = await (await fetch(`/api/v1/runs/${id}/series?${query}&max_points=${MAX_POINTS}`)).json();
  draw(document.getElementById("chart-loss"), "Loss", data.loss);
  draw(document.getElementById("chart-scale"), "Loss scale (log₂ axis)", data.scale,
       { log: true, ticks: log2Ticks(data.scale.values), color: "#2ca02c", extra: skippedMarkers(data.scale, data.skipped) });
  draw(document.getElementById("chart-grad_norm"), "Gradient norm (unscaled, log axis)", data.grad_norm,
       { log: true, color: "#9467bd" });
  const holder = document.getElementById("chart-extra");
  extra.forEach((name) => {
    let el = holder.querySelector(`[data-series="${CSS.escape(name)}"]`);
    if (!el) { el = document.createElement("div"); el.className = "chart"; el.dataset.series = name; holder.appendChild(el); }
    draw(el, name, data[name], { color: "#8c564b" });
  });
  document.getElementById("run-status").textContent = run.status;
  document.getElementById("run-status").className = `status status-${run.status}`;
  document.getElementById("run-health").textContent = run.health;
  document.getElementById("run-health").className = `badge health-${run.health}`;
  document.getElementById("run-step").textContent = run.last_step ?? "–";
  root.dataset.status = run.status;
  root.dataset.loaded = "true";
}

async function main() {
  const root = document.getElementById("charts");
  if (!root || typeof Plotly === "undefined") return;
  await refresh(root);
  // Until live streaming lands, a running run is re-read every two seconds.
  const timer = setInterval(() => {
    if (root.dataset.status !== "running") { clearInterval(timer); return; }
    refresh(root).catch((e) => console.error("ampwatch refresh failed", e));
  }, 2000);
}

main().catch((e) => console.error("ampwatch", e));
