// The run page's alert banner and browser notification. Include on /runs/{id} with
// <script src="/static/alerts.js" data-run-id="{{ run.id }}" defer></script>; polls the firing alerts of the run.
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

  async function poll() {
    try {
      const reply = await fetch(`/api/v1/alerts?run_id=${encodeURIComponent(runId)}&state=firing`);
      if (reply.ok) {
        const alerts = await reply.json();
        show(alerts);
        for (const a of alerts) {
          if (!seen.has(a.id) && !first) notify(a);  // alerts already firing when the page opened are in the banner
          seen.add(a.id);
        }
        first = false;
      }
    } catch (error) { /* the server is restarting: try again next time */ }
    setTimeout(poll, 5000);
  }

  if ("Notification" in window && Notification.permission === "default") {
    document.addEventListener("click", () => Notification.requestPermission(), { once: true });
  }
  poll();
})();
