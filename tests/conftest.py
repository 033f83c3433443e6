from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.calls import Call
from tests.support.clients import close_all
from tests.support.postgres import postgres_cluster, postgres_url  # noqa: F401 (fixtures)
from tests.support.processes import (
    FakeBackend,
    Gateway,
    cleanup,
    running_fake_backend,
    start_gateway,
)


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[Callable[..., Gateway]]:
    """Start `corrallm serve` with a config text; every one started is cleaned up."""
    started: list[Gateway] = []

    def start(config_text: str, **kwargs: object) -> Gateway:
        gateway = start_gateway(config_text, tmp_path, **kwargs)  # type: ignore[arg-type]
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
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
