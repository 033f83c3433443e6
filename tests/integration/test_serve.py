"""SPEC §1: `corrallm serve` refuses a bad config with every problem, and parses ADDR."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from corrallm.server import parse_addr


def test_serve_refuses_a_bad_config_listing_every_problem(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        "models:\n"
        "  a: {backends: [{cmd: 'x --port 1', maxConcurrent: -1}]}\n"
        "  b: {backends: [{proxy: 5800, sever: box}]}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "corrallm", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        env={**os.environ, "ADDR": "127.0.0.1:1"},
        timeout=60,
    )
    assert result.returncode == 1
    assert "models.a.backends[0].maxConcurrent" in result.stderr
    assert "models.a.backends[0]" in result.stderr and "proxy" in result.stderr
    assert "did you mean 'server'" in result.stderr


@pytest.mark.parametrize(
    ("addr", "expected"),
    [(":6502", ("0.0.0.0", 6502)), ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9))],
)
def test_addr_forms(addr, expected):
    assert parse_addr(addr) == expected


def test_addr_without_a_port_is_refused():
    with pytest.raises(ValueError, match="ADDR"):
        parse_addr("localhost")


@pytest.mark.serve_process
def test_serve_flags_db_and_activity_retention_by_env(gateway_factory, tmp_path):
    import signal
    import sqlite3
    import time

    from tests.support.processes import wait_for

    db = tmp_path / "elsewhere" / "store.db"
    config = "models: {m: {backends: [{proxy: 1}]}}"
    first = gateway_factory(config, env={"CORRALLM_DB": str(db)})
    assert db.exists() and not (first.home / "corrallm.db").exists()  # --db by its env twin
    first.signal(signal.SIGTERM)
    first.wait_exit()
    with sqlite3.connect(db) as conn:  # a row ten days old, and one from now
        for age in (10 * 86400, 0):
            conn.execute(
                "INSERT INTO activity (t, kind, grp, model, endpoint, status) "
                "VALUES (?, 'request', 'default', 'm', '/v1/chat/completions', 200)",
                (time.time() - age,),
            )
    gateway_factory(
        config,
        home=first.home,
        env={"CORRALLM_DB": str(db), "CORRALLM_ACTIVITY_RETENTION": "2d"},
    )

    def remaining() -> int:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM activity").fetchone()[0])

    wait_for(lambda: remaining() == 1, 20, interval=0.2, what="the old row pruned")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--health-timeout", "soon"),
        ("--reservation-max-ttl", "-5m"),
        ("--activity-retention", "forever"),
    ],
)
def test_serve_refuses_bad_durations_naming_the_flag(flag, value):
    result = subprocess.run(
        [sys.executable, "-m", "corrallm", "serve", flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert flag in result.stderr


def test_serve_web_root_serves_the_dashboard_files_from_a_folder_first(gateway_factory, tmp_path):
    import httpx

    root = tmp_path / "site"
    (root / "static").mkdir(parents=True)
    (root / "static" / "dashboard.css").write_text("/* operator's own look */")
    gw = gateway_factory(
        "models: {m: {backends: [{proxy: 1}]}}", env={"CORRALLM_WEB_ROOT": str(root)}
    )
    css = httpx.get(gw.url + "/ui/static/dashboard.css")
    assert css.status_code == 200 and css.text == "/* operator's own look */"
    js = httpx.get(gw.url + "/ui/static/dashboard.js")  # not overridden: the packaged one
    assert js.status_code == 200 and "EventSource" in js.text
    missing = subprocess.run(
        [sys.executable, "-m", "corrallm", "serve", "--web-root", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "--web-root" in missing.stderr
