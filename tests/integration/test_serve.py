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
