"""The alert of a critical event the run cannot train past carries the rollback plan: its notification says what to
restore and which steps to skip, with links to the plan, and the event on the run page says it too. A real fp16 CPU
loop that checkpoints every 10 steps, spikes, then collapses (tests/test_plan.py's), a real server and webhook."""

from __future__ import annotations

import httpx
from test_plan import EVERY, SPIKE, _train


def test_the_scale_collapse_alert_and_its_event_carry_the_rollback_plan(alert_server, receiver) -> None:
    server = alert_server()
    run_id = _train(server, 100, bad=True)
    body = receiver.wait(1, alert__rule="scale_collapse", status="firing")[0]
    rollback = body["alert"]["details"]["plan"]
    assert rollback["checkpoint"] == {"step": 6 * EVERY, "rank": 0, "path": "ckpt/step-60.pt"}
    assert rollback["skip"]["from"] == SPIKE and rollback["skip"]["to"] > SPIKE
    assert rollback["summary"].startswith(f"Trouble began at step {SPIKE}")
    assert "restore the checkpoint at step 60 (ckpt/step-60.pt)" in rollback["summary"]
    assert rollback["url"] == f"{server.url}/api/v1/runs/{run_id}/plan"
    assert rollback["page"] == f"{server.url}/runs/{run_id}#run-plan"
    lines = body["text"].splitlines()
    assert f"Rollback plan: {rollback['summary']}" in lines
    assert f"Plan: {rollback['page']} (JSON: {rollback['url']})" in lines
    doc = httpx.get(rollback["url"], timeout=30).json()  # the link leads to the plan, which agrees
    assert doc["checkpoint"] == rollback["checkpoint"] and doc["skip"]["from"] == rollback["skip"]["from"]

    lesser = receiver.bodies(alert__rule="skipped_step") + receiver.bodies(alert__rule="nonfinite_grad")
    assert all("plan" not in b["alert"]["details"] for b in lesser)  # (only the criticals the run cannot go past)
    page = httpx.get(f"{server.url}/runs/{run_id}", headers={"Accept": "text/html"}, timeout=30).text
    critical = next(e for e in doc["trouble"]["critical"] if e["type"] == "scale_collapse")
    item = page[page.index(f'data-id="{critical["id"]}"') :]
    item = item[: item.index("</li>")]
    assert f'<p class="ev-plan">Rollback plan: {doc["summary"]} <a href="#run-plan">' in item
