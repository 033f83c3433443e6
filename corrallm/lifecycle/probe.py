"""The health probe every supervisor is given (SPEC §4 L1): one GET, the status code or
None; and `call`, any one request to a backend's own API (sleep and wake, W1; slot
caches, W2). It owns the one aiohttp session they share (never the hot path's client)."""

from __future__ import annotations

from typing import Any

import aiohttp

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2)


class HealthProbe:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, url: str) -> int | None:
        """One health poll: the status code, or None if nothing answered."""
        if self._session is None:
            self.open()
        assert self._session is not None
        try:
            async with self._session.get(url, timeout=PROBE_TIMEOUT) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def call(
        self, method: str, url: str, body: Any, within: float
    ) -> tuple[int | None, bytes]:
        """One request to a backend's management API: (status, body), or (None, b"") when
        nothing answered within `within` seconds."""
        if self._session is None:
            self.open()
        assert self._session is not None
        try:
            async with self._session.request(
                method, url, json=body, timeout=aiohttp.ClientTimeout(total=within)
            ) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None, b""
