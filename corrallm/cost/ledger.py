"""The ledger: what each request and each load cost, charged to its caller (SPEC §9).

One place turns a finished visit into dollars and energy, settles the lane's spend-limit
reservation, and appends its activity row (to the batched writer: no I/O here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from corrallm.config.schema import Backend, Config, ProcessSpec
from corrallm.cost.model import CostModel, Metered, Price
from corrallm.cost.spend import SpendWindow
from corrallm.store.activity import Activity, ActivityLog
from corrallm.store.db import Store

ERROR_SUMMARY_CHARS = 500


@dataclass(slots=True)
class Visit:
    """One request, as the proxy saw it; filled in as it goes, settled once at the end."""

    key: str | None  # the configured key name; None for unknown or unkeyed callers
    group: str
    model: str
    endpoint: str
    bytes_in: int
    arrived: float = field(default_factory=time.time)
    arrived_mono: float = field(default_factory=time.monotonic)
    backend: Backend | None = None
    backend_id: str | None = None
    admitted_mono: float | None = None
    status: int = 0
    metered: Metered | None = None
    ttfb_ms: float | None = None
    degraded: bool = False
    spilled: bool = False
    preempted: bool = False
    error: str | None = None
    reserved_usd: float = 0.0
    price: Price | None = None
    request_id: str | None = None  # X-Corrallm-Request-Id (SPEC §21 O1)
    queue_ms: float = 0.0  # waiting for a slot
    load_ms: float = 0.0  # waiting for its backend to start or wake
    stream: bool = False  # the client asked for a stream


class Ledger:
    def __init__(self, config: Config, activity: ActivityLog) -> None:
        self.activity = activity
        self.spend: dict[str, SpendWindow] = {}
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Prices and limits from `config`; spend already in a window is kept."""
        self.costs = CostModel(config)
        spend = {}
        for name, group in config.priority_groups.items():
            if group.spend_limit is None:
                continue
            window = self.spend.get(name) or SpendWindow(0.0, 0.0)
            window.limit_usd, window.window = group.spend_limit.usd, group.spend_limit.window
            spend[name] = window
        self.spend = spend

    async def restore(self, store: Store) -> None:
        """After a restart, the spend still inside each limited lane's window (S6)."""
        for group, window in self.spend.items():
            rows = await store.query(
                "SELECT CAST(t / 60 AS INTEGER) * 60 AS minute, SUM(cost_usd) AS usd "
                "FROM activity INDEXED BY activity_grp_t WHERE grp = ? AND t >= ? "
                "GROUP BY minute ORDER BY minute",
                (group, time.time() - window.window),
            )
            for row in rows:
                window.add(row["usd"] or 0.0, row["minute"])

    def spent(self, group: str) -> float:
        window = self.spend.get(group)
        return window.spent(time.time()) if window else 0.0

    def reserve(self, visit: Visit, backend: Backend, max_tokens: int | None) -> float | None:
        """S6: hold the visit's estimated cost; None if admitted, else seconds to wait."""
        window = self.spend.get(visit.group)
        if window is None:
            return None
        estimate = self.costs.estimate(backend, visit.bytes_in, max_tokens)
        wait = window.try_reserve(estimate, time.time())
        if wait is None:
            visit.reserved_usd = estimate
        return wait

    def price(self, visit: Visit) -> Price:
        """What the visit cost (computed once)."""
        if visit.price is None:
            visit.price = Price()
            if visit.backend is not None and visit.metered is not None:
                visit.price = self.costs.request(visit.backend, visit.metered)
        return visit.price

    def settle(self, visit: Visit) -> Price:
        """The visit's real cost: charged to its lane and written to the activity log."""
        now = time.time()
        price = self.price(visit)
        if visit.group in self.spend:
            self.spend[visit.group].settle(visit.reserved_usd, price.cost_usd, now)
        m = visit.metered or Metered()
        audio = visit.backend is not None and self.costs.audio(visit.backend)
        admitted = visit.admitted_mono or time.monotonic()
        self.activity.record(
            Activity(
                t=visit.arrived,
                kind="request",
                key=visit.key,
                grp=visit.group,
                model=visit.model,
                backend=visit.backend_id,
                endpoint=visit.endpoint,
                status=visit.status,
                dwell_ms=(admitted - visit.arrived_mono) * 1000,
                duration_ms=(time.monotonic() - visit.arrived_mono) * 1000,
                ttfb_ms=visit.ttfb_ms,
                prompt_tokens=m.prompt_tokens,
                completion_tokens=m.completion_tokens,
                bytes=m.bytes_in + m.bytes_out if audio else 0,
                energy_wh=price.energy_wh,
                cost_usd=price.cost_usd,
                estimated=m.estimated,
                degraded=visit.degraded,
                spilled=visit.spilled,
                preempted=visit.preempted,
                error=visit.error[:ERROR_SUMMARY_CHARS] if visit.error else None,
                request_id=visit.request_id,
            )
        )
        return price

    def load(
        self,
        spec: ProcessSpec,
        backend_id: str,
        seconds: float,
        cause: tuple[str | None, str, str] | None,
    ) -> Price:
        """C1: a backend's load energy, as a `load` row for the caller that caused it."""
        price = self.costs.load(spec, seconds)
        key, group, model = cause or (None, "system", backend_id)
        if group in self.spend:
            self.spend[group].add(price.cost_usd, time.time())
        self.activity.record(
            Activity(
                t=time.time() - seconds,
                kind="load",
                key=key,
                grp=group,
                model=model,
                backend=backend_id,
                endpoint="load",
                status=200,
                duration_ms=seconds * 1000,
                energy_wh=price.energy_wh,
                cost_usd=price.cost_usd,
            )
        )
        return price
