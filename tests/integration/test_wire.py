"""The gateway's HTTP/1.1 connection on the wire (corrallm/http/connection.py, SPEC §13): what
its own response writer and disconnect hook handle, seen from a raw loopback socket
against a real `corrallm serve` and fake backend.

Covered: keep-alive, pipelined requests answered in order, `Expect: 100-continue`, a
chunked upload, HEAD, `Connection: close`, 413 on a declared length, a streamed answer's
head and events, and a client gone mid-answer cancelling its request (S7) through the
hook. How many writes an answer takes is not visible from a socket (the kernel merges
segments into one read): tests/unit/test_connection.py counts them.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.processes import (
    Gateway,
    cleanup,
    running_fake_backend,
    start_gateway,
    wait_for,
)

CHAT = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("wire")
    with running_fake_backend(tmp, "--tokens", "4") as backend:
        config = f"maxBodySize: 4096\nmodels: {{m: {{backends: [{{proxy: {backend.port}}}]}}}}\n"
        gateway = start_gateway(config, tmp)
        try:
            yield gateway
        finally:
            cleanup(gateway)


def connect(gw: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1])), timeout=10)


def post(body: bytes = CHAT, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


class Reader:
    """Whole HTTP/1.1 answers off one socket (content-length or chunked bodies)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed by the server")
        self.buffer += data

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._more()
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._more()
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def head(self) -> tuple[int, dict[bytes, bytes]]:
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def answer(self, method: bytes = b"POST") -> tuple[int, dict[bytes, bytes], bytes]:
        status, headers = self.head()
        while status == 100:
            status, headers = self.head()
        if method == b"HEAD":
            return status, headers, b""
        if b"content-length" in headers:
            return status, headers, self._take(int(headers[b"content-length"]))
        body = b""
        while size := int(self._line(), 16):
            body += self._take(size)
            assert self._take(2) == b"\r\n"
        assert self._take(2) == b"\r\n"
        return status, headers, body


def chat_answer(body: bytes) -> str:
    return str(json.loads(body)["choices"][0]["message"]["content"])


def test_wire_keep_alive_answers_requests_in_turn_on_one_connection(gw: Gateway) -> None:
    with connect(gw) as sock:
        reader = Reader(sock)
        for _ in range(3):
            sock.sendall(post())
            status, headers, body = reader.answer()
            assert status == 200 and chat_answer(body)
            assert headers[b"x-corrallm-backend"] == b"m#0"
            assert b"x-corrallm-request-id" in headers
            assert headers.get(b"connection") != b"close"


def test_wire_pipelined_requests_are_answered_in_order(gw: Gateway) -> None:
    with connect(gw) as sock:
        reader = Reader(sock)
        sock.sendall(
            post()
            + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
            + post(extra=b"X-Corrallm-Key: other\r\n")
        )
        first, second, third = reader.answer(), reader.answer(), reader.answer()
        assert first[0] == 200 and chat_answer(first[2])
        assert second[0] == 200 and {m["id"] for m in json.loads(second[2])["data"]} >= {"m"}
        assert third[0] == 200 and chat_answer(third[2])
        ids = {a[1][b"x-corrallm-request-id"] for a in (first, third)}
        assert len(ids) == 2


def test_wire_expect_100_continue_gets_continue_before_the_body(gw: Gateway) -> None:
    with connect(gw) as sock:
        reader = Reader(sock)
        head = post(extra=b"Expect: 100-continue\r\n")[: -len(CHAT)]
        sock.sendall(head)
        status, _ = reader.head()
        assert status == 100
        sock.sendall(CHAT)
        status, _, body = reader.answer()
        assert status == 200 and chat_answer(body)


def test_wire_a_chunked_upload_is_read_whole(gw: Gateway) -> None:
    with connect(gw) as sock:
        reader = Reader(sock)
        pieces = [CHAT[:10], CHAT[10:30], CHAT[30:]]
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
        )
        status, _, body = reader.answer()
        assert status == 200 and chat_answer(body)


def test_wire_a_declared_length_over_max_body_size_is_413(gw: Gateway) -> None:
    with connect(gw) as sock:
        reader = Reader(sock)
        body = b'{"model":"m","pad":"' + b"x" * 5000 + b'"}'
        sock.sendall(post(body))
        status, headers, answer = reader.answer()
        assert status == 413
        assert headers[b"content-type"] == b"application/json"
        assert json.loads(answer)["error"]["code"] == "body_too_large"


def test_wire_head_has_no_body_and_close_closes(gw: Gateway) -> None:
    with connect(gw) as sock:
        reader = Reader(sock)
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = reader.answer(b"HEAD")
        assert status == 200 and body == b"" and int(headers[b"content-length"]) > 0
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, headers, body = reader.answer()
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert headers[b"connection"] == b"close"
        assert reader.buffer == b"" and sock.recv(10) == b""


def test_wire_a_stream_head_goes_out_before_its_first_event(gw: Gateway) -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    with connect(gw) as sock:
        reader = Reader(sock)
        sock.sendall(post(body))
        status, headers = reader.head()
        assert status == 200
        assert headers[b"content-type"].startswith(b"text/event-stream")
        assert headers[b"transfer-encoding"] == b"chunked"
        # The events follow as chunks, the last one [DONE].
        events = b""
        while b"data: [DONE]" not in events:
            size = int(reader._line(), 16)
            events += reader._take(size)
            assert reader._take(2) == b"\r\n"


def test_S7_wire_a_client_gone_mid_answer_is_cancelled_through_the_connection(
    tmp_path: Path,
) -> None:
    """The hook, not a task in receive(): the request is recorded as 499 and its slot
    freed as soon as the socket closes."""
    with running_fake_backend(tmp_path, "--tokens", "200", "--token-delay", "0.05") as backend:
        gw = start_gateway(
            f"models: {{m: {{backends: [{{proxy: {backend.port}, maxConcurrent: 1}}]}}}}\n",
            tmp_path,
        )
        try:
            body = json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            ).encode()
            sock = connect(gw)
            sock.sendall(post(body))
            assert Reader(sock).head()[0] == 200
            sock.close()
            gone = time.monotonic()

            wait_for(lambda: gw.overview_backend("m#0")["in_flight"] == 0, timeout=5)
            assert time.monotonic() - gone < 5
            # The one slot serves the next request at once.
            r = httpx.post(gw.v1 + "/chat/completions", content=CHAT, timeout=10)
            assert r.status_code == 200
        finally:
            cleanup(gw)
