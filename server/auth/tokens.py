"""Access tokens: created, listed and revoked in the database (only a SHA-256 of each secret is stored), and
cached in each process, re-read every `Settings.token_refresh_s`."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from ampwatch.server import models
from ampwatch.server.db import now

log = logging.getLogger("ampwatch.server")
ROLES = ("ingest", "read", "admin")
_TOKEN = re.compile(r"amw_([0-9]{1,12})_([A-Za-z0-9_-]{43})")


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
    # (an UPDATE's result has a rowcount; SQLAlchemy types it as a plain Result)
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
        # (match is not None here: without one, row is None and the test stops before)
        if row is None or row.revoked_at is not None:
            return None
        if not hmac.compare_digest(row.secret_sha256, _digest(match[2])):  # type: ignore[index]
            return None
        return Principal(row.role, row.project, row.id)
