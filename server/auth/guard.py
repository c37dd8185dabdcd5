"""The guard: who may do what, and browser safety, for every request before its body is read.

Each route declares the role it needs with `requires(role)` (a FastAPI dependency: "ingest", "read", "admin",
or None for what anyone may see), and `Guard` looks the request's route up and enforces its role. A request
matching no route, or a route that declares nothing (`undeclared` lists them; a test fails on any), needs
"read" (a GET) or "admin" (anything else), so a 404 tells a stranger nothing.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any
from urllib.parse import quote, urlsplit

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.responses import RedirectResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ampwatch.server.auth.tokens import OPEN, Principal, Tokens
from ampwatch.server.settings import Settings

log = logging.getLogger("ampwatch.server")
COOKIE = "ampwatch_token"
_SAFE = ("GET", "HEAD", "OPTIONS")
_GRANTS = {"ingest": ("ingest", "admin"), "read": ("read", "admin"), "admin": ("admin",)}
_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}
# Pages load only their own scripts; Plotly sets inline styles and draws images from data: URLs.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_OWN_CSP_EXEMPT = ("/docs", "/redoc")  # FastAPI's API browser loads Swagger UI with an inline script
# FastAPI's own routes (the API browser and its schema) take no dependencies: their role is declared here.
FRAMEWORK_ROUTES = {"/openapi.json": "read", "/docs": "read", "/docs/oauth2-redirect": "read", "/redoc": "read"}
PUBLIC = "public"  # what `route_role` says of a route anyone may use


class _Role:
    """The dependency `requires` returns: it marks the route; `Guard` has checked the role before the call."""

    def __init__(self, role: str | None) -> None:
        self.role = role

    def __call__(self) -> None:
        return None


def requires(role: str | None) -> Any:
    """Declare the role a route (or every route of a router) needs: "ingest", "read", "admin", or None (anyone).
    Use as `dependencies=[requires("read")]`."""
    if role is not None and role not in _GRANTS:
        raise ValueError(f"no role {role!r}")
    return Depends(_Role(role))


def flat_routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    """Every route, in matching order, with included routers expanded (FastAPI keeps an included router as one
    entry that refers to the original; its routes carry their full path and their router's dependencies)."""
    out: list[BaseRoute] = []
    for route in routes:
        original = getattr(route, "original_router", None)
        out.extend(flat_routes(original.routes) if original is not None else [route])
    return out


def route_role(route: BaseRoute) -> str | None:
    """The role `route` declared (`PUBLIC` for anyone), or None when it declared none."""
    path = getattr(route, "path", "")
    if path in FRAMEWORK_ROUTES:
        return FRAMEWORK_ROUTES[path]
    declared = [d.dependency.role for d in getattr(route, "dependencies", []) if isinstance(d.dependency, _Role)]
    if not declared:
        return None
    return PUBLIC if declared[-1] is None else declared[-1]  # (a route's own declaration follows its router's)


def undeclared(app: FastAPI) -> list[str]:
    """The routes of `app` that declare no role ("METHODS /path")."""
    return [
        f"{','.join(sorted(getattr(r, 'methods', None) or []))} {getattr(r, 'path', r)}"
        for r in flat_routes(app.routes)
        if route_role(r) is None
    ]


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

    def __init__(self, app: ASGIApp, tokens: Tokens, settings: Settings, routes: list[BaseRoute]) -> None:
        self.app = app
        self.tokens = tokens
        self._routes = routes  # the app's: complete once requests come (see `requires`)
        self._flat: list[BaseRoute] | None = None
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
        need = self._required(scope)
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

    def _required(self, scope: Scope) -> str | None:
        """The role the request's route declared; None for what anyone may see (health, sign-in, static files)."""
        if self._flat is None:
            self._flat = flat_routes(self._routes)
        for route in self._flat:
            if route.matches(scope)[0] == Match.FULL and (role := route_role(route)) is not None:
                return None if role == PUBLIC else role
        return "read" if scope["method"] in _SAFE else "admin"  # (no such route: a 404 or 405 follows)

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
        # (FastAPI types openapi_schema as optional; it was just set)
        return app.openapi_schema  # type: ignore[return-value]

    # (FastAPI documents replacing app.openapi to extend the schema)
    app.openapi = openapi  # type: ignore[method-assign]


def principal_of(request: Request) -> Principal:
    """Who made this request (set by `Guard`)."""
    return getattr(request.state, "principal", OPEN)
