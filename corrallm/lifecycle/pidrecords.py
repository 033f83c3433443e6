"""PID records under `<home>/run/`: what lets a restarted corrallm find the backends it left.

A record holds the pid, process group, psutil create time (so a recycled pid is never
mistaken for ours), the port and the health URL. After a crash of corrallm a recorded
backend is re-adopted only if its health check answers; otherwise its group is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from corrallm.lifecycle.process import create_time
from corrallm.store.home import open_private


@dataclass(frozen=True)
class PidRecord:
    backend: str
    pid: int
    pgid: int
    started: float
    port: int | None
    base_url: str
    health_url: str
    cmd: str
    asleep: bool = False  # W1: re-adopted asleep, not ready

    def is_alive(self) -> bool:
        """The recorded process still runs and is the very one we started."""
        return create_time(self.pid) == self.started


def file_name(name: str) -> str:
    """A backend id made safe to use as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class PidRecords:
    def __init__(self, home: Path) -> None:
        self.folder = home / "run"

    def path(self, backend: str) -> Path:
        return self.folder / f"{file_name(backend)}.json"

    def write(self, record: PidRecord) -> None:
        tmp = self.path(record.backend).with_suffix(".tmp")
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)  # T5: 0600, in a 0700 folder
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(asdict(record)))
        tmp.replace(self.path(record.backend))

    def read(self, backend: str) -> PidRecord | None:
        return self._load(self.path(backend))

    def remove(self, backend: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(backend).unlink()

    def all(self) -> list[PidRecord]:
        if not self.folder.is_dir():
            return []
        records = (self._load(p) for p in sorted(self.folder.glob("*.json")))
        return [r for r in records if r is not None]

    def _load(self, path: Path) -> PidRecord | None:
        try:
            return PidRecord(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            path.unlink(missing_ok=True)  # a torn or foreign file: nothing we can act on
            return None
