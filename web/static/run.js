// The run page: charts of one rank that share one step axis (zoom one, all follow, and the zoomed range is read
// again at full resolution), the per-layer heatmap, skipped-step spans, an event timeline that moves the charts,
// and live updates over Server-Sent Events: new points appended with Plotly.extendTraces, late ones (a replayed
// spool, a slower rank) put in their place, per-layer norms folded into the heatmap's cells as they come.
"use strict";

(() => {
  const MAX_POINTS = 2000;
  const HEAT_COLUMNS = 300;
  const REREAD_AFTER = 20000; // appended points before the series are read (downsampled) again
  const STANDARD = {
    loss: { title: "Loss", log: "auto" },
    scale: { title: "Loss scale (log₂ axis)", log: 2, color: "#2b8a3e" },
    grad_norm: { title: "Gradient norm (unscaled, log axis)", log: 10, color: "#7048e8" },
    lr: { title: "Learning rate", log: "auto", color: "#0c8599" },
  };
  const HIDDEN = new Set(["skipped"]); // drawn as shaded spans and markers, not as a chart of its own
  // Per-layer series: one per module, so not a chart each (the gradient norms make the heatmap; the leading
  // indicators are read through the API, or their warnings on the timeline).
  const LAYERED = ["grad_norm/", "fp16_range/", "update_ratio/", "adam_lag/"];
  const perLayer = (name) => LAYERED.some((prefix) => name.startsWith(prefix));
  const root = document.getElementById("charts");
  if (!root || typeof Plotly === "undefined") return;
  const runId = encodeURIComponent(root.dataset.runId);
  const rank = Number(root.dataset.rank || 0);
  const heatEl = document.getElementById("chart-layers");
  const timeline = document.getElementById("timeline");
  const state = { cache: {}, grid: null, events: [], zoom: null, full: null, cursor: null, appended: 0, syncing: 0,
                  seen: new Set(), lastEvent: Number(root.dataset.afterEvent || 0), loading: null, pending: [],
                  resumes: JSON.parse(root.dataset.resumes || "[]") }; // (first steps of resumed launches, this rank)

  const getJSON = async (url) => {
    const reply = await fetch(url);
    if (!reply.ok) throw new Error(`${url}: HTTP ${reply.status}`);
    return reply.json();
  };
  const within = (range) => (range ? `&start_step=${Math.max(0, Math.floor(range[0]))}&end_step=${Math.max(0, Math.ceil(range[1]))}` : "");
  const lastStep = (s) => (s && s.steps.length ? s.steps[s.steps.length - 1] : -1);

  // ---- data -------------------------------------------------------------------------------------------
  async function read(range) {
    const run = await getJSON(`/api/v1/runs/${runId}`);
    const names = run.series.filter((n) => !perLayer(n));
    const query = names.map((n) => `name=${encodeURIComponent(n)}`).join("&");
    const wide = range && pad(range, 0.25);
    state.pending = [];
    state.loading = Promise.all([
      names.length ? getJSON(`/api/v1/runs/${runId}/series?${query}&rank=${rank}&max_points=${MAX_POINTS}${within(wide)}`) : {},
      heatRead(range),
    ]);
    const [data, grid] = await state.loading;
    state.loading = null;
    state.cache = data;
    state.grid = grid;
    state.appended = 0;
    state.pending.forEach(([name, s]) => merge(name, s)); // what streamed in while the read was on its way
    if (!range) state.full = fullView();
    header(run);
  }

  const heatRead = (range) => getJSON(`/api/v1/runs/${runId}/heatmap?columns=${HEAT_COLUMNS}&rank=${rank}${within(range)}`);

  /** Index of the first step >= `step` in a sorted list. */
  function bisect(steps, step) {
    let lo = 0, hi = steps.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (steps[mid] < step) lo = mid + 1; else hi = mid; }
    return lo;
  }

  /** Streamed points into the cache: appended after its last step, put in place (or replaced) before it.
   *  Returns what was appended, and whether anything before the end changed. */
  function merge(name, series) {
    const cur = state.cache[name] || (state.cache[name] = { steps: [], values: [] });
    const steps = [], values = [];
    let late = false;
    series.steps.forEach((step, i) => {
      const value = series.values[i];
      if (step > lastStep(cur)) {
        cur.steps.push(step); cur.values.push(value); steps.push(step); values.push(value);
        return;
      }
      const at = bisect(cur.steps, step);
      if (cur.steps[at] === step && cur.values[at] === value) return; // one it had already
      if (cur.steps[at] === step) cur.values[at] = value; else { cur.steps.splice(at, 0, step); cur.values.splice(at, 0, value); }
      late = true;
    });
    state.appended += steps.length;
    return { steps, values, late };
  }

  const BADNESS = { "NaN": 3, "Infinity": 2, "-Infinity": 1 };
  /** A heatmap cell after one more point: the largest value, or the non-finite one (NaN before +Inf before -Inf). */
  function worse(cell, value) {
    if (cell === null || cell === undefined) return value;
    const a = BADNESS[cell] || 0, b = BADNESS[value] || 0;
    if (a || b) return b >= a ? value : cell;
    return Math.max(cell, value);
  }

  /** Streamed per-layer norms folded into the grid's cells, new columns added at its end; false when the grid
   *  must be read again (a new layer, or it has grown to twice its size). */
  function heatFold(layer, series) {
    const g = state.grid;
    const row = g ? g.layers.indexOf(layer) : -1;
    if (row < 0 || !g.steps.length) return false;
    series.steps.forEach((step, i) => {
      const k = Math.floor((step - g.steps[0]) / g.width);
      if (k < 0) return; // before a zoomed grid: not shown
      while (g.steps.length <= k) {
        g.steps.push(g.steps[0] + g.steps.length * g.width);
        g.values.forEach((r) => r.push(null));
      }
      g.values[row][k] = worse(g.values[row][k], series.values[i]);
    });
    return g.steps.length <= 2 * HEAT_COLUMNS;
  }

  // ---- views and overlays -----------------------------------------------------------------------------
  function pad(range, share) {
    const w = Math.max(1, range[1] - range[0]) * share;
    return [range[0] - w, range[1] + w];
  }

  function fullView() {
    let lo = Infinity, hi = -Infinity;
    Object.values(state.cache).forEach((s) => { if (s.steps.length) { lo = Math.min(lo, s.steps[0]); hi = Math.max(hi, lastStep(s)); } });
    if (state.grid && state.grid.steps.length) {
      lo = Math.min(lo, state.grid.steps[0]);
      hi = Math.max(hi, state.grid.steps[state.grid.steps.length - 1] + state.grid.width - 1);
    }
    if (lo > hi) return null;
    const w = Math.max(0.5, (hi - lo) * 0.01);
    return [lo - w, hi + w];
  }

  const view = () => state.zoom || state.full || fullView();

  /** Runs of consecutive skipped steps (gaps under a pixel or so closed, since long series come downsampled). */
  function skipSpans() {
    const s = state.cache.skipped, shown = view();
    if (!s || !shown) return [];
    const gap = Math.max(1, (shown[1] - shown[0]) / 1500), spans = [];
    s.steps.forEach((step, i) => {
      if (s.values[i] !== 1) return;
      const last = spans[spans.length - 1];
      if (last && step - last[1] <= gap) last[1] = step; else spans.push([step, step]);
    });
    return spans.slice(0, 500);
  }

  function skippedMarkers() {
    const scale = state.cache.scale, skipped = state.cache.skipped;
    if (!scale || !skipped || !skipped.steps.length) return [];
    const at = new Map(scale.steps.map((s, i) => [s, scale.values[i]]));
    const steps = skipped.steps.filter((s, i) => skipped.values[i] === 1);
    return [{ x: steps, y: steps.map((s) => at.get(s)), mode: "markers", type: "scatter", name: "skipped step",
              marker: { symbol: "circle-open", size: 8, color: "#c92a2a", line: { width: 1.5 } }, cliponaxis: false,
              hovertemplate: "skipped at step %{x}<extra></extra>" }];
  }

  function spikeMarkers() {
    const norm = state.cache.grad_norm;
    if (!norm) return [];
    const at = new Map(norm.steps.map((s, i) => [s, norm.values[i]]));
    const steps = state.events.filter((e) => e.type === "grad_spike" && typeof at.get(e.step) === "number").map((e) => e.step);
    return steps.length ? [{ x: steps, y: steps.map((s) => at.get(s)), mode: "markers", type: "scatter", name: "spike",
                             marker: { symbol: "star", size: 12, color: "#e8590c" }, hovertemplate: "grad spike at step %{x}<extra></extra>" }] : [];
  }

  // ---- drawing ----------------------------------------------------------------------------------------
  function chartFor(name) {
    const id = `chart-${name}`;
    let el = STANDARD[name] ? document.getElementById(id) : document.querySelector(`#chart-extra [data-series="${CSS.escape(name)}"]`);
    if (!el && !HIDDEN.has(name) && !perLayer(name)) {
      el = Object.assign(document.createElement("div"), { className: "chart" });
      Object.assign(el.dataset, { series: name, title: name });
      document.getElementById("chart-extra").appendChild(el);
    }
    return el;
  }

  function drawLine(name) {
    const el = chartFor(name);
    if (!el) return null;
    const opts = Object.assign({ title: name, log: "auto", color: "#a05a2c" }, STANDARD[name] || {});
    opts.extra = name === "scale" ? skippedMarkers() : name === "grad_norm" ? spikeMarkers() : [];
    const zoomed = state.zoom ? { height: 250, notice: "no points in this range" } : {};
    const shown = { view: view(), spans: skipSpans(), cursor: state.cursor, resumes: state.resumes };
    const done = AW.line(el, state.cache[name], Object.assign(opts, shown, zoomed));
    bind(el);
    return done;
  }

  function drawHeat() {
    const notice = "no per-layer gradient norms: pass the model to run.watch(model=…)";
    const until = Math.max(...Object.values(state.cache).map(lastStep)) + 1; // (the last cell reaches no further)
    AW.heatmap(heatEl, state.grid || { layers: [], steps: [], width: 1, values: [] },
               { view: view(), cursor: state.cursor, resumes: state.resumes, notice, until: until > 0 ? until : null });
    bind(heatEl);
  }

  function drawAll() {
    const names = Object.keys(state.cache).filter((n) => !HIDDEN.has(n));
    ["loss", "scale", "grad_norm", "lr"].forEach((n) => names.includes(n) || names.push(n));
    names.forEach(chartFor); // every card in place first: a card added to #chart-extra narrows the others
    names.forEach(drawLine);
    drawHeat();
    root.dataset.view = (view() || []).map(Math.round).join(",");
  }

  const charts = () => Array.from(root.querySelectorAll(".js-plotly-plot"));

  function bind(el) {
    if (el._awBound) return;
    el._awBound = true;
    el.on("plotly_relayout", (ev) => {
      if (state.syncing) return;
      if ("xaxis.range[0]" in ev) zoomTo([ev["xaxis.range[0]"], ev["xaxis.range[1]"]]);
      else if (Array.isArray(ev["xaxis.range"])) zoomTo(ev["xaxis.range"]);
      else if (ev["xaxis.autorange"]) zoomTo(null);
    });
  }

  /** Every chart shows `view()`; then the shaded spans and the cursor follow. */
  async function sync() {
    const range = view();
    if (!range) return;
    state.syncing += 1;
    try {
      const spans = skipSpans();
      await Promise.all(charts().map((el) => Plotly.relayout(el, {
        "xaxis.range": range.slice(), "xaxis.autorange": false, ...AW.stepTicks(range),
        shapes: AW.shapes(el._aw ? el._aw.marks : {}, el === heatEl ? [] : spans, state.cursor,
                          el._aw && el._aw.empty ? [] : state.resumes),
      })));
    } finally {
      state.syncing -= 1;
    }
    root.dataset.view = range.map(Math.round).join(",");
  }

  let reread = null;
  async function zoomTo(range) {
    state.zoom = range;
    await sync();
    clearTimeout(reread);
    reread = setTimeout(() => read(state.zoom).then(drawAll).catch(report), 250); // at the zoom's own resolution
  }

  // ---- the event timeline -----------------------------------------------------------------------------
  function jumpTo(step, item) {
    timeline.querySelectorAll("li.active").forEach((li) => li.classList.remove("active"));
    if (item) item.classList.add("active", "open");
    state.cursor = step;
    const full = state.full || [step - 50, step + 50];
    const half = Math.max(25, (full[1] - full[0]) * 0.04);
    zoomTo([step - half, step + half]);
  }

  function addEvent(e) {
    if (state.seen.has(e.id)) return;
    state.seen.add(e.id);
    state.events.push(e);
    const none = timeline.querySelector("li.none");
    if (none) none.remove();
    const li = document.createElement("li");
    li.className = `ev sev-${e.severity}`;
    Object.assign(li.dataset, { step: e.step, id: e.id });
    const button = Object.assign(document.createElement("button"), { type: "button", className: "ev-jump" });
    const step = Object.assign(document.createElement("span"), { className: "ev-step", textContent: `step ${e.step}` });
    const badge = Object.assign(document.createElement("span"), { className: `badge sev-badge sev-${e.severity}`, textContent: e.type });
    button.append(step, badge);
    if (e.rank) button.append(Object.assign(document.createElement("span"), { className: "muted", textContent: `rank ${e.rank}` }));
    const msg = Object.assign(document.createElement("p"), { className: "ev-msg", textContent: e.message });
    li.append(button, msg);
    if (e.plan) { // a plan trigger: the plan as it stands now (the page's plan section, if any, is the load's)
      const plan = Object.assign(document.createElement("p"), { className: "ev-plan" });
      plan.textContent = `Rollback plan: ${e.plan.summary} `;
      const here = document.getElementById("run-plan");
      const link = here ? { href: "#run-plan", textContent: "Plan and files" } : { href: e.plan.path, textContent: "Plan (JSON)" };
      plan.append(Object.assign(document.createElement("a"), link));
      li.append(plan);
    }
    timeline.appendChild(li);
    const count = document.getElementById("event-count");
    if (count) count.textContent = String(state.seen.size);
  }

  // ---- live -------------------------------------------------------------------------------------------
  function header(run) {
    const set = (id, text, className) => {
      const el = document.getElementById(id);
      el.textContent = text;
      if (className) el.className = className;
    };
    set("run-status", run.status, `status status-${run.status}`);
    set("run-health", run.health, `badge health-${run.health}`);
    set("run-step", run.last_step ?? "–");
    root.dataset.status = run.status;
  }

  function append(name, series) {
    if (state.loading) state.pending.push([name, series]);
    const added = merge(name, series);
    if ((!added.steps.length && !added.late) || perLayer(name)) return;
    if (name === "skipped") { drawLine("scale"); return; }
    const el = chartFor(name);
    const drawn = Number(el.dataset.points || 0);
    const span = AW.extent(state.cache[name].values.slice(0, -added.values.length || undefined));
    const fresh = AW.extent(added.values);
    const outside = !span || !fresh || fresh[0] < span[0] || fresh[1] > span[1];
    if (added.late || !el.data || !drawn || outside || added.values.some((v) => typeof v === "string")) {
      drawLine(name); // a new marker or a new axis extent: draw it whole
    } else {
      Plotly.extendTraces(el, { x: [added.steps], y: [added.values] }, [0]);
      el.dataset.points = String(drawn + added.steps.length);
    }
  }

  let heatTimer = null;
  /** Redraw the heatmap at most every half second; read it again instead when `reread`. */
  function heatLater(reread) {
    state.heatReread = state.heatReread || reread;
    if (heatTimer) return;
    heatTimer = setTimeout(() => {
      heatTimer = null;
      const again = state.heatReread;
      state.heatReread = false;
      (again ? heatRead(state.zoom).then((g) => { state.grid = g; }) : Promise.resolve()).then(drawHeat).catch(report);
    }, 500);
  }

  function onUpdate(msg) {
    const before = root.dataset.status;
    header(msg.run);
    msg.events.forEach((e) => { addEvent(e); state.lastEvent = Math.max(state.lastEvent, e.id); });
    // An event (the rules fire with it) or a new status: alerts.js reads the run's alerts now, not at its next poll.
    if (msg.events.length || msg.run.status !== before) document.dispatchEvent(new CustomEvent("ampwatch:run-changed"));
    if (msg.reset || state.appended > REREAD_AFTER) { read(state.zoom).then(drawAll).catch(report); return; }
    const names = Object.keys(msg.points);
    names.forEach((name) => append(name, msg.points[name]));
    if (msg.events.some((e) => e.type === "grad_spike")) drawLine("grad_norm");
    if (msg.events.some(resumedHere)) { resumed(msg.events.filter(resumedHere)); }
    const layers = names.filter((n) => n.startsWith("grad_norm/"));
    if (layers.length) heatLater(!layers.every((n) => heatFold(n.slice("grad_norm/".length), msg.points[n])));
    if (!state.zoom) state.full = fullView();
    if (names.length) sync();
  }

  const resumedHere = (e) => e.type === "amp_config" && e.details && e.details.check === "resumed" && e.rank === rank;

  /** A launch that resumed the run arrived live: its line on every chart, and the key above them. */
  function resumed(events) {
    state.resumes = Array.from(new Set([...state.resumes, ...events.map((e) => e.step)])).sort((a, b) => a - b);
    document.getElementById("resume-key").hidden = false;
    drawAll();
  }

  let resumeAt = null; // the last message's id, "<feed position>/<event id>": where a new stream takes over

  function connect(delay = 1000) {
    // Every batch stored after the page was made; what the first read already had is merged away.
    const [position, event] = resumeAt ? resumeAt.split("/") : [root.dataset.feed || 0, state.lastEvent];
    const source = new EventSource(`/api/v1/runs/${runId}/stream?after_position=${position}&after_event=${event}&rank=${rank}`);
    const dot = document.getElementById("live");
    source.addEventListener("update", (e) => {
      if (e.lastEventId) resumeAt = e.lastEventId;
      onUpdate(JSON.parse(e.data));
    });
    source.onopen = () => { root.dataset.live = "open"; dot.hidden = false; delay = 1000; };
    source.onerror = () => {
      root.dataset.live = "reconnecting";
      dot.hidden = true;
      // The browser retries a dropped connection itself, but gives up for good on an answer that is not a stream
      // (a proxy's 502 during a deploy, the server's 503 while its database is away): open a new one, with backoff.
      if (source.readyState === EventSource.CLOSED) setTimeout(() => connect(Math.min(2 * delay, 30_000)), delay);
    };
  }

  function report(error) {
    console.error("ampwatch", error);
  }

  async function main() {
    document.getElementById("chart-area").hidden = false;
    timeline.querySelectorAll("li.ev").forEach((li) => state.seen.add(Number(li.dataset.id)));
    timeline.addEventListener("click", (e) => {
      const li = e.target.closest("li.ev");
      if (li) jumpTo(Number(li.dataset.step), li);
    });
    document.getElementById("show-all").addEventListener("click", () => { state.cursor = null; zoomTo(null); });
    const picker = document.getElementById("rank");
    if (picker) picker.addEventListener("change", () => picker.form.submit());
    state.events = await getJSON(`/api/v1/runs/${runId}/events`);
    await read(null);
    drawAll();
    const linked = new URLSearchParams(location.search).get("step"); // alert links point at their step
    if (linked && Number.isFinite(Number(linked))) {
      jumpTo(Number(linked), timeline.querySelector(`li.ev[data-step="${Number(linked)}"]`));
    }
    root.dataset.loaded = "true";
    // (a run the server called crashed comes back to life if it reports again: watch it too)
    if (["running", "stalled", "crashed"].includes(root.dataset.status)) connect();
  }

  main().catch(report);
})();
