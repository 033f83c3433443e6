"""The request in hand (SPEC §21 O1/O2): its id, and the capture of its exchange.

The ASGI app opens an `Exchange` for each /v1 request before its codec runs and makes it
current for the request's task (a context variable, so that no codec has to pass it on);
the pipeline reads it to name the request, and the app's `send` wrapper puts the same id
in `X-Corrallm-Request-Id` on every answer (with the headers the pipeline left in
`headers`) and feeds the capture what goes out.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from corrallm.auth.callers import Caller
    from corrallm.cost.ledger import Visit

HEADER = b"x-corrallm-request-id"

# Ids are unique across restarts without a clock or a lookup: a random prefix per process
# and a counter (a uuid4 costs several times as much, on every request).
_PREFIX = secrets.token_hex(4)
_NUMBERS = itertools.count(1)


def new_request_id() -> str:
    return f"{_PREFIX}{next(_NUMBERS):08x}"


class Tee(Protocol):
    """What the app's send wrapper feeds a capture (`captures.Capture`)."""

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def body(self, chunk: bytes) -> None: ...


@dataclass(slots=True)
class Exchange:
    id: str
    scope: MutableMapping[str, Any] | None = None  # the request's ASGI scope (E2: its headers)
    capture: Tee | None = None
    visit: Visit | None = None  # set by the pipeline once the request is admitted to it
    answered: bool = False  # the head of an answer went out to the client
    # SPEC §19 X3: it came from another gateway (it carries X-Corrallm-Lane headers), and
    # the lane those headers name if their signature checked out.
    hop: bool = False
    lane: str | None = None
    # SPEC §22 T5: who is calling, judged from the head before any body byte is read.
    caller: Caller | None = None
    # T4: the user behind the caller's key, where the key may name one (auth.userHeader).
    user: str | None = None
    # Headers the pipeline adds to the answer's head, whatever the answer (T3: the key's
    # x-ratelimit-* counts); the app's send wrapper puts them there.
    headers: list[tuple[bytes, bytes]] | None = None
    # T3: a key with limits whose request was answered before they counted it (a 400,
    # 403, 404...): its counts as they are, read only if such an answer starts (a
    # `functools.partial`, made in C: nothing is read for the requests that are counted).
    counts: Callable[[], list[tuple[bytes, bytes]]] | None = None


CURRENT: ContextVar[Exchange | None] = ContextVar("corrallm_exchange", default=None)


def answer_begun() -> bool | None:
    """Whether the request in hand has sent its client the head of an answer (None: no
    exchange was opened for it, as for a realtime session)."""
    exchange = CURRENT.get()
    return None if exchange is None else exchange.answered
