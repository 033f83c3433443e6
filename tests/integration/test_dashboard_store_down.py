"""Issue 30, SPEC §11 D1: the dashboard while the store is down.

Before, each page and each poll of a section answered a JSON 500 and logged a traceback
(~12 lines a second for one open page). Now the page says the store is unavailable (503,
HTML, naming the cause and the fix), the log gets one line when the outage begins and one
when it ends. In process: the real gateway (not started) and dashboard over a real SQLite
store whose reads are made to fail, through httpx's ASGI transport.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corrallm.config import load_config_text
from corrallm.gateway import Gateway
from corrallm.store.db import StoreUnavailable
from corrallm.ui.app import Dashboard

TOKEN = "t" * 32
CONFIG = 'models:\n  m: {backends: [{cmd: "srv --port ${PORT}", proxy: "${PORT}"}]}\n'


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, bool]]]:
    gw = Gateway(load_config_text(CONFIG), tmp_path)
    await gw.store.open()
    down = {"now": False}
    read = gw.store.query

    async def query(sql: str, args: Any = ()) -> Any:
        if down["now"]:
            raise StoreUnavailable(gw.store.path, OSError("disk I/O error"))
        return await read(sql, args)

    gw.store.query = query  # type: ignore[method-assign]
    transport = httpx.ASGITransport(app=Dashboard(gw, TOKEN))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as c:
        yield c, down
    await gw.store.close()


async def test_issue30_D1_store_down_is_a_503_page_and_one_log_line_per_outage(
    setup: tuple[httpx.AsyncClient, dict[str, bool]], caplog: pytest.LogCaptureFixture
) -> None:
    client, down = setup
    assert (await client.get("/ui/section/activity")).status_code == 200
    caplog.set_level(logging.INFO, logger="corrallm")
    down["now"] = True
    answers = [await client.get(path) for path in ["/", *["/ui/section/activity"] * 10]]
    for answer in answers:
        assert answer.status_code == 503
        assert answer.headers["content-type"].startswith("text/html")
        assert "The store is unavailable" in answer.text and "disk I/O error" in answer.text
    # A section that reads no store still answers, and does not end the outage.
    assert (await client.get("/ui/section/overview")).status_code == 200
    assert (await client.get("/ui/section/usage")).status_code == 503
    down["now"] = False
    assert (await client.get("/ui/section/activity")).status_code == 200
    assert (await client.get("/")).status_code == 200
    lines = [r for r in caplog.records if r.name.startswith("corrallm.ui")]
    # (How long the outage lasted depends on the machine's load: not compared.)
    assert [(r.levelname, r.getMessage().split(" (")[0].split(" after ")[0]) for r in lines] == [
        ("WARNING", "dashboard: the store is unavailable"),
        ("INFO", "dashboard: the store is available again"),
    ], [r.getMessage() for r in lines]
    assert re.search(r"available again after \d+\.\ds \(12 failed reads\)", lines[1].getMessage())
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
