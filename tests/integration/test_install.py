"""Issue 30: what `make run` installs (the package without extras) runs every subcommand.

`corrallm verify` and `corrallm bench` once crashed with `No module named 'httpx'` after
`make run`: httpx was in the `dev` extra only, and the suite runs in the dev venv, where it
is always there. Here the package is installed, as `make run` does, without extras, into a
fresh virtual environment of its own (one per module: about 30 s with pip's wheel cache),
and that environment must

- answer `--help` for every subcommand (the commands' own imports run lazily, so this
  alone would not have caught it), and
- find every third-party module the package imports anywhere (module level, inside a
  function or under TYPE_CHECKING: read from the source, so no code path is missed), but
  for those of an optional extra, each named with its extra.

The same environment shows what `--db postgresql://…` says without the `postgres` extra
(SPEC §19 X5), and `telemetry.otlp` without the `otel` extra (§23 E2): one line naming
`corrallm[postgres]` (`corrallm[otel]`), and a non-zero exit.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer

import corrallm
from corrallm.cli import app
from tests.support.processes import free_port

ROOT = Path(corrallm.__file__).resolve().parent.parent
PACKAGE = ROOT / "corrallm"
# Modules that only an optional extra provides (pyproject.toml's optional-dependencies):
# the code imports them only when the feature is asked for.
# (opentelemetry: its API also comes with FastAPI; the SDK and exporter only with `otel`.)
EXTRAS = {
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "pynvml": "gpu",
    "opentelemetry": "otel",
}
# Imports that are not distributions: the package itself, and typing-only stubs' names.
NOT_DISTRIBUTIONS = {"corrallm", "_typeshed"}


@pytest.fixture(scope="module")
def runtime_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A virtual environment holding corrallm and its runtime dependencies only: its bin/."""
    folder = tmp_path_factory.mktemp("runtime-venv")
    venv.EnvBuilder(with_pip=True, symlinks=True).create(folder)
    python = folder / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(ROOT)],
        capture_output=True,
        text=True,
        env=_clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
        timeout=300,
    )
    assert done.returncode == 0, f"pip install {ROOT} failed:\n{done.stdout}\n{done.stderr}"
    yield folder / "bin"


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would let the dev venv's modules in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def subcommands() -> list[list[str]]:
    """Every subcommand, nested ones too (`keys hash`), as argv after `corrallm`."""
    found: list[list[str]] = []

    def walk(group: object, prefix: list[str]) -> None:
        for name, command in sorted(getattr(group, "commands", {}).items()):
            if getattr(command, "commands", None):
                walk(command, [*prefix, name])
            else:
                found.append([*prefix, name])

    walk(typer.main.get_command(app), [])
    return found


def imported_names() -> set[str]:
    """The top-level name of every module the package imports, wherever it is written."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - NOT_DISTRIBUTIONS


def test_issue30_every_subcommand_answers_help_with_the_runtime_dependencies_only(
    runtime_env: Path,
) -> None:
    commands = subcommands()
    assert ["verify"] in commands and ["bench"] in commands and ["keys", "hash"] in commands
    failed = []
    for argv in commands:
        done = subprocess.run(
            [str(runtime_env / "corrallm"), *argv, "--help"],
            capture_output=True,
            text=True,
            env=_clean_env(),
            timeout=60,
        )
        if done.returncode != 0 or "usage" not in (done.stdout + done.stderr).lower():
            failed.append((argv, done.returncode, done.stderr[-2000:]))
    assert not failed


def test_issue30_every_module_the_package_imports_is_a_runtime_dependency_or_an_extras(
    runtime_env: Path,
) -> None:
    names = sorted(imported_names())
    assert {"httpx", "aiohttp", "typer"} <= set(names)
    probe = (
        "import importlib.util, json, sys; "
        "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))"
    )
    done = subprocess.run(
        [str(runtime_env / "python"), "-c", probe, *names],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=60,
        check=True,
    )
    missing = set(json.loads(done.stdout))
    assert missing - EXTRAS.keys() == set(), (
        "imported by corrallm but not installed by `pip install corrallm` (no extras): "
        "add them to [project] dependencies in pyproject.toml"
    )


def test_issue30_X5_a_postgresql_store_without_the_extra_is_one_line_naming_it(
    runtime_env: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            str(runtime_env / "corrallm"),
            "serve",
            "--home",
            str(tmp_path / "home"),
            "--db",
            "postgresql://corrallm@127.0.0.1:9/corrallm",
        ],
        capture_output=True,
        text=True,
        env=_clean_env(ADDR=f"127.0.0.1:{free_port()}"),
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()  # one line, nothing else
    assert "pip install 'corrallm[postgres]'" in line and "psycopg" in line, line


def test_E2_traces_without_the_extra_are_one_line_naming_it(
    runtime_env: Path, tmp_path: Path
) -> None:
    config = tmp_path / "corrallm.yaml"
    config.write_text("telemetry: {otlp: {endpoint: 'http://127.0.0.1:9'}}\n")
    done = subprocess.run(
        [
            str(runtime_env / "corrallm"),
            "serve",
            "--home",
            str(tmp_path / "home"),
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        env=_clean_env(ADDR=f"127.0.0.1:{free_port()}"),
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()  # one line, nothing else
    assert "pip install 'corrallm[otel]'" in line and "telemetry.otlp" in line, line
