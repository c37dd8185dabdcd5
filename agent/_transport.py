"""HTTP transport to the server, standard library only."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

_NONFINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def encode_value(value: float) -> float | str:
    """JSON has no NaN or Infinity: send them as the strings the read API uses."""
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else _NONFINITE[value]


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


class Transport:
    """Sends JSON documents to one server; never raises."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "User-Agent": "ampwatch-agent"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def send(self, method: str, path: str, document: dict[str, Any]) -> Response:
        """One request; the result says whether to retry."""
        try:
            data = json.dumps(document, allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError) as error:  # a bug on our side: retrying cannot help
            return Response(400, f"the agent could not encode this document: {error}")
        request = urllib.request.Request(self._url + path, data, self._headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as reply:
                return Response(reply.status, reply.read().decode(errors="replace"))
        except urllib.error.HTTPError as error:
            return Response(error.code, error.read().decode(errors="replace"), _retry_after(error))
        except (OSError, ValueError) as error:  # refused, reset, timed out, bad URL
            return Response(0, str(error))


def _retry_after(error: urllib.error.HTTPError) -> float | None:
    try:
        return float(error.headers.get("Retry-After", ""))
    except ValueError:
        return None
