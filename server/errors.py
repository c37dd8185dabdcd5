"""Errors that always render: validation errors echo non-finite or huge inputs back short and safe, and a
database that is briefly out of reach is a 503 with Retry-After (which agents retry), not a 500."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

log = logging.getLogger("ampwatch.server")
_ECHO_CHARS = 200
_SECRET = re.compile("password|secret|token|url", re.I)  # webhook URLs carry their token
RETRY_AFTER_S = 1


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 with each error's location and message; the offending input is shown as a short repr."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": [_error(e) for e in exc.errors()[:50]]}, status_code=422)


def _error(error: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": error.get("type"),
        "loc": [str(p) for p in error.get("loc", ())],
        "msg": str(error.get("msg")),
    }
    if "input" in error:
        secret = any(_SECRET.search(part) for part in out["loc"])  # proxies and logs may keep error bodies
        text = "'***'" if secret else repr(_masked(error["input"]))
        out["input"] = text if len(text) <= _ECHO_CHARS else text[:_ECHO_CHARS] + "…"
    return out


def _masked(value: Any) -> Any:
    """A request body with the values of secret-looking keys (password, secret, token, url) hidden."""
    if isinstance(value, dict):
        return {k: "***" if isinstance(k, str) and _SECRET.search(k) else _masked(v) for k, v in value.items()}
    return value


async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """503 + Retry-After for a lost database connection or a SQLite lock held past the busy timeout; any other
    OperationalError is a bug and propagates (500)."""
    assert isinstance(exc, OperationalError)
    if not (exc.connection_invalidated or "database is locked" in str(exc.orig)):
        raise exc
    log.warning("database unavailable during %s %s: %s", request.method, request.url.path, exc.orig)
    detail = "the database is unavailable for a moment; retry the request"
    return JSONResponse({"detail": detail}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
