"""Signing in to the dashboard: a read or admin token kept in an HttpOnly, SameSite=Strict cookie."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette.responses import Response

from ampwatch.server.auth.guard import COOKIE, requires
from ampwatch.server.auth.tokens import Tokens

router = APIRouter(include_in_schema=False, dependencies=[requires(None)])


def _local(target: str) -> str:
    """Only a path on this server: never an open redirect."""
    return target if target.startswith("/") and not target.startswith("//") and "\\" not in target else "/"


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = "/", error: str | None = None) -> Any:  # noqa: A002 - the query name
    """The sign-in form: paste a read or admin token."""
    from ampwatch.web.pages import templates

    return templates.TemplateResponse(
        request, "login.html", {"next": _local(next), "error": error}, status_code=401 if error else 200
    )


@router.post("/login")
async def login(request: Request) -> Response:
    """Check the token and keep it in an HttpOnly, SameSite=Strict cookie."""
    form = dict(parse_qsl((await request.body()).decode(errors="replace"), max_num_fields=5))
    target, token = _local(form.get("next", "/")), form.get("token", "").strip()
    tokens: Tokens = request.app.state.tokens
    principal = tokens.verify(token)
    if principal is None or principal.role == "ingest":
        error = (
            "That token is not valid."
            if principal is None
            else "An ingest token can only send data; sign in with a read or admin token."
        )
        return login_page(request, target, error)
    reply = RedirectResponse(target, status_code=303)
    secure = request.url.scheme == "https" or (request.app.state.settings.public_url or "").startswith("https:")
    reply.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure, max_age=30 * 86400)
    return reply


@router.post("/logout")
def logout() -> Response:
    """Forget the sign-in cookie."""
    reply = RedirectResponse("/login", status_code=303)
    reply.delete_cookie(COOKIE, httponly=True, samesite="strict")
    return reply
