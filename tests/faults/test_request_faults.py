"""SPEC §15/§20 faults a hostile or careless client injects in the request itself, against
real processes: a float `max_tokens` (issue 13, fault 6) must neither pass a backend's
`maxTokens` clamp nor reach it unclamped, and `/upstream/<model>/…` must forward the path
as the client sent it (fault 7): `%20` stays `%20` in the request line, `%3F` stays in
the path instead of starting a query string."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.support.processes import FakeBackend


def clamped_config(backend: FakeBackend) -> str:
    return f"""
models:
  chat: {{backends: [{{proxy: "{backend.url}", maxTokens: 8}}]}}
"""


def chat(gw, max_tokens: object) -> httpx.Response:
    # Sent as raw JSON so that the number goes exactly as written (1000.0, 1e29, 16.5).
    body = (
        '{"model": "chat", "messages": [{"role": "user", "content": "hi"}], '
        f'"max_tokens": {max_tokens}}}'
    )
    headers = {"Content-Type": "application/json"}
    return httpx.post(gw.v1 + "/chat/completions", content=body, headers=headers, timeout=30)


def received_max_tokens(backend: FakeBackend) -> list[object]:
    """The max_tokens of every request the backend received, oldest first."""
    requests = httpx.get(backend.url + "/debug/requests", timeout=10).json()
    return [r["body"].get("max_tokens") for r in requests if r["path"] == "/v1/chat/completions"]


def outcome(response: httpx.Response) -> tuple[object, ...]:
    """(status, completion tokens) of an answer; (status, code, param) of an error."""
    answer = response.json()
    if "error" in answer:
        return response.status_code, answer["error"]["code"], answer["error"]["param"]
    return response.status_code, answer["usage"]["completion_tokens"]


def test_F2_a_float_max_tokens_is_clamped_like_a_whole_one_or_refused(
    gateway_factory, fake_backend
):
    gw = gateway_factory(clamped_config(fake_backend))
    # Whole numbers written as floats are clamped to 8 (the fake backend stops there);
    # 16.5 is not a whole number of tokens: refused, never forwarded.
    seen = [(asked, *outcome(chat(gw, asked))) for asked in ("1000.0", "1e29", "16.5")]
    assert [*seen, received_max_tokens(fake_backend)] == [
        ("1000.0", 200, 8),
        ("1e29", 200, 8),
        ("16.5", 400, "invalid_request", "max_tokens"),
        [8, 8],
    ]


class _RequestLineEcho(socketserver.StreamRequestHandler):
    """Answers every request with its own request line, byte for byte, as received."""

    def handle(self) -> None:
        line = self.rfile.readline(65536).rstrip(b"\r\n")
        while self.rfile.readline(65536) not in (b"\r\n", b"\n", b""):
            pass  # the headers: not needed
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(line)
            + line
        )


@contextmanager
def request_line_echo() -> Iterator[str]:
    """A stand-in backend on a free loopback port, in this process: its base URL."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _RequestLineEcho)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def raw_get(url: str, target: str, token: str) -> bytes:
    """GET `target` exactly as written (no client re-encoding), as an operator (`token`);
    the whole answer's body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
            "Connection: close\r\n\r\n"
        )
        sock.sendall(request.encode("latin-1"))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0] + b" | " + body


def test_upstream_passthrough_forwards_the_raw_path_percent_escapes_and_all(gateway_factory):
    with request_line_echo() as backend:
        gw = gateway_factory(f'models: {{raw: {{backends: [{{proxy: "{backend}"}}]}}}}')
        answer = raw_get(gw.url, "/upstream/raw/files/my%20doc%3Fv2?x=1", gw.token)
    assert answer == b"HTTP/1.1 200 OK | GET /files/my%20doc%3Fv2?x=1 HTTP/1.1"
