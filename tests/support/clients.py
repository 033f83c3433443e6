"""SDK clients a test makes in helpers, closed when the test ends (tests/conftest.py).

An `openai.OpenAI` or `anthropic.Anthropic` keeps its kept-alive connections in a pool;
dropped unclosed, its sockets are finalized whenever the garbage collector runs, in
whichever test is running then, where `filterwarnings = error` turns the ResourceWarning
into that other test's error."""

from __future__ import annotations

from typing import Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)
_OPEN: list[Closable] = []


def closed_at_end(client: C) -> C:
    """`client`, closed when the test that made it ends."""
    _OPEN.append(client)
    return client


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()
