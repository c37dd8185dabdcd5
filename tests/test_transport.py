"""The agent's HTTP transport: one kept-alive connection, reopened when the server closed it, and proxies
from the environment still honoured."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from ampwatch._transport import HttpTransport


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers 200 to every POST and notes which connection (client port) and path each came on."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    seen: list[tuple[int, str]] = []
    drop_after_reply = False  # close the connection after replying, without saying so (as an idle timeout does)

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.client_address[1], self.path))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
        self.close_connection = type(self).drop_after_reply

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"seen": [], "drop_after_reply": False})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_batches_share_one_kept_alive_connection(receiver) -> None:
    url, handler = receiver
    transport = HttpTransport(url + "/base", None, 5.0)
    assert [transport.send("POST", f"/b{i}", b"{}").status for i in range(3)] == [200, 200, 200]
    assert [path for _, path in handler.seen] == ["/base/b0", "/base/b1", "/base/b2"]
    assert len({port for port, _ in handler.seen}) == 1
    transport.close()


def test_a_connection_the_server_closed_meanwhile_is_reopened_without_losing_the_request(receiver) -> None:
    url, handler = receiver
    handler.drop_after_reply = True  # each connection dies after one reply, unannounced
    transport = HttpTransport(url, None, 5.0)
    replies = [transport.send("POST", f"/b{i}", b"{}") for i in range(3)]
    assert [r.status for r in replies] == [200, 200, 200], [r.body for r in replies]
    assert [path for _, path in handler.seen] == ["/b0", "/b1", "/b2"]
    assert len({port for port, _ in handler.seen}) == 3


def test_an_unreachable_server_is_status_0(receiver) -> None:
    url, _ = receiver
    reply = HttpTransport("http://127.0.0.1:9", None, 2.0).send("POST", "/b", b"{}")
    assert reply.status == 0 and reply.retryable


def test_a_proxy_from_the_environment_is_used(receiver, monkeypatch) -> None:
    url, handler = receiver  # the receiver plays the proxy: it is asked for the absolute URL
    monkeypatch.setenv("http_proxy", url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    reply = HttpTransport("http://ampwatch.invalid:8600", None, 5.0).send("POST", "/api/v1/runs/r/batches", b"{}")
    assert reply.status == 200
    assert [path for _, path in handler.seen] == ["http://ampwatch.invalid:8600/api/v1/runs/r/batches"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:port", "http://[::1", "ftp://127.0.0.1:9"])
def test_a_malformed_url_is_an_unreachable_server_never_an_exception(url: str) -> None:
    reply = HttpTransport(url, None, 1.0).send("POST", "/api/v1/runs/r/batches", b"{}")
    assert reply.status == 0 and reply.retryable and reply.body
