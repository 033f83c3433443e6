"""How a backend is started and stopped (SPEC §10 P2): the supervision strategies.

- `process` (default): corrallm runs `cmd` and owns its process group.
- `command`: `cmd` starts it (corrallm still owns that process) and `stop` stops it.
- `docker`: `docker start <dockerContainer>` / `docker stop -t <stopGrace> <dockerContainer>`.
- `systemd`: `systemctl start <systemdUnit>` / `systemctl stop <systemdUnit>`.

Readiness is always the health check. Whatever the strategy, a backend is never stopped
with requests in flight unless forced: that rule lives in `Supervisor.unload`.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

from corrallm.config.schema import ProcessSpec
from corrallm.lifecycle.process import program_argv


@dataclass(frozen=True)
class Strategy:
    serve: list[str] | None  # a long-running process corrallm owns (process, command)
    start: list[str] | None  # a starter that runs to completion (docker, systemd)
    stop: list[str] | None  # a stop command; None: signal the owned process group

    def describe(self) -> str:
        argv = self.serve or self.start or []
        return shlex.join(argv)


def strategy(spec: ProcessSpec, cmd: str | None) -> Strategy:
    """The commands for `spec`, with `cmd` already given its port."""
    grace = str(math.ceil(spec.stop_grace))
    if spec.supervision == "docker":
        name = spec.docker_container or ""
        return Strategy(None, ["docker", "start", name], ["docker", "stop", "-t", grace, name])
    if spec.supervision == "systemd":
        unit = spec.systemd_unit or ""
        return Strategy(None, ["systemctl", "start", unit], ["systemctl", "stop", unit])
    assert cmd is not None, "validated config: process and command supervision need cmd"
    stop = shlex.split(spec.stop) if spec.supervision == "command" and spec.stop else None
    return Strategy(program_argv(cmd), None, stop)
