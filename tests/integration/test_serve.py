"""SPEC §1: `corrallm serve` refuses a bad config with every problem, and parses ADDR."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from corrallm.server import parse_addr
from tests.support.processes import free_port, kill_group, wait_for


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


def serve(
    tmp_path, *args: str, env: dict[str, str] | None = None, output: object = subprocess.PIPE
) -> subprocess.Popen[str]:
    """`corrallm serve` on the demo config with its own home, its output to `output`."""
    return subprocess.Popen(
        [sys.executable, "-m", "corrallm", "serve", "--home", str(tmp_path / "home"), *args],
        stdout=output,  # type: ignore[arg-type]
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,  # no ./corrallm.yaml there: the packaged demo
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )


def test_issue30_serve_listens_on_addr_and_its_help_names_the_flag_and_ADDR(tmp_path):
    """Issue 30: `serve` had no --addr, only an ADDR variable its --help did not mention.
    --addr wins over ADDR."""
    shown = subprocess.run(
        [sys.executable, "-m", "corrallm", "serve", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=60,
    ).stdout
    assert "--addr" in shown and "HOST:PORT" in shown and "ADDR" in shown
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = serve(
            tmp_path, "--addr", f"127.0.0.1:{port}", env={"ADDR": "127.0.0.1:1"}, output=out
        )
    try:
        url = f"http://127.0.0.1:{port}/health"

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(url, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, what="corrallm on --addr")
    finally:
        kill_group(proc.pid)
        proc.wait(10)


def test_issue30_a_busy_address_is_one_line_naming_its_holder_before_any_startup(tmp_path):
    """Issue 30: a port in use printed uvicorn's raw `[Errno 98]` after "startup complete".
    Now `serve` stops at once, non-zero, with one line naming the address and the process
    holding it (this test's own, here)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = serve(tmp_path, "--addr", f"127.0.0.1:{port}")
        try:
            output, _ = proc.communicate(timeout=60)
        finally:
            kill_group(proc.pid)
    assert proc.returncode != 0
    assert "startup complete" not in output.lower() and "Errno" not in output, output
    (line,) = [line for line in output.splitlines() if f"127.0.0.1:{port}" in line]
    assert "in use by" in line and f"pid {os.getpid()}" in line, output
    assert "--addr" in line


def test_E1_a_busy_ollama_listen_address_is_one_line_naming_the_setting(tmp_path):
    """SPEC §23 E1: `ollama.listen` is bound like --addr, before anything starts."""
    config = tmp_path / "corrallm.yaml"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config.write_text(f"ollama: {{listen: '127.0.0.1:{port}'}}\nmodels: {{}}\n")
        proc = serve(tmp_path, "--config", str(config), "--addr", f"127.0.0.1:{free_port()}")
        try:
            output, _ = proc.communicate(timeout=60)
        finally:
            kill_group(proc.pid)
    assert proc.returncode != 0
    assert "startup complete" not in output.lower() and "Errno" not in output, output
    (line,) = [line for line in output.splitlines() if f"127.0.0.1:{port}" in line]
    assert "in use by" in line and "ollama.listen in the config" in line, output


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
