"""A backend's captured output: a bounded ring buffer, a log file, and what we parse from it.

llama-server reports its context and slots in several formats across versions
(`n_ctx = 4096`, `n_slots = 2, n_ctx_slot = 256`, `initializing slots, n_slots = 4`…);
the last value seen wins, because a restart prints them again. Per-slot lines
(`new slot, n_ctx = 256`, `| task -1 |`) never stand for the whole context; where only
the slot context is printed, the whole is slot context times slots, unless the KV cache
is unified (`kv_unified = 'true'`: then every slot sees the whole context).
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

_N_CTX = re.compile(r"\bn_ctx\s*[=:]\s*(\d+)")
_N_CTX_SLOT = re.compile(r"\bn_ctx_slot\s*[=:]\s*(\d+)")
_N_SLOTS = re.compile(r"\bn_slots\s*[=:]\s*(\d+)")
_TOTAL_SLOTS = re.compile(r"\btotal_slots\s*[=:]\s*(\d+)")
_KV_UNIFIED = re.compile(r"\bkv_unified\s*=\s*'?(true|false)'?")


class LogBuffer:
    def __init__(self, path: Path | None, max_lines: int = 2000) -> None:
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.n_slots: int | None = None
        self._n_ctx: int | None = None  # the whole context, as printed
        self._n_ctx_slot: int | None = None
        self._unified = False
        self._path = path
        self._file: TextIO | None = None
        self.listeners: list[Callable[[str], None]] = []  # e.g. the live event stream

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
        for listener in self.listeners:
            listener(line)

    def tail(self, n: int = 20) -> list[str]:
        if n <= 0:
            return []
        return list(self.lines)[-n:]

    @property
    def n_ctx(self) -> int | None:
        if self._n_ctx is not None:
            return self._n_ctx
        if self._n_ctx_slot is None or self.n_slots is None:
            return None
        return self._n_ctx_slot if self._unified else self._n_ctx_slot * self.n_slots

    def _parse(self, line: str) -> None:
        if "n_ctx" in line:
            if match := _N_CTX_SLOT.search(line):
                self._n_ctx_slot = int(match.group(1))
            per_slot = "| task" in line or "new slot" in line
            if not per_slot and (match := _N_CTX.search(line)):
                self._n_ctx = int(match.group(1))
        if "kv_unified" in line and (match := _KV_UNIFIED.search(line)):
            self._unified = match.group(1) == "true"
        if "slots" in line and (match := _N_SLOTS.search(line) or _TOTAL_SLOTS.search(line)):
            self.n_slots = int(match.group(1))
