"""Served model -> the backend one request goes to: tiers in order, round-robin inside one."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from corrallm.config.schema import Backend, Model, PriorityGroup
from corrallm.lifecycle.state import State
from corrallm.routing.tiers import may_serve, tiers
from corrallm.scheduler.fifo import SlotGate


class Endpoint(Protocol):
    """What a route needs of a backend's process (a Supervisor, or a pure-proxy endpoint)."""

    id: str
    state: State
    base_url: str
    in_flight: int
    last_used: float

    async def ensure_ready(self) -> None: ...
    def available(self) -> bool: ...
    def enter(self) -> bool: ...
    def leave(self) -> None: ...


@dataclass
class Route:
    """One backend of one served model, with its slots."""

    id: str
    model: str
    config: Backend
    endpoint: Endpoint
    gate: SlotGate

    @property
    def upstream_headers(self) -> dict[str, str]:
        return self.config.headers


@dataclass
class ServedModel:
    name: str
    config: Model
    routes: list[Route]
    _tiers: list[list[Route]] = field(init=False)
    _turns: list[itertools.count[int]] = field(init=False)

    def __post_init__(self) -> None:
        self._tiers = [[self.routes[i] for i in tier] for tier in tiers(self.config.backends)]
        self._turns = [itertools.count() for _ in self._tiers]

    @property
    def primary(self) -> Route:
        return self.routes[0]

    def pick(
        self, group: PriorityGroup | None, placeable: Callable[[Route], bool] | None = None
    ) -> Route:
        """The first tier the group may use with an available backend; round-robin within.

        With `placeable`, a backend that cannot be given memory now is passed over for the
        next one that can (R2 spill); if none can, the first choice waits for room. With
        none available at all, the primary answers, so the caller hears why (paused, failed).
        """
        primary_quality = self.primary.config.quality
        first: Route | None = None
        for tier, turns in zip(self._tiers, self._turns, strict=True):
            if not may_serve(tier[0].config, primary_quality, group):
                continue
            candidates = [r for r in tier if r.endpoint.available()]
            if not candidates:
                continue
            start = next(turns)
            ordered = [candidates[(start + i) % len(candidates)] for i in range(len(candidates))]
            if placeable is None:
                return ordered[0]
            first = first or ordered[0]
            for route in ordered:
                if placeable(route):
                    return route
        return first or self.primary

    def degraded(self, route: Route) -> bool:
        return route.config.quality < self.primary.config.quality
