"""What the request pipeline needs from the gateway (`Runtime`), and nothing more.

The pipeline (proxy/pipeline.py) takes a `Runtime`, not the whole `Gateway`: the served
models of the topology in force, the caller a key names, the pauses, the long-lived owners
a request passes through (admission, ledger, throttle, live requests) and a few questions
about a route. The owners are seen through narrow ports (`Seats`, `Spend`, `Limits`,
`Live`): each member is a question with a plain answer or one call to an owner, so that
a relaying worker in another process asks them of the one owner of state across a socket
(corrallm/workers/remote.py). `Gateway` implements it in process with its own objects;
tests use a fake (tests/unit/test_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from corrallm.auth.callers import Caller
    from corrallm.auth.keys import Identity
    from corrallm.auth.limits import Ask, Hold, LimitRefusal, Remaining
    from corrallm.config.schema import BackendConfig, Config, PriorityGroup, SpendLimit
    from corrallm.cost.ledger import OverSpend, Visit
    from corrallm.cost.model import CostModel, Price
    from corrallm.observe.live import LiveRequest
    from corrallm.observe.traces import Tracer
    from corrallm.routing.router import Route, ServedModel
    from corrallm.scheduler.ticket import Stop, Ticket


class Queues(Protocol):
    """What a waiting client is told (K4): where a request waits, and for how long."""

    def position(self, request_id: int) -> tuple[str, int, int] | None: ...
    def load(self, backend: str) -> tuple[int, int, int]: ...
    def retry_after(self, backend: str) -> float: ...


class Seats(Protocol):
    """Slots on backends (scheduler/admission.py's `Admission`, or the owner's across the
    hop): a ticket, given back once; a preempted one queued again."""

    @property
    def core(self) -> Queues: ...

    async def acquire(
        self,
        group_name: str,
        group: PriorityGroup | None,
        tiers: Sequence[Sequence[Route]],
        affinity: str | None = None,
        on_queued: Callable[[int], None] | None = None,
        stop: Stop | None = None,
    ) -> Ticket: ...

    def release(self, ticket: Ticket, tokens: int = 0, dollars: float = 0.0) -> None: ...

    async def requeue(self, ticket: Ticket, group: PriorityGroup | None) -> Ticket: ...


class Spend(Protocol):
    """Spend limits and prices (cost/ledger.py's `Ledger`)."""

    @property
    def costs(self) -> CostModel: ...

    async def reserve(
        self,
        visit: Visit,
        backend: BackendConfig,
        max_tokens: int | None,
        key_limit: SpendLimit | None = None,
        usd: float | None = None,
    ) -> OverSpend | None: ...

    def price(self, visit: Visit) -> Price: ...


class Limits(Protocol):
    """Per-key rate windows (auth/throttle.py's `Throttle`)."""

    def counts(self, identity: Identity, user: str | None) -> list[tuple[bytes, bytes]]: ...

    def admit_now(
        self, asks: Sequence[Ask], estimate: int
    ) -> Hold | tuple[LimitRefusal, Remaining] | None: ...

    async def admit(
        self, asks: Sequence[Ask], estimate: int
    ) -> Hold | tuple[LimitRefusal, Remaining]: ...

    def release(self, admitted: Hold, tokens: int) -> None: ...


class Live(Protocol):
    """The live list (observe/live.py's `LiveRequests`)."""

    def enter(self, visit: Visit) -> LiveRequest: ...
    def leave(self, live: LiveRequest) -> None: ...


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

    @property
    def admission(self) -> Seats: ...
    @property
    def ledger(self) -> Spend: ...
    @property
    def throttle(self) -> Limits: ...
    @property
    def live(self) -> Live: ...
    @property
    def tracer(self) -> Tracer | None:
        """E2: None unless telemetry.otlp is set."""

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
