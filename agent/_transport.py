"""How batches reach the server: the `Transport` contract, and its HTTP implementation (standard library only).

`HttpTransport` keeps one connection alive per run (a sender thread sends a few batches a second: a new TCP
connection each time would cost more than the batch). A connection the server closed in the meantime
is opened again once; documents are sent as JSON bytes encoded once by the caller.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Protocol

from ampwatch._protocol import packed  # noqa: F401  (re-exported: tests and benchmarks pack series with it)


def encode(document: dict[str, Any]) -> bytes:
    """A document as the bytes sent and spooled; raises ValueError/TypeError on what JSON cannot hold."""
    return json.dumps(document, allow_nan=False, separators=(",", ":")).encode()


class Response:
    """Outcome of one request: `status` 0 means the server could not be reached."""

    def __init__(self, status: int, body: str = "", retry_after_s: float | None = None) -> None:
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def refused(self) -> bool:
        """The server wants a (different) token: kept and retried, since a token can be created later."""
        return self.status in (401, 403)

    @property
    def retryable(self) -> bool:
        """Unreachable, overloaded or failing servers, and missing tokens, are retried; other 4xx are permanent."""
        return self.status == 0 or self.status in (408, 425, 429) or self.status >= 500 or self.refused


class Transport(Protocol):
    """What the sender needs to deliver batches; `ampwatch.init(transport=...)` takes any object that has it.

    `send` makes one request of the ingest API (`PUT /api/v1/runs/{id}` registers the run with its JSON document,
    `POST /api/v1/runs/{id}/batches` delivers one batch) and returns its `Response`; it must never raise: a failure
    is `Response(0, why)`, which the sender retries. `close` lets go of any connection (a later send may reopen one).
    Both are called from the sender thread only (and `close` from `finish()` once that thread is done).
    """

    def send(self, method: str, path: str, body: bytes) -> Response: ...

    def close(self) -> None: ...


class HttpTransport:
    """Sends JSON bodies to one server over HTTP(S); never raises."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "User-Agent": "ampwatch-agent"}
        self._conn: http.client.HTTPConnection | None = None
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._connect: Any = None  # a connection factory; None: through urllib (a proxy applies, or a bad URL)
        self._opener = (
            urllib.request.build_opener()
        )  # (urlopen's is built once per process: it may predate a proxy setting)
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:  # urllib says so at each attempt, as for any unreachable server
            return
        self._base_path = parts.path.rstrip("/")
        if parts.scheme in ("http", "https") and parts.hostname and not _proxied(parts):
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            self._connect = lambda: kind(parts.hostname, parts.port, timeout=timeout_s)

    def send(self, method: str, path: str, body: bytes) -> Response:
        """One request; the result says whether to retry."""
        if self._connect is None:
            return self._send_urllib(method, path, body)
        reused = self._conn is not None
        reply, error = self._request(method, path, body)
        if reused and error is not None and not isinstance(error, TimeoutError):
            reply, _ = self._request(method, path, body)  # the server closed the kept-alive connection: once more
        return reply

    def _request(self, method: str, path: str, body: bytes) -> tuple[Response, Exception | None]:
        try:
            if self._conn is None:
                self._conn = self._connect()
            self._conn.request(method, self._base_path + path, body, self._headers)
            reply = self._conn.getresponse()
            text = reply.read().decode(errors="replace")
        except (OSError, http.client.HTTPException, ValueError) as error:  # refused, reset, timed out, bad URL
            self.close()
            return Response(0, str(error)), error
        if reply.will_close:
            self.close()
        return Response(reply.status, text, _retry_after(reply.getheader("Retry-After"))), None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _send_urllib(self, method: str, path: str, body: bytes) -> Response:
        try:
            request = urllib.request.Request(self._url + path, body, self._headers, method=method)
            with self._opener.open(request, timeout=self._timeout_s) as reply:
                return Response(reply.status, reply.read().decode(errors="replace"))
        except urllib.error.HTTPError as error:
            return Response(
                error.code, error.read().decode(errors="replace"), _retry_after(error.headers.get("Retry-After"))
            )
        except (OSError, ValueError) as error:  # refused, reset, timed out, bad URL
            return Response(0, str(error))


def _proxied(parts: urllib.parse.SplitResult) -> bool:
    """Whether the environment routes this URL through a proxy (urllib then sends it, as it always did)."""
    return bool(urllib.request.getproxies().get(parts.scheme)) and not urllib.request.proxy_bypass(parts.netloc)


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value or "")
    except ValueError:
        return None
