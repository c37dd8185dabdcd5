"""The command line's HTTP client of the server's API, standard library only: requests with the token, errors as
one line to print, and the reads that follow the server's paging."""

from __future__ import annotations

import argparse
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ampwatch import __version__

DEFAULT_URL = "http://127.0.0.1:8600"
EVENTS_PAGE = 10_000  # the most events the server answers at once


class CommandError(Exception):
    """A failure to report on one line of stderr, with the exit code to leave with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Client:
    """The server's HTTP API with the token as `Authorization: Bearer`; HTTP errors become `CommandError`s."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def open(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """The open response (a context manager) of one request; `path` may be a full URL the server gave."""
        target = path if "://" in path else self.url + path
        if query:
            pairs = [(k, v) for k, v in query.items() if v is not None]
            target += ("&" if "?" in target else "?") + urllib.parse.urlencode(pairs, doseq=True)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(target, data=data, method=method)
        request.add_header("User-Agent", f"ampwatch-cli/{__version__}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            return urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s)
        except urllib.error.HTTPError as error:
            raise self._refused(error) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise CommandError(
                f"cannot reach the ampwatch server at {self.url} ({reason}); start it, or set AMPWATCH_URL (or --url)"
            ) from None

    def json(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None) -> tuple[Any, Any]:
        """(the decoded JSON body or None when empty, the response headers)."""
        with self.open(method, path, query, body) as response:
            raw = response.read()
            return (json.loads(raw) if raw.strip() else None), response.headers

    def get(self, path: str, **query: Any) -> Any:
        return self.json("GET", path, query)[0]

    def _refused(self, error: urllib.error.HTTPError) -> CommandError:
        try:
            detail = json.loads(error.read() or b"{}").get("detail") or error.reason
        except (ValueError, AttributeError, OSError):
            detail = error.reason
        detail = detail if isinstance(detail, str) else json.dumps(detail)
        if error.code == 401:
            given = "the token was refused" if self.token else "this server needs a token"
            return CommandError(f"{given} ({detail}): set AMPWATCH_TOKEN (or --token) to a read or admin token")
        if error.code == 403:
            return CommandError(f"forbidden ({detail}): set AMPWATCH_TOKEN (or --token) to a token allowed to do this")
        if error.code == 404:
            return CommandError(str(detail))
        return CommandError(f"the server answered HTTP {error.code}: {detail}")


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """`--url` and `--token`; SUPPRESS keeps a subcommand from overwriting what its parent command parsed."""
    parser.add_argument("--url", default=argparse.SUPPRESS, help=f"the server (default AMPWATCH_URL, or {DEFAULT_URL})")
    parser.add_argument(
        "--token", default=argparse.SUPPRESS, help="a read token, admin to delete (default AMPWATCH_TOKEN)"
    )


def client_of(args: argparse.Namespace) -> Client:
    """The client for the parsed `--url` and `--token`, else AMPWATCH_URL and AMPWATCH_TOKEN."""
    url = getattr(args, "url", None) or os.environ.get("AMPWATCH_URL") or DEFAULT_URL
    return Client(url, getattr(args, "token", None) or os.environ.get("AMPWATCH_TOKEN") or None)


def quoted(run_id: str) -> str:
    """A run id as one path segment."""
    return urllib.parse.quote(run_id, safe="")


def list_runs(client: Client, project: str | None) -> list[dict[str, Any]]:
    """Every run (newest first), following the server's next-page cursor (`Link: rel="next"` or `X-Next-Cursor`)
    when it sends one."""
    runs: list[dict[str, Any]] = []
    path, query, seen = "/api/v1/runs", {"project": project}, set()
    while True:
        page, headers = client.json("GET", path, query)
        runs += page
        link = _next_link(headers.get("Link", ""))
        cursor = headers.get("X-Next-Cursor")
        if link and link not in seen:
            seen.add(link)
            path, query = urllib.parse.urljoin(client.url + "/", link), {}
        elif cursor and cursor not in seen:
            seen.add(cursor)
            path, query = "/api/v1/runs", {"project": project, "cursor": cursor}
        else:
            return runs


def list_events(client: Client, run_id: str, after_id: int = 0) -> list[dict[str, Any]]:
    """Every event of the run stored after the event `after_id` (0: from the first), in stored order, read a page
    at a time; events stored while it reads are included."""
    events: list[dict[str, Any]] = []
    while True:
        page = client.get(f"/api/v1/runs/{quoted(run_id)}/events", limit=EVENTS_PAGE, after_id=after_id)
        events += page
        if len(page) < EVENTS_PAGE:
            return events
        after_id = page[-1]["id"]


def _next_link(header: str) -> str | None:
    for part in header.split(","):
        target, _, params = part.partition(";")
        if re.search(r'rel="?next"?', params) and target.strip().startswith("<"):
            return target.strip()[1:-1]
    return None
