"""An in-memory transport for tests of the agent's own logic: `ampwatch.init(..., transport=MemoryTransport())`.

It takes what the server's ingest API takes, validated by the server's own request schemas (a body the server
would refuse is refused here too, with the same status), and keeps it as the read API returns it: series per
(run, rank) with the last value of a step winning, events in step order, a run's status. Each (run, rank, seq)
is stored once. Tests of the server, the database or the wire (end to end, restarts, spool) use a real server.
Imported as `_memory` (pytest puts tests/ on the path).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from pydantic import ValidationError

from ampwatch import Response
from ampwatch.server.schemas import BatchIn, RunIn
from ampwatch.server.values import to_json

_RUN = re.compile(r"/api/v1/runs/([A-Za-z0-9_-]{1,64})(/batches)?")


class MemoryTransport:
    """The ingest API of one server, in memory; `send` and `close` as `ampwatch.Transport` asks, never raising."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (sent from the sender threads, read from the test's)
        self._runs: dict[str, dict[str, Any]] = {}
        self._points: dict[tuple[str, int, str], dict[int, float]] = {}  # (run, rank, name) -> step -> value
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._seen: set[tuple[str, int, int]] = set()  # (run, rank, seq) of the batches stored
        self.requests = 0
        self.closed = 0

    # -- the transport ---------------------------------------------------------------------
    def send(self, method: str, path: str, body: bytes) -> Response:
        match = _RUN.fullmatch(path)
        if match is None:
            return Response(404, '{"detail":"Not Found"}')
        run_id, batches = match.group(1), match.group(2)
        with self._lock:
            self.requests += 1
            try:
                document = json.loads(body)
                if method == "PUT" and not batches:
                    return self._register(run_id, RunIn.model_validate(document))
                if method == "POST" and batches:
                    return self._ingest(run_id, BatchIn.model_validate(document))
            except (ValueError, ValidationError) as error:  # (pydantic's error is a ValueError too)
                return Response(422, json.dumps({"detail": str(error)}))
        return Response(405, '{"detail":"Method Not Allowed"}')

    def close(self) -> None:
        self.closed += 1

    def _register(self, run_id: str, run: RunIn) -> Response:
        stored = self._runs.setdefault(run_id, {"id": run_id, "status": "running", "last_step": None})
        stored.update(project=run.project, name=run.name, config=run.config, environment=run.environment)
        return Response(200, json.dumps({"id": run_id, "status": stored["status"]}))

    def _ingest(self, run_id: str, batch: BatchIn) -> Response:
        run = self._runs.get(run_id)
        if run is None:
            return Response(404, json.dumps({"detail": f"unknown run {run_id}"}))
        if (run_id, batch.rank, batch.seq) in self._seen:
            return Response(200, json.dumps({"stored": False, "points": 0}))
        self._seen.add((run_id, batch.rank, batch.seq))
        count = 0
        for name, series in batch.points.items():
            stored = self._points.setdefault((run_id, batch.rank, name), {})
            stored.update(zip(series.steps, series.values))
            count += len(series.steps)
        for event in batch.events:
            fields = event.model_dump()
            fields["rank"] = batch.rank if event.rank is None else event.rank
            self._events.setdefault(run_id, []).append(fields)
        steps = [max(s.steps) for s in batch.points.values() if s.steps] + [e.step for e in batch.events]
        if steps:
            run["last_step"] = max(steps + ([run["last_step"]] if run["last_step"] is not None else []))
        if batch.status is not None:
            run["status"] = batch.status
        return Response(200, json.dumps({"stored": True, "points": count}))

    # -- what tests read, shaped as the read API returns it -----------------------------------
    def run(self, run_id: str) -> dict[str, Any]:
        """The run as registered, with its `status`, `last_step`, the names of its `series` and its `ranks`."""
        with self._lock:
            keys = [(rank, name) for (r, rank, name) in self._points if r == run_id]
            return {**self._runs[run_id], "series": sorted({n for _, n in keys}), "ranks": sorted({k for k, _ in keys})}

    def runs(self, project: str | None = None) -> list[dict[str, Any]]:
        """The runs (of `project`), newest first."""
        with self._lock:
            ids = [i for i, run in self._runs.items() if project is None or run.get("project") == project]
        return [self.run(i) for i in reversed(ids)]

    def series(self, run_id: str, name: list[str] | str | None = None, rank: int = 0) -> dict[str, dict[str, list]]:
        """`{name: {"steps": [...], "values": [...]}}` in step order; non-finite values spelt 'NaN', 'Infinity'..."""
        names = [name] if isinstance(name, str) else name
        with self._lock:
            found = {n: points for (r, k, n), points in self._points.items() if r == run_id and k == rank}
        return {
            n: {"steps": sorted(points), "values": to_json(points[s] for s in sorted(points))}
            for n, points in found.items()
            if names is None or n in names
        }

    def events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's events (step, rank, type, severity, message, details, time) in step order, then arrival."""
        with self._lock:
            return sorted((dict(e) for e in self._events.get(run_id, [])), key=lambda e: e["step"])
