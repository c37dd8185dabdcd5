// The run page's alerts, live: the banner, the "N firing" badge, the alerts table, and a browser notification.
// Include on /runs/{id} with <script src="/static/alerts.js" data-run-id="{{ run.id }}" defer></script>; reads the
// run's alerts every 5 s, and at once when run.js's stream brings an event or a new status.
(function () {
  "use strict";
  const script = document.currentScript;
  const runId = script && script.dataset.runId;
  if (!runId) return;
  const seen = new Set();
  let first = true;
  const banner = document.createElement("p");
  banner.className = "card";
  banner.id = "alert-banner";
  banner.setAttribute("role", "alert");
  banner.hidden = true;
  document.addEventListener("DOMContentLoaded", () => (document.querySelector("main") || document.body).prepend(banner));

  function show(alerts) {
    banner.hidden = alerts.length === 0;
    banner.replaceChildren(...alerts.map((a) => {
      const line = document.createElement("div");
      line.textContent = `${a.severity.toUpperCase()} firing: ${a.summary}`;
      return line;
    }));
  }

  function notify(alert) {
    if (!("Notification" in window) || Notification.permission !== "granted") return;
    new Notification(`ampwatch: ${alert.severity}`, { body: alert.summary, tag: `ampwatch-alert-${alert.id}` });
  }

  const two = (n) => String(n).padStart(2, "0");
  const stamp = (iso) => {  // as web/formats.py's stamp
    const d = new Date(iso);
    return `${d.getUTCFullYear()}-${two(d.getUTCMonth() + 1)}-${two(d.getUTCDate())} ${two(d.getUTCHours())}:${two(d.getUTCMinutes())}:${two(d.getUTCSeconds())}`;
  };
  const el = (tag, props = {}, ...children) => {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  };

  function badge(firing) {  // the "N firing alerts" link in the page's header, as run.html writes it
    let link = document.getElementById("run-firing");
    if (!firing.length) { if (link) link.remove(); return; }
    if (!link) {
      link = el("a", { id: "run-firing", href: "#run-alerts" });
      document.getElementById("run-step")?.parentElement.after(link);
    }
    link.className = `badge health-${firing.some((a) => a.severity === "critical") ? "critical" : "warning"}`;
    link.textContent = `${firing.length} firing alert${firing.length > 1 ? "s" : ""}`;
  }

  function table(alerts) {  // the Alerts card's rows, as run.html writes them
    const card = document.getElementById("run-alerts");
    if (!card || !alerts.length) return;
    card.querySelector("h2 small").textContent = String(Math.min(alerts.length, 50));
    let body = card.querySelector("tbody");
    if (!body) {
      card.querySelector("p.muted")?.remove();
      const head = ["Severity", "Rule", "State", "Started (UTC)", "Resolved (UTC)", "Summary"].map((h) => el("th", { textContent: h }));
      body = el("tbody");
      card.append(el("table", {}, el("thead", {}, el("tr", {}, ...head)), body));
    }
    body.replaceChildren(...alerts.slice(0, 50).map((a) => {  // (the newest 50, as web/pages.py lists them)
      const row = el("tr", {},
        el("td", {}, el("span", { className: `badge sev-badge sev-${a.severity}`, textContent: a.severity })),
        el("td", {}, el("code", { textContent: a.rule })),
        el("td", {}, el("span", { className: `status status-${a.state}`, textContent: a.state })),
        el("td", { textContent: stamp(a.started_at) }),
        el("td", { textContent: a.resolved_at ? stamp(a.resolved_at) : "–" }),
        el("td", { textContent: a.summary }));
      row.dataset.alertId = a.id;
      row.dataset.state = a.state;
      return row;
    }));
  }

  let timer = null;
  let reading = false;
  async function poll() {
    clearTimeout(timer);
    if (reading) { timer = setTimeout(poll, 100); return; }  // (one read at a time; the next one sees what changed)
    reading = true;
    try {
      const reply = await fetch(`/api/v1/alerts?run_id=${encodeURIComponent(runId)}`);
      if (reply.ok) {
        const alerts = await reply.json();
        const firing = alerts.filter((a) => a.state === "firing");
        show(firing);
        badge(firing);
        table(alerts);
        for (const a of firing) {
          if (!seen.has(a.id) && !first) notify(a);  // alerts already firing when the page opened are in the banner
          seen.add(a.id);
        }
        first = false;
      }
    } catch (error) { /* the server is restarting: try again next time */ }
    reading = false;
    timer = setTimeout(poll, 5000);
  }

  document.addEventListener("ampwatch:run-changed", () => poll());

  if ("Notification" in window && Notification.permission === "default") {
    document.addEventListener("click", () => Notification.requestPermission(), { once: true });
  }
  poll();
})();
