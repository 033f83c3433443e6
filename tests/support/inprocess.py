"""The gateway served from a thread of the test process, on a loopback port.

`corrallm.server.build` makes the same gateway, app and uvicorn server `corrallm serve`
runs; here `server.run()` runs in a thread of its own (its own event loop), so the SDKs and
httpx still talk HTTP to it, and the backends it starts are still real processes. What only
a process shows (signals, re-adoption of backends, file descriptors, the CLI, exit codes,
the environment it reads at start) stays with `start_gateway` in `processes.py`.

Each gateway has its own home folder, port and log file. Its log gets the records of the
thread it runs in (and of the test's thread while it is built), each handler carrying the
gateway's redactor as `corrallm serve`'s handlers do; stopping it waits for the thread, so
no task, socket or thread outlives the test.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from corrallm.config import load_config
from corrallm.config.units import parse_duration
from corrallm.residency.footprints import footprint_problems
from corrallm.server import LOG_FORMAT, Served, ServeOptions, build
from tests.support.processes import GatewayClient, free_port, kill_group, wait_for

# Which in-process gateway a thread belongs to (its server thread; the test's thread while
# it builds one): a record from a thread in here goes to that gateway's log only, one from
# any other thread (the test's, a helper's) to every gateway's.
_OWNERS: dict[int, InProcessGateway] = {}
_LOCK = threading.Lock()
_running = 0
_level_before = logging.NOTSET
# While one runs, the "corrallm" logger is at INFO, as `corrallm serve` sets its root
# (pytest leaves the root at WARNING); the handlers go on these loggers.
_LOGGERS = ("", "uvicorn")  # the loggers `corrallm serve`'s redactor is put on


@dataclass
class InProcessGateway(GatewayClient):
    """A gateway served from a thread of this process (see the module's docstring)."""

    served: Served | None = field(default=None, kw_only=True)
    thread: threading.Thread | None = field(default=None, kw_only=True)
    handler: logging.Handler | None = field(default=None, kw_only=True)

    def owns(self, record: logging.LogRecord) -> bool:
        owner = _OWNERS.get(record.thread or 0)
        return owner is None or owner is self

    def stop(self, timeout: float = 30.0) -> None:
        """Shut it down as SIGTERM would (graceful, then cut) and wait for its thread."""
        if self.served is not None and self.thread is not None:
            self.served.server.should_exit = True
            self.thread.join(timeout)
            if self.thread.is_alive():
                self.served.server.force_exit = True
                self.thread.join(timeout)
            if self.thread.is_alive():
                raise AssertionError(f"the gateway on {self.url} did not stop in {timeout}s")
        self.records()
        for pgid in self.backend_groups:
            kill_group(pgid)
        _release(self)


def _claim(gateway: InProcessGateway) -> None:
    global _running, _level_before
    handler = logging.FileHandler(gateway.log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(gateway.owns)
    gateway.handler = handler
    with _LOCK:
        if _running == 0:
            _level_before = logging.getLogger("corrallm").level
            logging.getLogger("corrallm").setLevel(logging.INFO)
        _running += 1
    logging.getLogger().addHandler(handler)


def _release(gateway: InProcessGateway) -> None:
    global _running
    handler = gateway.handler
    if handler is None:
        return
    gateway.handler = None
    for name in _LOGGERS:
        logging.getLogger(name).removeHandler(handler)
    handler.close()
    with _LOCK:
        for ident in [i for i, owner in _OWNERS.items() if owner is gateway]:
            del _OWNERS[ident]
        _running -= 1
        if _running == 0:
            logging.getLogger("corrallm").setLevel(_level_before)


def start_in_process(
    config_text: str,
    tmp: Path,
    *,
    home: Path | None = None,
    health_timeout: str = "20s",
    port: int | None = None,
) -> InProcessGateway:
    """Like `start_gateway`, in a thread: returns once it answers (its lifespan started)."""
    config_path = tmp / f"corrallm-{time.monotonic_ns()}.yaml"
    config_path.write_text(config_text)
    home = home or tmp / "home"
    port = port or free_port()
    gateway = InProcessGateway(
        f"http://127.0.0.1:{port}", home, tmp / f"corrallm-{port}.log", config_path=config_path
    )
    _claim(gateway)
    try:
        with _LOCK:
            _OWNERS[threading.get_ident()] = gateway
        try:
            options = ServeOptions(
                addr=f"127.0.0.1:{port}",
                home=home,
                health_timeout=parse_duration(health_timeout),
                config_path=config_path,
            )
            config = load_config(config_path, checks=[footprint_problems])
            served = build(config, options, owns_process=False)
        finally:
            with _LOCK:
                _OWNERS.pop(threading.get_ident(), None)
        if gateway.handler is not None:
            gateway.handler.addFilter(served.redactor)  # T5, as `corrallm serve` does
            # uvicorn's Config has just set its loggers up again (they do not propagate).
            logging.getLogger("uvicorn").addHandler(gateway.handler)
        gateway.served = served
        gateway.thread = threading.Thread(
            target=_serve, args=(gateway, served), name=f"corrallm-{port}", daemon=True
        )
        gateway.thread.start()
        wait_for(lambda: _up(gateway, served), 30, 0.01, f"the gateway on {gateway.url}")
    except BaseException:
        with contextlib.suppress(AssertionError):
            gateway.stop()
        _release(gateway)
        raise
    return gateway


def _serve(gateway: InProcessGateway, served: Served) -> None:
    with _LOCK:
        _OWNERS[threading.get_ident()] = gateway
    served.run()


def _up(gateway: InProcessGateway, served: Served) -> bool:
    if served.server.started:
        return True
    if gateway.thread is not None and not gateway.thread.is_alive():
        raise AssertionError(f"the gateway did not start:\n{gateway.log()}")
    return False
