from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.calls import Call
from tests.support.clients import close_all
from tests.support.inprocess import InProcessGateway, start_in_process
from tests.support.postgres import postgres_cluster, postgres_url  # noqa: F401 (fixtures)
from tests.support.processes import (
    FakeBackend,
    Gateway,
    GatewayClient,
    cleanup,
    running_fake_backend,
    start_gateway,
)

# CORRALLM_WORKERS=2 (`make workers-tiers` runs the integration and fault tiers so): every
# gateway is a `corrallm serve` process, which reads it from its environment and serves
# with two relaying workers behind one owner of state (docs/design.md).
# A config with peers stays one process even so (`start_gateway` sees to it, for every
# gateway a test starts): `serve --workers` refuses peers.
WORKERS = os.environ.get("CORRALLM_WORKERS", "1") not in ("", "1")

# What a gateway must be a `corrallm serve` process for: the environment it reads at start,
# or a test that looks at the process itself (signals, exit, fds).
_PROCESS_ONLY = ("env", "wait")


@pytest.fixture
def gateway_factory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., GatewayClient]]:
    """Start a gateway with a config text; every one started is stopped at the end.

    Served in process (`tests/support/inprocess.py`) unless the test is marked
    `serve_process`, or passes `process=True` or what only a process takes (`env`,
    `wait=False`): then a `corrallm serve` subprocess (`tests/support/processes.py`)."""
    started: list[GatewayClient] = []
    # A browser test keeps the gateway a process: Playwright's sync API runs an event loop
    # of its own in the test's thread, beside the dashboard's long-lived streams.
    marked = request.node.get_closest_marker("serve_process") is not None or (
        "browser" in request.fixturenames
    )

    def start(config_text: str, *, process: bool = False, **kwargs: object) -> GatewayClient:
        gateway: GatewayClient
        if process or marked or WORKERS or any(k in kwargs for k in _PROCESS_ONLY):
            gateway = start_gateway(config_text, tmp_path, **kwargs)  # type: ignore[arg-type]
        else:
            gateway = start_in_process(config_text, tmp_path, **kwargs)  # type: ignore[arg-type]
        started.append(gateway)
        return gateway

    yield start
    for gateway in reversed(started):
        if isinstance(gateway, InProcessGateway):
            gateway.stop()
        else:
            assert isinstance(gateway, Gateway)
            cleanup(gateway)


@pytest.fixture
def fake_backend(tmp_path: Path) -> Iterator[FakeBackend]:
    """A fake backend started by the test itself (for pure-proxy routes)."""
    with running_fake_backend(tmp_path) as backend:
        yield backend


@pytest.fixture
def calls() -> Iterator[list[Call]]:
    """Chat requests a test runs in threads of their own (`tests/support/calls.py`): each
    is waited for at the end, bounded."""
    made: list[Call] = []
    yield made
    for call in made:
        call.join(30)


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    """Every SDK client a test's helpers made (`tests/support/clients.py`) is closed."""
    yield
    close_all()
