"""SPEC §15, §9 C5, §10 P1 (fault 8 of issue 13): the store's disk full during a management
write, against real processes.

Before: a pause requested while the disk was full answered a plain-text 500, applied the
pause in memory only (requests refused as paused, the process still running) and lost it
on restart. Now a write the store cannot keep fails as a whole: an OpenAI-shaped 503
`store_unavailable` naming the cause and the fix, and nothing changed; once there is room
again the same request succeeds, durably.

The store lives on a small tmpfs mounted for the test (root needed; skipped loudly where
mount is not permitted), filled to the last byte after the gateway is up.
"""

from __future__ import annotations

import errno
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.support.processes import fake_cmd

CONFIG = f"""
models:
  m: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
  p: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}
"""
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs, unmounted afterwards whatever the test did."""
    mount = tmp_path / f"store-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: cannot mount a tmpfs for the store ({done.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Write until the file system refuses even one more byte."""
    filler = folder / "filler"
    with filler.open("wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            block = b"\0" * chunk
            while True:
                try:
                    out.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    return filler


def chat(gw, model: str = "m") -> httpx.Response:
    return httpx.post(gw.v1 + "/chat/completions", json={"model": model, **CHAT}, timeout=60)


def paused(gw, name: str = "m") -> bool:
    model = next(m for m in gw.api("GET", "overview").json()["models"] if m["name"] == name)
    return bool(model["paused"])


@pytest.mark.serve_process
def test_fault8_C5_P1_a_pause_the_full_store_cannot_keep_is_a_503_and_changes_nothing(
    gateway_factory, small_disk, tmp_path
):
    env = {"CORRALLM_DB": str(small_disk / "corrallm.db")}
    gw = gateway_factory(CONFIG, env=env)
    assert chat(gw).status_code == 200
    pid = gw.pid_of("m#0")
    assert gw.api("POST", "models/pause", {"model": "p"}).status_code == 200
    filler = fill(small_disk)
    assert shutil.disk_usage(small_disk).free < 4096

    refused = gw.api("POST", "models/pause", {"model": "m"})
    assert refused.status_code == 503, refused.text
    assert refused.headers["content-type"].startswith("application/json")
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("api_error", "store_unavailable")
    assert "database or disk is full" in error["message"]  # the cause
    assert str(small_disk) in error["message"] and "free space" in error["message"]  # the fix
    assert "nothing was changed" in error["message"]
    # Nothing changed: not paused, the process never stopped, the model still serves.
    assert not paused(gw)
    assert psutil.pid_exists(pid) and gw.state("m#0") == "ready"
    assert chat(gw).status_code == 200

    # An unpause (a store write too) is refused the same way, and the pause stays whole.
    unpause = gw.api("POST", "models/unpause", {"model": "p"})
    assert unpause.status_code == 503, unpause.text
    assert unpause.json()["error"]["code"] == "store_unavailable"
    assert paused(gw, "p") and chat(gw, "p").json()["error"]["code"] == "paused"

    gw.signal(signal.SIGTERM)
    gw.wait_exit()
    filler.unlink()
    again = gateway_factory(CONFIG, home=gw.home, env=env)
    assert not paused(again)  # the refused pause was never kept anywhere
    assert paused(again, "p")  # and the pause the refused unpause left is still kept
    assert chat(again).status_code == 200

    # With room again the same request succeeds, and durably: it survives a restart.
    assert again.api("POST", "models/pause", {"model": "m"}).status_code == 200
    again.signal(signal.SIGTERM)
    again.wait_exit()
    third = gateway_factory(CONFIG, home=gw.home, env=env)
    assert paused(third)
    assert chat(third).json()["error"]["code"] == "paused"
