"""What the fault suite reads back from a running gateway: load (in flight, waiting),
activity rows, the process's file descriptors and memory; and a raw-socket client for
requests a well-behaved HTTP library will not send (a lying Content-Length, a client that
hangs up at a chosen moment)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

from tests.support.processes import Gateway

MAX_ACTIVITY = 10_000  # the API's largest `limit`


@dataclass(frozen=True)
class Load:
    """Sums over every backend of the overview and every lane."""

    backends_in_flight: int
    backends_waiting: int
    lanes_in_flight: int
    lanes_waiting: int

    @property
    def idle(self) -> bool:
        return not (
            self.backends_in_flight
            or self.backends_waiting
            or self.lanes_in_flight
            or self.lanes_waiting
        )


def load(gw: Gateway) -> Load:
    overview = gw.api("GET", "overview").json()
    lanes = gw.api("GET", "lanes").json()["lanes"]
    backends = [b for m in overview["models"] for b in m["backends"]]
    return Load(
        sum(int(b["in_flight"]) for b in backends),
        sum(int(b["waiting"]) for b in backends),
        sum(int(lane["in_flight"]) for lane in lanes),
        sum(int(lane["waiting"]) for lane in lanes),
    )


def backend_load(gw: Gateway, backend: str) -> tuple[int, int]:
    """(in_flight, waiting) of one backend, from the overview."""
    b = gw.overview_backend(backend)
    return int(b["in_flight"]), int(b["waiting"])  # type: ignore[call-overload]


def request_rows(gw: Gateway, **filters: str) -> list[dict[str, object]]:
    """Activity rows of requests (not `load` rows), newest first. Fails rather than
    silently truncating when a filter matches as many rows as the API returns at most."""
    query = "&".join(f"{k}={v}" for k, v in filters.items())
    r = gw.api("GET", f"activity?limit={MAX_ACTIVITY}" + (f"&{query}" if query else ""))
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    assert len(rows) < MAX_ACTIVITY, f"{len(rows)} rows for {filters}: split the query further"
    return [row for row in rows if row["endpoint"] != "load"]


def fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 1e6


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def relaying_worker(proc: psutil.Process) -> bool:
    """One of a `serve --workers` owner's relaying workers (corrallm/workers/worker.py),
    which are its children beside its backends."""
    try:
        return "corrallm.workers.worker" in proc.cmdline()
    except psutil.Error:
        return False


class RawClient:
    """One TCP connection to the gateway, written to and read from byte by byte."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        self.host = f"{parts.hostname}:{parts.port}"
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)

    def send_head(
        self, method: str, path: str, headers: dict[str, str], content_length: int | None
    ) -> None:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}"]
        if content_length is not None:
            lines.append(f"Content-Length: {content_length}")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_response(self) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (lower-cased names) and the body of a Content-Length answer."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before a full answer head: {data!r}")
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(status_line.split()[1]), headers, body

    def close(self) -> None:
        """Hang up at once (RST rather than a lingering FIN is not needed: a FIN is what a
        client that goes away sends)."""
        self.sock.close()
