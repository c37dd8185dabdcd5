"""SQLite under concurrent writers: many clients of one server, and two server processes on one file (their
alert evaluators write too). No request may fail with "database is locked"; every batch is stored once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

STEPS_PER_BATCH = 40


def batch(seq: int) -> dict[str, Any]:
    """Batch `seq` of a run: two series over its own steps, and a critical event every fifth batch (it opens
    an alert in the ingest transaction, so alerting writes race with ingest)."""
    steps = list(range((seq - 1) * STEPS_PER_BATCH, seq * STEPS_PER_BATCH))
    events = [{"step": steps[-1], "type": "nonfinite_loss", "severity": "critical", "message": f"NaN at {steps[-1]}"}]
    return {
        "seq": seq,
        "points": {
            "loss": {"steps": steps, "values": [s / 7 for s in steps]},
            "scale": {"steps": steps, "values": [1024.0] * len(steps)},
        },
        "events": events if seq % 5 == 0 else [],
    }


def assert_stored_once(http: httpx.Client, run_id: str, batches: int) -> None:
    """Every step of `batches` batches is there with its value, and every event once."""
    series = http.get(f"/api/v1/runs/{run_id}/series", params={"name": ["loss", "scale"]}).json()
    steps = list(range(batches * STEPS_PER_BATCH))
    assert series["loss"]["steps"] == steps, run_id
    assert series["loss"]["values"] == [s / 7 for s in steps], run_id
    assert series["scale"]["steps"] == steps, run_id
    events = [e for e in http.get(f"/api/v1/runs/{run_id}/events").json() if e["type"] == "nonfinite_loss"]
    assert sorted(e["step"] for e in events) == [seq * STEPS_PER_BATCH - 1 for seq in range(5, batches + 1, 5)], run_id


def test_concurrent_clients_of_one_sqlite_server_get_no_5xx_and_each_batch_is_stored_once(sqlite_server) -> None:
    runs, batches = 8, 20

    def client(index: int) -> list[int]:
        run_id = f"writer-{index}"
        with sqlite_server.client() as http:
            http.put(f"/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).raise_for_status()
            # Each batch twice, like an agent whose acknowledgement got lost: the second must change nothing.
            return [
                http.post(f"/api/v1/runs/{run_id}/batches", json=batch(seq)).status_code
                for seq in range(1, batches + 1)
                for _ in (1, 2)
            ]

    with ThreadPoolExecutor(runs) as pool:
        statuses = [s for result in pool.map(client, range(runs)) for s in result]
    assert statuses == [200] * (2 * runs * batches)
    with sqlite_server.client() as http:
        for index in range(runs):
            assert_stored_once(http, f"writer-{index}", batches)


def test_two_server_processes_on_one_sqlite_file_store_every_batch_once(sqlite_url, server_processes) -> None:
    env = {"AMPWATCH_ALERT_EVAL_INTERVAL_S": "0.05"}  # both evaluators write all the time
    servers = [
        server_processes(sqlite_url, **env),
        server_processes(sqlite_url, **env),
    ]  # both migrate the new file at once
    for server in servers:
        server.wait_ready()
    runs, batches = 4, 10
    run_ids = [f"shared-{i}" for i in range(runs)]
    for run_id in run_ids:
        httpx.put(f"{servers[0].url}/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).raise_for_status()

    def send(job: tuple[str, int, int]) -> tuple[int, bool]:
        run_id, seq, which = job
        reply = httpx.post(f"{servers[which].url}/api/v1/runs/{run_id}/batches", json=batch(seq), timeout=60)
        return reply.status_code, reply.status_code == 200 and reply.json()["stored"]

    # Every batch goes to both processes at the same moment: exactly one of them may store it.
    jobs = [(run_id, seq, which) for seq in range(1, batches + 1) for run_id in run_ids for which in (0, 1)]
    with ThreadPoolExecutor(2 * runs) as pool:
        replies = list(pool.map(send, jobs))
    assert [status for status, _ in replies] == [200] * len(jobs)
    assert sum(stored for _, stored in replies) == runs * batches
    with httpx.Client(base_url=servers[1].url) as http:
        for run_id in run_ids:
            assert_stored_once(http, run_id, batches)
    for server in servers:
        assert "database is locked" not in server.log.read_text()
