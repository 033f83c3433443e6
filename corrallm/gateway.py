"""The running gateway: served models, their routes and process supervisors, residency
and pauses, built once from the config. Everything per-request reads prebuilt tables;
nothing here parses config on the hot path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from corrallm.config import Config, backend_id
from corrallm.config.schema import Model, PriorityGroup, ProcessSpec
from corrallm.cost.ledger import Ledger, Visit
from corrallm.events import EventBus
from corrallm.lifecycle.addresses import resolve_url
from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.pauses import Kind, Pausable, Pauses
from corrallm.lifecycle.pidrecords import PidRecords
from corrallm.lifecycle.process import adopt, stop_group
from corrallm.lifecycle.remote import RemoteEndpoint
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.lifecycle.transitions import Transitions
from corrallm.metrics import Metrics
from corrallm.proxy.forward import new_session
from corrallm.residency.manager import Residency, Tenancy
from corrallm.residency.measure import nvml_reader
from corrallm.routing.router import Endpoint, Route, ServedModel
from corrallm.scheduler.admission import Admission
from corrallm.store import queries
from corrallm.store.activity import ActivityLog
from corrallm.store.db import Store

log = logging.getLogger("corrallm.lifecycle")

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2)
REAPER_SECONDS = 1.0  # how often ttl-expired residents and expired pauses are looked at
QUEUE_SAMPLE_SECONDS = 5.0
PRUNE_SECONDS = 3600.0


@dataclass(frozen=True)
class Caller:
    key: str | None
    group_name: str
    group: PriorityGroup | None
    known: bool  # the key is configured in `keys`: the caller has a lane of its own


class Gateway:
    def __init__(
        self,
        config: Config,
        home: Path,
        health_timeout: float = 120.0,
        db_path: Path | None = None,
        reservation_max_ttl: float = 300.0,
        activity_retention: float = 30 * 86400.0,
        config_path: Path | None = None,
    ) -> None:
        self.config_path = config_path  # None: the packaged demo
        self.version = 0  # bumped by each config reload
        self.reservation_max_ttl = reservation_max_ttl
        self.activity_retention = activity_retention
        self.home = home
        self.health_timeout = health_timeout
        self.started_at = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self.store = Store(db_path or home / "corrallm.db")
        self.activity = ActivityLog(self.store)
        self.ledger = Ledger(config, self.activity)
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics = Metrics(self)
        self.events = EventBus()
        # One bus for every supervisor's transitions, subscribed to once (a reload swaps the
        # supervisors, never the subscribers).
        self.bus = Transitions()
        self.bus.subscribe(moved=_log_transition)
        self.bus.subscribe(moved=self._charge_load)
        self.bus.subscribe(moved=self.metrics.transition)
        self.bus.subscribe(moved=self._publish_transition)
        self.bus.subscribe(
            line=lambda backend, line: self.events.publish(
                "log", {"backend": backend, "line": line}
            )
        )
        self.residency = Residency({}, bus=self.bus)
        self.configure(config)
        self.pauses = Pauses(self.store, self._pausables())
        self.admission = Admission(config, self.routes)

    def configure(self, config: Config) -> None:
        """(Re)build every table from `config`, keeping the supervisor (and so the running
        process) of each backend whose spec is unchanged (SPEC §10 P6)."""
        self._previous = getattr(self, "supervisors", {})
        self.config = config
        self.supervisors: dict[str, Supervisor] = {}
        self.extensions: dict[str, Supervisor] = {}
        self.routes: dict[str, Route] = {}
        self.models: dict[str, ServedModel] = {}  # by name and by alias
        self.served: list[ServedModel] = []  # each once, in config order
        self._tenancies: list[Tenancy] = []
        self._build()
        self.residency.reconfigure(dict(config.servers), config.scheduler.max_wait, self._tenancies)
        self._previous = {}
        self.version += 1

    def stale(self, route: Route) -> bool:
        """Whether a route taken before a config reload no longer leads to a backend of
        the config in force (removed, or replaced by one with a new spec)."""
        return route.id not in self.routes or getattr(route.endpoint, "retired", False)

    # -- built once ------------------------------------------------------------------

    def _build(self) -> None:
        for name, spec in self.config.extensions.items():
            self.extensions[name] = self._supervisor(f"extension:{name}", spec)
        for name, model in self.config.models.items():
            routes = []
            for index, backend in enumerate(model.backends):
                bid = backend_id(name, index, backend)
                endpoint: Endpoint
                if backend.extension:
                    endpoint = self.extensions[backend.extension]
                elif backend.cmd or backend.supervision in ("docker", "systemd"):
                    endpoint = self._supervisor(bid, backend)
                    self._track(endpoint, backend, [model])
                else:
                    assert backend.proxy is not None, "validated config"
                    endpoint = RemoteEndpoint(bid, resolve_url(backend.proxy, None))
                route = Route(bid, name, backend, endpoint)
                routes.append(route)
                self.routes[bid] = route
            served = ServedModel(name, model, routes)
            self.served.append(served)
            for key in (name, *model.aliases):
                self.models[key] = served
        for name, sup in self.extensions.items():
            self._track(sup, self.config.extensions[name], self.hosted_by(name))
        self._groups = dict(self.config.priority_groups)
        self._default = self.config.scheduler.default_group

    def _supervisor(self, sid: str, spec: ProcessSpec) -> Supervisor:
        sup = self._previous.get(sid)
        if sup is None or sup.spec != spec:
            sup = Supervisor(
                sid,
                spec,
                self.probe,
                self.home,
                self.health_timeout,
                bus=self.bus,
                room=self.residency.make_room,
            )
        self.supervisors[sid] = sup
        return sup

    def _track(self, sup: Supervisor, spec: ProcessSpec, models: list[Model]) -> None:
        """Account the process in its server's pools (R1) and for idle unload (R4); pinned if
        any model it serves is. Without a server or ramUsage it takes no room but still
        expires by its sticky.ttl."""
        server = spec.server or (next(iter(self.config.servers)) if self.config.servers else None)
        if not spec.ram_usage:
            server = None
        stickies = [m.sticky for m in models]
        ttls = [s.ttl for s in stickies if s is not None and s.ttl is not None]
        costs = [s.evict_cost for s in stickies if s is not None]
        self._tenancies.append(
            Tenancy(
                sup,
                server,
                dict(spec.ram_usage),
                pinned=any(m.persistent for m in models),
                # An extension expires only once every model it hosts would.
                ttl=max(ttls) if ttls and len(ttls) == len(models) else None,
                evict_cost=max(costs, key=["low", "medium", "high"].index, default="medium"),
            )
        )

    def hosted_by(self, extension: str) -> list[Model]:
        return [
            m
            for m in self.config.models.values()
            if any(b.extension == extension for b in m.backends)
        ]

    def _pausables(self) -> dict[tuple[Kind, str], Pausable]:
        targets: dict[tuple[Kind, str], Pausable] = {}
        for served in self.served:
            targets[("model", served.name)] = Pausable(
                "model", served.name, self.own_supervisors(served), served.config.persistent
            )
        for name, sup in self.extensions.items():
            pinned = any(m.persistent for m in self.hosted_by(name))
            targets[("extension", name)] = Pausable("extension", name, [sup], pinned)
        return targets

    def own_supervisors(self, served: ServedModel) -> list[Supervisor]:
        """The processes a model alone owns (not the extensions it shares with others)."""
        return [
            r.endpoint
            for r in served.routes
            if isinstance(r.endpoint, Supervisor) and not r.config.extension
        ]

    def _charge_load(self, sup: Supervisor, old: State, new: State) -> None:
        """C1: a finished start costs its load energy, charged to whoever caused it."""
        if old is State.STARTING and new is State.READY and sup.last_load_seconds is not None:
            self.ledger.load(sup.spec, sup.id, sup.last_load_seconds, sup.started_for)

    def settle(self, visit: Visit) -> None:
        """A request is over: its cost, spend and activity row (no I/O: rows are batched)."""
        price = self.ledger.settle(visit)
        self.metrics.visit(visit, price.cost_usd, price.energy_wh)
        if self.events.subscribers:
            m = visit.metered
            self.events.publish(
                "usage",
                {
                    "key": visit.key,
                    "group": visit.group,
                    "model": visit.model,
                    "backend": visit.backend_id,
                    "status": visit.status,
                    "prompt_tokens": m.prompt_tokens if m else 0,
                    "completion_tokens": m.completion_tokens if m else 0,
                    "cost_usd": price.cost_usd,
                    "energy_wh": price.energy_wh,
                },
            )

    def _publish_transition(self, sup: Supervisor, old: State, new: State) -> None:
        models = sorted({r.model for r in self.routes.values() if r.endpoint is sup})
        self.events.publish(
            "lifecycle",
            {"backend": sup.id, "models": models, "old": str(old), "new": str(new), "pid": sup.pid},
        )

    def publish_load(self) -> None:
        """Admission load of every backend, for live views (sent each reaper pass)."""
        if not self.events.subscribers:
            return
        backends = []
        for route_id in self.routes:
            capacity, in_flight, waiting = self.admission.core.load(route_id)
            backends.append(
                {
                    "backend": route_id,
                    "capacity": capacity,
                    "in_flight": in_flight,
                    "waiting": waiting,
                }
            )
        self.events.publish("admission", {"backends": backends})

    # -- callers ---------------------------------------------------------------------

    def caller(self, key: str | None) -> Caller:
        lane = self.config.keys.get(key) if key else None
        group_name = lane or self._default
        return Caller(key, group_name, self._groups.get(group_name), lane is not None)

    def placeable(self, route: Route) -> bool:
        """Could this route serve now without waiting for memory (R2 spill)?"""
        endpoint = route.endpoint
        return not isinstance(endpoint, Supervisor) or self.residency.could_fit(endpoint)

    @property
    def session(self) -> aiohttp.ClientSession:
        """For health probes and the realtime WebSocket relay (not the hot path)."""
        assert self._session is not None, "gateway not started"
        return self._session

    async def probe(self, url: str) -> int | None:
        """One health poll: the status code, or None if nothing answered."""
        try:
            async with self.session.get(url, timeout=PROBE_TIMEOUT) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    # -- start and stop --------------------------------------------------------------

    async def start(self) -> None:
        self._session = new_session()
        await self.store.open()
        await self.ledger.restore(self.store)
        self.residency.reader = await asyncio.to_thread(nvml_reader)
        await self._recover_records()
        await self.pauses.restore()
        for served in self.served:
            if served.config.persistent and not self.pauses.paused("model", served.name):
                self._background(self._preload(served))
        self._background(self._reaper())
        self._background(self.activity.run())
        self._background(self._housekeeping())

    async def stop(self) -> None:
        """Stop every backend this gateway started; nothing is left behind (L5)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(sup.stop() for sup in self.supervisors.values()))
        try:
            await self.activity.flush()
        finally:
            await self.store.close()
        if self._session is not None:
            await self._session.close()

    async def _recover_records(self) -> None:
        """After a crash: re-adopt healthy recorded backends, reap the rest (L5)."""
        records = PidRecords(self.home)
        adoptions = []
        for record in records.all():
            sup = self.supervisors.get(record.backend)
            if sup is not None:
                adoptions.append(sup.adopt(record))
            elif record.is_alive():  # a backend no longer configured: ours, so stop it
                proc = adopt(record.pid, record.started)
                adoptions.append(stop_group(record.pgid, proc.exited, 10.0))
                records.remove(record.backend)
            else:
                records.remove(record.backend)
        await asyncio.gather(*adoptions)

    async def _preload(self, served: ServedModel) -> None:
        """R3: persistent models are loaded at boot."""
        try:
            await served.primary.endpoint.ensure_ready()
        except LifecycleError as exc:
            log.warning("preload of %s failed: %s", served.name, exc)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(REAPER_SECONDS)
            try:
                self.admission.expire_leases()
                self.publish_load()
                await self.residency.reap_expired()
                await self.pauses.expire()
            except Exception:
                log.exception("reaper pass failed; trying again")

    async def _housekeeping(self) -> None:
        """C4: queue depth sampled every few seconds; activity past retention pruned hourly."""
        last_prune = 0.0
        while True:
            await asyncio.sleep(QUEUE_SAMPLE_SECONDS)
            try:
                now = time.time()
                samples = []
                for route_id in self.routes:
                    _, in_flight, waiting = self.admission.core.load(route_id)
                    if waiting or in_flight:  # an idle backend's absence reads as zero
                        samples.append((route_id, waiting, in_flight))
                await queries.record_queue_depth(self.store, now, samples)
                self.events.publish(
                    "queue_depth",
                    {
                        "points": [
                            {"backend": b, "waiting": w, "in_flight": f} for b, w, f in samples
                        ]
                    },
                )
                if now - last_prune >= PRUNE_SECONDS:
                    last_prune = now
                    pruned = await queries.prune(self.store, now - self.activity_retention)
                    if pruned:
                        log.info("pruned %d activity rows older than the retention", pruned)
            except Exception:
                log.exception("housekeeping pass failed; trying again")

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _log_transition(sup: Supervisor, old: State, new: State) -> None:
    log.info("backend=%s transition=%s->%s pid=%s", sup.id, old, new, sup.pid)
