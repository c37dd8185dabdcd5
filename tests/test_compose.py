"""The container setup: Dockerfile, .dockerignore and docker-compose.yml agree, and what they run works.

No Docker engine runs where the tests run, so the image is not built. Instead the tests read the files,
build the package from exactly the build context the Dockerfile copies, and start the exact command with
the exact environment that compose gives the server, as a real process on a real Postgres; only the
database address/credentials and the port are swapped for local ones.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
SERVER_PORT = 8600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- reading the files -------------------------------------------------------------------------------


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$`, with `env` as the shell."""

    def substitute(match: re.Match[str]) -> str:
        name, operator, default = match.group(1), match.group(2), match.group(3) or ""
        if operator == ":-":
            return env.get(name) or default
        if operator == "-":
            return env.get(name, default)
        return env.get(name, "")

    result = re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", substitute, value.replace("$$", "\0"))
    assert "$" not in result, f"unsupported interpolation in {value!r}"
    return result.replace("\0", "$")


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _environment(service: dict[str, Any], shell: dict[str, str]) -> dict[str, str]:
    """A service's environment (mapping or list form) as `docker compose up` would pass it."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {str(k): _interpolate(str("" if v is None else v), shell) for k, v in raw.items()}


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in lines]


def _instructions(name: str) -> list[str]:
    return [args for instruction, args in _dockerfile() if instruction == name]


def _exec_form(args: str) -> list[str]:
    """A CMD/HEALTHCHECK in exec (JSON) form; shell form would make `sh`, not the server, PID 1."""
    assert args.startswith("["), f"use the exec form so signals reach the server: {args}"
    return json.loads(args)


def _image_command() -> list[str]:
    (cmd,) = _instructions("CMD")
    return _exec_form(cmd)


def _image_healthcheck() -> list[str]:
    (healthcheck,) = _instructions("HEALTHCHECK")
    return _exec_form(healthcheck[healthcheck.index("CMD") + len("CMD") :].strip())


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _instructions("ENV"):
        env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def _server_command(compose: dict[str, Any]) -> list[str]:
    """What the server container runs: compose's `command` if given, else the image's CMD."""
    command = compose["services"]["server"].get("command")
    if command is None:
        return _image_command()
    return shlex.split(command) if isinstance(command, str) else list(command)


def _flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def _with_port(command: list[str], port: int) -> list[str]:
    """`command` with the port it serves or probes (8600) replaced by `port`."""
    return [re.sub(rf"\b{SERVER_PORT}\b", str(port), part) for part in command]


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's .dockerignore semantics: the last rule matching the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for exclude, pattern in rules:
        if any(pattern.fullmatch(candidate) for candidate in candidates):
            ignored = exclude
    return ignored


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        glob = line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        rules.append((exclude, re.compile(regex)))
    return rules


def _copied_sources() -> list[str]:
    """The context paths the Dockerfile's COPY instructions take (the last argument is the destination)."""
    sources = []
    for args in _instructions("COPY"):
        assert not args.startswith("--from"), "the image is built in one stage"
        sources += [source.strip("/") for source in shlex.split(args)[:-1]]
    return sources


def _build_context_files(source: str) -> list[Path]:
    """The files under `source` that reach the build context."""
    rules = _dockerignore()
    top = ROOT / source
    files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
    return [p for p in files if not _ignored(p.relative_to(ROOT).as_posix(), rules)]


# --- the compose file --------------------------------------------------------------------------------


def test_postgres_service_keeps_its_data_in_a_named_volume_and_reports_readiness() -> None:
    compose = _compose()
    postgres = compose["services"]["postgres"]
    assert postgres["image"].split(":")[0] == "postgres" and postgres["image"].split(":")[1].startswith("16")
    env = _environment(postgres, {})
    assert env["POSTGRES_USER"] and env["POSTGRES_PASSWORD"] and env["POSTGRES_DB"]
    volumes = {volume.split(":")[0]: volume.split(":")[1] for volume in postgres["volumes"]}
    assert volumes.get("pgdata") == "/var/lib/postgresql/data"
    assert "pgdata" in compose["volumes"], "the data volume must be declared at top level to be named"
    check = postgres["healthcheck"]["test"]
    assert check[0] == "CMD" and check[1] == "pg_isready"
    assert _flag(check, "-U") == env["POSTGRES_USER"] and _flag(check, "-d") == env["POSTGRES_DB"]


def test_server_starts_only_after_postgres_is_healthy_and_restarts() -> None:
    server = _compose()["services"]["server"]
    assert server["build"] in (".", {"context": "."})
    assert server["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert server["restart"] in ("unless-stopped", "always")
    assert set(server["healthcheck"]) >= {"test", "interval", "timeout", "retries", "start_period"}


def test_server_database_url_is_the_postgres_service_via_psycopg_with_its_credentials() -> None:
    compose = _compose()
    postgres = _environment(compose["services"]["postgres"], {})
    url = make_url(_environment(compose["services"]["server"], {})["AMPWATCH_DATABASE_URL"])
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.port or 5432) == ("postgres", 5432), "the host is the compose service name"
    assert (url.username, url.password, url.database) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )


def test_server_links_name_the_published_address() -> None:
    server = _compose()["services"]["server"]
    assert _environment(server, {})["AMPWATCH_PUBLIC_URL"] == f"http://localhost:{SERVER_PORT}"
    overridden = _environment(server, {"AMPWATCH_PUBLIC_URL": "https://amp.example.org"})
    assert overridden["AMPWATCH_PUBLIC_URL"] == "https://amp.example.org"


def test_the_scale_profile_puts_nginx_on_loopback_in_front_of_the_replicas_with_streams_unbuffered() -> None:
    compose = _compose()
    nginx = compose["services"]["nginx"]
    assert nginx["profiles"] == ["scale"] and "profiles" not in compose["services"]["server"]
    assert all(str(mapping).startswith("127.0.0.1:") for mapping in nginx["ports"])
    assert nginx["depends_on"] == {"server": {"condition": "service_healthy"}}
    mounted = {volume.split(":")[1]: ROOT / volume.split(":")[0] for volume in nginx["volumes"]}
    assert all(path.is_file() for path in mounted.values()), mounted
    config = mounted["/etc/nginx/nginx.conf"].read_text()
    assert "server server:8600" in config and "include /etc/nginx/ampwatch-locations.conf;" in config
    assert "proxy_buffering off;" in mounted["/etc/nginx/ampwatch-locations.conf"].read_text()


# --- the Dockerfile, and its agreement with compose ----------------------------------------------------


def test_server_listens_on_all_interfaces_as_a_non_root_user() -> None:
    (base,) = _instructions("FROM")
    assert base == "python:3.11-slim"
    command = _server_command(_compose())
    assert command[:2] == ["ampwatch", "server"]
    assert _flag(command, "--host") == "0.0.0.0", "inside a container 127.0.0.1 is unreachable from outside"
    assert _flag(command, "--port") == str(SERVER_PORT)
    users = _instructions("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_compose_publishes_the_exposed_port_and_checks_health_like_the_image() -> None:
    server = _compose()["services"]["server"]
    port = _flag(_server_command(_compose()), "--port")
    assert _instructions("EXPOSE") == [port]
    # Loopback only: an open (token-less, AMPWATCH_INSECURE) server must not be published to the network.
    # (a range from SERVER_PORT, so that `--scale server=3` replicas each find a host port)
    published = [re.fullmatch(rf"127\.0\.0\.1:{SERVER_PORT}(-\d+)?:{port}", str(m)) for m in server["ports"]]
    assert any(published), server["ports"]
    image_check, compose_check = _image_healthcheck(), server["healthcheck"]["test"]
    assert compose_check == ["CMD", *image_check]
    assert image_check[0] == "python" and f"127.0.0.1:{port}/healthz" in image_check[-1]


def test_every_path_the_dockerfile_copies_is_in_the_build_context() -> None:
    sources = _copied_sources()
    assert {"pyproject.toml", "agent", "server", "web", "migrations"} <= set(sources)
    missing = [source for source in sources if not _build_context_files(source)]
    assert not missing, f"COPY would fail: {missing} missing from the repo or excluded by .dockerignore"


def test_build_context_leaves_out_repository_junk() -> None:
    rules = _dockerignore()
    for path in (".git/config", "tests/conftest.py", "ampwatch.db", "server/__pycache__/app.cpython-311.pyc"):
        assert _ignored(path, rules), f"{path} would be sent to the Docker daemon"
    for path in ("pyproject.toml", "server/app.py", "web/templates/base.html", "migrations/versions/x.py"):
        assert not _ignored(path, rules), f"{path} would be missing from the image"


# --- what the image would install and run ---------------------------------------------------------------


@pytest.fixture(scope="module")
def image_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built and installed (not editable) from only the files the Dockerfile copies."""
    context, target = tmp_path_factory.mktemp("context"), tmp_path_factory.mktemp("install")
    for source in _copied_sources():
        for file in _build_context_files(source):
            destination = context / file.relative_to(ROOT)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, destination)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    # No build isolation and no deps: nothing here can download; the server's dependencies are installed.
    wheel_dir = context / "dist"
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), str(context)]
    subprocess.run([*pip, *build], check=True)
    (wheel,) = wheel_dir.glob("ampwatch-*.whl")
    subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True)
    return target


def _image_like_env(install: Path, server_env: dict[str, str]) -> dict[str, str]:
    """A bare environment like the container's: the image's ENV, then compose's, and the install on the paths."""
    path = f"{install / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin:/bin"
    return {"PATH": path, "PYTHONPATH": str(install), "HOME": str(install), **_image_env(), **server_env}


def test_image_install_holds_pages_and_migrations_and_no_top_level_folders(image_install: Path) -> None:
    packaged = ("ampwatch/web/templates/base.html", "ampwatch/web/static/app.js", "ampwatch/migrations/script.py.mako")
    for path in packaged:
        assert (image_install / path).is_file(), f"{path} is not installed"
    assert list((image_install / "ampwatch/migrations/versions").glob("0001_*.py"))
    assert not {"agent", "server", "web", "migrations"} & {p.name for p in image_install.iterdir()}
    assert (image_install / "bin" / "ampwatch").is_file()
    env = _image_like_env(image_install, {})
    probe = "import ampwatch.server, ampwatch.web, ampwatch.migrations as m; print(m.__file__)"
    where = subprocess.run(["python", "-c", probe], env=env, cwd=image_install.parent, capture_output=True, text=True)
    assert Path(where.stdout.strip()).is_relative_to(image_install), where.stderr or where.stdout


def _healthcheck_passes(command: list[str], env: dict[str, str], cwd: Path) -> bool:
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, timeout=30).returncode == 0


@dataclass
class ComposeServer:
    port: int
    env: dict[str, str]
    cwd: Path
    process: subprocess.Popen[bytes]
    log: Path


def _wait_until_listening(client: httpx.Client, server: ComposeServer, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert server.process.poll() is None, f"the server exited:\n{server.log.read_text()}"
        assert time.monotonic() < deadline, f"the server never answered:\n{server.log.read_text()}"
        try:
            client.get("/healthz")
            return
        except httpx.TransportError:
            time.sleep(0.1)


@pytest.fixture
def compose_server(image_install: Path, pg_url: str, tmp_path: Path) -> Iterator[ComposeServer]:
    """The compose server's exact command and environment, on the local Postgres and a free port."""
    compose = _compose()
    server_env = _environment(compose["services"]["server"], {})
    local = make_url(pg_url)
    url = make_url(server_env["AMPWATCH_DATABASE_URL"]).set(
        host=local.host, port=local.port, username=local.username, password=local.password, database=local.database
    )
    port = free_port()
    server_env["AMPWATCH_DATABASE_URL"] = url.render_as_string(hide_password=False)
    server_env["AMPWATCH_PUBLIC_URL"] = server_env["AMPWATCH_PUBLIC_URL"].replace(str(SERVER_PORT), str(port))
    env, log = _image_like_env(image_install, server_env), tmp_path / "server.log"
    with log.open("wb") as out:
        command = _with_port(_server_command(compose), port)
        process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield ComposeServer(port, env, tmp_path, process, log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_compose_server_command_serves_health_and_read_api_on_postgres(compose_server: ComposeServer) -> None:
    server = compose_server
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
        _wait_until_listening(client, server)
        health = client.get("/healthz")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        runs = client.get("/api/v1/runs")
        assert (runs.status_code, runs.json()) == (200, [])
    healthcheck = _with_port(_image_healthcheck(), server.port)
    assert _healthcheck_passes(healthcheck, server.env, server.cwd), "the container healthcheck fails"
    server.process.send_signal(signal.SIGTERM)  # what `docker compose stop` sends to PID 1
    # uvicorn shuts down gracefully, then re-raises the signal it caught, so -SIGTERM is a clean exit too.
    assert server.process.wait(timeout=20) in (0, -signal.SIGTERM), server.log.read_text()
    assert "Application shutdown complete" in server.log.read_text()
    assert f"http://localhost:{server.port}" in server.log.read_text(), "AMPWATCH_PUBLIC_URL did not reach the server"
    assert not _healthcheck_passes(healthcheck, server.env, server.cwd), "the healthcheck passes with no server"
