"""A finished span as corrallm makes it (observe/traces.py), and where it goes (`Sink`:
observe/otlp.py hands it to the OpenTelemetry SDK). Apart from both so that neither
imports the other: the SDK's side is loaded only when traces are on (SPEC §23 E2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

Kind = Literal["server", "client", "internal"]
Attributes = dict[str, str | int]


class SpanRecord(NamedTuple):
    """One finished span, as the sink turns it into the SDK's."""

    name: str
    span_id: int
    parent_id: int | None
    remote_parent: bool  # the parent is the client's span (another process's)
    kind: Kind
    start_ns: int  # wall clock, nanoseconds since the epoch
    end_ns: int
    attributes: Attributes
    error: str | None  # set: the span's status is ERROR with this description


class Sink(Protocol):
    """Where finished spans go (observe/otlp.py: the SDK's batch processor); `export`
    never blocks on the network."""

    def export(self, trace_id: int, spans: Sequence[SpanRecord]) -> None: ...

    def close(self) -> None:
        """Send what is queued and stop (blocks: call it off the event loop)."""
