"""`corrallm serve`: the gateway on uvicorn (uvloop + httptools), stopped cleanly on signals."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from corrallm.api.auth import ensure_token
from corrallm.app import CorrallmApp
from corrallm.config import Config
from corrallm.config.units import format_size, parse_address
from corrallm.extras import MissingExtra
from corrallm.gateway import Gateway
from corrallm.http.asgi import ASGIApp
from corrallm.http.bodies import BodyLimits
from corrallm.http.connection import protocol_class
from corrallm.http.head_guard import HeadGuard, HeadLimits, fds_free, raise_fd_limit
from corrallm.lifecycle.process import listener_of
from corrallm.observe.events import buffer_from_env
from corrallm.observe.redaction import Redactor, install
from corrallm.store.home import secure_home

# Open streams get this long to finish on SIGTERM/SIGINT before they are cut and every
# backend is stopped.
GRACEFUL_SHUTDOWN_SECONDS = 5


@dataclass(frozen=True)
class ServeOptions:
    addr: str
    home: Path
    health_timeout: float
    config_path: Path | None
    db: Path | str | None = None  # an SQLite file, or a postgresql:// URL (X5)
    reservation_max_ttl: float = 300.0
    activity_retention: float = 30 * 86400.0
    web_root: Path | None = None


def parse_addr(addr: str) -> tuple[str, int]:
    """`:6502` (all interfaces), `127.0.0.1:6502`, `[::1]:6502`."""
    return parse_address(addr, "the address (--addr or ADDR)")


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


@dataclass(frozen=True)
class Served:
    """A gateway ready to serve: the uvicorn server that runs it (`server.run()` blocks
    until it stops), the gateway, and the filter every handler of its log must carry (T5:
    the admin token, peer tokens and env values replaced as they are written)."""

    server: uvicorn.Server
    gateway: Gateway
    redactor: Redactor
    sock: socket.socket  # bound by `listen` before anything started
    app: CorrallmApp
    # SPEC §23 E1: `ollama.listen`'s socket, the same app served on it.
    also: tuple[socket.socket, ...] = ()

    def run(self) -> None:
        """Serve until stopped (blocks), on the sockets bound before anything started."""
        self.server.run(sockets=[self.sock, *self.also])


def listen(addr: str, setting: str = "--addr", reuse_port: bool = False) -> socket.socket:
    """The gateway's listening socket, bound before anything starts (uvicorn listens on it):
    an address in use stops `serve` at once with one line naming what holds it and the
    `setting` to change. `reuse_port`: one of several (`serve --workers`: the kernel
    spreads connections over the sockets that listen)."""
    host, port = parse_address(addr, setting)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            holder = listener_of(port)
            held = f"in use by {holder}" if holder else "in use"
            raise SystemExit(
                f"corrallm serve: cannot listen on {addr}: the address is {held}; stop it, "
                f"or pick another address with {setting}"
            ) from None
        raise SystemExit(
            f"corrallm serve: cannot listen on {addr}: {exc.strerror or exc}"
        ) from None
    return sock


def run(config: Config, options: ServeOptions) -> None:
    """`corrallm serve`: the whole process is the gateway's (root logging, SIGHUP, SIGTERM
    and SIGINT, the garbage collector's settings)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    served = build(config, options)
    # T5: uvicorn's Config has set up its loggers; from here on, every handler of the
    # gateway's log replaces the admin token, peer tokens and env values as it writes.
    install(served.redactor)
    served.run()


def build(
    config: Config,
    options: ServeOptions,
    *,
    owns_process: bool = True,
    sock: socket.socket | None = None,
) -> Served:
    """The gateway, its app and its uvicorn server, as `corrallm serve` runs them.
    `owns_process=False` (a gateway run in a thread of a process that is not its own, as
    the tests do): no SIGHUP handler and the garbage collector left as it is; uvicorn
    itself listens to signals only from the main thread. `sock`: serve there instead of
    on `options.addr` (`serve --workers`: the owner's Unix socket)."""
    sock = sock or listen(options.addr)  # before anything starts or says it has
    also: list[socket.socket] = []
    try:
        if config.ollama.listen is not None:
            if parse_address(config.ollama.listen) == parse_addr(options.addr):
                raise SystemExit(
                    f"corrallm serve: ollama.listen ({config.ollama.listen}) is the address "
                    f"corrallm listens on already ({options.addr}); Ollama's API is served "
                    "there anyway: remove ollama.listen or give it another address"
                )
            also.append(listen(config.ollama.listen, "ollama.listen in the config"))
        served = _build(config, options, sock, owns_process)
    except BaseException:
        for bound in (sock, *also):
            bound.close()
        raise
    return dataclasses.replace(served, also=tuple(also))


def server_config(app: ASGIApp, limits: HeadLimits, log_level: str, **where: Any) -> uvicorn.Config:
    """uvicorn's settings for a corrallm process (the gateway, or a `--workers` worker):
    `where` is the host and port when uvicorn is told them (it serves on sockets bound
    before anything started either way)."""
    return uvicorn.Config(
        app,
        **where,
        loop="uvloop",
        # uvicorn's httptools protocol with a header timeout, a head size limit and a
        # cap on connections still sending their head (corrallm/http/head_guard.py), a
        # disconnect hook and a leaner response writer (corrallm/http/connection.py).
        http=protocol_class(HeadGuard(limits)),
        lifespan="on",
        # Said, not guessed: `CorrallmApp.__call__` is a plain function returning the
        # request's coroutine (one `await` level fewer), which uvicorn's guess would
        # take for ASGI 2.
        interface="asgi3",
        access_log=False,
        # corrallm never reads the client's address: no X-Forwarded-* rewriting
        # middleware on every request.
        proxy_headers=False,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )


def _build(
    config: Config, options: ServeOptions, sock: socket.socket, owns_process: bool
) -> Served:
    host, port = parse_addr(options.addr)
    fd_limit = raise_fd_limit()
    try:
        limits = HeadLimits.from_env(os.environ, fds_free(fd_limit))
        bodies = BodyLimits.from_env(os.environ)
        event_buffer = buffer_from_env(os.environ)
    except ValueError as exc:
        raise SystemExit(f"corrallm serve: {exc}") from None
    secure_home(options.home)  # T5: 0700, tightened if it was not
    try:
        gateway = Gateway(
            config,
            options.home,
            options.health_timeout,
            options.db,
            options.reservation_max_ttl,
            options.activity_retention,
            options.config_path,
        )
    except MissingExtra as exc:  # one line naming the extra, not a traceback (X5, E2)
        raise SystemExit(f"corrallm serve: {exc}") from None
    gateway.events.limit = event_buffer  # T5: bytes queued per events subscriber
    token = ensure_token(options.home)
    source = options.config_path or "the packaged demo config"
    logging.getLogger("corrallm").info(
        "serving %d models from %s on %s:%d (home %s)",
        len(gateway.served),
        source,
        host,
        port,
        options.home,
    )
    if config.ollama.listen is not None:
        logging.getLogger("corrallm").info(
            "serving Ollama's API on %s too (ollama.listen)", config.ollama.listen
        )
    logging.getLogger("corrallm.http").info(
        "request heads: %gs header timeout, %d bytes at most, %d pending at most "
        "(file descriptors: %d)",
        limits.timeout,
        limits.max_bytes,
        limits.max_pending,
        fd_limit,
    )
    logging.getLogger("corrallm.http").info(
        "request bodies: %gs body timeout, %s held at most across requests; "
        "events: %s queued at most per subscriber",
        bodies.timeout,
        format_size(bodies.max_memory),
        format_size(event_buffer),
    )
    app = CorrallmApp(gateway, token, options.web_root, bodies, owns_process=owns_process)
    uvicorn_config = server_config(app, limits, "info", host=host, port=port)
    redactor = Redactor(lambda: gateway.captures.secrets.texts)
    return Served(uvicorn.Server(uvicorn_config), gateway, redactor, sock, app)
