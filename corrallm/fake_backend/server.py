"""Process side of the fake backend: bind, llama-server-like log lines, uvicorn, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from types import FrameType

import uvicorn

from corrallm.fake_backend.app import FakeBackend
from corrallm.fake_backend.options import Options, parse_options


def log(line: str) -> None:
    """Print one line and flush it (the gateway reads our stdout through a pipe).

    When the reader is gone (the gateway died; we may be re-adopted later), further output
    goes to /dev/null instead of failing requests and signal handling.
    """
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:
        _stdout_to_devnull()


def _raw_log(line: str) -> None:
    """Unbuffered and exception-free: safe inside a signal handler."""
    try:
        os.write(1, line.encode() + b"\n")
    except OSError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.close(fd)


def bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def banner(opts: Options) -> list[str]:
    """What llama-server prints while loading, in the formats corrallm's log parser reads."""
    return [
        f"srv    load_model: loading model '{opts.model_file}'",
        f"llama_model_loader: loaded meta data from {opts.model_file} (fake)",
        "llama_context: constructing llama_context",
        f"llama_context: n_seq_max     = {opts.n_slots}",
        f"llama_context: n_ctx         = {opts.n_ctx}",
        f"llama_context: n_ctx_per_seq = {opts.n_ctx_slot}",
        "llama_context: n_batch       = 2048",
        f"srv    load_model: initializing slots, n_slots = {opts.n_slots}",
        *(
            f"slot   load_model: id {i:2d} | task -1 | new slot n_ctx_slot = {opts.n_ctx_slot}"
            for i in range(opts.n_slots)
        ),
    ]


def main(argv: list[str]) -> None:
    started = time.monotonic()
    opts = parse_options(argv)
    log(f"build: 0 (corrallm-fake) with Python {sys.version.split()[0]}; pid {os.getpid()}")
    exit_code = 3 if opts.exit_code is None else opts.exit_code
    if opts.exit_after_seconds == 0:
        log(f"error: failed to load model '{opts.model_file}' (--exit-after-seconds 0)")
        sys.exit(exit_code)
    try:
        sock = bind(opts.host, opts.port)
    except OSError as exc:
        log(
            f"error: couldn't bind HTTP server socket, hostname: {opts.host}, "
            f"port: {opts.port}: {exc}"
        )
        sys.exit(1)
    log(f"main: HTTP server is listening, hostname: {opts.host}, port: {opts.port}")
    log(f"main: server is listening on http://{opts.host}:{opts.port} - starting the main loop")
    for line in banner(opts):
        log(line)
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(opts, sock, started + opts.load_seconds, exit_code))


async def _serve(opts: Options, sock: socket.socket, ready_at: float, exit_code: int) -> None:
    loop = asyncio.get_running_loop()
    app = FakeBackend(opts, log, ready_at)

    def loaded() -> None:
        app.sleep.load()  # --hold-mb: held until a sleep (--sleep-mode) frees it
        log("main: model loaded")
        log("srv  update_slots: all slots are idle")

    until_ready = max(0.0, ready_at - time.monotonic())
    loop.call_later(until_ready, loaded)
    if opts.load_progress is not None:
        _progress(loop, opts.load_progress, ready_at)
    if opts.hang_after_ready is not None:

        def hang() -> None:
            _raw_log(
                f"main: not answering anything from now on (--hang-after-ready) t={time.time()}"
            )
            while True:  # block the event loop: no request, health poll or signal is served
                time.sleep(3600)

        loop.call_later(until_ready + opts.hang_after_ready, hang)
    if opts.die_after_ready is not None:

        def die_ready() -> None:
            _raw_log(f"error: the model server died (--die-after-ready) t={time.time()}")
            os._exit(1)

        loop.call_later(until_ready + opts.die_after_ready, die_ready)
    if opts.exit_after_seconds is not None:

        def die() -> None:
            log(f"error: failed to load model '{opts.model_file}' (--exit-after-seconds)")
            os._exit(exit_code)

        loop.call_later(opts.exit_after_seconds, die)

    config = uvicorn.Config(
        app,
        http="httptools",
        ws="websockets",
        lifespan="off",
        interface="asgi3",
        access_log=False,
        log_config=None,
        log_level="warning",
        server_header=False,
        timeout_graceful_shutdown=1,
        backlog=2048,
    )
    server = _Server(config, ignore_sigterm=opts.ignore_sigterm)
    await server.serve(sockets=[sock])


def _progress(loop: asyncio.AbstractEventLoop, every: float, ready_at: float) -> None:
    """Print a load-progress line every `every` seconds until `ready_at` (monotonic)."""
    started = time.monotonic()
    total = max(ready_at - started, 1e-9)

    def tick() -> None:
        now = time.monotonic()
        if now >= ready_at:
            return
        log(f"llama_model_load: loading tensors ... {min(99, int(100 * (now - started) / total))}%")
        loop.call_later(every, tick)

    loop.call_later(every, tick)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ignore_sigterm: bool) -> None:
        super().__init__(config)
        self.ignore_sigterm = ignore_sigterm

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler may interrupt a buffered print: write the raw fd instead.
        if self.ignore_sigterm and sig == signal.SIGTERM:
            _raw_log("main: received SIGTERM, ignoring it (--ignore-sigterm)")
            return
        super().handle_exit(sig, frame)
        _raw_log(f"main: received signal {sig}, shutting down")
