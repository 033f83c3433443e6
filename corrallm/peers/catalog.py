"""What a gateway knows of one peer (SPEC §19 X1, X2): its models and their live state,
from its `/api/v1/overview` and then its `/api/v1/events`. Pure: no I/O, no clock.

Only the peer's own backends are imported, never the ones it serves from its own peers
(its overview marks those with `peer`), so routing never crosses two hops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from corrallm.lifecycle.state import BEST_FIRST, State


@dataclass
class RemoteBackend:
    """One backend process on the peer, as it reports it."""

    id: str
    state: State
    quality: int
    type: str
    max_concurrent: int
    in_flight: int = 0
    waiting: int = 0
    service_s: float | None = None  # how long a request holds its slot there, on average
    load_s: float | None = None  # how long its last start took
    modes: tuple[str, ...] = ()


@dataclass
class RemoteModel:
    name: str
    aliases: tuple[str, ...]
    paused: bool
    backends: list[RemoteBackend]
    # X2: this gateway's own requests that entered (+) or left (-) the model there since
    # the peer last reported its load. The peer reports it once a reaper pass (a second),
    # so without this a request of ours that just finished there would still count as
    # holding its slot, and the next one would go to a busier backend.
    since_report: int = 0

    @property
    def primary(self) -> RemoteBackend:
        return self.backends[0]

    @property
    def capacity(self) -> int:
        return sum(b.max_concurrent for b in self.backends)

    @property
    def state(self) -> State:
        if self.paused:
            return State.PAUSED
        return min((b.state for b in self.backends), key=BEST_FIRST.__getitem__)

    @property
    def modes(self) -> tuple[str, ...]:
        """The STT surfaces any of its backends serves (U3)."""
        return tuple(sorted({m for b in self.backends for m in b.modes}))

    def shape(self) -> tuple[Any, ...]:
        """What the gateway's routes are built from; a change rebuilds them."""
        b = self.primary
        return (self.name, self.aliases, b.quality, b.type, self.capacity, self.modes)

    def expected_wait(self) -> float:
        """X2: seconds a request sent now would wait there: its queue times the average
        hold of a slot, spread over the slots, plus a start when nothing is loaded."""
        service = max((b.service_s or 0.0 for b in self.backends), default=0.0)
        waiting = sum(b.waiting for b in self.backends)
        wait = waiting * service / max(1, self.capacity)
        if not any(b.state is State.READY for b in self.backends):
            wait += max((b.load_s or 0.0 for b in self.backends), default=0.0)
        return wait

    def free_slot(self) -> bool:
        """A ready backend with a slot nobody waits for, counting what this gateway sent
        or finished there since the last report."""
        open_ = [b for b in self.backends if b.state is State.READY and not b.waiting]
        busy = sum(b.in_flight for b in open_) + self.since_report
        return bool(open_) and busy < sum(b.max_concurrent for b in open_)


@dataclass
class PeerView:
    name: str
    url: str
    up: bool = False
    models: dict[str, RemoteModel] = field(default_factory=dict)
    error: str | None = None  # why it is down, for the overview

    def shape(self) -> tuple[Any, ...]:
        return tuple(m.shape() for m in self.models.values())

    def apply_overview(self, data: dict[str, Any]) -> None:
        """Replace what is known by a fresh overview of the peer."""
        models = {}
        for model in data.get("models", []):
            own = [_backend(b) for b in model.get("backends", []) if not b.get("peer")]
            if own:
                models[model["name"]] = RemoteModel(
                    model["name"], tuple(model.get("aliases", ())), bool(model.get("paused")), own
                )
        self.models = models

    def apply_event(self, kind: str, data: dict[str, Any]) -> bool:
        """Fold one event of the peer's stream in; False if it names something unknown
        (the peer's config changed: read its overview again)."""
        if kind == "lifecycle":
            found = self._backends(data.get("backend"))
            for b in found:
                b.state = _state(data.get("new"))
            return bool(found) or not data.get("models")
        if kind == "admission":
            known = {b.id: (m, b) for m in self.models.values() for b in m.backends}
            for load in data.get("backends", []):
                if (hit := known.get(load.get("backend"))) is not None:
                    m, b = hit
                    b.in_flight = int(load.get("in_flight", 0))
                    b.waiting = int(load.get("waiting", 0))
                    m.since_report = 0  # the report counts ours as they are now
        return True

    def _backends(self, backend_id: object) -> list[RemoteBackend]:
        return [b for m in self.models.values() for b in m.backends if b.id == backend_id]

    def view(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "state": "up" if self.up else "down",
            "error": self.error,
            "models": [
                {
                    "name": m.name,
                    "backend": f"{m.name}@{self.name}",
                    "state": str(m.state),
                    "capacity": m.capacity,
                    "in_flight": sum(b.in_flight for b in m.backends),
                    "waiting": sum(b.waiting for b in m.backends),
                    "backends": [
                        {"id": b.id, "state": str(b.state), "in_flight": b.in_flight}
                        for b in m.backends
                    ],
                }
                for m in self.models.values()
            ],
        }


def _state(value: object) -> State:
    try:
        return State(str(value))
    except ValueError:
        return State.FAILED


def _backend(raw: dict[str, Any]) -> RemoteBackend:
    return RemoteBackend(
        id=str(raw["id"]),
        state=_state(raw.get("state")),
        quality=int(raw.get("quality", 100)),
        type=str(raw.get("type", "chat")),
        max_concurrent=max(1, int(raw.get("max_concurrent", 1))),
        in_flight=int(raw.get("in_flight", 0)),
        waiting=int(raw.get("waiting", 0)),
        service_s=raw.get("service_seconds"),
        load_s=raw.get("load_seconds"),
        modes=tuple(raw.get("modes") or ()),
    )
