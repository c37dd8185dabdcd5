"""Who may do what, and browser safety.

Bearer tokens (`ampwatch token create`) have a role: `ingest` (agents; optionally one project), `read`
(dashboard and read API) or `admin` (everything, including alert rules, channels and silences). The
dashboard signs in by putting a token in an HttpOnly, SameSite=Strict cookie. A server with no token is
open; `ampwatch server` allows that only on loopback (or with `--insecure`), and an open server answers
only requests addressed to a loopback name or the host of its public URL (even with `--insecure`), so a
web page cannot reach it through DNS rebinding.

Every request also passes a cross-origin check: a browser's unsafe request (POST, PUT, PATCH, DELETE)
whose `Sec-Fetch-Site` or `Origin` says it comes from another site is refused, which stops CSRF without
form tokens. Every response gets security headers; pages get a Content-Security-Policy.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ampwatch.server import models
from ampwatch.server.db import now
from ampwatch.server.settings import Settings

log = logging.getLogger("ampwatch.server")
ROLES = ("ingest", "read", "admin")
COOKIE = "ampwatch_token"
_TOKEN = re.compile(r"amw_([0-9]{1,12})_([A-Za-z0-9_-]{43})")
_INGEST = re.compile(r"/api/v1/runs/[A-Za-z0-9_-]{1,64}(/batches)?")
_PUBLIC = ("/healthz", "/login", "/logout")
_SAFE = ("GET", "HEAD", "OPTIONS")
_GRANTS = {"ingest": ("ingest", "admin"), "read": ("read", "admin"), "admin": ("admin",)}
_HEADERS = {
    "x-content-type-options": "nosniff", "x-frame-options": "DENY", "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}  # fmt: skip
# Pages load only their own scripts; Plotly sets inline styles and draws images from data: URLs.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_OWN_CSP_EXEMPT = ("/docs", "/redoc")  # FastAPI's API browser loads Swagger UI with an inline script


@dataclass(frozen=True)
class Principal:
    """Who is asking: a token's role and project, or `open` on a server without tokens."""

    role: str
    project: str | None = None
    token_id: int | None = None


OPEN = Principal("open")


def _digest(secret: str) -> str:
    # Tokens carry 256 random bits, so a fast hash is as good as a slow one and keeps requests cheap.
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(session: Session, *, name: str, role: str, project: str | None = None) -> str:
    """Store a new token (hashed) and return it; it is never shown again."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if project is not None and role != "ingest":
        raise ValueError("only ingest tokens are limited to a project")
    secret = secrets.token_urlsafe(32)
    row = models.ApiToken(name=name, role=role, project=project, secret_sha256=_digest(secret), created_at=now())
    session.add(row)
    session.commit()
    return f"amw_{row.id}_{secret}"


def list_tokens(session: Session) -> list[models.ApiToken]:
    """Every token ever created, oldest first (revoked ones included, marked)."""
    return list(session.scalars(select(models.ApiToken).order_by(models.ApiToken.id)))


def revoke_token(session: Session, token_id: int) -> bool:
    """Revoke a token; False when there is no such active token."""
    result = session.execute(
        update(models.ApiToken)
        .where(models.ApiToken.id == token_id, models.ApiToken.revoked_at.is_(None))
        .values(revoked_at=now())
    )
    session.commit()
    return bool(result.rowcount)  # type: ignore[attr-defined]


class Tokens:
    """The tokens, cached in memory and re-read every `refresh_s` seconds (`Settings.token_refresh_s`)."""

    def __init__(self, sessions: sessionmaker[Session], refresh_s: float) -> None:
        self._sessions = sessions
        self.refresh_s = refresh_s
        self._rows: dict[int, Any] | None = None  # None: never read (then nobody is let in, not everybody)
        self._read_at = -refresh_s
        self._lock = threading.Lock()

    @property
    def stale(self) -> bool:
        return time.monotonic() - self._read_at >= self.refresh_s

    def refresh(self) -> None:
        """Re-read the table; on a database error keep what was read last (and say so)."""
        with self._lock:  # concurrent first requests wait here for the one read, rather than find nothing yet
            if self.known and not self.stale:
                return
            self._read_at = time.monotonic()
            try:
                with self._sessions() as session:
                    table = models.ApiToken
                    rows = session.execute(
                        select(table.id, table.role, table.project, table.secret_sha256, table.revoked_at)
                    )
                    self._rows = {row.id: row for row in rows}
            except Exception as error:  # the database is away: keep the last list, retry after refresh_s
                log.warning("could not read the token list (%s); using the last one read", error)

    @property
    def known(self) -> bool:
        return self._rows is not None

    @property
    def configured(self) -> bool:
        """Whether a token was ever created: then every request needs one (revoking the last does not reopen)."""
        return bool(self._rows)

    def verify(self, token: str) -> Principal | None:
        """The principal of a valid, active token, compared in constant time; None otherwise."""
        match = _TOKEN.fullmatch(token)
        row = (self._rows or {}).get(int(match[1])) if match else None
        if row is None or row.revoked_at is not None or not hmac.compare_digest(row.secret_sha256, _digest(match[2])):  # type: ignore[index]
            return None
        return Principal(row.role, row.project, row.id)


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (`127.0.0.0/8`, `::1`)."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(settings: Settings, tokens: Tokens) -> str | None:
    """Why the server must not start as configured, or None."""
    tokens.refresh()
    if is_loopback(settings.host) or settings.insecure or tokens.configured:
        return None
    return (
        f"refusing to listen on {settings.host}: no access token exists, so anyone who can reach this address "
        "could read and change everything. Create one first (`ampwatch token create --role admin`), or pass "
        "--insecure (AMPWATCH_INSECURE=1) if something else guards the network."
    )


class Guard:
    """ASGI middleware: cross-origin check, authentication, authorization, security headers."""

    def __init__(self, app: ASGIApp, tokens: Tokens, settings: Settings) -> None:
        self.app = app
        self.tokens = tokens
        public = urlsplit(settings.public_url).hostname if settings.public_url else None
        self._names = {name.lower() for name in (settings.host, public) if name}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.tokens.stale or not self.tokens.known:
            await anyio.to_thread.run_sync(self.tokens.refresh)
        headers = Headers(scope=scope)
        outcome = self._cross_site(scope, headers) or self._authorize(scope, headers)
        if isinstance(outcome, Response):
            await outcome(scope, receive, self._secured(send, scope["path"]))
            return
        scope.setdefault("state", {})["principal"] = outcome
        await self.app(scope, receive, self._secured(send, scope["path"]))

    def _cross_site(self, scope: Scope, headers: Headers) -> Response | None:
        if scope["method"] in _SAFE:
            return None
        site = headers.get("sec-fetch-site")
        origin = headers.get("origin")
        # The origin's host, not its scheme: behind a TLS-terminating proxy the server itself sees http.
        foreign = origin is not None and urlsplit(origin).netloc != headers.get("host")
        if site not in (None, "same-origin", "none") or site is None and foreign:
            return _refuse(403, "cross-site request refused: change things from ampwatch's own pages or with a token")
        return None

    def _authorize(self, scope: Scope, headers: Headers) -> Principal | Response:
        path, method = scope["path"], scope["method"]
        need = _required(method, path)
        if not self.tokens.known:
            return _refuse(503, "the server cannot read its access tokens yet (database unreachable)")
        if not self.tokens.configured:
            host = (urlsplit(f"//{headers.get('host', '')}").hostname or "").lower()
            if is_loopback(host) or host in self._names:  # --insecure lifts the refusal to start, never this
                return OPEN
            return _refuse(
                403,
                f"host {host!r} is not allowed: a server without tokens answers only on loopback names and the "
                "host of AMPWATCH_PUBLIC_URL (a web page could reach it through DNS rebinding otherwise)",
            )
        if need is None:
            return OPEN
        presented = _bearer(headers) or _cookie(headers)
        principal = self.tokens.verify(presented) if presented else None
        if principal is None:
            if method == "GET" and not path.startswith("/api/") and "text/html" in headers.get("accept", ""):
                target = path + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
                return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)
            reason = "the token is not valid (or was revoked)" if presented else "this server needs a token"
            return _refuse(401, f"{reason}: send `Authorization: Bearer <token>`", {"www-authenticate": "Bearer"})
        if principal.role not in _GRANTS[need]:
            return _refuse(
                403, f"a {principal.role} token cannot do this; it needs a {' or '.join(_GRANTS[need])} token"
            )
        return principal

    def _secured(self, send: Send, path: str) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers.setdefault(name, value)
                if headers.get("content-type", "").startswith("text/html") and path not in _OWN_CSP_EXEMPT:
                    headers.setdefault("content-security-policy", _CSP)
            await send(message)

        return wrapped


def _required(method: str, path: str) -> str | None:
    """The role a request needs; None for what anyone may see (health, sign-in, static files)."""
    if path in _PUBLIC or path.startswith("/static/"):
        return None
    match = _INGEST.fullmatch(path)
    if match and (method, bool(match[1])) in (("PUT", False), ("POST", True)):  # register a run, send a batch
        return "ingest"
    return "read" if method in _SAFE else "admin"


def _bearer(headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def _cookie(headers: Headers) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value or None
    return None


def _refuse(status: int, detail: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def document(app: FastAPI) -> None:
    """Declare the bearer tokens in the OpenAPI schema, so `/docs` has an "Authorize" button."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {"token": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"token": []}, {}]  # optional: a server without tokens is open
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def principal_of(request: Request) -> Principal:
    """Who made this request (set by `Guard`)."""
    return getattr(request.state, "principal", OPEN)


router = APIRouter(include_in_schema=False)


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
