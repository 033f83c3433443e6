"""A relaying worker process (`serve --workers N`): `python -m corrallm.workers.worker
<hop socket> <index>`, started by the owner's pool (corrallm/workers/pool.py).

It joins the owner over the hop, takes its brief (the config in force, the address, the
admin token), binds its own listener on the gateway's address with `SO_REUSEPORT` (the
kernel spreads connections over the workers, as gunicorn's and granian's do), and serves
the pipeline's surfaces with the same app code as a single process (`CorrallmApp`'s /v1
path) over a `RemoteRuntime`; every other path goes up to the owner (`upward.py`).

It lives only as long as its owner: the hop's end (or, where Linux offers it, the
parent-death signal) ends it at once. SIGHUP and SIGINT are the owner's to act on (a
reload reaches the worker as the new config over the hop; Ctrl-C's SIGINT to the whole
group is the owner's shutdown, which stops the workers with SIGTERM: each drains then).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
from collections.abc import Awaitable
from types import FrameType

import uvicorn

from corrallm.app import SURFACES, CorrallmApp, settle_garbage_collector
from corrallm.http.asgi import Receive, Scope, Send, header
from corrallm.http.bodies import Bodies, BodyLimits
from corrallm.http.head_guard import HeadLimits, fds_free, raise_fd_limit
from corrallm.observe.redaction import Redactor, install
from corrallm.peers import lanes
from corrallm.proxy.pipeline import Pipeline
from corrallm.server import LOG_FORMAT, listen, server_config
from corrallm.store.location import store_at
from corrallm.workers.hop import HEAD, Kind, encode, frame
from corrallm.workers.owner import Brief
from corrallm.workers.remote import RemoteRuntime
from corrallm.workers.upward import Upward

log = logging.getLogger("corrallm.workers")

PR_SET_PDEATHSIG = 1


# The surfaces a worker relays itself. Ollama's (SPEC §23 E1) go up to the owner for now:
# `keep_alive: 0` unloads through the owner's supervisors, which a worker does not hold.
RELAYED = frozenset(path for path in SURFACES if not path.startswith("/api/"))


class WorkerApp(CorrallmApp):
    """`CorrallmApp`'s /v1 path (the same `_http`: exchange, caller, body, capture, the
    surface's codec) over a `RemoteRuntime`; every other path relayed to the owner. It
    holds none of the owner's parts (no gateway, dashboard or management API), so it
    sets only what that path reads instead of calling the full app's constructor."""

    def __init__(
        self, runtime: RemoteRuntime, brief: Brief, upward: Upward, hop: socket.socket
    ) -> None:
        self.runtime = runtime
        self.pipeline = Pipeline(runtime)
        self._admin_token = brief.admin_token
        self.captures = runtime.captures
        self.captures.also_redact(brief.admin_token)
        self.bodies = Bodies(BodyLimits.from_env(os.environ))
        self.upward = upward
        self._hop_socket = hop
        self._reporting: asyncio.Task[None] | None = None
        self._writing: asyncio.Task[None] | None = None

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        kind = scope["type"]
        if kind == "http":
            if scope["path"] in RELAYED and not _forwarded(scope):
                return self._http(scope, receive, send)
            return self.upward.relay(scope, receive, send)
        if kind == "websocket":
            return self._websocket(scope, receive, send)
        return self._worker_lifespan(receive, send)

    async def _worker_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                loop = asyncio.get_running_loop()
                await self.runtime.store.open()  # the owner made or migrated it first
                await loop.create_unix_connection(lambda: self.runtime.link, sock=self._hop_socket)
                self._reporting = loop.create_task(self.runtime.link.report())
                self._writing = loop.create_task(self.runtime.activity.run())
                settle_garbage_collector()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._reporting is not None:
                    self._reporting.cancel()
                self.runtime.link.counted(0)  # the last of its metrics
                self.runtime.link.flush_now()
                await self.upward.close()
                await self.pipeline.close()
                if self._writing is not None:
                    self._writing.cancel()
                try:
                    await self.runtime.activity.flush()  # the last of its rows
                finally:
                    await self.runtime.store.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _forwarded(scope: Scope) -> bool:
    """A request another gateway forwarded (it carries a lane, X3) goes up to the owner:
    a lane's nonce is good once on the whole node (T5), and the worker that receives
    a replay need not be the one that saw its first use; the owner's `Nonces` is the
    one memory of them, and its /metrics the one count of lanes ignored."""
    return header(scope, lanes.LANE) is not None or header(scope, lanes.SIGNATURE) is not None


class WorkerServer(uvicorn.Server):
    """SIGINT is the owner's (it stops its workers with SIGTERM, which drains them)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGINT:
            super().handle_exit(sig, frame)


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL when the owner dies (the hop's end does it too)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # it died before that took hold
        os._exit(3)


def _read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    head = _read(sock, HEAD.size)
    length, kind, rid = HEAD.unpack(head)
    return kind, rid, _read(sock, length)


def _read(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise SystemExit("corrallm worker: the owner closed the hop before its brief")
        data += chunk
    return bytes(data)


def join(hop_path: str, index: int) -> tuple[socket.socket, Brief]:
    """Connect to the owner and take this worker's brief (the first frame it sends)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(hop_path)
    sock.sendall(frame(Kind.JOIN, 0, encode([index, os.getpid()])))
    kind, _, payload = _read_frame(sock)
    if kind != Kind.HELLO:
        raise SystemExit(f"corrallm worker: expected the owner's brief, got message {kind}")
    brief = pickle.loads(payload)
    assert isinstance(brief, Brief)
    return sock, brief


def main(argv: list[str]) -> None:
    hop_path, index = argv[0], int(argv[1])
    _die_with_parent()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload comes as config over the hop
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    hop, brief = join(hop_path, index)
    upward_path = os.path.join(os.path.dirname(hop_path), "http.sock")
    fd_limit = raise_fd_limit()
    limits = HeadLimits.from_env(os.environ, fds_free(fd_limit))
    runtime = RemoteRuntime(brief.config, store_at(brief.db))
    runtime.keys.load(*brief.keys)
    app = WorkerApp(runtime, brief, Upward(upward_path), hop)
    listener = listen(brief.addr, reuse_port=True)
    config = server_config(app, limits, "warning")
    server = WorkerServer(config)
    install(Redactor(lambda: runtime.captures.secrets.texts))
    log.info("worker %d (pid %d) serving on %s", index, os.getpid(), brief.addr)
    server.run(sockets=[listener])


if __name__ == "__main__":
    main(sys.argv[1:])
