"""Following one peer (SPEC §19 X2, X4): its overview, then its events stream.

The events stream is subscribed first and the overview read after, so that no change
falls between the two. The stream is asked for a heartbeat a third of `peerTimeout`
apart, and a read that sees nothing for `peerTimeout` marks the peer down (a node killed
outright is seen at once: its connection closes). A down peer is retried with back-off
and is up again once its stream reconnects. The overview is read again when an event
names a backend not known (the peer's config changed) and every `REFRESH` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from corrallm.peers.catalog import PeerView

log = logging.getLogger("corrallm.peers")

REFRESH = 10.0  # seconds between overview reads while the stream is up
BACKOFF_FIRST, BACKOFF_MAX = 0.2, 5.0
KINDS = "lifecycle,admission"

Changed = Callable[[PeerView, bool, bool], None]  # (peer, its routes' shape changed, up/down)


class Follower:
    def __init__(
        self,
        view: PeerView,
        token: str,
        timeout: float,
        session: aiohttp.ClientSession,
        changed: Changed,
    ) -> None:
        self.view, self.token, self.timeout = view, token, timeout
        self.session, self.changed = session, changed
        self._auth = {"Authorization": f"Bearer {token}"}

    async def run(self) -> None:
        backoff = BACKOFF_FIRST
        while True:
            began = time.monotonic()
            try:
                if await self._follow():
                    # T5: the node closed the stream because this gateway fell behind
                    # reading it; the peer is up: follow it again at once.
                    name = self.view.name
                    log.warning("peer=%s events stream overflowed: following it again", name)
                    backoff = BACKOFF_FIRST
                    continue
                error = "its events stream ended"
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError) as exc:
                error = _describe(exc, self.timeout)
            self._down(error)
            if time.monotonic() - began > BACKOFF_MAX:
                backoff = BACKOFF_FIRST  # it was up a while: this is a new outage
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _follow(self) -> bool:
        """Follow the node's events until the stream ends; True if it ended because
        this gateway fell too far behind (`overflow`)."""
        url = f"{self.view.url}/api/v1/events"
        params = {"kinds": KINDS, "heartbeat": f"{self.timeout / 3:.3f}"}
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeout, sock_connect=self.timeout, sock_read=self.timeout
        )
        async with self.session.get(
            url, params=params, headers=self._auth, timeout=timeout
        ) as stream:
            _check(stream, url)
            await self._read_overview()
            refreshed = time.monotonic()
            kind, data = "", b""
            async for raw in stream.content:
                line = raw.rstrip(b"\r\n")
                if line.startswith(b"event:"):
                    kind = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    data = line[5:].strip()
                elif not line and kind:
                    if kind == "overflow":
                        return True
                    stale = not self.view.apply_event(kind, orjson.loads(data))
                    if stale or time.monotonic() - refreshed > REFRESH:
                        await self._read_overview()
                        refreshed = time.monotonic()
                    kind, data = "", b""
        return False

    async def _read_overview(self) -> None:
        url = f"{self.view.url}/api/v1/overview"
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self.session.get(url, headers=self._auth, timeout=timeout) as response:
            _check(response, url)
            overview = orjson.loads(await response.read())
        before = self.view.shape()
        was_up = self.view.up
        self.view.apply_overview(overview)
        self.view.up, self.view.error = True, None
        if not was_up:
            log.info(
                "peer=%s up url=%s models=%d", self.view.name, self.view.url, len(self.view.models)
            )
        self.changed(self.view, before != self.view.shape() or not was_up, not was_up)

    def _down(self, error: str) -> None:
        self.view.error = error
        if self.view.up:
            self.view.up = False
            log.warning("peer=%s down url=%s: %s", self.view.name, self.view.url, error)
            self.changed(self.view, False, True)


def _check(response: aiohttp.ClientResponse, url: str) -> None:
    if response.status == 401:
        raise ValueError(
            f"{url} refused the token (401): set peers.<name>.token to its admin token"
        )
    if response.status != 200:
        raise ValueError(f"{url} answered {response.status}")


def _describe(exc: BaseException, timeout: float) -> str:
    """Why the peer is down, in an operator's words (aiohttp's own are for developers)."""
    if isinstance(exc, TimeoutError):
        return f"no answer for {timeout:g}s (peerTimeout)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to {exc.host}:{exc.port} ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return "its events stream broke off (the node closed the connection or died)"
    return str(exc) or type(exc).__name__
