"""Validation errors that always render: non-finite or huge inputs are echoed back short and safe."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_ECHO_CHARS = 200


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 with each error's location and message; the offending input is shown as a short repr."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": [_error(e) for e in exc.errors()[:50]]}, status_code=422)


def _error(error: dict[str, Any]) -> dict[str, Any]:
    out = {"type": error.get("type"), "loc": [str(p) for p in error.get("loc", ())], "msg": str(error.get("msg"))}
    if "input" in error:
        text = repr(error["input"])
        out["input"] = text if len(text) <= _ECHO_CHARS else text[:_ECHO_CHARS] + "…"
    return out
