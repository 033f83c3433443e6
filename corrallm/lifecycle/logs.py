"""A backend's output: its log file, a bounded ring buffer, and what we parse from it.

The backend writes its stdout and stderr straight to `<home>/logs/<backend>.log` (see
`process.spawn`), so its output outlives corrallm; the supervisor's own lines (spawn, exit,
health) go to the same file. `LogBuffer` follows the file: small reads of what was added
since the last look (`catch_up`, every `FOLLOW_SECONDS` in `follow()`, and at each
transition), each new line going to the ring buffer, the parsers and the listeners (the
live event stream). Our own lines are in the ring already and are skipped when read back.
Following starts at the file's end, so a re-adopted backend's earlier output is not
replayed. A reader that falls more than `MAX_BACKLOG` behind skips to the newest output.

llama-server reports its context and slots in several formats across versions
(`n_ctx = 4096`, `n_slots = 2, n_ctx_slot = 256`, `initializing slots, n_slots = 4`…);
the last value seen wins, because a restart prints them again. Per-slot lines
(`new slot, n_ctx = 256`, `| task -1 |`) never stand for the whole context; where only
the slot context is printed, the whole is slot context times slots, unless the KV cache
is unified (`kv_unified = 'true'`: then every slot sees the whole context).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from corrallm.store.home import open_private

_N_CTX = re.compile(r"\bn_ctx\s*[=:]\s*(\d+)")
_N_CTX_SLOT = re.compile(r"\bn_ctx_slot\s*[=:]\s*(\d+)")
_N_SLOTS = re.compile(r"\bn_slots\s*[=:]\s*(\d+)")
_TOTAL_SLOTS = re.compile(r"\btotal_slots\s*[=:]\s*(\d+)")
_KV_UNIFIED = re.compile(r"\bkv_unified\s*=\s*'?(true|false)'?")

FOLLOW_SECONDS = 0.1  # how often a running backend's new output is read
MAX_BACKLOG = 1 << 20  # read at most this much per look; further behind, skip to the newest
MAX_LINE = 1 << 16  # a longer line without a newline is taken in pieces
_ECHO_WINDOW = 8  # how far ahead an own line is looked for when it is read back


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
        # Bytes of output taken in so far, finished lines or not (a progress bar without
        # line ends counts): how a start shows it is not stalled (SPEC §17 M5).
        self.received = 0
        # Following the file: where we are, a line not finished yet, our own lines not yet
        # read back (skipped when they are).
        self._reader: int | None = None
        self._offset = 0
        self._partial = b""
        self._resync = False
        self._ours: deque[str] = deque()

    @property
    def path(self) -> Path | None:
        return self._path

    def open(self) -> None:
        """Open the file for our own lines and start following it from its current end."""
        if self._path is not None and self._file is None:
            fd = open_private(self._path, os.O_WRONLY | os.O_APPEND)  # T5: 0600
            self._file = os.fdopen(fd, "a", buffering=1, encoding="utf-8")
            if self._reader is None:
                self._reader = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                self._offset = os.fstat(self._reader).st_size
                self._partial, self._resync = b"", False
                self._ours.clear()

    def close(self) -> None:
        self.catch_up()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._reader is not None:
            os.close(self._reader)
            self._reader = None

    def note(self, text: str) -> None:
        """A line of corrallm's own about this backend (spawn, exit, health)."""
        self.append(f"[corrallm {time.strftime('%H:%M:%S')}] {text}")

    def append(self, line: str) -> None:
        """Lines of ours (or a starter's output): to the ring, the parsers and the file.

        What the backend wrote before is taken first, and our line is read back at once
        (and skipped), so the ring keeps the file's order."""
        self.catch_up()
        for part in line.rstrip("\r\n").split("\n"):
            part = part.rstrip("\r")
            if self._file is not None:
                self._file.write(part + "\n")
                if self._reader is not None:
                    self._ours.append(part)
            else:
                self.received += len(part) + 1
            self._take(part)
        self.catch_up()

    def catch_up(self) -> None:
        """Take in what was written to the file since the last look (one bounded read)."""
        fd = self._reader
        if fd is None:
            return
        size = os.fstat(fd).st_size
        if size < self._offset:  # truncated under us: start again from its beginning
            self._offset, self._partial, self._resync = 0, b"", False
            self._ours.clear()
        if size - self._offset > MAX_BACKLOG:  # too far behind: the newest output matters
            self._offset, self._partial, self._resync = size - MAX_BACKLOG, b"", True
            self._ours.clear()
        if size > self._offset:
            chunk = os.pread(fd, size - self._offset, self._offset)
            self._offset += len(chunk)
            self._feed(chunk)

    async def follow(self, interval: float = FOLLOW_SECONDS) -> None:
        """Follow the file until cancelled (while a process we own writes to it)."""
        while True:
            self.catch_up()
            await asyncio.sleep(interval)

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

    def _feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        *complete, rest = (self._partial + chunk).split(b"\n")
        if self._resync and complete:  # after a skip: the first piece is half a line
            complete, self._resync = complete[1:], False
        elif self._resync:
            rest = b""
        if len(rest) > MAX_LINE:
            complete.append(rest)
            rest = b""
        self._partial = rest
        for raw in complete:
            self._read_back(raw.decode("utf-8", "replace").rstrip("\r"))

    def _read_back(self, line: str) -> None:
        ours = self._ours
        for i in range(min(len(ours), _ECHO_WINDOW)):
            if ours[i] == line:  # one of our own lines, already taken when written
                for _ in range(i + 1):
                    ours.popleft()
                return
        self._take(line)

    def _take(self, line: str) -> None:
        self.lines.append(line)
        self._parse(line)
        for listener in self.listeners:
            listener(line)

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
