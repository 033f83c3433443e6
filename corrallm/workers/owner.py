"""The owner of state's hop server (`serve --workers N`): a `WorkerLink` (held.py) per
connected worker, the brief each worker joins with, and what goes to every worker — the
config after a reload, the runtime keys when they change, a limited key's counts — or
is asked of every one: their metrics whenever /metrics is read (`TALLY`, answered by
`COUNTED`).

The config and the keys go out numbered, and each worker answers `APPLIED` with the
number once they are in force there: a reload or a key made, rotated or revoked is
answered to its caller only then (`in_force`), so that the caller's next request, on
whichever worker the kernel hands it to, meets the change.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corrallm.workers.held import WorkerLink
from corrallm.workers.hop import Kind, encode

if TYPE_CHECKING:
    from corrallm.auth.limits import Ask
    from corrallm.gateway import Gateway
    from corrallm.topology import Topology

log = logging.getLogger("corrallm.workers")

TALLY_SECONDS = 2.0  # how long /metrics waits for a worker's counts
APPLIED_SECONDS = 1.0  # how long a change's answer waits for every worker to apply it


@dataclass(frozen=True)
class Brief:
    """What a worker is told when it joins: enough to serve exactly as the owner would."""

    config: Any  # corrallm.config.Config (pickled across)
    addr: str
    admin_token: str
    version: int
    keys: Any  # T2: KeyRing.runtime(), the keys made through the API and refused secrets
    db: str  # the store: an SQLite file's path or a PostgreSQL URL (its activity rows)


class Owner:
    """The hop server: a `WorkerLink` per connected worker, and the config pushed to each
    whenever the gateway swaps in a new topology (a reload)."""

    def __init__(self, gateway: Gateway, addr: str, admin_token: str) -> None:
        self.gateway = gateway
        self.addr, self.admin_token = addr, admin_token
        self.links: set[WorkerLink] = set()
        self.server: asyncio.AbstractServer | None = None
        self.joins: dict[int, asyncio.Event] = {}
        gateway.swapped.append(self._swapped)
        gateway.keys.changed.append(self._keys_changed)
        gateway.metrics.sources.append(self.tally)
        gateway.settling.append(self.in_force)
        self._keys_due = False
        self._asks = itertools.count(1)
        self._pushed = 0  # the number of the last config or keys sent to the workers
        self._waiting: list[tuple[int, asyncio.Future[None]]] = []

    def brief(self) -> bytes:
        gw = self.gateway
        brief = Brief(
            gw.config, self.addr, self.admin_token, gw.version, gw.keys.runtime(), str(gw.db)
        )
        return pickle.dumps(brief)

    async def listen(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: WorkerLink(self), path)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in list(self.links):
            if link.transport is not None:
                link.transport.close()

    def joined(self, link: WorkerLink) -> None:
        self.links.add(link)
        link.applied = self._pushed  # its brief holds everything pushed so far
        link.send(Kind.HELLO, 0, self.brief())
        log.info("worker %d (pid %d) joined", link.index, link.pid)

    def left(self, link: WorkerLink, held: int) -> None:
        self.links.discard(link)
        self.applied(link)  # no longer waited for
        if held:
            log.warning(
                "worker %d (pid %d) left holding %d requests: their slots are free",
                link.index,
                link.pid,
                held,
            )

    async def tally(self) -> None:
        """/metrics is read: every worker's metrics counted since it last sent them are
        added to the owner's first (`TALLY`, answered by `COUNTED`), so that a request
        answered before the scrape is in it. A worker that does not answer within
        TALLY_SECONDS is rendered as last heard."""
        loop = asyncio.get_running_loop()
        waits = []
        for link in self.links:
            ask = next(self._asks) & 0xFFFFFFFF or 1
            asked = link.asked[ask] = loop.create_future()
            waits.append(asked)
            link.send(Kind.TALLY, ask)
        if waits:
            _, late = await asyncio.wait(waits, timeout=TALLY_SECONDS)
            if late:
                log.warning("%d workers did not send their metrics for /metrics", len(late))

    def counts(self, asks: Sequence[Ask], headers: list[tuple[str, str]]) -> None:
        """T3: a key's counts as they are after this admission, for every worker: the
        x-ratelimit-* headers of an answer refused before the limits are asked (an
        unknown model's 404) are the last counts heard (no round trip for a head)."""
        counted = encode([[a.subject for a in asks], headers])
        for link in self.links:
            link.send(Kind.COUNTS, 0, counted)

    async def in_force(self) -> None:
        """Return once every worker has the config and keys pushed so far in force (or
        after APPLIED_SECONDS, logged: a worker that slow is stuck, and the change is
        the owner's all the same)."""
        if self._keys_due:
            self._push_keys()
        target = self._pushed
        if all(link.applied >= target for link in self.links):
            return
        applied = asyncio.get_running_loop().create_future()
        self._waiting.append((target, applied))
        try:
            await asyncio.wait_for(asyncio.shield(applied), APPLIED_SECONDS)
        except TimeoutError:
            late = sorted(link.index for link in self.links if link.applied < target)
            log.warning(
                "workers %s did not apply change %d within %g s", late, target, APPLIED_SECONDS
            )
        finally:
            if (target, applied) in self._waiting:
                self._waiting.remove((target, applied))

    def applied(self, link: WorkerLink) -> None:
        if not self._waiting:
            return
        slowest = min((link.applied for link in self.links), default=self._pushed)
        for target, applied in [w for w in self._waiting if w[0] <= slowest]:
            self._waiting.remove((target, applied))
            if not applied.done():
                applied.set_result(None)

    def _keys_changed(self) -> None:
        """T2: a key made, rotated or revoked (here, or by a gateway sharing the store):
        every worker gets the runtime keys as they are now, once per loop turn."""
        if self._keys_due or not self.links:
            return
        self._keys_due = True
        asyncio.get_running_loop().call_soon(self._push_keys)

    def _push_keys(self) -> None:
        if not self._keys_due:  # pushed already, by `in_force`
            return
        self._keys_due = False
        self._push(Kind.KEYS, pickle.dumps(self.gateway.keys.runtime()))

    def _swapped(self, topology: Topology) -> None:
        self._push(Kind.CONFIG, pickle.dumps(topology.config))

    def _push(self, kind: Kind, payload: bytes) -> None:
        self._pushed += 1
        for link in self.links:
            link.send(kind, self._pushed, payload)
