"""Tokens, roles, the sign-in cookie, CSRF, DNS-rebinding and exposure checks, security headers, on real servers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

import ampwatch
from ampwatch._sync import sync
from ampwatch.server import Settings, auth

SILENCE = {"project": "p", "duration_s": 60, "comment": "test"}


REFRESH_S = 0.05


@pytest.fixture(autouse=True)
def _fast_token_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMPWATCH_TOKEN_REFRESH_S", str(REFRESH_S))  # servers started here: new tokens count at once


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPWATCH_")}
    return subprocess.run(
        [sys.executable, "-m", "ampwatch._cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _token(server, role: str, project: str | None = None) -> str:
    with server.app.state.sessions() as session:
        token = auth.create_token(session, name=f"test {role}", role=role, project=project)
    time.sleep(2 * REFRESH_S)  # the server re-reads its tokens every REFRESH_S
    return token


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_open_loopback_server_refuses_cross_site_writes_and_foreign_hosts(sqlite_server) -> None:
    with sqlite_server.client() as client:
        page = client.get("/")
        assert page.status_code == 200
        assert page.headers["x-content-type-options"] == "nosniff" and page.headers["x-frame-options"] == "DENY"
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]

        # A web page elsewhere posting a form to the server: refused, and nothing was created.
        for hostile in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
            reply = client.post("/api/v1/silences", json=SILENCE, headers=hostile)
            assert reply.status_code == 403, hostile
            assert "cross-site" in reply.json()["detail"]
        assert client.get("/api/v1/silences").json() == []

        # The dashboard's own pages (same origin) and non-browser clients (no Origin) still work.
        own = client.post(
            "/api/v1/silences", json=SILENCE, headers={"Origin": sqlite_server.url, "Sec-Fetch-Site": "same-origin"}
        )
        assert own.status_code == 201, own.text
        assert client.post("/api/v1/silences", json=SILENCE).status_code == 201

        # DNS rebinding: a page on evil.example resolving to 127.0.0.1 talks to the server as "evil.example".
        rebound = client.get("/api/v1/runs", headers={"Host": "evil.example:8600"})
        assert rebound.status_code == 403 and "loopback" in rebound.json()["detail"]
        assert client.get("/api/v1/runs", headers={"Host": "localhost:8600"}).status_code == 200


def test_insecure_lifts_the_refusal_to_start_not_the_rebinding_guard(sqlite_url: str, live_server_factory) -> None:
    # As docker-compose runs it: no token, --insecure, the public URL naming the published address.
    server = live_server_factory(
        Settings(database_url=sqlite_url, insecure=True, public_url="http://dash.example:8600")
    )
    with server.client() as client:
        assert client.get("/api/v1/runs", headers={"Host": "dash.example:8600"}).status_code == 200
        rebound = client.post(
            "/api/v1/silences", json=SILENCE, headers={"Host": "evil.example:8600", "Sec-Fetch-Site": "same-origin"}
        )
        assert rebound.status_code == 403
        assert client.get("/api/v1/silences").json() == []


def test_tokens_gate_reads_writes_and_pages_by_role(sqlite_server) -> None:
    read, admin = _token(sqlite_server, "read"), _token(sqlite_server, "admin")
    with sqlite_server.client() as client:
        missing = client.get("/api/v1/runs")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert client.get("/api/v1/runs", headers=_bearer(read)).status_code == 200
        assert (
            client.get("/api/v1/runs", headers=_bearer(read[:-1] + ("A" if read[-1] != "A" else "B"))).status_code
            == 401
        )
        assert client.get("/api/v1/runs", headers=_bearer("amw_999_" + "x" * 43)).status_code == 401
        assert client.get("/healthz").status_code == 200  # health checks need no token
        assert client.get("/static/app.css").status_code == 200

        denied = client.post("/api/v1/silences", json=SILENCE, headers=_bearer(read))
        assert denied.status_code == 403 and "admin" in denied.json()["detail"]
        assert client.post("/api/v1/silences", json=SILENCE, headers=_bearer(admin)).status_code == 201

        # A browser without the cookie is sent to sign in, and comes back where it was going.
        bounce = client.get("/compare?series=loss", headers={"Accept": "text/html"})
        assert bounce.status_code == 303 and bounce.headers["location"] == "/login?next=%2Fcompare%3Fseries%3Dloss"
        assert client.post("/login", data={"token": "amw_1_" + "y" * 43, "next": "/"}).status_code == 401
        signed = client.post("/login", data={"token": read, "next": "//evil.example/"})
        assert signed.status_code == 303 and signed.headers["location"] == "/"  # never an open redirect
        cookie = signed.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        page = client.get("/", headers={"Accept": "text/html"})  # the client kept the cookie
        assert page.status_code == 200 and "Sign out" in page.text
        assert read not in page.text  # the token itself is never written into a page


def test_ingest_token_is_limited_to_its_project_and_refused_data_is_kept_for_sync(
    sqlite_server, tmp_path: Path
) -> None:
    ingest = _token(sqlite_server, "ingest", project="vision")
    admin = _token(sqlite_server, "admin")
    with ampwatch.init("vision", name="allowed", url=sqlite_server.url, token=ingest) as run:
        for step in range(20):
            run.log({"loss": 1.0 / (step + 1)}, step=step)
    with ampwatch.init("speech", name="other project", url=sqlite_server.url, token=ingest) as refused:
        for step in range(20):
            refused.log({"loss": float(step)}, step=step)

    with sqlite_server.client() as client:

        def steps(run_id: str) -> list[int]:
            reply = client.get(f"/api/v1/runs/{run_id}/series", params={"name": "loss"}, headers=_bearer(admin))
            return reply.json()["loss"]["steps"] if reply.status_code == 200 else []

        assert steps(run.id) == list(range(20))
        assert client.get(f"/api/v1/runs/{refused.id}", headers=_bearer(admin)).status_code == 404
        # An ingest token can neither read nor touch another project's existing run.
        assert client.get("/api/v1/runs", headers=_bearer(ingest)).status_code == 403
        hijack = client.put(
            f"/api/v1/runs/{run.id}",
            json={"project": "vision", "name": "x"},
            headers=_bearer(_token(sqlite_server, "ingest", "speech")),
        )
        assert hijack.status_code == 403

        # Nothing was lost: the refused run waits in the spool, and `ampwatch sync` with a good token uploads it.
        assert sync(Path(os.environ["AMPWATCH_SPOOL_DIR"]), sqlite_server.url, admin) == 0
        assert steps(refused.id) == list(range(20))


def test_revoked_token_stops_working_and_only_hashes_are_stored(sqlite_url: str, live_server_factory) -> None:
    made = _cli("token", "create", "--role", "admin", "--name", "ops", "--db", sqlite_url)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("amw_") and "shown only this once" in made.stderr
    with create_engine(sqlite_url).connect() as connection:
        dump = "\n".join(str(row) for row in connection.execute(text("SELECT * FROM api_tokens")))
    assert token.split("_", 2)[2] not in dump  # only a SHA-256 of the secret is in the database

    listed = _cli("token", "list", "--db", sqlite_url)
    assert "admin" in listed.stdout and "ops" in listed.stdout and token.split("_", 2)[2] not in listed.stdout
    server = live_server_factory(Settings(database_url=sqlite_url))
    with server.client() as client:
        assert client.get("/api/v1/runs", headers=_bearer(token)).status_code == 200
        assert _cli("token", "revoke", token.split("_")[1], "--db", sqlite_url).returncode == 0
        time.sleep(2 * REFRESH_S)
        assert client.get("/api/v1/runs", headers=_bearer(token)).status_code == 401
        assert client.get("/api/v1/runs").status_code == 401  # revoking the last token does not reopen the server
    assert _cli("token", "create", "--role", "read", "--project", "p", "--db", sqlite_url).returncode == 2


def test_server_refuses_a_public_address_without_tokens(sqlite_url: str, tmp_path: Path) -> None:
    refused = _cli("server", "--host", "0.0.0.0", "--port", "1", "--db", sqlite_url)
    assert refused.returncode == 2
    assert "no access token" in refused.stderr and "--insecure" in refused.stderr
    with pytest.raises(httpx.ConnectError):  # it never listened (port 1 would also need root)
        httpx.get("http://127.0.0.1:1/healthz", timeout=1)

    from ampwatch.server import db

    engine = db.make_engine(sqlite_url)
    tokens = auth.Tokens(db.session_factory(engine), refresh_s=5.0)
    public = Settings(database_url=sqlite_url, host="0.0.0.0")
    assert auth.exposure_problem(public, tokens) is not None
    assert auth.exposure_problem(public.model_copy(update={"insecure": True}), tokens) is None
    assert auth.exposure_problem(Settings(database_url=sqlite_url, host="::1"), tokens) is None
    with db.session_factory(engine)() as session:
        auth.create_token(session, name="", role="admin")
    tokens._read_at = float("-inf")  # force a re-read
    assert auth.exposure_problem(public, tokens) is None


def test_a_refused_request_never_echoes_a_password_back(sqlite_server) -> None:
    secret = "hunter2-correct-horse"
    bodies = [
        {
            "name": "mail",
            "kind": "email",
            "to": ["a@example.org"],
            "smtp": {"host": "127.0.0.1", "port": "not a port", "password": secret},
        },
        {
            "name": "mail",
            "kind": "email",
            "to": ["a@example.org"],
            "smtp": {"host": "127.0.0.1", "port": 25, "password": [secret]},
        },
        {
            "name": "bad name!",
            "kind": "email",
            "to": ["a@example.org"],
            "smtp": {"host": "127.0.0.1", "password": secret},
        },
    ]
    with sqlite_server.client() as client:
        for body in bodies:
            reply = client.post("/api/v1/alert-channels", json=body)
            assert reply.status_code == 422, reply.text
            assert secret not in reply.text


def test_a_refused_channel_never_echoes_its_webhook_url(sqlite_server) -> None:
    with sqlite_server.client() as client:
        for url in (
            "https://user@hooks.slack.com/services/T0/B0/SUPERSECRETXYZ",
            "https://hooks.slack.com:99999/services/T0/B0/SUPERSECRETXYZ",
        ):
            reply = client.post("/api/v1/alert-channels", json={"name": "chat", "kind": "slack", "url": url})
            assert reply.status_code == 422 and "SUPERSECRETXYZ" not in reply.text, reply.text


def test_requests_arriving_during_the_first_token_read_wait_for_it_instead_of_getting_503(sqlite_server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import event

    @event.listens_for(sqlite_server.app.state.engine, "before_cursor_execute")
    def _slow_token_read(conn, cursor, statement, *_) -> None:
        if "api_tokens" in statement:
            time.sleep(0.3)  # a busy database: the first read takes a while, and requests keep arriving

    def first_request(index: int) -> int:
        with sqlite_server.client() as http:
            return http.put(f"/api/v1/runs/r{index}", json={"project": "p", "name": "r"}).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(first_request, range(8))) == [200] * 8
