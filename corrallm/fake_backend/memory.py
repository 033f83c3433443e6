"""Resident memory standing in for a model's weights (--hold-mb, --asleep-mb)."""

from __future__ import annotations

import mmap

MIB = 1024 * 1024
PAGE = mmap.PAGESIZE


class HeldMemory:
    """An anonymous mapping of some MiB, every page written so that it is resident.

    Resizing unmaps the old block first, so the process's RSS really drops when it shrinks
    (an anonymous mapping goes back to the kernel at once; a freed heap block may not).
    """

    def __init__(self) -> None:
        self._block: mmap.mmap | None = None

    @property
    def mib(self) -> int:
        return 0 if self._block is None else len(self._block) // MIB

    def resize(self, mib: int) -> None:
        if mib == self.mib:
            return
        if self._block is not None:
            self._block.close()
            self._block = None
        if mib > 0:
            block = mmap.mmap(-1, mib * MIB)
            block[::PAGE] = b"\x01" * (len(block) // PAGE)
            self._block = block
