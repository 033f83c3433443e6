"""A peer's model as one backend of the gateway (SPEC §19 X1): `<model>@<peer>`.

The node owns its processes, memory and slots; the gateway never starts anything there.
So this endpoint is never spawned: it is ready while the peer is up and serves the model,
and its state is the model's best state on the peer (what routing and the views show).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from corrallm.lifecycle.description import Description, Kind
from corrallm.lifecycle.errors import PeerDown
from corrallm.lifecycle.state import State
from corrallm.peers import lanes
from corrallm.peers.catalog import PeerView, RemoteModel


@dataclass(eq=False)
class PeerEndpoint:
    kind: ClassVar[Kind] = "peer"

    id: str  # <model>@<peer>
    peer: PeerView
    model: str
    token: str
    in_flight: int = 0
    last_used: float = 0.0
    pid: None = None
    retired: bool = False  # the peer left the config, or stopped serving the model
    clock: Callable[[], float] = time.monotonic

    @property
    def base_url(self) -> str:
        return self.peer.url

    @property
    def remote(self) -> RemoteModel | None:
        return self.peer.models.get(self.model)

    @property
    def state(self) -> State:
        remote = self.remote
        if not self.peer.up or remote is None:
            return State.STOPPED
        return remote.state

    @property
    def last_error(self) -> str | None:
        return None if self.peer.up else self.peer.error

    def available(self) -> bool:
        remote = self.remote
        return self.peer.up and not self.retired and remote is not None and not remote.paused

    async def ensure_ready(self, cause: object = None) -> None:
        """The node starts its own backend when the request reaches it; here only a peer
        that is down (or no longer serves the model) refuses."""
        if not self.available():
            why = self.peer.error or "it does not serve this model now"
            raise PeerDown(
                f"peer '{self.peer.name}' ({self.peer.url}) cannot take '{self.model}': "
                f"{why}. Requests go to its other backends; it returns once its events "
                "stream reconnects (GET /api/v1/overview lists peers)."
            )

    async def load(self) -> None:
        await self.ensure_ready()

    def describe(self) -> Description:
        return Description(
            self.kind,
            self.state,
            self.base_url,
            node=self.peer.name,
            last_error=self.last_error,
            retired=self.retired,
        )

    def enter(self) -> bool:
        """Count a request in flight; False if the peer cannot take it now (then
        `ensure_ready` says why)."""
        if not self.available():
            return False
        self.in_flight += 1
        self._since_report(1)
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        self.last_used = self.clock()
        self._since_report(-1)

    def _since_report(self, change: int) -> None:
        """X2: the peer's last report of its load lags; ours is known at once."""
        remote = self.remote
        if remote is not None:
            remote.since_report += change

    def hop_headers(self, group: str, method: str, path: str) -> dict[str, str]:
        """X3: the caller's lane, signed with the peer's token (never the caller's key)
        for this one request: its method and path, and a fresh nonce (T5)."""
        return lanes.sign(self.token, group, method, path, time.time())

    def rank(self) -> tuple[int, float]:
        """X2: ready with a free slot first, then the shortest expected wait."""
        remote = self.remote
        if remote is None:
            return (1, float("inf"))
        return (0, 0.0) if remote.free_slot() else (1, remote.expected_wait())
