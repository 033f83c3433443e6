"""Served model -> the tiers of backends a caller may use, in order (SPEC §8 F1, F2)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from corrallm.config.schema import BackendConfig, ModelConfig, PriorityGroup
from corrallm.lifecycle.description import Description, Kind
from corrallm.lifecycle.state import State
from corrallm.routing.filters import NO_FILTERS, RequestFilters
from corrallm.routing.tiers import may_serve, tiers


class Endpoint(Protocol):
    """What a route needs of a backend's process (a Supervisor, or a pure-proxy endpoint)."""

    id: str
    in_flight: int
    last_used: float

    # What `describe()` says too, as fields: asked of every request (`Gateway.stale`,
    # `placeable`), where a whole `Description` is ~90 opcodes (bench/opcodes.py).
    @property
    def kind(self) -> Kind: ...
    @property
    def retired(self) -> bool: ...
    @property
    def state(self) -> State: ...
    @property
    def base_url(self) -> str: ...

    async def ensure_ready(self, cause: tuple[str | None, str, str] | None = None) -> None: ...
    async def load(self) -> None:
        """An explicit load (POST /api/v1/models/{name}/load)."""
        ...

    def describe(self) -> Description:
        """What it says of itself: its kind, node, url, state... (views never ask which
        class it is)."""
        ...

    def available(self) -> bool: ...
    def enter(self) -> bool: ...
    def leave(self) -> None: ...


@dataclass
class Route:
    """One backend of one served model."""

    id: str
    model: str
    config: BackendConfig
    endpoint: Endpoint
    filters: RequestFilters = NO_FILTERS  # its model's request filters (K5)


@dataclass
class ServedModel:
    name: str
    config: ModelConfig
    routes: list[Route]
    _tiers: list[list[Route]] = field(init=False)

    def __post_init__(self) -> None:
        self._tiers = [[self.routes[i] for i in tier] for tier in tiers(self.config.backends)]

    @property
    def primary(self) -> Route:
        return self.routes[0]

    def tiers_for(
        self,
        group: PriorityGroup | None,
        placeable: Callable[[Route], bool] | None = None,
        local_only: bool = False,
    ) -> list[list[Route]]:
        """The tiers this group may use, in order, each with its available backends.

        Paused tiers and tiers backing off after a failed start are skipped (F1); lower-
        quality tiers only for groups accepting degrade (F2). With `placeable`, backends
        that cannot be given memory now are left out, so the request spills past them
        (R2) -- unless that leaves nothing, when they wait for room. `local_only`: a
        request that already crossed a hop from another gateway never goes to a peer
        (X1); the caller checks that a local backend exists. With nothing available at
        all, the primary (local) answers, so the caller hears why.
        """
        if len(self.routes) == 1:
            # What `_usable` comes to for one backend, whatever its state (perf, SPEC §13:
            # most models have one, and this is asked of every request).
            return [[self.routes[0]]]
        return self._usable(group, placeable, local_only)

    def _usable(
        self,
        group: PriorityGroup | None,
        placeable: Callable[[Route], bool] | None,
        local_only: bool,
    ) -> list[list[Route]]:
        quality = self.primary.config.quality
        usable = [
            [r for r in tier if r.endpoint.available() and not (local_only and r.config.peer)]
            for tier in self._tiers
            if may_serve(tier[0].config, quality, group)
        ]
        usable = [tier for tier in usable if tier]
        if placeable is not None:
            placed = [[r for r in tier if placeable(r)] for tier in usable]
            placed = [tier for tier in placed if tier]
            usable = placed or usable
        if usable:
            return usable
        return [[next((r for r in self.routes if not r.config.peer), self.primary)]]

    @property
    def local(self) -> bool:
        """Some backend of it runs here (not only on peers)."""
        return any(not r.config.peer for r in self.routes)

    def degraded(self, route: Route) -> bool:
        return route.config.quality < self.routes[0].config.quality  # (the primary's)
