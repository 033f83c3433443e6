"""The ledger: what each request and each load cost, charged to its caller (SPEC §9).

One place turns a finished visit into dollars and energy, settles the lane's spend-limit
reservation, and appends its activity row (to the batched writer: no I/O here).

Spend limits (S6) on an embedded store live in memory (cost/spend.py): reserving costs no
I/O. On a store shared by several gateways (X5) a lane with a `spendLimit` reserves in the
database (store/spend.py), atomically across the gateways, and settles through a batched
writer off the request path. If the database cannot be reached, the lane falls back to
this gateway's own window for a few seconds, with a warning: serving goes on when the store
is down (SPEC §20), the limit then held per gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field

from corrallm.config.schema import Backend, Config, ProcessSpec
from corrallm.cost.model import FREE, CostModel, Metered, Price
from corrallm.cost.spend import SpendWindow, retry_after
from corrallm.store import spend as table
from corrallm.store.activity import Activity, ActivityLog
from corrallm.store.db import Store, StoreUnavailable

log = logging.getLogger("corrallm.cost")

ERROR_SUMMARY_CHARS = 500
FALLBACK_SECONDS = 5.0  # a shared store that failed a reservation is asked again after this
RESERVE_SECONDS = 2.0  # a shared store slower than this to reserve counts as failed
REFRESH_SECONDS = 2.0  # how stale a shared lane's `spent` may get before it is read again
PRUNE_SECONDS = 300.0  # how often a shared lane's rows out of the window are deleted


# T5: what a model name that is not served is called in rows, events and metric labels
# (callers choose names: each one kept would grow the store and the metrics).
UNKNOWN_MODEL = "unknown"


@dataclass(slots=True)
class Visit:
    """One request, as the proxy saw it; filled in as it goes, settled once at the end."""

    key: str | None  # the key's name; `unknown` for a key not configured; None: no key
    group: str
    model: str  # the served model's name; UNKNOWN_MODEL for a name not served
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
    reservation: int | None = None  # its reservation's row in a shared store (X5)
    price: Price | None = None
    request_id: str | None = None  # X-Corrallm-Request-Id (SPEC §21 O1)
    queue_ms: float = 0.0  # waiting for a slot
    load_ms: float = 0.0  # waiting for its backend to start or wake
    stream: bool = False  # the client asked for a stream


class Ledger:
    def __init__(self, config: Config, activity: ActivityLog) -> None:
        self.activity = activity
        self.spend: dict[str, SpendWindow] = {}  # the embedded windows, or the fallback
        store = activity.store
        self.shared: Store | None = store if store.dialect.shared else None
        self.gateway = f"{socket.gethostname()}/{os.getpid()}"
        self.settlements = table.SpendLog(store, self.gateway)
        self._fallback_until = 0.0
        self._known: dict[str, tuple[float, float]] = {}  # shared lane -> (spent, read at)
        self._reading: set[str] = set()
        self._pruned: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
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
        """After a restart, the spend still inside each limited lane's window (S6). (A
        shared store's `spend` table needs no restoring: this fills the fallback windows.)"""
        for group, window in self.spend.items():
            for minute, usd in await table.recent_costs(store, group, time.time() - window.window):
                window.add(usd, minute)

    def spent(self, group: str) -> float:
        """The lane's spending in its window. On a shared store, every gateway's, as last
        read (at each reservation, or at most REFRESH_SECONDS ago when asked for often)."""
        window = self.spend.get(group)
        if window is None:
            return 0.0
        now = time.time()
        if self.shared is None:
            return window.spent(now)
        known = self._known.get(group)
        if known is None or now - known[1] > REFRESH_SECONDS:
            self._read_spent(group, window)
        return known[0] if known is not None else window.spent(now)

    async def reserve(
        self,
        visit: Visit,
        backend: Backend,
        max_tokens: int | None,
        usd: float | None = None,
    ) -> float | None:
        """S6: hold the visit's estimated cost (`usd` where the caller knows it: a lease's
        slot-seconds); None if admitted, else seconds to wait.

        On a shared store this is a database round trip (for lanes with a `spendLimit`
        only; the others return at once), so that the limit holds across the gateways."""
        window = self.spend.get(visit.group)
        if window is None:
            return None
        estimate = self.costs.estimate(backend, visit.bytes_in, max_tokens) if usd is None else usd
        now = time.time()
        if self.shared is not None and now >= self._fallback_until:
            try:
                async with asyncio.timeout(RESERVE_SECONDS):
                    return await self._reserve_shared(visit, window, estimate, now)
            except (StoreUnavailable, TimeoutError) as exc:
                self._fallback_until = now + FALLBACK_SECONDS
                log.warning(
                    "spend limit of lane %s: the shared store failed (%s); holding the limit "
                    "with this gateway's own spending for %gs",
                    visit.group,
                    str(exc) or f"no answer in {RESERVE_SECONDS:g}s",
                    FALLBACK_SECONDS,
                )
        wait = window.try_reserve(estimate, now)
        if wait is None:
            visit.reserved_usd = estimate
        return wait

    async def _reserve_shared(
        self, visit: Visit, window: SpendWindow, estimate: float, now: float
    ) -> float | None:
        assert self.shared is not None
        group = visit.group
        got = await table.reserve(
            self.shared, group, estimate, window.limit_usd, window.window, now, self.gateway
        )
        self._known[group] = (got.spent, now)
        if got.id is not None:
            visit.reserved_usd, visit.reservation = estimate, got.id
            return None
        over = got.spent + got.reserved + estimate - window.limit_usd
        spending = await table.spending(self.shared, group, now - window.window)
        return retry_after(spending, over, window.window, now)

    def _read_spent(self, group: str, window: SpendWindow) -> None:
        """Read a shared lane's spending again, in the background (one read at a time)."""
        if group in self._reading or self.shared is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        store, now = self.shared, time.time()

        async def read() -> None:
            try:
                self._known[group] = (await table.spent(store, group, now - window.window), now)
                if now - self._pruned.get(group, 0.0) >= PRUNE_SECONDS:
                    self._pruned[group] = now
                    await table.prune(store, group, now - window.window, now)
            except StoreUnavailable as exc:
                log.warning("spend of lane %s: could not read the shared store: %s", group, exc)
            finally:
                self._reading.discard(group)

        self._reading.add(group)
        task = loop.create_task(read())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """At shutdown: write the settlements still queued for a shared store."""
        await self.settlements.flush()

    def price(self, visit: Visit) -> Price:
        """What the visit cost (computed once)."""
        if visit.price is None:
            visit.price = (
                FREE
                if visit.backend is None or visit.metered is None
                else self.costs.request(visit.backend, visit.metered)
            )
        return visit.price

    def settle(self, visit: Visit) -> Price:
        """The visit's real cost: charged to its lane and written to the activity log."""
        now = time.time()
        price = self.price(visit)
        window = self.spend.get(visit.group)
        if window is not None:
            if visit.reservation is not None:  # reserved in the shared store
                window.add(price.cost_usd, now)  # (this gateway's own, for a fallback)
                self.settlements.settle(visit.reservation, price.cost_usd, now)
            else:
                window.settle(visit.reserved_usd, price.cost_usd, now)
                if self.shared is not None and price.cost_usd > 0:  # reserved while it was down
                    self.settlements.add(visit.group, price.cost_usd, now)
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
            if self.shared is not None and price.cost_usd > 0:
                self.settlements.add(group, price.cost_usd, time.time())
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
