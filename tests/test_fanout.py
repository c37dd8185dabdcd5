"""Live streams fan out: one poller per topic shared by every open stream, slow clients dropped, and on
Postgres a commit through one server wakes the streams of another at once (LISTEN/NOTIFY)."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack
from typing import Any

import httpx
from conftest import LiveServer
from test_stream import SSE, sse

from ampwatch.server.fanout import Hub, Subscription
from ampwatch.server.settings import Settings


def _register(client: httpx.Client, run_id: str) -> None:
    assert client.put(f"/api/v1/runs/{run_id}", json={"project": "p", "name": run_id}).status_code == 200


def _post(client: httpx.Client, run_id: str, seq: int, step: int, value: Any = 1.0) -> None:
    body = {"seq": seq, "points": {"loss": {"steps": [step], "values": [value]}}}
    assert client.post(f"/api/v1/runs/{run_id}/batches", json=body).json()["stored"]


def _has(step: int) -> Any:
    return lambda data: step in data["points"].get("loss", {}).get("steps", [])


def test_many_streams_of_a_run_share_one_poller_and_each_gets_every_point(
    live_server: LiveServer, wait_for: Any
) -> None:
    hub: Hub = live_server.app.state.streams
    with live_server.client() as client, ExitStack() as stack:
        _register(client, "r1")
        streams: list[SSE] = []
        for _ in range(12):
            response = stack.enter_context(client.stream("GET", "/api/v1/runs/r1/stream", timeout=10))
            assert response.status_code == 200
            streams.append(SSE(response))
        runs_list = stack.enter_context(sse(client, "/api/v1/stream/runs"))

        def subscribers() -> dict[str, int]:
            return {str(key): len(topic.subscribers) for key, topic in list(hub.topics.items())}

        expected = {"('run', 'r1', 0)": 12, "('runs', None, None, None)": 1}  # two topics, two pollers
        wait_for(lambda: subscribers() == expected, what=f"12 + 1 subscribers, not {subscribers()}")
        _post(client, "r1", 1, 7, "NaN")
        for stream in streams:
            (update,) = stream.until(_has(7))[-1:]
            assert update["data"]["points"]["loss"] == {"steps": [7], "values": ["NaN"]}
        runs = runs_list.next("runs")["data"]
        assert [r["id"] for r in runs] == ["r1"] and runs[0]["last_step"] == 7
    wait_for(lambda: hub.topics == {}, what="the pollers to stop with their last stream")


def test_a_client_that_falls_behind_is_dropped_and_the_others_get_everything() -> None:
    async def scenario() -> tuple[list[int], bool, bool]:
        hub = Hub(queue=5)
        published = asyncio.Event()
        counter = iter(range(1000))

        async def start() -> Any:
            async def poll() -> tuple[list[int], bool]:
                await asyncio.sleep(0.001)
                if published.is_set():
                    return [], False
                return [next(counter)], True

            return poll

        got: list[int] = []
        async with hub.subscribe("t", None, start, 0.01) as slow, hub.subscribe("t", None, start, 0.01) as fast:
            while len(got) < 50:
                got += await fast.get(1.0)
            published.set()
            return got, slow.dropped, fast.dropped

    got, slow_dropped, fast_dropped = asyncio.run(scenario())
    assert got[:50] == list(range(got[0], got[0] + 50)) and slow_dropped and not fast_dropped


def test_a_point_ingested_through_one_server_wakes_a_stream_of_another_on_postgres(
    pg_url: str, live_server_factory: Any
) -> None:
    # The second server polls only every 60 s: its stream learns of the point from Postgres's NOTIFY.
    writer = live_server_factory(Settings(database_url=pg_url))
    reader = live_server_factory(Settings(database_url=pg_url, stream_poll_s=60.0, stream_runs_poll_s=60.0))
    assert reader.app.state.listener.listening.is_set()  # (ready means listening: no commit slips past it)
    with writer.client() as ingest, reader.client() as watch:
        _register(ingest, "r1")
        with sse(watch, "/api/v1/runs/r1/stream") as stream:
            _post(ingest, "r1", 1, 3)
            stream.until(_has(3), timeout_s=10)  # (the stream's own catch-up is over: what follows is shared)
            sent = time.monotonic()
            _post(ingest, "r1", 2, 4, "Infinity")
            update = stream.until(_has(4), timeout_s=10)[-1]
            took = time.monotonic() - sent
    assert update["data"]["points"]["loss"] == {"steps": [4], "values": ["Infinity"]}
    assert took < 5.0, took  # woken, not polled (the poll is 60 s away)


def test_a_subscription_waits_until_a_message_or_its_timeout_and_a_cancelled_stream_stops_waiting() -> None:
    async def scenario() -> tuple[list[Any], float, list[Any], list[Any], bool]:
        sub = Subscription(limit=10)
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        empty = await sub.get(0.05)
        waited = time.monotonic() - start
        loop.call_later(0.01, sub.put, b"one")
        woken = await sub.get(5.0)
        sub.put(b"two")
        sub.put(b"three")
        ready = await sub.get(5.0)  # (waiting already: no wait)
        task = asyncio.create_task(sub.get(5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
            cancelled = False
        except asyncio.CancelledError:
            cancelled = True
        return empty, waited, woken, ready, cancelled

    empty, waited, woken, ready, cancelled = asyncio.run(scenario())
    assert empty == [] and 0.04 <= waited < 2.0
    assert woken == [b"one"] and ready == [b"two", b"three"] and cancelled
