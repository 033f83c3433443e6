"""The hot path's upstream HTTP/1.1 client (http/client.py) against raw loopback servers
that answer exactly what each test scripts: bodies by length, chunked and by close, interim
1xx answers, keep-alive reuse, a pooled connection the server closed (sent again once),
a server that breaks off mid-body or speaks no HTTP, HEAD, backpressure, and HTTPS."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from corrallm.http.client import HIGH_WATER, Client, UpstreamError, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class Server:
    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.requests = handler, 0, []

    async def __aenter__(self) -> Server:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/x"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    c = Client()
    yield c
    await c.close()


async def fetch(client: Client, url: str, method: str = "POST") -> tuple[int, bytes]:
    async with await client.request(method, url, b'{"a": 1}', [(b"X-Test", b"1")]) as response:
        return response.status, b"".join([c async for c in response.iter_any()])


def keep_alive(answer: bytes, seen: list[bytes] | None = None) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            if seen is not None:
                seen.append(request)
            writer.write(answer)
            await writer.drain()

    return handler


async def test_a_body_by_length_on_one_reused_connection(client):
    seen: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\nok"
    async with Server(keep_alive(answer, seen)) as server:
        for _ in range(5):
            assert await fetch(client, server.url) == (200, b"ok")
        assert server.connections == 1
    head = seen[0].split(b"\r\n")
    assert head[0] == b"POST /v1/x HTTP/1.1" and b"X-Test: 1" in head
    assert b"Content-Length: 8" in head and seen[0].endswith(b'{"a": 1}')


async def test_chunked_body_arrives_chunk_by_chunk(client):
    released = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await released.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with (
        Server(handler) as server,
        await client.request("POST", server.url, b"", []) as response,
    ):
        chunks = response.iter_any()
        assert await asyncio.wait_for(chunks.__anext__(), 5) == b"first"  # not buffered
        released.set()
        assert [c async for c in chunks] == [b"second"]


async def test_chunks_that_came_in_one_read_are_handed_on_as_one_piece(client):
    # A backend writes each SSE event as a chunk of its own; those that arrive together
    # are relayed in one write, not one each (the events that come with a stream's head).
    events = [b"data: %d\n\n" % i for i in range(3)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with (
        Server(answer_once(head + chunked)) as server,
        await client.request("POST", server.url, b"", []) as response,
    ):
        assert await response.next_chunk() == b"".join(events)
        assert await response.next_chunk() is None


def answer_once(raw: bytes) -> Handler:
    """Read one request, send `raw`, close."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(raw)
        await writer.drain()

    return handler


async def test_a_body_delimited_by_close_and_an_interim_100(client):
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"
    async with Server(answer_once(interim + answer)) as server:
        assert await fetch(client, server.url) == (200, b"until the end")
        assert await fetch(client, server.url) == (200, b"until the end")
        assert server.connections == 2  # a closed connection is never reused


async def test_a_pooled_connection_the_server_drops_is_sent_again_once(client):
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def drops_the_second_request(reader, writer):
        await read_request(reader)
        writer.write(ok)
        await writer.drain()
        # The next request on this connection is read, then the connection closes
        # unanswered: what a server that ends keep-alive connections does.
        await read_request(reader)

    async with Server(drops_the_second_request) as server:
        assert await fetch(client, server.url) == (200, b"ok")
        assert await fetch(client, server.url) == (200, b"ok")  # resent on a fresh one
        assert server.connections == 2


async def test_a_server_breaking_off_mid_body_is_an_error_not_a_short_answer(client):
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"
    async with Server(answer_once(answer)) as server:
        with pytest.raises(UpstreamError, match="mid-answer"):
            await fetch(client, server.url)


async def test_no_http_and_no_server_are_oserrors_with_a_reason(client):
    async def garbage(reader, writer):
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with Server(garbage) as server:
        with pytest.raises(UpstreamError, match="not valid HTTP"):
            await fetch(client, server.url)
        url = server.url
    with pytest.raises(OSError):
        await fetch(client, url)  # nothing listens there any more


async def test_head_answers_have_no_body_even_with_a_length(client):
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n"
    async with Server(keep_alive(answer)) as server:
        assert await fetch(client, server.url, method="HEAD") == (200, b"")


async def test_a_slow_reader_pauses_the_backend_instead_of_buffering_everything(client):
    size = 32 * HIGH_WATER  # well beyond what loopback socket buffers can hold
    sent = 0

    async def firehose(reader, writer):
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        block = b"x" * 65536
        while sent < size:
            writer.write(block)
            sent += len(block)
            await writer.drain()

    async with (
        Server(firehose) as server,
        await client.request("POST", server.url, b"", []) as response,
    ):
        chunks = response.iter_any()
        got = len(await chunks.__anext__())
        conn = response._conn
        for _ in range(500):  # a deadline of 5 s for reading to be paused
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused and response.buffered <= HIGH_WATER + 4 * 65536
        assert sent < size  # the server is held back, not drained into memory
        async for chunk in chunks:
            got += len(chunk)
        assert got == size


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost, made with Debian's openssl."""
    openssl = shutil.which("openssl")
    assert openssl, "the HTTPS test makes its certificate with openssl (apt-get install openssl)"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj"]
    names = ["/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run([openssl, *request, *names, *files], check=True, capture_output=True)
    return cert, key


async def test_https_upstreams_are_verified_against_the_system_trust(certificate, monkeypatch):
    # Paid backends (api.openai.com and the like) are HTTPS: the certificate is checked
    # against the system's trust store, which SSL_CERT_FILE points at here.
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret"
    server = await asyncio.start_server(keep_alive(answer), "127.0.0.1", 0, ssl=context)
    url = f"https://localhost:{server.sockets[0].getsockname()[1]}/v1/x"
    try:
        untrusting = Client()
        with pytest.raises(ssl.SSLCertVerificationError):
            await fetch(untrusting, url)  # not in the trust store: refused, not sent
        await untrusting.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        trusting = Client()
        assert await fetch(trusting, url) == (200, b"secret")
        assert await fetch(trusting, url) == (200, b"secret")  # the TLS connection is reused
        await trusting.close()
    finally:
        server.close()


async def test_S20_a_client_paused_by_backpressure_is_not_the_backends_silence(client):
    # The backend is held back by us (reading paused) for longer than the idle timeout:
    # that is not the backend being silent, and the answer completes.
    size = 32 * HIGH_WATER

    async def firehose(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        block = b"x" * 65536
        for _ in range(size // len(block)):
            writer.write(block)
            await writer.drain()

    async with (
        Server(firehose) as server,
        await client.request("POST", server.url, b"", [], idle_timeout=0.2) as response,
    ):
        chunks = response.iter_any()
        got = len(await chunks.__anext__())
        conn = response._conn
        for _ in range(500):  # a deadline of 5 s for reading to be paused
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused
        await asyncio.sleep(0.5)  # a slow client: 2.5 idle timeouts without reading
        async for chunk in chunks:
            got += len(chunk)
        assert got == size and response.error is None


async def test_S20_an_idle_timeout_mid_body_fails_the_answer_and_closes_the_connection(client):
    closed = asyncio.Event()

    async def stalls(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
        await writer.drain()
        await reader.read()  # until the client hangs up
        closed.set()

    async with Server(stalls) as server:
        response = await client.request("POST", server.url, b"", [], idle_timeout=0.2)
        async with response:
            got = b""
            with pytest.raises(UpstreamTimeout) as caught:
                async for chunk in response.iter_any():
                    got += chunk
        assert got == b"half" and caught.value.headers_seen
        await asyncio.wait_for(closed.wait(), 5)  # the backend sees the cancel
        assert not client._idle.get(response._conn.key)  # never pooled
