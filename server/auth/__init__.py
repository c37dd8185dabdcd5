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

from ampwatch.server.auth.guard import (
    COOKIE,
    PUBLIC,
    Guard,
    document,
    exposure_problem,
    flat_routes,
    is_loopback,
    principal_of,
    requires,
    route_role,
    undeclared,
)
from ampwatch.server.auth.pages import router
from ampwatch.server.auth.tokens import OPEN, ROLES, Principal, Tokens, create_token, list_tokens, revoke_token

__all__ = [
    "COOKIE",
    "OPEN",
    "PUBLIC",
    "ROLES",
    "Guard",
    "Principal",
    "Tokens",
    "create_token",
    "document",
    "exposure_problem",
    "flat_routes",
    "is_loopback",
    "list_tokens",
    "principal_of",
    "requires",
    "revoke_token",
    "route_role",
    "router",
    "undeclared",
]
