"""The running gateway: served models, their routes and process supervisors, built once
from the config. Everything per-request reads prebuilt tables; nothing here parses config
on the hot path."""

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
from corrallm.config.schema import PriorityGroup, ProcessSpec
from corrallm.lifecycle.pidrecords import PidRecords
from corrallm.lifecycle.process import adopt, stop_group
from corrallm.lifecycle.remote import RemoteEndpoint
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import LifecycleError, Supervisor, resolve_url
from corrallm.proxy.forward import new_session
from corrallm.routing.router import Endpoint, Route, ServedModel
from corrallm.scheduler.fifo import SlotGate

log = logging.getLogger("corrallm.lifecycle")

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2)


@dataclass(frozen=True)
class Caller:
    key: str | None
    group_name: str
    group: PriorityGroup | None


class Gateway:
    def __init__(self, config: Config, home: Path, health_timeout: float = 120.0) -> None:
        self.config = config
        self.home = home
        self.health_timeout = health_timeout
        self.started_at = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self.supervisors: dict[str, Supervisor] = {}
        self.routes: dict[str, Route] = {}
        self.models: dict[str, ServedModel] = {}  # by name and by alias
        self.served: list[ServedModel] = []  # each once, in config order
        self._tasks: set[asyncio.Task[None]] = set()
        self._build()

    # -- built once ------------------------------------------------------------------

    def _build(self) -> None:
        extensions = {
            name: self._supervisor(f"extension:{name}", spec)
            for name, spec in self.config.extensions.items()
        }
        for name, model in self.config.models.items():
            routes = []
            for index, backend in enumerate(model.backends):
                bid = backend_id(name, index, backend)
                endpoint: Endpoint
                if backend.extension:
                    endpoint = extensions[backend.extension]
                elif backend.cmd:
                    endpoint = self._supervisor(bid, backend)
                else:
                    assert backend.proxy is not None, "validated config"
                    endpoint = RemoteEndpoint(bid, resolve_url(backend.proxy, None))
                route = Route(bid, name, backend, endpoint, SlotGate(backend.max_concurrent))
                routes.append(route)
                self.routes[bid] = route
            served = ServedModel(name, model, routes)
            self.served.append(served)
            for key in (name, *model.aliases):
                self.models[key] = served
        self._groups = dict(self.config.priority_groups)
        self._default = self.config.scheduler.default_group

    def _supervisor(self, sid: str, spec: ProcessSpec) -> Supervisor:
        sup = Supervisor(
            sid, spec, self.probe, self.home, self.health_timeout, listeners=[_log_transition]
        )
        self.supervisors[sid] = sup
        return sup

    # -- callers ---------------------------------------------------------------------

    def caller(self, key: str | None) -> Caller:
        group_name = self.config.keys.get(key, self._default) if key else self._default
        return Caller(key, group_name, self._groups.get(group_name))

    @property
    def session(self) -> aiohttp.ClientSession:
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
        await self._recover_records()
        for served in self.served:
            if served.config.persistent:
                self._background(self._preload(served))

    async def stop(self) -> None:
        """Stop every backend this gateway started; nothing is left behind (L5)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(sup.stop() for sup in self.supervisors.values()))
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
        try:
            await served.primary.endpoint.ensure_ready()
        except LifecycleError as exc:
            log.warning("preload of %s failed: %s", served.name, exc)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _log_transition(sup: Supervisor, old: State, new: State) -> None:
    log.info("backend=%s transition=%s->%s pid=%s", sup.id, old, new, sup.pid)
