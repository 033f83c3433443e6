"""What `corrallm check` reports about the machine (SPEC §11 D4): whether systemd and docker
are usable, where `nvidia-smi` is, the GPUs NVML sees; and what of the config they
cannot serve (a `docker` backend without docker is a warning, not an error)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from corrallm.config.schema import Config
from corrallm.config.units import format_size


@dataclass
class Environment:
    systemd: str | None  # why it is not usable; None: usable
    docker: str | None
    nvidia_smi: str | None  # its path
    gpus: list[tuple[int, str, int]] = field(default_factory=list)  # index, name, bytes
    nvml: str | None = None  # why NVML is unavailable; None: it answered


def probe() -> Environment:
    return Environment(_systemd(), _docker(), shutil.which("nvidia-smi"), *_gpus())


def _systemd() -> str | None:
    if shutil.which("systemctl") is None:
        return "no systemctl on PATH"
    if not Path("/run/systemd/system").is_dir():
        return "systemctl present, but systemd is not running (no /run/systemd/system)"
    return None


def _docker() -> str | None:
    docker = shutil.which("docker")
    if docker is None:
        return "no docker on PATH"
    try:
        done = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker info` failed: {exc}"
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        return f"{docker} present, but no engine answers ({detail[0] if detail else 'no output'})"
    return None


def _gpus() -> tuple[list[tuple[int, str, int]], str | None]:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception as exc:  # no `gpu` extra, no driver, no GPU
        return [], f"NVML unavailable ({exc})"
    found = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        found.append((index, name if isinstance(name, str) else name.decode(), int(memory)))
    return found, None


def warnings(config: Config, env: Environment) -> list[str]:
    out = []
    specs = [(f"extensions.{n}", e) for n, e in config.extensions.items()] + [
        (f"models.{m}.backends[{i}]", b)
        for m, model in config.models.items()
        for i, b in enumerate(model.backends)
    ]
    for where, spec in specs:
        if spec.supervision == "docker" and env.docker:
            out.append(f"{where}: supervision docker, but {env.docker}")
        if spec.supervision == "systemd" and env.systemd:
            out.append(f"{where}: supervision systemd, but {env.systemd}")
    if env.nvml is None:
        for name, server in config.servers.items():
            for pool in server.pools:
                if pool.startswith("gpu") and pool[3:].isdigit() and int(pool[3:]) >= len(env.gpus):
                    out.append(
                        f"servers.{name}.pools.{pool}: NVML sees {len(env.gpus)} GPU(s) here"
                    )
    return out


def report(env: Environment) -> str:
    lines = [
        "environment:",
        f"  systemd: {'usable' if env.systemd is None else 'not usable: ' + env.systemd}",
        f"  docker: {'usable' if env.docker is None else 'not usable: ' + env.docker}",
        f"  nvidia-smi: {env.nvidia_smi or 'not found'}",
    ]
    if env.nvml is not None:
        lines.append(f"  GPUs (NVML): none seen: {env.nvml}")
    else:
        lines.append(f"  GPUs (NVML): {len(env.gpus)}")
        lines += [f"    gpu{i}: {name}, {format_size(memory)}" for i, name, memory in env.gpus]
    return "\n".join(lines)
