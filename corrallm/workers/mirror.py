"""A worker's topology: the config's served models and routes, as the owner's, each
backend reached through a `Mirror` of the owner's endpoint.

The worker never starts, stops or counts a backend: the owner admitted the request to a
ready backend and counted it in flight there before it answered `ADMITTED`, with the
backend's URL (a process may come back on another port). So a mirror is always ready
to enter, and leaving it is the owner's business (`RELEASE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from corrallm.config import Config
from corrallm.config.schema import BackendConfig, ModelConfig
from corrallm.lifecycle.description import Description, Kind
from corrallm.lifecycle.state import State
from corrallm.topology import Topology, serve


@dataclass(eq=False)
class Mirror:
    kind: ClassVar[Kind] = "proxy"  # the worker relays to it as to a pure proxy
    retired: ClassVar[bool] = False  # a reload's retired backend is the owner's to refuse

    id: str
    base_url: str = ""  # the owner's, as its last ADMITTED for this backend said
    in_flight: int = 0
    last_used: float = 0.0
    state: State = State.READY

    async def ensure_ready(self, cause: object = None) -> None:
        return None

    async def load(self) -> None:
        return None

    def describe(self) -> Description:
        return Description("proxy", self.state, self.base_url)

    def available(self) -> bool:
        return True

    def enter(self) -> bool:
        return True

    def leave(self) -> None:
        return None


def mirrored(config: Config, previous: Mapping[str, Mirror] | None = None) -> Topology:
    """The topology a worker serves `config` with; the mirrors of `previous` (the
    topology before a reload) kept, with the URLs they learnt."""
    kept = previous or {}

    def mirror(bid: str, name: str, model: ModelConfig, backend: BackendConfig) -> Mirror:
        return kept.get(bid) or Mirror(bid)

    topo = Topology(config)
    for name, model in config.models.items():
        serve(topo, name, model, mirror)
    return topo
