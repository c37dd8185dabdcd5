// The runs page, live: rows change in place as runs report, and new runs appear at the top. Values are written
// exactly as web/formats.py writes them on the server, so a live row reads the same as after a reload.
"use strict";

(() => {
  const table = document.getElementById("runs");
  if (!table || typeof EventSource === "undefined") return;
  const body = table.tBodies[0];
  const SUPERSCRIPT = { "-": "⁻", 0: "⁰", 1: "¹", 2: "²", 3: "³", 4: "⁴", 5: "⁵", 6: "⁶", 7: "⁷", 8: "⁸", 9: "⁹" };
  const two = (n) => String(n).padStart(2, "0");

  const format = {
    scale: (v) => {
      if (v === null || v === undefined) return "–";
      if (typeof v === "string") return { NaN: "NaN", Infinity: "+Inf", "-Infinity": "-Inf" }[v] || v;
      if (typeof v === "number" && v > 0 && Number.isInteger(Math.log2(v))) {
        return "2" + String(Math.log2(v)).split("").map((c) => SUPERSCRIPT[c]).join("");
      }
      return typeof v === "number" ? String(+v.toPrecision(3)) : v;
    },
    rate: (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)} %`),
    stamp: (iso) => { const d = new Date(iso); return `${d.getUTCFullYear()}-${two(d.getUTCMonth() + 1)}-${two(d.getUTCDate())} ${format.clock(iso)}`; },
    clock: (iso) => { const d = new Date(iso); return `${two(d.getUTCHours())}:${two(d.getUTCMinutes())}:${two(d.getUTCSeconds())}`; },
  };

  const el = (tag, props = {}, ...children) => {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  };

  const CELLS = {
    project: (r) => [r.project],
    name: (r) => [el("a", { href: `/runs/${encodeURIComponent(r.id)}`, textContent: r.name })],
    status: (r) => [el("span", { className: `status status-${r.status}`, textContent: r.status })],
    health: (r) => [el("span", { className: `badge health-${r.health}`, textContent: r.health })],
    firing: (r) => [r.firing ? el("span", { className: "badge health-critical", textContent: `${r.firing} firing` }) : "–"],
    last_step: (r) => [r.last_step === null ? "–" : String(r.last_step)],
    skip_rate: (r) => [format.rate(r.skip_rate)],
    scale: (r) => [format.scale(r.scale)],
    created_at: (r) => [el("time", { textContent: format.stamp(r.created_at) })],
    last_seen_at: (r) => [el("time", { textContent: format.clock(r.last_seen_at) })],
  };
  const NUMERIC = new Set(["firing", "last_step", "skip_rate", "scale"]);

  function newRow(run) {
    const row = el("tr");
    row.dataset.runId = run.id;
    const box = el("input", { type: "checkbox", name: "run", value: run.id });
    box.setAttribute("aria-label", `compare ${run.name}`);
    row.append(el("td", { className: "pick" }, box));
    Object.keys(CELLS).forEach((field) => {
      const cell = el("td", { className: NUMERIC.has(field) ? "num" : "" });
      cell.dataset.field = field;
      row.append(cell);
    });
    return row;
  }

  function update(run) {
    let row = Array.from(body.rows).find((r) => r.dataset.runId === run.id);
    if (run.in_filter === false) { // (a finished run on a status=running page): gone, as after a reload
      if (row) row.remove();
      if (!body.rows.length) {
        const td = el("td", { className: "muted", colSpan: table.tHead.rows[0].cells.length, textContent: "No run matches these filters." });
        body.append(el("tr", { className: "none" }, td));
      }
      return;
    }
    if (!row && table.dataset.paged) return; // (a later page: new runs belong on the first)
    if (!row) {
      const none = body.querySelector("tr.none");
      if (none) none.remove();
      row = newRow(run);
      body.prepend(row);
    }
    Object.entries(CELLS).forEach(([field, render]) => row.querySelector(`td[data-field="${field}"]`).replaceChildren(...render(run)));
    row.classList.remove("flash");
    void row.offsetWidth; // restart the highlight
    row.classList.add("flash");
  }

  let since = table.dataset.since;
  const connect = (delay = 1000) => {
    const params = new URLSearchParams({ since });
    ["project", "status", "q"].forEach((k) => table.dataset[k] && params.set(k, table.dataset[k]));
    const source = new EventSource(`/api/v1/stream/runs?${params}`);
    const dot = document.getElementById("live");
    source.addEventListener("runs", (e) => {
      if (e.lastEventId) since = e.lastEventId;
      JSON.parse(e.data).forEach(update);
    });
    source.onopen = () => { table.dataset.live = "open"; dot.hidden = false; delay = 1000; };
    source.onerror = () => {
      table.dataset.live = "reconnecting";
      dot.hidden = true;
      // (the browser gives up for good on an answer that is not a stream: see run.js)
      if (source.readyState === EventSource.CLOSED) setTimeout(() => connect(Math.min(2 * delay, 30_000)), delay);
    };
  };
  connect();
})();
