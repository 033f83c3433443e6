"""The peers of this gateway (SPEC §19): one long-lived owner of what is known of them.

It follows each configured peer (`follower.py`), keeps one `PeerEndpoint` per peer and
model across topology rebuilds (so counts in flight survive them), and tells the gateway
when the routes must be rebuilt (a peer's models changed) and when a peer went down (its
requests are moved off it) or came back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from corrallm.config import Config
from corrallm.config.schema import Peer
from corrallm.peers.catalog import PeerView
from corrallm.peers.endpoint import PeerEndpoint
from corrallm.peers.follower import Follower


class Nodes:
    def __init__(
        self,
        rebuild: Callable[[], None],
        moved: Callable[[PeerView], None],
    ) -> None:
        self._rebuild, self._moved = rebuild, moved  # moved: up <-> down
        self.views: dict[str, PeerView] = {}
        self.endpoints: dict[str, PeerEndpoint] = {}
        self._configs: dict[str, Peer] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._timeout = 5.0

    def endpoint(self, peer: str, model: str) -> PeerEndpoint:
        """The one endpoint of `model` on `peer`, made on first use."""
        key = f"{model}@{peer}"
        endpoint = self.endpoints.get(key)
        if endpoint is None or endpoint.retired:
            endpoint = PeerEndpoint(key, self.views[peer], model, self._configs[peer].token)
            self.endpoints[key] = endpoint
        return endpoint

    def kept(self, route_ids: set[str]) -> None:
        """After a rebuild: endpoints no route uses any more are retired (never reused)."""
        for key, endpoint in list(self.endpoints.items()):
            if key not in route_ids:
                endpoint.retired = True
                del self.endpoints[key]

    def reconfigure(self, config: Config) -> None:
        """Follow the config's peers: new ones start, removed or changed ones stop. A new
        `peerTimeout` restarts the followers of the others (each watches its peer's
        silence with it), their views kept: a peer stays up across it."""
        retimed = config.peer_timeout != self._timeout
        self._timeout = config.peer_timeout
        for name in list(self._configs):
            if config.peers.get(name) != self._configs[name]:
                self._stop(name)
            elif retimed and name in self._tasks:
                self._tasks.pop(name).cancel()
                self._start(name)
        for name, peer in config.peers.items():
            if name not in self._configs:
                self._configs[name] = peer
                self.views[name] = PeerView(name, peer.url.rstrip("/"))
                if self._session is not None:
                    self._start(name)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        for name in self._configs:
            self._start(name)

    async def close(self) -> None:
        for name in list(self._tasks):
            task = self._tasks.pop(name)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _start(self, name: str) -> None:
        assert self._session is not None
        follower = Follower(
            self.views[name], self._configs[name].token, self._timeout, self._session, self._changed
        )
        self._tasks[name] = asyncio.create_task(follower.run(), name=f"corrallm-peer-{name}")

    def suspect(self, view: PeerView, error: str) -> None:
        """A request could not reach the peer (its connection failed before any answer):
        it is down now, not once its events stream notices, and its stream is opened
        again (it is up again at once if it answers)."""
        if view.name not in self._tasks or not view.up:
            return
        self._tasks.pop(view.name).cancel()
        view.up, view.error = False, error
        self._changed(view, False, True)
        self._start(view.name)

    def _stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        del self._configs[name]
        view = self.views.pop(name)
        view.up = False
        for key, endpoint in list(self.endpoints.items()):
            if endpoint.peer is view:  # a changed peer is a new view: never reused
                endpoint.retired = True
                del self.endpoints[key]

    def _changed(self, view: PeerView, shape: bool, moved: bool) -> None:
        if shape:
            self._rebuild()
        if moved:
            self._moved(view)
