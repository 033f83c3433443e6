"""The unit tier's shared fixture: a scripted World for the supervisor tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.scripted import World


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    yield w
    for sup in w.made:
        await sup.stop()
