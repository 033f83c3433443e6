"""Small writes to a shared store, off the request path (SPEC §19 X5): settlements of
spend reservations (store/spend.py) and of rate-limit reservations (store/rates.py).

`queue` only appends (no I/O where a request is served); a task started on demand
writes everything queued in one transaction, and whatever arrived meanwhile in the next.
A failed write is kept and tried again (the database may be down: the writes reach it
once it is back). At shutdown `flush` waits a bounded time for the last of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from corrallm.store.db import Store

log = logging.getLogger("corrallm.store")

RETRY_SECONDS = 1.0  # a failed write is tried again after this long
FLUSH_SECONDS = 5.0  # how long shutdown waits for the last writes


class QueuedWrites:
    """Rows for a fixed set of statements, written in batches, in the statements' order."""

    def __init__(self, store: Store, statements: Sequence[str], what: str) -> None:
        self.store = store
        self.what = what  # for the log: whose writes these are
        self._rows: dict[str, list[Sequence[Any]]] = {sql: [] for sql in statements}
        self._writer: asyncio.Task[None] | None = None

    def queue(self, sql: str, row: Sequence[Any]) -> None:
        self._rows[sql].append(row)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._drain())

    @property
    def pending(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    async def flush(self) -> None:
        """Write what is queued (at shutdown), waiting FLUSH_SECONDS at most."""
        if not self.pending and (self._writer is None or self._writer.done()):
            return
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._drain())
        await asyncio.wait({self._writer}, timeout=FLUSH_SECONDS)
        if not self._writer.done():
            self._writer.cancel()
            log.warning("%s: %d settlements not written at shutdown", self.what, self.pending)

    async def _drain(self) -> None:
        while self.pending:
            try:
                await self._write()
            except Exception as exc:
                log.warning(
                    "%s: writing %d settlements failed: %s; retrying", self.what, self.pending, exc
                )
                await asyncio.sleep(RETRY_SECONDS)

    async def _write(self) -> None:
        taken = {sql: rows for sql, rows in self._rows.items() if rows}
        if not taken:
            return
        for sql in taken:
            self._rows[sql] = []
        try:
            await self.store.execute_batches(list(taken.items()))
        except BaseException:
            for sql, rows in taken.items():
                self._rows[sql][:0] = rows
            raise
