"""The ledger: what each request and each load cost, charged to its caller (SPEC §9).

One place turns a finished visit into dollars and energy, settles the lane's spend-limit
reservation, and appends its activity row (to the batched writer: no I/O here).

Spend limits (S6) on an embedded store live in memory (cost/spend.py): reserving costs no
I/O. A request reserves against its lane's limit and, when its key has a `spendLimit` of
its own (SPEC §22 T3), against that too: both must fit, and both are charged.

On a store shared by several gateways (X5) a lane (or key) with a `spendLimit` reserves
in the database (store/spend.py), atomically across the gateways, and settles through a
batched writer off the request path. If the database cannot be reached, the lane falls back to
this gateway's own window for a few seconds, with a warning: serving goes on when the store
is down (SPEC §20), the limit then held per gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from corrallm.config.schema import BackendConfig, Config, ProcessSpec, SpendLimit
from corrallm.cost.model import FREE, CostModel, Metered, Price
from corrallm.cost.spend import SpendWindow, retry_after
from corrallm.store import spend as table
from corrallm.store.activity import Activity, ActivityLog, values
from corrallm.store.db import Store, StoreUnavailable

log = logging.getLogger("corrallm.cost")

ERROR_SUMMARY_CHARS = 500
FALLBACK_SECONDS = 5.0  # a shared store that failed a reservation is asked again after this
RESERVE_SECONDS = 2.0  # a shared store slower than this to reserve counts as failed
REFRESH_SECONDS = 2.0  # how stale a shared lane's `spent` may get before it is read again
PRUNE_SECONDS = 300.0  # how often a shared lane's rows out of the window are deleted


@dataclass(frozen=True, slots=True)
class SpendHold:
    """A visit's reservation against one spend window."""

    lane: str  # a group's name, or `key:<name>` for a key's own window
    usd: float
    reservation: int | None = None  # its row in a shared store (X5)


@dataclass(frozen=True, slots=True)
class OverSpend:
    """Why a visit was refused a spend reservation (S6, T3)."""

    lane: str  # the group's name, or the key's
    key: bool  # the key's own spendLimit (else its group's)
    estimate: float  # dollars
    limit: float
    wait: float | None  # seconds until it would fit; None: the estimate alone is over


def key_lane(name: str) -> str:
    """A key's own spend window, as the shared `spend` table names it (group names are
    kept apart in memory; in the table a group named `key:…` would share the window)."""
    return "key:" + name


# T5: what a model name that is not served is called in rows, events and metric labels
# (callers choose names: each one kept would grow the store and the metrics).
UNKNOWN_MODEL = "unknown"
NOTHING = Metered()  # what a visit without a meter's reading used


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
    backend: BackendConfig | None = None
    backend_id: str | None = None
    admitted_mono: float | None = None
    status: int = 0
    metered: Metered | None = None
    ttfb_ms: float | None = None
    degraded: bool = False
    spilled: bool = False
    preempted: bool = False
    error: str | None = None
    holds: tuple[SpendHold, ...] = ()  # its spend reservations (its lane's, its key's)
    price: Price | None = None
    request_id: str | None = None  # X-Corrallm-Request-Id (SPEC §21 O1)
    queue_ms: float = 0.0  # waiting for a slot
    load_ms: float = 0.0  # waiting for its backend to start or wake
    stream: bool = False  # the client asked for a stream
    user: str | None = None  # the user behind the key, where it may name one (SPEC §22 T4)


def price_of(costs: CostModel, visit: Visit) -> Price:
    """What the visit cost (computed once)."""
    if visit.price is None:
        visit.price = (
            FREE
            if visit.backend is None or visit.metered is None
            else costs.request(visit.backend, visit.metered)
        )
    return visit.price


def activity_row(costs: CostModel, visit: Visit) -> tuple[Price, tuple[Any, ...]]:
    """What the finished visit cost and its activity row (C3, in store/activity.py's
    column order): pure, given the config's prices, so that a relaying worker works both
    out and writes the row itself, its owner only charging the cost (`Ledger.charge`)."""
    price = price_of(costs, visit)
    m = visit.metered or NOTHING
    audio = visit.backend is not None and costs.audio(visit.backend)
    now = time.monotonic()
    admitted = visit.admitted_mono or now
    row = Activity(
        t=visit.arrived,
        kind="request",
        key=visit.key,
        grp=visit.group,
        model=visit.model,
        backend=visit.backend_id,
        endpoint=visit.endpoint,
        status=visit.status,
        dwell_ms=(admitted - visit.arrived_mono) * 1000,
        duration_ms=(now - visit.arrived_mono) * 1000,
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
        usr=visit.user,
    )
    return price, values(row)


class Ledger:
    def __init__(self, config: Config, activity: ActivityLog) -> None:
        self.activity = activity
        self.spend: dict[str, SpendWindow] = {}  # the embedded windows, or the fallback
        self.key_spend: dict[str, SpendWindow] = {}  # keys' own windows, by key name (T3)
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

    async def restore(self, store: Store, keys: Iterable[tuple[str, SpendLimit]] = ()) -> None:
        """After a restart, the spend still inside each limited lane's window (S6), and
        each of `keys`' (their names and spendLimits: T3). (A shared store's `spend` table
        needs no restoring: this fills the fallback windows.)"""
        for group, window in self.spend.items():
            for minute, usd in await table.recent_costs(store, group, time.time() - window.window):
                window.add(usd, minute)
        for name, limit in keys:
            window = self._key_window(name, limit)
            since = time.time() - window.window
            for minute, usd in await table.recent_key_costs(store, name, since):
                window.add(usd, minute)

    def _key_window(self, name: str, limit: SpendLimit) -> SpendWindow:
        """A key's own window, made on first use; its limit as the key says now (a reload
        or a key changed at runtime applies from its next request)."""
        window = self.key_spend.get(name)
        if window is None:
            window = self.key_spend[name] = SpendWindow(limit.usd, limit.window)
        else:
            window.limit_usd, window.window = limit.usd, limit.window
        return window

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
        backend: BackendConfig,
        max_tokens: int | None,
        key_limit: SpendLimit | None = None,
        usd: float | None = None,
    ) -> OverSpend | None:
        """S6: hold the visit's estimated cost (`usd` where the caller knows it: a lease's
        slot-seconds) against its lane's window and, with `key_limit` (its key's own
        spendLimit, T3), its key's; None if both fit.

        On a shared store this is a database round trip per limited window (lanes and
        keys without a `spendLimit` return at once), so that the limits hold across the
        gateways. An estimate larger than a whole limit is refused before anything is
        reserved: waiting cannot help it."""
        windows: list[tuple[str, str, bool, SpendWindow]] = []  # (lane, name, key?, window)
        group = self.spend.get(visit.group)
        if group is not None:
            windows.append((visit.group, visit.group, False, group))
        if key_limit is not None and visit.key is not None:
            own = self._key_window(visit.key, key_limit)
            windows.append((key_lane(visit.key), visit.key, True, own))
        if not windows:
            return None
        estimate = self.costs.estimate(backend, visit.bytes_in, max_tokens) if usd is None else usd
        for _, name, key, window in windows:
            if estimate > window.limit_usd + 1e-12:
                return OverSpend(name, key, estimate, window.limit_usd, None)
        holds: list[SpendHold] = []
        for lane, name, key, window in windows:
            now = time.time()
            got = await self._reserve(lane, window, estimate, now)
            if isinstance(got, float):
                for hold in holds:  # the other window's reservation is given back
                    self._give_back(hold, now)
                return OverSpend(name, key, estimate, window.limit_usd, got)
            holds.append(got)
        visit.holds = tuple(holds)
        return None

    async def _reserve(
        self, lane: str, window: SpendWindow, estimate: float, now: float
    ) -> SpendHold | float:
        """Reserve in one window: the hold, or seconds to wait."""
        if self.shared is not None and now >= self._fallback_until:
            try:
                async with asyncio.timeout(RESERVE_SECONDS):
                    return await self._reserve_shared(lane, window, estimate, now)
            except (StoreUnavailable, TimeoutError) as exc:
                self._fallback_until = now + FALLBACK_SECONDS
                log.warning(
                    "spend limit of lane %s: the shared store failed (%s); holding the limit "
                    "with this gateway's own spending for %gs",
                    lane,
                    str(exc) or f"no answer in {RESERVE_SECONDS:g}s",
                    FALLBACK_SECONDS,
                )
        wait = window.try_reserve(estimate, now)
        return SpendHold(lane, estimate) if wait is None else wait

    async def _reserve_shared(
        self, lane: str, window: SpendWindow, estimate: float, now: float
    ) -> SpendHold | float:
        assert self.shared is not None
        got = await table.reserve(
            self.shared, lane, estimate, window.limit_usd, window.window, now, self.gateway
        )
        self._known[lane] = (got.spent, now)
        if got.id is not None:
            return SpendHold(lane, estimate, got.id)
        over = got.spent + got.reserved + estimate - window.limit_usd
        spending = await table.spending(self.shared, lane, now - window.window)
        return retry_after(spending, over, window.window, now)

    def _give_back(self, hold: SpendHold, now: float) -> None:
        """Undo a reservation of a visit refused by its other window: nothing spent."""
        if hold.reservation is not None:
            self.settlements.settle(hold.reservation, 0.0, now)
            return
        window = self._window(hold.lane)
        if window is not None:
            window.settle(hold.usd, 0.0, now)

    def _window(self, lane: str) -> SpendWindow | None:
        if lane.startswith("key:"):
            return self.key_spend.get(lane[4:])
        return self.spend.get(lane)

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
        return price_of(self.costs, visit)

    def charge(self, group: str, key: str | None, holds: tuple[SpendHold, ...], usd: float) -> None:
        """A settled visit's real cost charged to its lane's spend window and its key's,
        in place of what it reserved there (its row is written by whoever settled it)."""
        key_window = key is not None and self.key_spend
        if group not in self.spend and not key_window:
            return  # the common case: no spend limit on its lane or its key
        now = time.time()
        self._charge(group, self.spend.get(group), holds, usd, now)
        if key is not None and key_window:
            self._charge(key_lane(key), self.key_spend.get(key), holds, usd, now)

    def _charge(
        self,
        lane: str,
        window: SpendWindow | None,
        holds: tuple[SpendHold, ...],
        usd: float,
        now: float,
    ) -> None:
        """The visit's real cost replaces its reservation in one spend window."""
        if window is None:
            return
        hold = next((h for h in holds if h.lane == lane), None)
        if hold is not None and hold.reservation is not None:  # reserved in the shared store
            window.add(usd, now)  # (this gateway's own, for a fallback)
            self.settlements.settle(hold.reservation, usd, now)
            return
        window.settle(hold.usd if hold is not None else 0.0, usd, now)
        if self.shared is not None and usd > 0:  # reserved while it was down
            self.settlements.add(lane, usd, now)

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
        lanes = [(group, self.spend.get(group))]
        if key is not None:  # T3: a key's own spendLimit pays for the starts it causes
            lanes.append((key_lane(key), self.key_spend.get(key)))
        for lane, window in lanes:
            if window is not None:
                window.add(price.cost_usd, time.time())
                if self.shared is not None and price.cost_usd > 0:
                    self.settlements.add(lane, price.cost_usd, time.time())
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
