"""A server SIGKILLed while agents send loses nothing it acknowledged: it acknowledges after commit, and after a
restart on the same database the agents' retries and spools bring in the rest, each batch once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _runs
import httpx

import ampwatch

STEPS_PER_BATCH = 40


def batch(seq: int) -> dict[str, Any]:
    steps = list(range((seq - 1) * STEPS_PER_BATCH, seq * STEPS_PER_BATCH))
    event = {"step": steps[-1], "type": "skipped_step", "severity": "info", "message": f"batch {seq}"}
    return {"seq": seq, "points": {"loss": {"steps": steps, "values": [s / 3 for s in steps]}}, "events": [event]}


def stored_batches(http: httpx.Client, run_id: str) -> list[int]:
    """The seq of every batch whose event is stored, one entry per stored event."""
    return sorted(int(e["message"].split()[1]) for e in http.get(f"/api/v1/runs/{run_id}/events").json())


def test_a_server_sigkilled_mid_ingest_loses_nothing_it_acknowledged_and_stores_every_step_once(
    db_url, server_processes, monkeypatch, wait_for
) -> None:
    monkeypatch.setenv("AMPWATCH_FINISH_TIMEOUT_S", "60")  # the agent backs off while the server is gone
    holder = {"server": server_processes(db_url)}
    port = holder["server"].port  # the restart comes back here
    url = holder["server"].url
    # Beside a real agent in a training loop, senders that record what the server acknowledged.
    senders, batches = 3, 40
    run_ids = [f"killed-{i}" for i in range(senders)]
    for run_id in run_ids:
        httpx.put(f"{url}/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).raise_for_status()
    acked: dict[str, list[int]] = {r: [] for r in run_ids}
    go = threading.Event()

    def send_all(run_id: str) -> None:  # an agent's delivery loop: the same batch again until it is acknowledged
        go.wait()
        seq = 1
        with httpx.Client(base_url=url, timeout=10) as http:
            while seq <= batches:
                try:
                    reply = http.post(f"/api/v1/runs/{run_id}/batches", json=batch(seq))
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                if reply.status_code == 200:
                    acked[run_id].append(seq)
                    seq += 1
                else:
                    assert reply.status_code >= 500, reply.text
                    time.sleep(0.05)

    run = ampwatch.init("robust", "sigkill", url=url)
    restart = threading.Thread(target=lambda: holder.update(server=server_processes(db_url, port)))
    acked_before: dict[str, list[int]] = {}

    def kill_mid_ingest(step: int) -> None:
        if step == 90:
            go.set()  # the senders start now, so that they are mid-way at the kill
        if step == 100:
            wait_for(
                lambda: sum(len(a) for a in acked.values()) >= senders * batches // 4,
                60,
                "a quarter of the batches acknowledged",
            )
            holder["server"].kill()  # mid-ingest: the senders always have a request in flight
            acked_before.update({r: list(a) for r, a in acked.items()})
            restart.start()  # training goes on while the server starts again
        time.sleep(0.002)

    with ThreadPoolExecutor(senders) as pool:
        sending = [pool.submit(send_all, r) for r in run_ids]
        _runs.train(run, range(300), kill_mid_ingest)
        restart.join(60)
        for future in sending:
            future.result(timeout=120)
    run.finish()
    assert sum(len(a) for a in acked_before.values()) < senders * batches  # the kill came before the end
    with httpx.Client(base_url=holder["server"].url) as http:
        for run_id in run_ids:
            assert set(acked_before[run_id]) <= set(stored_batches(http, run_id)), run_id  # nothing acknowledged lost
            assert stored_batches(http, run_id) == list(range(1, batches + 1)), run_id  # each batch once
            loss = http.get(f"/api/v1/runs/{run_id}/series", params={"name": "loss"}).json()["loss"]
            assert loss["steps"] == list(range(batches * STEPS_PER_BATCH))
            assert loss["values"] == [s / 3 for s in loss["steps"]]
    _runs.assert_every_step_once(holder["server"].url, run.id, 300)
