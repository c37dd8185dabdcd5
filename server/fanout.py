"""Live streams fan out: one poller per topic (the runs list with its filters; one rank of one run) in each
server process, shared by every open stream of that topic, so the database work grows with the number of
topics watched, not with the number of open tabs.

A stream subscribes first, then catches up on its own from where its client is (a new page, or the
`Last-Event-ID` it reconnected with), then sends what the topic's poller publishes: everything committed after
the subscription reaches it, some of it twice, which clients merge (points by step, events by id, runs by id).
A stream whose client reads slower than the topic publishes (more than `stream_queue` messages behind) is
dropped: its client reconnects with its `Last-Event-ID` and catches up from there, and nobody waits for it.

Pollers look at the database every `stream_poll_s` (`stream_runs_poll_s` for the runs list), and at once when
woken: by a commit of this process (`ingested`), and on Postgres by `NOTIFY ampwatch_ingest` from a commit of
any replica (`PgListener`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import Engine, event, text
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("ampwatch.server")
CHANNEL = "ampwatch_ingest"
_INGESTED = "ampwatch.ingested"  # session.info key: runs this transaction wrote
Poll = Callable[[], Awaitable[tuple[list[Any], bool]]]  # one look: (messages to publish, whether more wait)


class Subscription:
    """What one stream has not sent yet, up to `limit` messages; past that it is dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.dropped = False
        self._items: deque[Any] = deque()
        # A bare future and a timer per wait: asyncio.wait_for made a task per wait, per message, per open stream.
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        if self.dropped:
            return
        if len(self._items) >= self.limit:
            self.drop()  # (its client resumes from its Last-Event-ID; nobody waits for it)
        else:
            self._items.append(item)
            _wake(self._waiter)

    def drop(self) -> None:
        """End this stream: its client reconnects and catches up on its own."""
        self.dropped = True
        self._items.clear()
        _wake(self._waiter)

    async def get(self, timeout_s: float) -> list[Any]:
        """The messages waiting (none after `timeout_s`)."""
        if not self._items and not self.dropped:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


@dataclass
class _Topic:
    run_id: str | None  # None: the runs list (woken by any run)
    subscribers: set[Subscription] = field(default_factory=set)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # the poller knows where it starts
    polls: int = 0  # looks at the database so far (for tests and benchmarks)


class Hub:
    """The topics of one server process (`app.state.streams`)."""

    def __init__(self, *, queue: int) -> None:
        self.queue = queue
        self.topics: dict[Hashable, _Topic] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @asynccontextmanager
    async def subscribe(
        self, key: Hashable, run_id: str | None, start: Callable[[], Awaitable[Poll]], interval_s: float
    ) -> AsyncIterator[Subscription]:
        """A subscription to `key`'s messages, starting its poller (`await start()` gives its one-look function)
        if nobody watches it yet; the poller stops with its last subscriber. It is given once the poller knows
        where it starts: a stream that catches up afterwards leaves no gap before the poller's first message."""
        self._loop = asyncio.get_running_loop()
        topic = self.topics.get(key)
        if topic is None:
            topic = self.topics[key] = _Topic(run_id)
            topic.task = asyncio.create_task(self._poll(key, topic, start, interval_s))
        sub = Subscription(self.queue)
        topic.subscribers.add(sub)
        try:
            await topic.ready.wait()
            yield sub
        finally:
            topic.subscribers.discard(sub)
            if not topic.subscribers and self.topics.get(key) is topic:
                del self.topics[key]
                assert topic.task is not None
                topic.task.cancel()

    async def _poll(
        self, key: Hashable, topic: _Topic, start: Callable[[], Awaitable[Poll]], interval_s: float
    ) -> None:
        try:
            poll = await start()
            topic.ready.set()
            while topic.subscribers:
                messages, more = await poll()
                topic.polls += 1
                for message in messages:
                    for sub in list(topic.subscribers):
                        sub.put(message)
                if not more:
                    try:
                        await asyncio.wait_for(topic.wake.wait(), interval_s)
                    except TimeoutError:
                        pass
                    topic.wake.clear()
        except asyncio.CancelledError:
            raise
        except Exception:  # a lost database: the streams end, their clients reconnect (and start a new poller)
            log.exception("live stream poller failed")
            if self.topics.get(key) is topic:
                del self.topics[key]
            topic.ready.set()
            for sub in list(topic.subscribers):
                sub.drop()

    def wake(self, run_ids: set[str]) -> None:
        """Look at once in the topics of these runs and of the runs list (call in the event loop)."""
        for topic in self.topics.values():
            if topic.run_id is None or topic.run_id in run_ids:
                topic.wake.set()

    def wake_threadsafe(self, run_ids: set[str]) -> None:
        """`wake`, from any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.wake, run_ids)


def ingested(session: Session, run_id: str) -> None:
    """Mark that this transaction writes to `run_id`: on commit, this process's streams of it look at once, and
    on Postgres every replica's (the NOTIFY is delivered on commit, and not at all on rollback)."""
    session.info.setdefault(_INGESTED, set()).add(run_id)
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, :run)"), {"channel": CHANNEL, "run": run_id})


def wire(sessions: sessionmaker[Session], hub: Hub) -> None:
    """Wake `hub` after each commit that `ingested` something."""

    def after_commit(session: Session) -> None:
        runs = session.info.pop(_INGESTED, None)
        if runs:
            hub.wake_threadsafe(runs)

    def after_rollback(session: Session) -> None:
        session.info.pop(_INGESTED, None)

    event.listen(sessions, "after_commit", after_commit)
    event.listen(sessions, "after_rollback", after_rollback)


class PgListener:
    """A thread holding one Postgres connection that LISTENs for other replicas' commits and wakes `hub`;
    it reconnects after a lost connection (streams keep polling meanwhile)."""

    def __init__(self, engine: Engine, hub: Hub) -> None:
        self._url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._hub = hub
        self._stop = threading.Event()
        self.listening = threading.Event()  # set once the first LISTEN is in place
        self._thread = threading.Thread(target=self._loop, name="ampwatch-listen", daemon=True)

    def start(self, wait_s: float = 10.0) -> bool:
        """Start listening; return once the LISTEN is in place (a commit notified before it would wake nobody until
        the next poll), or after `wait_s` (False: Postgres is slow to answer; the thread goes on trying)."""
        self._thread.start()
        if self.listening.wait(wait_s):
            return True
        log.warning("not yet listening for other replicas' commits after %.0f s; live streams poll meanwhile", wait_s)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._url, autocommit=True, connect_timeout=5) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    while not self._stop.is_set():
                        for notice in connection.notifies(timeout=0.5, stop_after=1):  # (wake at the first)
                            self._hub.wake_threadsafe({notice.payload})
            except psycopg.Error as error:
                log.warning("listening for other replicas' commits failed (%s); retrying", error)
                self._stop.wait(1.0)
