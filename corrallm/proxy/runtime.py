"""What the request pipeline needs from the gateway (`Runtime`), and nothing more.

The pipeline (proxy/pipeline.py) takes a `Runtime`, not the whole `Gateway`: the served
models of the topology in force, the caller a key names, the pauses, the long-lived owners
a request passes through (admission, ledger, throttle, live requests) and a few questions
about a route. Each member is a question with a plain answer or one call to an owner, so
that a later relaying worker in another process could ask them of one owner of state
across a socket. `Gateway` implements it; tests use a fake (tests/unit/test_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from corrallm.auth.callers import Caller
    from corrallm.auth.throttle import Throttle
    from corrallm.config.schema import Config
    from corrallm.cost.ledger import Ledger, Visit
    from corrallm.observe.live import LiveRequests
    from corrallm.observe.traces import Tracer
    from corrallm.routing.router import Route, ServedModel
    from corrallm.scheduler.admission import Admission


class Runtime(Protocol):
    @property
    def config(self) -> Config:
        """The config in force (keys policy, feedback, timeouts)."""

    @property
    def models(self) -> Mapping[str, ServedModel]:
        """Served models by name and alias, of the topology in force."""

    @property
    def served(self) -> Sequence[ServedModel]:
        """Every served model, in config order (for error messages)."""

    admission: Admission
    ledger: Ledger
    throttle: Throttle
    live: LiveRequests
    tracer: Tracer | None  # E2: None unless telemetry.otlp is set

    def caller(self, key: str | None, signed: str | None = None) -> Caller: ...

    def user_header(self) -> bytes | None:
        """T4: the header a trusted key's user is named in (`auth.userHeader`)."""

    def paused(self, kind: Literal["model", "extension"], name: str) -> bool: ...

    def pause_remaining(self, kind: Literal["model", "extension"], name: str) -> float | None:
        """F3: seconds until a pause with an `until` ends (its Retry-After); None else."""

    def stale(self, route: Route) -> bool:
        """P6/X4: the route no longer leads to a backend of the config in force."""

    def placeable(self, route: Route) -> bool: ...

    def upstream_idle(self, route: Route) -> float:
        """Seconds the route's backend may stay silent mid-answer."""

    def peer_failed(self, route: Route, message: str) -> None:
        """X4: the peer behind `route` failed a request before answering."""

    def settle(self, visit: Visit) -> None:
        """The request is over: record and charge it."""
