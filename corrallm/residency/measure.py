"""R5: what a backend's process group really holds on each GPU, read through NVML.

NVML comes with the optional `gpu` extra (nvidia-ml-py). Pools named `gpu<N>` map to
NVML device N. Without NVML (no extra, no driver, no GPU) there is no reader and only
the declared `ramUsage` is shown.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Protocol

import psutil

log = logging.getLogger("corrallm.residency")


class MemoryReader(Protocol):
    def read(self, pid: int) -> dict[str, int] | None:
        """Bytes held per pool by the process `pid` and its descendants."""
        ...


class NvmlReader:
    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._count = nvml.nvmlDeviceGetCount()

    def read(self, pid: int) -> dict[str, int] | None:
        pids = {pid}
        with contextlib.suppress(psutil.Error):
            pids.update(p.pid for p in psutil.Process(pid).children(recursive=True))
        held: dict[str, int] = {}
        for index in range(self._count):
            handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory:
                    held[f"gpu{index}"] = held.get(f"gpu{index}", 0) + int(proc.usedGpuMemory)
        return held


def nvml_reader() -> MemoryReader | None:
    """The NVML reader when a driver answers, else None (declared sizes only)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return NvmlReader(pynvml)
    except Exception as exc:  # no extra installed, no driver, no GPU: all mean "no reader"
        log.info("no GPU memory reader (NVML unavailable: %s); showing declared ramUsage", exc)
        return None
