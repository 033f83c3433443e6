"""The README's examples run as written, against the demo config `make run` serves.

Every fenced block of README.md is run, or said here why not: Python blocks are executed,
shell blocks run in bash (`set -e`, curl failing on an HTTP error), the YAML block is the
`corrallm.yaml` the shell blocks check. Only addresses are adapted: the demo's
`127.0.0.1:6502` becomes the test gateway's port and `~/.corrallm` its home folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import GatewayClient

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "corrallm" / "config" / "demo.yaml"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
# Lines not run, and why: `make test` is this suite; `make run` and `corrallm serve` serve
# a gateway, which the test has started itself.
NOT_RUN = ("make test", "make run", ".venv/bin/corrallm serve")


def blocks(kind: str) -> list[str]:
    found = [body for lang, body in BLOCK.findall((ROOT / "README.md").read_text()) if lang == kind]
    assert found, f"no {kind} block in the README"
    return found


def adapted(text: str, gw: GatewayClient) -> str:
    return text.replace("http://127.0.0.1:6502", gw.url).replace("~/.corrallm", str(gw.home))


@pytest.fixture
def demo(gateway_factory) -> GatewayClient:
    return gateway_factory(DEMO.read_text())


def test_every_readme_block_is_one_the_test_knows() -> None:
    kinds = {lang for lang, _ in BLOCK.findall((ROOT / "README.md").read_text())}
    assert kinds <= {"python", "sh", "yaml"}, kinds


def test_readme_python_examples_run_against_the_demo(demo: GatewayClient) -> None:
    for source in blocks("python"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(adapted(source, demo), "README.md", "exec"), {})
        assert out.getvalue().strip(), source


def test_readme_shell_examples_run_against_the_demo(demo: GatewayClient, tmp_path: Path) -> None:
    (config,) = blocks("yaml")
    (tmp_path / "corrallm.yaml").write_text(config)
    env = {
        **os.environ,
        "OPENAI_API_KEY": "sk-test",
        "ALICE_KEY": "alice-secret",
        "INDEXER_KEY": "indexer-secret",
    }
    corrallm = f"{shlex.quote(sys.executable)} -m corrallm"
    ran = 0
    for block in blocks("sh"):
        lines = [
            line for line in block.replace("\\\n", " ").splitlines() if not line.startswith(NOT_RUN)
        ]
        script = "\n".join(lines)
        script = adapted(script, demo).replace(".venv/bin/corrallm", corrallm)
        script = script.replace("curl -s ", "curl -s --fail-with-body ")
        if not script.strip():
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{script}\n---\n{done.stdout}\n{done.stderr}"
        ran += 1
    assert ran >= 3
