"""Request bodies read into memory (SPEC §22 T5): how long a body may stall, and how many
body bytes all requests together may hold at once.

Every surface that reads a body whole (/v1 and its audio uploads, reservations,
`/upstream`, the dashboard's sign-in) reads it through one `Bodies`, so one bound covers
them all. Two limits, read once at startup (`BodyLimits.from_env`, documented in
docs/config.md "Environment variables"):

- **body timeout** (`CORRALLM_BODY_TIMEOUT`, 15 s): a body that sends nothing this long
  gets 408 `body_timeout` and its connection is closed. Idle time, not total: a large
  upload that keeps moving is never cut.
- **body memory** (`CORRALLM_MAX_BODY_MEMORY`, 256 MiB): the body bytes received and not
  yet given back, across all requests. A request arriving when the bound is reached, or
  whose body would cross it, gets 503 `server_busy` with `Retry-After`. Only bytes
  actually received count (a declared Content-Length costs an attacker nothing to send,
  so reserving it up front would let headers alone lock everyone out).

A body is held until its request is over (the pipeline may forward it again after a
reload or a preemption), so the reader gives its bytes back (`release`) when the request
ends, not when the body is read.

Cost on the hot path: an int add and a comparison per body, an int subtract at the end.
A body that arrived with its head (nearly all of them) is read without a timer: the
connection says it is there (`Connection.body_ready`); only a body still on its way is
awaited under a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from corrallm.config.units import env_value, format_size, parse_size
from corrallm.http.asgi import CONNECTION, ClientGone, Message, Receive, Scope, header
from corrallm.http.errors import ApiError

DEFAULT_BODY_TIMEOUT = 15.0
DEFAULT_MAX_BODY_MEMORY = 256 * 2**20
RETRY_AFTER_SECONDS = 1  # bodies are given back as requests end: soon, as a rule
# Closing the connection after an answer sent before the body was read: what is left of
# the body would otherwise be parsed as the next request's bytes or waited for.
_CLOSE = {"connection": "close"}


@dataclass(frozen=True)
class BodyLimits:
    timeout: float = DEFAULT_BODY_TIMEOUT
    max_memory: int = DEFAULT_MAX_BODY_MEMORY

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> BodyLimits:
        """`CORRALLM_BODY_TIMEOUT` (seconds) and `CORRALLM_MAX_BODY_MEMORY` (a size:
        `256MiB`, `1GB`, bytes); ValueError naming the variable when one is bad."""
        timeout = env_value(env, "CORRALLM_BODY_TIMEOUT", float, "a positive number of seconds")
        memory = env_value(
            env, "CORRALLM_MAX_BODY_MEMORY", parse_size, "a size above 0 such as 256MiB or 1GB"
        )
        return cls(
            DEFAULT_BODY_TIMEOUT if timeout is None else timeout,
            DEFAULT_MAX_BODY_MEMORY if memory is None else memory,
        )


class Bodies:
    """The one reader of request bodies and the owner of the bytes they hold."""

    def __init__(self, limits: BodyLimits | None = None) -> None:
        self.limits = limits or BodyLimits()
        self.held = 0  # body bytes received and not given back, all requests together

    async def read(self, scope: Scope, receive: Receive, limit: int, what: str) -> bytes:
        """The whole body, at most `limit` bytes (`what` names that limit in the 413). The
        caller owns `len(body)` bytes of the bound until it calls `release`; on any error
        raised here nothing is left held."""
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit, what)
        if self.held >= self.limits.max_memory:
            raise self._busy()
        connection = scope.get(CONNECTION)
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                if connection is not None and connection.body_ready():
                    message = await receive()  # there already: no timer needed
                else:
                    message = await self._waited(receive)
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk: bytes = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    self.held += len(chunk)
                    if size > limit:
                        raise too_large(limit, what)
                    if self.held > self.limits.max_memory:
                        raise self._busy()
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except BaseException:
            self.held -= size
            raise

    def release(self, size: int) -> None:
        """A request is over: its body's bytes no longer count."""
        self.held -= size

    async def _waited(self, receive: Receive) -> Message:
        timeout = self.limits.timeout
        try:
            async with asyncio.timeout(timeout):
                return await receive()
        except TimeoutError:
            raise ApiError(
                408,
                f"The request body sent nothing for {timeout:g} seconds "
                "(CORRALLM_BODY_TIMEOUT); send the whole body without pausing.",
                code="body_timeout",
                headers=dict(_CLOSE),
            ) from None

    def _busy(self) -> ApiError:
        bound = self.limits.max_memory
        return ApiError(
            503,
            f"corrallm holds as many request-body bytes as it may at once ({format_size(bound)}, "
            "CORRALLM_MAX_BODY_MEMORY); retry shortly, or raise CORRALLM_MAX_BODY_MEMORY.",
            code="server_busy",
            headers={"retry-after": str(RETRY_AFTER_SECONDS), **_CLOSE},
        )


def too_large(limit: int, what: str) -> ApiError:
    return ApiError(
        413,
        f"The request body is larger than {what} ({limit} bytes). "
        f"Send a smaller body or raise {what} in the config.",
        code="body_too_large",
        headers=dict(_CLOSE),
    )
