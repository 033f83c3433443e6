"""R5, M2: what a backend's process group really holds, read after each load.

- `system`: the resident set (RSS) of the process and all its descendants (psutil), always;
- `gpu<N>`: per NVML device N, the GPU memory its processes hold, where NVML answers
  (the optional `gpu` extra, nvidia-ml-py, a driver and a GPU).

The residency maps these names onto its server's pools (`gpu<N>` is the pool whose name
ends in N, M3) and keeps only pools the server has. Every read here blocks (it walks
/proc, NVML calls the driver): the residency runs them in a worker thread.

`command_key` names what a footprint is learned for: a backend's command line and the
rest of its placement-independent spec; a changed cmd is a new key (M2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from typing import Any, Protocol

import psutil

from corrallm.config.schema import ProcessSpec

log = logging.getLogger("corrallm.residency")

SYSTEM_POOL = "system"


class MemoryReader(Protocol):
    def read(self, pid: int) -> dict[str, int] | None:
        """Bytes held per pool by the process `pid` and its descendants."""
        ...


def _family(pid: int) -> list[psutil.Process]:
    """The process and its descendants (those alive now)."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    family = [root]
    with contextlib.suppress(psutil.Error):
        family += root.children(recursive=True)
    return family


class RssReader:
    """The `system` pool: the summed RSS of the process and its descendants."""

    def read(self, pid: int) -> dict[str, int] | None:
        total = 0
        for proc in _family(pid):
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return {SYSTEM_POOL: total} if total else None


class NvmlReader:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._count = nvml.nvmlDeviceGetCount()

    def read(self, pid: int) -> dict[str, int] | None:
        pids = {p.pid for p in _family(pid)} | {pid}
        held: dict[str, int] = {}
        for index in range(self._count):
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory:
                    held[f"gpu{index}"] = held.get(f"gpu{index}", 0) + int(proc.usedGpuMemory)
        return held


class Readers:
    """Several readers as one: each pool from whichever reader reports it."""

    def __init__(self, *readers: MemoryReader) -> None:
        self.readers = readers

    def read(self, pid: int) -> dict[str, int] | None:
        held: dict[str, int] = {}
        for reader in self.readers:
            held.update(reader.read(pid) or {})
        return held or None


def nvml_reader() -> MemoryReader | None:
    """The NVML reader when a driver answers, else None (no GPU memory is measured)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return NvmlReader(pynvml)
    except Exception as exc:  # no extra installed, no driver, no GPU: all mean "no reader"
        log.info("no GPU memory reader (NVML unavailable: %s); measuring system RSS only", exc)
        return None


def memory_reader() -> MemoryReader:
    """What the gateway measures with: RSS always, NVML where it answers. Blocks (NVML's
    init): call it in a worker thread."""
    gpu = nvml_reader()
    return RssReader() if gpu is None else Readers(RssReader(), gpu)


def visible_gpu(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of a running process (a re-adopted one, whose placement this
    run of corrallm did not choose); None when unreadable or unset."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES")
    return None


def command_key(spec: ProcessSpec) -> str:
    """What a learned footprint is kept under, beside the backend id: a hash of how the
    process is run (cmd with its `${PORT}`/`${GPU}` placeholders, env, cwd, supervision)."""
    what = {
        "cmd": spec.cmd,
        "env": dict(sorted(spec.env.items())),
        "cwd": spec.cwd,
        "supervision": spec.supervision,
        "docker": spec.docker_container,
        "systemd": spec.systemd_unit,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
