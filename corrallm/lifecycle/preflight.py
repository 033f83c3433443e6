"""What would keep a backend's process from starting, seen before it is asked to (issue 30):
its program not found, a `--slot-save-path` folder that does not exist.

These read the machine, not the config, so they are warnings with the YAML path, not config
errors: `corrallm check` may run where the backends' programs are not installed (a CI
box), and a program can be installed while the gateway runs. `corrallm check` prints them;
`corrallm serve` prints them once at start. The config's own contradictions (a `--port`
that disagrees with `proxy`) are errors, in `config/validation.py`.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

from corrallm.config.schema import Config, ProcessSpec
from corrallm.config.validation import Loc, Problem
from corrallm.lifecycle.process import program_argv

SLOT_SAVE_FLAG = "--slot-save-path"


def _specs(config: Config) -> Iterator[tuple[Loc, ProcessSpec]]:
    for name, ext in config.extensions.items():
        yield ("extensions", name), ext
    for model, served in config.models.items():
        for index, backend in enumerate(served.backends):
            if backend.peer is None:
                yield ("models", model, "backends", index), backend


def missing_program(argv: list[str], cwd: str | None, env: dict[str, str]) -> str | None:
    """Why `argv[0]` cannot be run, naming it; None when it can be found."""
    program = argv[0]
    if "/" in program:
        path = Path(cwd or ".", program) if not Path(program).is_absolute() else Path(program)
        if not path.is_file():
            return f"program '{program}' not found (no such file: {path})"
        if not os.access(path, os.X_OK):
            return f"program '{program}' is not executable ({path})"
        return None
    search = env.get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(program, path=search) is None:
        return f"program '{program}' not found on PATH ({search})"
    return None


def _slot_save_path(argv: list[str]) -> str | None:
    for index, arg in enumerate(argv):
        if arg == SLOT_SAVE_FLAG and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(SLOT_SAVE_FLAG + "="):
            return arg.partition("=")[2]
    return None


def start_problems(config: Config) -> list[Problem]:
    """Each backend or extension corrallm would start whose process could not start."""
    problems: list[Problem] = []
    for loc, spec in _specs(config):
        if not spec.cmd or spec.supervision in ("docker", "systemd"):
            continue  # docker and systemd: D4's warnings say whether those are usable
        try:
            argv = program_argv(spec.cmd)
        except ValueError:
            continue  # the config's own errors say why
        if not argv:
            continue
        env = {k: v for k, v in spec.env.items() if "${" not in v}
        why = missing_program(argv, spec.cwd, env)
        if why is not None:
            problems.append(
                ((*loc, "cmd"), f"{why}: the process cannot start; install it or give its path")
            )
        folder = _slot_save_path(argv)
        if folder is not None and "${" not in folder:
            path = Path(spec.cwd or ".", folder).expanduser()
            if not path.is_dir():
                problems.append(
                    (
                        (*loc, "cmd"),
                        f"{SLOT_SAVE_FLAG} {folder}: no such folder ({path}); llama-server "
                        f"cannot save slots there: create it (mkdir -p {shlex.quote(str(path))})",
                    )
                )
    return problems
