"""A backend's captured output: a bounded ring buffer, a log file, and what we parse from it.

llama-server reports its context and slots in several formats across versions
(`n_ctx = 4096`, `n_slots = 2, n_ctx_slot = 256`, `initializing slots, n_slots = 4`…);
the last value seen wins, because a restart prints them again.
"""

from __future__ import annotations

import re
import time
from collections import deque
from pathlib import Path
from typing import TextIO

_N_CTX = re.compile(r"\bn_ctx\s*[=:]\s*(\d+)")
_N_CTX_SLOT = re.compile(r"\bn_ctx_slot\s*[=:]\s*(\d+)")
_N_SLOTS = re.compile(r"\bn_slots\s*[=:]\s*(\d+)")
_TOTAL_SLOTS = re.compile(r"\btotal_slots\s*[=:]\s*(\d+)")


class LogBuffer:
    def __init__(self, path: Path | None, max_lines: int = 2000) -> None:
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.n_ctx: int | None = None
        self.n_slots: int | None = None
        self._n_ctx_slot: int | None = None
        self._path = path
        self._file: TextIO | None = None

    def open(self) -> None:
        if self._path is not None and self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a", buffering=1, encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def note(self, text: str) -> None:
        """A line of corrallm's own about this backend (spawn, exit, health)."""
        self.append(f"[corrallm {time.strftime('%H:%M:%S')}] {text}")

    def append(self, line: str) -> None:
        line = line.rstrip("\r\n")
        self.lines.append(line)
        if self._file is not None:
            self._file.write(line + "\n")
        self._parse(line)

    def tail(self, n: int = 20) -> list[str]:
        if n <= 0:
            return []
        return list(self.lines)[-n:]

    def _parse(self, line: str) -> None:
        if "n_ctx" in line:
            if match := _N_CTX_SLOT.search(line):
                self._n_ctx_slot = int(match.group(1))
            if match := _N_CTX.search(line):
                self.n_ctx = int(match.group(1))
        if "slots" in line and (match := _N_SLOTS.search(line) or _TOTAL_SLOTS.search(line)):
            self.n_slots = int(match.group(1))
        # Builds that print only the per-slot context: the whole is slot context times slots.
        if self.n_ctx is None and self._n_ctx_slot is not None and self.n_slots is not None:
            self.n_ctx = self._n_ctx_slot * self.n_slots
