"""The running gateway: the long-lived owners, and the topology the config makes of them.

Two kinds of state, kept apart (docs/design.md, "Who owns what"):
- the topology (topology.py): served models, routes, the supervisor of each process, what
  each asks of the pools. Derived from the config by a pure build, swapped as a whole by
  `reconfigure()` on a reload;
- the long-lived owners, built once here and never rebuilt: the store and the activity
  writer, the ledger (spend windows), admission (lanes, slots, queues, leases), residency
  (pools, with the NVML reader), pauses, the transition bus, events, metrics and
  telemetry. Each subscribes once to the bus; a reload hands them the new topology's
  parts and keeps what they have counted. The tracer (E2) alone is replaced when a
  reload changes `telemetry`, its queued spans sent first.

Everything per-request reads prebuilt tables; nothing here parses config on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, Literal

from corrallm.auth.callers import Caller, Callers
from corrallm.auth.keys import KeyRing
from corrallm.auth.runtime import RuntimeKeys
from corrallm.auth.throttle import Throttle
from corrallm.config import Config
from corrallm.config.schema import ProcessSpec
from corrallm.cost.economics import Economics
from corrallm.cost.ledger import Ledger, Visit
from corrallm.cost.model import Price
from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.pauses import Pauses
from corrallm.lifecycle.probe import HealthProbe
from corrallm.lifecycle.recovery import recover
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.lifecycle.transitions import Transitions
from corrallm.observe.captures import Captures
from corrallm.observe.events import EventBus
from corrallm.observe.live import LiveRequests
from corrallm.observe.metrics import Metrics
from corrallm.observe.telemetry import Telemetry
from corrallm.observe.traces import Tracer, retrace, tracer_for
from corrallm.peers.catalog import PeerView
from corrallm.peers.endpoint import PeerEndpoint
from corrallm.peers.nodes import Nodes
from corrallm.residency.footprints import estimate_footprints
from corrallm.residency.manager import Residency
from corrallm.residency.measure import memory_reader
from corrallm.routing.router import Route, ServedModel
from corrallm.scheduler.admission import Admission
from corrallm.store import queries
from corrallm.store.activity import ActivityLog
from corrallm.store.db import Store
from corrallm.store.location import store_at
from corrallm.topology import Topology, build

log = logging.getLogger("corrallm.lifecycle")

__all__ = ["Caller", "Gateway"]


class Gateway:
    def __init__(
        self,
        config: Config,
        home: Path,
        health_timeout: float = 120.0,
        db_path: Path | str | None = None,
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
        self._tasks: set[asyncio.Task[None]] = set()
        # Who hears each new topology once it is in force (the relaying workers' owner,
        # corrallm/workers/owner.py, sends the config on to its workers).
        self.swapped: list[Callable[[Topology], None]] = []
        # What a change is answered only after (a reload; a key made, rotated, revoked):
        # every relaying worker has it in force (workers/owner.py's `in_force`).
        self.settling: list[Callable[[], Awaitable[None]]] = []
        # -- the long-lived owners ---------------------------------------------------
        self.probe = HealthProbe()
        self.db = db_path or home / "corrallm.db"  # X5: a URL is PostgreSQL
        self.store = store_at(self.db)
        self.activity = ActivityLog(self.store)
        self.ledger = Ledger(config, self.activity)
        self.events = EventBus()
        self.bus: Transitions[Supervisor] = Transitions()
        self.metrics = Metrics(self)
        self.residency = Residency({}, bus=self.bus)
        self.nodes = Nodes(self.refresh_peers, self._peer_moved)
        self.nodes.reconfigure(config)
        self.economics = Economics(
            self.bus, self.store, self.residency, lambda: self.config.ledger.gpu_hour_price
        )
        self._footprints = estimate_footprints(config)[0]
        self.topology = build(
            config, self._new_supervisor, footprints=self._footprints, nodes=self.nodes
        )
        self.keys = KeyRing()  # T1/T2: the config's keys and the runtime ones, as digests
        self.keys.reconfigure(config.keys)
        self.callers = Callers(config, self.keys)
        self.runtime_keys = RuntimeKeys(self.store, self.keys)  # T2: the API's keys, last_used
        self.throttle = Throttle(self.store)  # T3: per-key rpm, tpm and concurrency
        self.admission = Admission(config, self.routes)
        self.pauses = Pauses(self.store, self.topology.pausables())
        self.captures = Captures(config, self.keys)
        self.live = LiveRequests(self.events)
        self.telemetry = Telemetry(
            self.ledger,
            self.metrics,
            self.events,
            lambda: self.admission,
            lambda sup: self.topology.models_of(sup),
            lambda: list(self.routes),
        )
        self.telemetry.subscribe(self.bus)
        self._place(self.topology)
        # E2: None unless telemetry.otlp is set (the SDK loaded, or MissingExtra); last,
        # as its exporter starts a thread.
        self.tracer: Tracer | None = tracer_for(config.telemetry)

    # -- the topology in force -----------------------------------------------------------

    @property
    def config(self) -> Config:
        return self.topology.config

    @property
    def supervisors(self) -> dict[str, Supervisor]:
        return self.topology.supervisors

    @property
    def extensions(self) -> dict[str, Supervisor]:
        return self.topology.extensions

    @property
    def routes(self) -> dict[str, Route]:
        return self.topology.routes

    @property
    def models(self) -> dict[str, ServedModel]:
        return self.topology.models

    @property
    def served(self) -> list[ServedModel]:
        return self.topology.served

    def caller(self, key: str | None, signed: str | None = None) -> Caller:
        return self.callers(key, signed)

    def own_supervisors(self, served: ServedModel) -> list[Supervisor]:
        return self.topology.own_supervisors(served)

    def reconfigure(self, config: Config) -> Topology:
        """P6: build the new config's topology (unchanged processes carried over), swap it
        in, and hand its parts to the long-lived owners. Returns the topology it replaced;
        retiring the processes that left it is the caller's (api/reload.py)."""
        previous = self.topology
        self.nodes.reconfigure(config)
        self._footprints = estimate_footprints(config)[0]
        self.ledger.reconfigure(config)
        self.captures.reconfigure(config)
        self.keys.reconfigure(config.keys)
        self.callers.reconfigure(config)
        if config.telemetry != previous.config.telemetry:
            self.tracer = retrace(self.tracer, config.telemetry)  # E2
        self._swap(config)
        return previous

    def refresh_peers(self) -> None:
        """X1: a peer's models changed (or it connected): the same config, new routes."""
        self._swap(self.config)

    def _swap(self, config: Config) -> None:
        topology = build(
            config, self._new_supervisor, self.topology.supervisors, self._footprints, self.nodes
        )
        self.topology = topology
        self.version += 1
        self.admission.reconfigure(config, topology.routes)
        self.pauses.targets = topology.pausables()
        self._place(topology)
        for hear in self.swapped:
            hear(topology)

    def _peer_moved(self, view: PeerView) -> None:
        """X4: a peer went down (its requests are moved off it) or came back."""
        self.events.publish("peer", view.view())
        if not view.up:
            self.admission.evacuate(
                {r.id for r in self.routes.values() if r.endpoint.describe().node == view.name}
            )

    def stale(self, route: Route) -> bool:
        """Whether a route taken before a config reload no longer leads to a backend of
        the config in force (removed, or replaced by one with a new spec)."""
        endpoint = route.endpoint
        if endpoint.kind == "peer" and not endpoint.available():
            return True  # X4: its peer went down while the request waited for it
        return route.id not in self.topology.routes or endpoint.retired

    def placeable(self, route: Route) -> bool:
        """Could this route serve now without waiting for memory (R2 spill)?"""
        endpoint = route.endpoint
        return endpoint.kind != "process" or self.residency.could_fit(endpoint)

    # -- the rest of what a request asks (proxy/runtime.py's Runtime) ---------------------

    def user_header(self) -> bytes | None:
        return self.callers.user_header

    def paused(self, kind: Literal["model", "extension"], name: str) -> bool:
        return self.pauses.paused(kind, name)

    def pause_remaining(self, kind: Literal["model", "extension"], name: str) -> float | None:
        return self.pauses.remaining(kind, name)

    def upstream_idle(self, route: Route) -> float:
        return self.config.upstream_idle(route.config)

    def peer_failed(self, route: Route, message: str) -> None:
        endpoint = route.endpoint
        if isinstance(endpoint, PeerEndpoint):
            self.nodes.suspect(endpoint.peer, message)

    def settle(self, visit: Visit) -> None:
        """A request is over: its cost, spend, activity row, metrics and usage event."""
        self.runtime_keys.used(visit.key, time.time())
        self.telemetry.settle(visit)

    def charge(
        self, visit: Visit, price: Price, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """A request a relaying worker settled (its activity row written and its metrics
        counted there): what only this owner of state keeps of it."""
        self.runtime_keys.used(visit.key, time.time())
        self.telemetry.charge(visit, price, prompt_tokens, completion_tokens)

    def _new_supervisor(self, sid: str, spec: ProcessSpec) -> Supervisor:
        return Supervisor(
            sid,
            spec,
            self.probe,
            self.home,
            self.health_timeout,
            bus=self.bus,
            room=self.residency.make_room,
            call=self.probe.call,
        )

    def _place(self, topology: Topology) -> None:
        config = topology.config
        self.residency.reconfigure(
            dict(config.servers), config.scheduler.max_wait, topology.tenancies
        )

    # -- start and stop --------------------------------------------------------------

    async def start(self) -> None:
        self.probe.open()
        await self.store.open()
        await self.residency.restore(self.store)  # M2: what earlier runs measured
        await self.runtime_keys.restore()  # T2: the API's keys, before their spend windows
        # S6, T3: the spend still in the windows of lanes and of keys with a spendLimit
        # (the runtime keys must be in the ring by now to have theirs restored).
        await self.ledger.restore(
            self.store, [(i.name, i.spend_limit) for i in self.keys.all() if i.spend_limit]
        )
        await self.economics.start()
        self.residency.reader = await asyncio.to_thread(memory_reader)
        await recover(self.home, self.supervisors)
        await self.pauses.restore()
        self.background(self.pauses.follow())  # X5: other gateways' pauses (shared store)
        self.background(self.runtime_keys.follow())  # T2: other gateways' keys (shared store)
        self.background(self.runtime_keys.run())
        await self.nodes.start()
        self.preload()
        self.background(reaper(self.admission, self.telemetry, self.residency, self.pauses))
        self.background(self.activity.run())
        self.background(
            housekeeping(
                self.admission,
                lambda: list(self.routes),
                self.store,
                self.events,
                self.activity_retention,
            )
        )

    async def stop(self) -> None:
        """Stop every backend this gateway started; nothing is left behind (L5)."""
        for task in self._tasks:
            task.cancel()
        self.admission.end_leases()  # T5: what live leases held is charged before the flush
        await self.nodes.close()
        await asyncio.gather(*(sup.stop() for sup in self.supervisors.values()))
        await self.residency.close()
        try:
            await self.economics.stop()
        finally:
            try:
                await self.ledger.flush()  # X5: spend settlements queued for a shared store
                await self.throttle.flush()  # X5, T3: and rate-limit settlements
                await self.activity.flush()
                await self.runtime_keys.flush()
            finally:
                await self.store.close()
        await self.probe.close()
        if self.tracer is not None:  # E2: queued spans sent, bounded (a collector down)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self.tracer.close), TRACES_CLOSE_SECONDS)

    def preload(self) -> None:
        """R3: persistent models are loaded at boot (and after a reload), unless paused."""
        for served in self.served:
            if served.config.persistent and not self.pauses.paused("model", served.name):
                self.background(_preload(served))

    async def in_force(self) -> None:
        """Return once a change made here is in force wherever requests are served."""
        for settle in self.settling:
            await settle()

    def background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `coro` as a task the gateway keeps (and cancels at shutdown)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _preload(served: ServedModel) -> None:
    try:
        await served.primary.endpoint.ensure_ready()
    except LifecycleError as exc:
        log.warning("preload of %s failed: %s", served.name, exc)


# The gateway's periodic work, off the request path: the reaper (every second: expired
# leases, live admission load, ttl-expired residents, expired pauses) and housekeeping
# (queue depth sampled every few seconds, C4; activity past retention pruned hourly).
# Each pass that fails is logged and tried again; neither loop ever dies of an error.


REAPER_SECONDS = 1.0
TRACES_CLOSE_SECONDS = 5.0  # at shutdown: the spans still queued, sent within this
QUEUE_SAMPLE_SECONDS = 5.0
PRUNE_SECONDS = 3600.0


async def reaper(
    admission: Admission, telemetry: Telemetry, residency: Residency, pauses: Pauses
) -> None:
    while True:
        await asyncio.sleep(REAPER_SECONDS)
        try:
            admission.expire_leases()
            telemetry.publish_load()
            await residency.reap_expired()
            await pauses.expire()
        except Exception:
            log.exception("reaper pass failed; trying again")


async def housekeeping(
    admission: Admission,
    route_ids: Callable[[], Iterable[str]],
    store: Store,
    events: EventBus,
    retention: float,
) -> None:
    last_prune = 0.0
    while True:
        await asyncio.sleep(QUEUE_SAMPLE_SECONDS)
        try:
            now = time.time()
            samples = []
            for route_id in route_ids():
                _, in_flight, waiting = admission.core.load(route_id)
                if waiting or in_flight:  # an idle backend's absence reads as zero
                    samples.append((route_id, waiting, in_flight))
            await queries.record_queue_depth(store, now, samples)
            events.publish(
                "queue_depth",
                {"points": [{"backend": b, "waiting": w, "in_flight": f} for b, w, f in samples]},
            )
            if now - last_prune >= PRUNE_SECONDS:
                last_prune = now
                pruned = await queries.prune(store, now - retention)
                if pruned:
                    log.info("pruned %d activity rows older than the retention", pruned)
        except Exception:
            log.exception("housekeeping pass failed; trying again")
