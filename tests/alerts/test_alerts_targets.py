"""Channel destinations are validated (scheme, user info, link-local and metadata addresses, the configured
scope) when a channel is saved and again, after DNS, when it is sent to; secrets never come back out."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from ampwatch.server import Settings, create_app
from ampwatch.server.alerts import ConfigError
from ampwatch.server.alerts._targets import TargetError, resolve

PASSWORD = "pw-echoed-by-a-careless-relay"
TOKEN = "xoxb-secret-token-value"
pytestmark = pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")


def _create(http: Any, url: str, name: str = "c") -> Any:
    return http.post("/api/v1/alert-channels", json={"name": name, "kind": "webhook", "url": url})


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://127.0.0.1/hook", "must start with http:// or https://"),
        ("file:///etc/passwd", "must start with http:// or https://"),
        ("http:///no-host", "has no host"),
        ("http://user:pw@127.0.0.1/hook", "must not contain a user name or password"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[fe80::1]/hook", "link-local"),
        ("http://[::ffff:169.254.169.254]/hook", "link-local"),
        ("http://[64:ff9b::a9fe:a9fe]/hook", "link-local"),  # NAT64 of 169.254.169.254
        ("http://0.0.0.0:80/hook", "unspecified, multicast or reserved"),
    ],
)
def test_a_channel_url_that_is_not_plain_http_to_a_host_is_a_422_with_the_reason(
    alert_server, url: str, why: str
) -> None:
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        refused = _create(http, url)
        assert refused.status_code == 422, refused.text
        assert why in refused.text
        assert http.get("/api/v1/alert-channels").json() == []


def test_loopback_and_private_addresses_are_allowed_by_default_and_refused_in_narrower_scopes(
    alert_server, receiver
) -> None:
    default = alert_server(alert_webhook_url="")
    with default.client() as http:
        assert _create(http, f"{receiver.url}/hook", "here").status_code == 201
        assert _create(http, "http://10.1.2.3/hook", "lan").status_code == 201
    loopback = _server_with_scope(alert_server, "loopback")
    with loopback.client() as http:
        lan = _create(http, "http://10.1.2.3/hook")
        assert lan.status_code == 422 and "only this machine" in lan.text
        named = _create(http, "https://hooks.slack.example/services/T/B/x")
        assert named.status_code == 422 and "AMPWATCH_ALERT_URL_SCOPE=loopback" in named.text
        assert _create(http, f"{receiver.url}/hook").status_code == 201
    public = _server_with_scope(alert_server, "public")
    with public.client() as http:
        here = _create(http, f"{receiver.url}/hook")
        assert here.status_code == 422 and "is this machine" in here.text
        assert _create(http, "http://192.168.1.5/hook").status_code == 422


def _server_with_scope(alert_server: Any, scope: str) -> Any:
    return alert_server(alert_webhook_url="", alert_url_scope=scope)


def test_a_name_is_checked_after_dns_when_sending(alert_server, receiver) -> None:
    server = _server_with_scope(alert_server, "public")
    with server.client() as http:  # a name is accepted when saved (no DNS on the request path) ...
        made = _create(http, f"http://localhost:{receiver.url.rsplit(':', 1)[1]}/hook")
        assert made.status_code == 201, made.text
        test = http.post(f"/api/v1/alert-channels/{made.json()['id']}/test").json()
    # ... and refused once it resolves to this machine; nothing was sent
    assert test["ok"] is False and "localhost (127.0.0.1) is this machine" in test["error"], test
    assert receiver.received == []


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    """Answers for made-up names. Mocked because this machine's resolver cannot be pointed at a test DNS
    server; every other name goes to the real resolver. Each lookup pops the name's next answer."""
    answers: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and host in answers:
            address = answers[host].pop(0) if len(answers[host]) > 1 else answers[host][0]
            return real(address, port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield answers


@pytest.mark.parametrize("host", ["2852039166", "0xa9.0xfe.0xa9.0xfe", "0251.0376.0251.0376"])
def test_the_metadata_address_spelled_as_a_number_is_refused_when_sending(host: str) -> None:
    with pytest.raises(TargetError, match=r"\(169.254.169.254\) is a link-local or cloud metadata address"):
        resolve(host, 80, "private")  # the C library reads these as addresses: no DNS query leaves


def test_a_name_that_resolves_to_the_metadata_address_is_refused(fake_dns) -> None:
    fake_dns["metadata.rebind.test"] = ["169.254.169.254"]
    with pytest.raises(TargetError, match="link-local"):
        resolve("metadata.rebind.test", 80, "private")
    fake_dns["mixed.rebind.test"] = ["127.0.0.1", "169.254.169.254"]
    assert resolve("mixed.rebind.test", 80, "private") == "127.0.0.1"  # first answer ...
    with pytest.raises(TargetError):
        resolve("mixed.rebind.test", 80, "private")  # ... a later one is checked too


def test_plain_http_goes_to_the_address_that_was_checked_not_a_later_answer(alert_server, receiver, fake_dns) -> None:
    # The first lookup (the check) says the receiver; any later one says 127.0.0.2, where nothing listens.
    # Were the request to resolve the name again, it would fail to connect.
    fake_dns["hook.rebind.test"] = ["127.0.0.1", "127.0.0.2"]
    port = receiver.url.rsplit(":", 1)[1]
    server = alert_server(alert_webhook_url="")
    with server.client() as http:
        made = _create(http, f"http://hook.rebind.test:{port}/pinned")
        test = http.post(f"/api/v1/alert-channels/{made.json()['id']}/test").json()
    assert test["ok"] is True, test
    assert receiver.received[0].path == "/pinned"
    assert fake_dns["hook.rebind.test"] == ["127.0.0.2"]  # the checked answer was used, once


@pytest.fixture
def echoing_smtp() -> Iterator[int]:
    """A real SMTP server whose 535 answer quotes the password it was given (some relays do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def authenticate(server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> AuthResult:
        return AuthResult(success=False, handled=False, message=f"535 5.7.8 bad password {auth_data.password.decode()}")

    controller = Controller(
        object(),
        hostname="127.0.0.1",
        port=port,
        authenticator=authenticate,
        auth_required=True,
        auth_require_tls=False,
    )
    controller.start()
    yield port
    controller.stop()


def test_secrets_are_write_only_and_kept_out_of_errors_pages_and_logs(
    alert_server, receiver, echoing_smtp, caplog, wait_for
) -> None:
    caplog.set_level(logging.DEBUG)
    receiver.echo_path = True
    receiver.replies = [(400, {}, 0.0)] * 4  # "invalid token", quoting the URL's path
    server = alert_server(alert_webhook_url="")
    mail = {
        "name": "mail",
        "kind": "email",
        "to": ["a@example.com"],
        "smtp": {"host": "127.0.0.1", "port": echoing_smtp, "starttls": False, "username": "u", "password": PASSWORD},
    }
    with server.client() as http:
        mail_id = http.post("/api/v1/alert-channels", json=mail).json()["id"]
        slack_id = http.post(
            "/api/v1/alert-channels",
            json={"name": "chat", "kind": "slack", "url": f"{receiver.url}/services/T0/B0/{TOKEN}"},
        ).json()["id"]
        mail_test = http.post(f"/api/v1/alert-channels/{mail_id}/test").json()
        slack_test = http.post(f"/api/v1/alert-channels/{slack_id}/test").json()
        _nan_event(http)
        wait_for(lambda: _deliveries_done(http, 2), what="the background deliveries to both channels")
        shown = [
            http.get("/api/v1/alert-channels").text,
            http.get("/alerts/rules").text,
            http.get("/alerts").text,
            str(mail_test),
            str(slack_test),
            http.get("/api/v1/alerts/1").text,
        ]
    assert mail_test["error"].startswith("SMTP 535") and "***" in mail_test["error"], mail_test
    assert slack_test["error"].startswith("HTTP 400: /***/"), slack_test
    assert receiver.bodies(f"/services/T0/B0/{TOKEN}")  # the real URL was used to send
    assert "failed" in caplog.text  # the background deliveries failed and said so in the log
    logged = "\n".join(
        r.getMessage() for r in caplog.records if not r.name.startswith("mail")
    )  # not the test's SMTP server
    assert "HTTP Request: POST http://127.0.0.1" in logged  # httpx's own request log line is among them
    for text in [*shown, logged]:
        assert PASSWORD not in text and TOKEN not in text


def _deliveries_done(http: Any, channels: int) -> bool:
    """Alert 1's notification has finished (failed for good) on `channels` channels."""
    reply = http.get("/api/v1/alerts/1")
    flips = reply.json().get("flips", []) if reply.status_code == 200 else []
    finished = {
        d["channel"] for f in flips for d in f["deliveries"] if d["finished_at"] is not None and d["status"] == "failed"
    }
    return len(finished) >= channels


def _nan_event(http: Any) -> None:
    http.put("/api/v1/runs/r", json={"project": "p", "name": "r"}).raise_for_status()
    event = {"step": 3, "type": "nonfinite_loss", "severity": "critical", "message": "NaN", "details": {"loss": "NaN"}}
    http.post("/api/v1/runs/r/batches", json={"seq": 1, "events": [event]}).raise_for_status()


def test_a_refused_env_webhook_or_config_file_stops_the_server_without_repeating_the_secret(
    sqlite_url, tmp_path
) -> None:
    with pytest.raises(ConfigError) as refused:
        create_app(Settings(database_url=sqlite_url, alert_webhook_url=f"http://user:{TOKEN}@127.0.0.1/hook"))
    assert (
        str(refused.value)
        == "AMPWATCH_ALERT_WEBHOOK_URL: url: the URL must not contain a user name or password (user:password@host): "
        "put a token in the path or query"
    )
    path = tmp_path / "alerts.json"
    path.write_text(
        json.dumps(
            {
                "channels": [
                    {
                        "name": "m",
                        "kind": "email",
                        "to": ["a@example.com"],
                        "smtp": {"host": "127.0.0.1", "port": "many", "password": PASSWORD},
                    }
                ]
            }
        )
    )
    with pytest.raises(ConfigError) as broken:
        create_app(Settings(database_url=sqlite_url, alert_rules_file=str(path)))
    assert str(broken.value) == f"{path}: port: Input should be a valid integer, unable to parse string as an integer"
    assert PASSWORD not in str(broken.value) and broken.value.__cause__ is None


@pytest.mark.parametrize(
    "url",
    [
        "https://api.telegram.org/bot123456:AAH-secretTOKEN/sendMessage?chat_id=1",
        "https://ntfy.sh/secret-topic-8f3a",
        "https://hooks.slack.com/services/T0/B0/SUPERSECRETXYZ",
    ],
)
def test_a_masked_url_shows_no_part_of_its_path_or_query(url: str) -> None:
    from ampwatch.server.alerts._targets import mask_url

    masked = mask_url(url)
    assert masked.endswith("/***") and not any(
        secret in masked for secret in ("AAH-secret", "8f3a", "SUPERSECRET", "chat_id")
    )


@pytest.mark.parametrize("address", ["fd00:ec2::254", "100.100.100.200", "169.254.169.254"])
def test_cloud_metadata_addresses_are_refused_in_every_scope(address: str) -> None:
    from ampwatch.server.alerts._targets import TargetError, check_host

    for scope in ("private", "public", "loopback"):
        with pytest.raises(TargetError):
            check_host(address, scope)


def test_email_goes_to_the_address_that_was_checked_not_a_later_answer(alert_server, fake_dns) -> None:
    class Inbox:
        def __init__(self) -> None:
            self.count = 0

        async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 - aiosmtpd's name
            self.count += 1
            return "250 OK"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbox = Inbox()
    controller = Controller(inbox, hostname="127.0.0.1", port=port)
    controller.start()
    fake_dns["mail.rebind.test"] = ["127.0.0.1", "127.0.0.2"]  # a second lookup would name an address nobody serves
    try:
        server = alert_server(alert_webhook_url="")
        channel = {
            "name": "mail",
            "kind": "email",
            "to": ["a@example.com"],
            "smtp": {"host": "mail.rebind.test", "port": port, "starttls": False},
        }
        with server.client() as http:
            made = http.post("/api/v1/alert-channels", json=channel)
            assert made.status_code == 201, made.text
            test = http.post(f"/api/v1/alert-channels/{made.json()['id']}/test").json()
    finally:
        controller.stop()
    assert test["ok"] is True, test
    assert inbox.count == 1
