"""The server's comparison of DDP ranks' `param_norm` (server/alerts/_desync.py), fed batches as the agent sends them,
on SQLite and Postgres: exact (one ulp apart is apart, NaN on both ranks agrees), only for replicated runs, said once.
The two-rank gloo launch in tests/test_distributed.py covers the agent's side."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from ampwatch._protocol import batch_document, event
from ampwatch.server.plan import MARGIN

NAN = float("nan")
NORMS = [1.5, 2.0, NAN, 3.0, 4.0]


def _send(http: Any, run: str, rank: int, seq: int, steps: list[int], values: list[float]) -> None:
    body = batch_document(rank, seq, {"param_norm": (steps, values)}, [], None)
    assert http.post(f"/api/v1/runs/{run}/batches", json=body).status_code == 200


def _desyncs(http: Any, run: str) -> list[dict[str, Any]]:
    return [e for e in http.get(f"/api/v1/runs/{run}/events").json() if e["type"] == "ranks_desync"]


@pytest.mark.parametrize("rank_zero_first", [True, False])
def test_the_first_step_a_rank_differs_at_is_said_once(live_server, rank_zero_first: bool) -> None:
    environment = {"world_size": 2, "parallel": "replicated"}
    apart = [*NORMS[:3], math.nextafter(NORMS[3], 9.0), 4.5]  # one ulp at step 3
    with live_server.client() as http:
        assert http.put("/api/v1/runs/d1", json={"project": "p", "name": "d", "environment": environment}).is_success
        order = [(0, NORMS), (1, apart)] if rank_zero_first else [(1, apart), (0, NORMS)]
        for rank, values in order:
            _send(http, "d1", rank, 1, [0, 1, 2, 3, 4], values)
        _send(http, "d1", 0, 2, [5, 6], [5.0, 6.0])
        _send(http, "d1", 1, 2, [5, 6], [5.5, 6.5])  # (still apart: not said again)
        [event] = _desyncs(http, "d1")
        [alert] = http.get(
            "/api/v1/alerts", params={"run_id": "d1"}
        ).json()  # (the built-in rule, in the batch's commit)
        _send(http, "d1", 1, 3, [7, 200], [7.5, 200.5])  # (no quiet stretch clears it: the ranks stay apart)
        finished = batch_document(0, 3, {}, [], "finished")
        assert http.post("/api/v1/runs/d1/batches", json=finished).status_code == 200
        deadline = time.monotonic() + 60
        while (resolved := http.get(f"/api/v1/alerts/{alert['id']}").json())["state"] != "resolved":
            assert time.monotonic() < deadline, resolved
            time.sleep(0.1)
    assert (alert["rule"], alert["severity"], alert["state"]) == ("ranks_desync", "critical", "firing")
    assert alert["summary"] == "Ranks hold different parameters in p/d at step 3"
    assert "The run ended (finished)." in str(resolved)
    assert (event["severity"], event["step"], event["rank"]) == ("critical", 3, 1)
    assert event["details"] == {
        "detected_by": "server",
        "rank": 1,
        "reference_rank": 0,
        "param_norm": apart[3],
        "reference_param_norm": 3.0,
    }
    assert "at step 3 rank 1's param_norm is" in event["message"]


def test_ranks_that_agree_bitwise_or_are_not_replicated_are_not_compared(live_server) -> None:
    with live_server.client() as http:
        for run, environment in [
            ("same", {"world_size": 2, "parallel": "replicated"}),
            ("shards", {"world_size": 2, "parallel": "sharded"}),
            ("unsaid", {"world_size": 2}),
        ]:
            assert http.put(f"/api/v1/runs/{run}", json={"project": "p", "name": run, "environment": environment})
            for rank in (0, 1):
                _send(http, run, rank, 1, [0, 1, 2, 3, 4], NORMS if run == "same" else [v + rank for v in NORMS])
            assert _desyncs(http, run) == [], run


def test_a_desync_is_a_plan_trigger_its_event_and_alert_restore_the_last_checkpoint_before_it(live_server) -> None:
    """A desynchronised rank's state is corrupt from the first step it differs at: restore the checkpoint before."""
    environment = {"world_size": 2, "parallel": "replicated"}
    checkpoints = [event(s, 0, "checkpoint", "info", "checkpoint", {"path": f"ckpt/{s}"}) for s in (2, 4)]
    with live_server.client() as http:
        assert http.put("/api/v1/runs/d2", json={"project": "p", "name": "d", "environment": environment}).is_success
        body = batch_document(
            0, 1, {"param_norm": ([0, 1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])}, checkpoints, None
        )
        assert http.post("/api/v1/runs/d2/batches", json=body).status_code == 200
        _send(http, "d2", 1, 1, [0, 1, 2, 3, 4, 5], [1.0, 2.0, 3.0, 4.0, 5.5, 6.5])  # apart from step 4 on
        [desync] = _desyncs(http, "d2")
        [alert] = http.get("/api/v1/alerts", params={"run_id": "d2"}).json()
        details = http.get(f"/api/v1/alerts/{alert['id']}").json()["details"]
        doc = http.get("/api/v1/runs/d2/plan").json()
    assert (doc["trouble"]["critical_step"], doc["trouble"]["first_sign"]["type"]) == (4, "ranks_desync")
    assert doc["checkpoint"] == {"step": 2, "rank": 0, "path": "ckpt/2"}  # (the one at 4 may hold the corrupt state)
    assert desync["plan"] == {
        "summary": doc["summary"],
        "checkpoint": doc["checkpoint"],
        "skip": {"from": 4, "to": 4 + MARGIN},
        "path": "/api/v1/runs/d2/plan",
    }
    assert details["plan"]["summary"] == doc["summary"] and details["plan"]["checkpoint"]["step"] == 2
