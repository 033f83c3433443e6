"""The one request pipeline (SPEC §3-§9): every surface that admits a request goes through
the same gates, in the same order, here and nowhere else.

    keys -> lookup -> allowlist -> modes -> pause -> rate limits -> spend reservation
      -> admission -> ready + enter -> [the surface's work: forward, relay] -> leave
      -> release -> rate limits settled -> settle

A surface (chat and friends, audio uploads and speech, realtime sessions, and later other
dialects) is a codec around this: it reads its request into an `Inbound`, supplies the
`work` that talks to the admitted backend, and renders the `ApiError`s raised here in its
own shape. Reservations and the `/upstream` passthrough use the first gates (`gates()`)
and the lifecycle table, not copies of them.

What the pipeline owns beyond the gates: re-routing a request whose backend a config
reload took away while it waited (P6), putting a preempted request that sent nothing
back in its queue (S4), the client's disconnect while it waits (S7), and the live-request
registry (SPEC §21 O1): each request is named (`X-Corrallm-Request-Id`), listed while it
is held, and may be cancelled by an operator wherever it is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import aiohttp

from corrallm.auth.callers import Caller, trusts_user, user_named
from corrallm.auth.keys import Identity
from corrallm.auth.keys import RevokedSecret as Refused
from corrallm.auth.limits import Hold, Remaining
from corrallm.auth.limits import LimitRefusal as LimitRefused
from corrallm.auth.throttle import asks_of
from corrallm.config.schema import BackendConfig as Backend
from corrallm.cost.ledger import UNKNOWN_MODEL, Visit
from corrallm.http.asgi import Headers, Scope, header
from corrallm.http.client import Client
from corrallm.http.errors import ApiError, lifecycle_failure, not_found, quoted
from corrallm.lifecycle.errors import RETIRED, BackendPaused, LifecycleError
from corrallm.lifecycle.supervisor import Cause
from corrallm.observe.context import CURRENT, answer_begun, new_request_id
from corrallm.observe.live import LiveRequest
from corrallm.peers.endpoint import PeerEndpoint
from corrallm.proxy.feedback import (
    Narrator,
    QueueNote,
    StreamFeedback,
    Waited,
    Waiting,
    load_note,
)
from corrallm.proxy.forward import DisconnectWatch, new_session, request_headers
from corrallm.proxy.refusals import (
    PREEMPTED,
    cancelled,
    model_paused,
    peer_down,
    rate_limited,
    spend_limited,
    too_many_requests,
)
from corrallm.proxy.runtime import Runtime
from corrallm.routing.router import Route, ServedModel
from corrallm.scheduler.admission import Rejected
from corrallm.scheduler.ticket import Interrupt, Interruption, Progress, Stop, Ticket

if TYPE_CHECKING:
    from corrallm.gateway import Gateway


@dataclass(slots=True)
class Inbound:
    """One request as its surface read it: what the gates need to know."""

    model: str
    endpoint: str  # the path, as recorded in the activity row
    key: str | None  # the caller's API key, if it sent one
    size: int = 0  # bytes in
    mode: str | None = None  # the STT surface it came in on, gated by the model's modes (U3)
    limit: int | None = None  # the completion tokens it asks for, for the spend estimate
    session: str | None = None  # the conversation it belongs to, for affinity (K6)
    stream: bool = False  # the client asked for a streamed answer
    # T4: the user behind a trusted key, for a surface without an exchange (realtime);
    # the HTTP surfaces' is the exchange's, read by the app with the caller.
    user: str | None = None


@dataclass(slots=True)
class Admitted:
    """A request holding a slot on a ready backend, counted in flight there."""

    served: ServedModel
    caller: Caller
    ticket: Ticket
    visit: Visit
    waited: Waited
    live: LiveRequest  # the surface sets `live.meter` so tokens so far can be listed (O1)

    @property
    def route(self) -> Route:
        return self.ticket.route

    @property
    def progress(self) -> Progress:
        """The relay's progress with this attempt's answer (what the pipeline reads)."""
        return self.ticket.progress

    def upstream_headers(
        self, raw: Sequence[tuple[bytes, bytes]], url: str, method: str = "POST"
    ) -> Headers:
        """The request's headers for its backend: the caller's identity left out, the
        backend's own `headers` added, and across a hop the caller's lane, signed (X3)
        for this one request (`method` to `url`: T5)."""
        route = self.route
        extra = route.config.headers
        if isinstance(route.endpoint, PeerEndpoint):
            lane = route.endpoint.hop_headers(self.caller.group_name, method, urlsplit(url).path)
            extra = {**extra, **lane}
        return request_headers(raw, extra)


# The surface's part: talk to the admitted backend (proxy/relay.py), fill in
# `visit.metered`/`ttfb_ms`, and return the status to record. The relay keeps
# `admitted.progress`, which says how an interruption may end the answer.
Work = Callable[[Admitted], Awaitable[int]]


class Pipeline:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.upstream = Client()  # the hot path's pooled HTTP/1.1 client
        self._websockets: aiohttp.ClientSession | None = None

    @property
    def websockets(self) -> aiohttp.ClientSession:
        """The realtime relay's upstream WebSockets (not the hot path), opened on first use."""
        if self._websockets is None:
            self._websockets = new_session()
        return self._websockets

    @property
    def gw(self) -> Gateway:
        """The whole gateway, for the surfaces that are not requests on a backend
        (reservations, the model catalog); the request path reads `runtime` only."""
        return cast("Gateway", self.runtime)

    async def close(self) -> None:
        await self.upstream.close()
        if self._websockets is not None:
            await self._websockets.close()

    def has_choice(self, model: str) -> bool:
        """Whether a request for `model` may have a choice of backend (not an unknown
        name: the gates refuse it, and nothing of it is worth hashing)."""
        served = self.runtime.models.get(model)
        return served is not None and len(served.routes) > 1

    # -- the first gates, also for reservations and /upstream ------------------------

    def lookup(self, model: str, reloaded: bool = False) -> ServedModel:
        served = self.runtime.models.get(model)
        if served is None:
            # Raised as made, never held in a local: an exception in a local of a frame
            # its traceback holds is a cycle, and the request's body with it would wait
            # for the cyclic collector (T5: a flood of them is memory held).
            raise self._not_served(model, reloaded)
        return served

    def _not_served(self, model: str, reloaded: bool) -> ApiError:
        names = ", ".join(s.name for s in self.runtime.served if not s.config.unlisted)
        what = (
            "was removed by a config reload while this request waited"
            if reloaded
            else "does not exist here"
        )
        error = not_found(
            f"The model '{quoted(model)}' {what}. Served models: {names or 'none'}. "
            "GET /v1/models lists them with their aliases.",
            code="model_not_found",
        )
        if not reloaded:  # T5: the name is the caller's: rows say only that much
            error.recorded = "model_not_found: the model asked for is not served here"
        return error

    def gates(self, inbound: Inbound, caller: Caller) -> ServedModel:
        """keys -> lookup -> allowlist -> modes -> pause: everything decided before money
        or slots."""
        self.check_key(caller)
        served = self.lookup(inbound.model)
        self.check_allowed(caller, served)
        if inbound.mode is not None and not offered(served, inbound.mode):
            raise not_found(
                f"The model '{served.name}' is not offered on {inbound.endpoint}: its modes "
                f"are {', '.join(modes_of(served))}. GET /v1/capabilities lists each "
                "surface's models.",
                code="model_not_found",
            )
        if self.runtime.paused("model", served.name):
            raise model_paused(served.name, self.runtime.pause_remaining("model", served.name))
        return served

    def identify(self, scope: Scope, signed: str | None = None) -> Caller:
        """T1/T5: the caller, from the request head alone (no body byte read yet); a key
        refused here is refused before the body is read. A key with rate limits gets its
        counts on whatever answer follows (T3; once admitted, the counts after it)."""
        caller = self.runtime.caller(caller_key(scope), signed)
        self.check_key(caller)
        exchange = CURRENT.get()
        if exchange is not None:
            exchange.user = self.user_of(scope, caller)  # T4, before its limits are read
        identity = caller.identity
        if exchange is not None and identity is not None and identity.limits is not None:
            exchange.counts = partial(self.runtime.throttle.counts, identity, exchange.user)
        return caller

    def user_of(self, scope: Scope, caller: Caller) -> str | None:
        """T4: the user a key with `trustUserHeader` names in `auth.userHeader`; None for
        every other caller, whose user header is ignored (anybody can send one)."""
        name = self.runtime.user_header()
        if name is None or not trusts_user(caller):
            return None
        raw = header(scope, name)
        return None if raw is None else user_named(raw)

    def caller_of(self, scope: Scope) -> Caller:
        """The caller the app judged from this request's head, else judged now."""
        exchange = CURRENT.get()
        if exchange is not None and exchange.caller is not None:
            return exchange.caller
        return self.identify(scope, exchange.lane if exchange is not None else None)

    def check_allowed(self, caller: Caller, served: ServedModel) -> None:
        """T3: a key with a `models` allowlist may use only the models it names, by name
        or by any alias."""
        identity = caller.identity
        if identity is None or not identity.models:
            return
        verdict = caller.allowed.get(served.name)
        if verdict is None:
            verdict = caller.allowed[served.name] = identity.allows(names_of(served))
        if verdict:
            return
        allowed = [
            s.name
            for s in self.runtime.served
            if not s.config.unlisted and identity.allows(names_of(s))
        ]
        raise ApiError(
            403,
            f"The API key '{identity.name}' may not use the model '{served.name}': its "
            f"models allowlist is {', '.join(identity.models)}. Use one of "
            f"{', '.join(allowed) or 'none'} (GET /v1/models lists what this key may use), "
            "or ask the gateway's operator to widen the key's models.",
            "model_not_allowed",
            type="permission_error",
        )

    def check_key(self, caller: Caller) -> None:
        if caller.refused is not None:  # T2: refused whatever requireKeys says
            raise key_refused(caller.refused)
        identity = caller.identity
        if identity is not None and identity.expires is not None and identity.expired(time.time()):
            raise ApiError(
                401,
                f"The API key '{identity.name}' has expired; ask the gateway's operator "
                "for a new one.",
                "key_expired",
                type="authentication_error",
            )
        if not caller.known and self.runtime.config.scheduler.require_keys:
            raise ApiError(
                401,
                "This gateway serves only configured API keys (scheduler.requireKeys); send "
                "yours as 'Authorization: Bearer <key>' or 'X-Corrallm-Key'.",
                "invalid_api_key",
                type="authentication_error",
            )

    # -- the whole way -----------------------------------------------------------------

    async def run(
        self,
        inbound: Inbound,
        work: Work,
        watch: DisconnectWatch | None = None,
        waiting: Waiting | None = None,
    ) -> None:
        """Admit `inbound`, have `work` done on a ready backend, and account for it.

        Raises the `ApiError` a surface renders (with how long it waited in its headers),
        or returns once the answer is over. A client gone (`watch`) is recorded as 499.
        With `waiting`, a request that waits is told why (K4) as its lane's `feedback`
        says."""
        rt = self.runtime
        exchange = CURRENT.get()
        hop = exchange is not None and exchange.hop
        caller = exchange.caller if exchange is not None else None
        if caller is None:  # a surface without an exchange (realtime): judged here
            caller = rt.caller(inbound.key, exchange.lane if exchange is not None else None)
        known = rt.models.get(inbound.model)
        visit = Visit(
            caller.name,
            caller.group_name,
            known.name if known is not None else UNKNOWN_MODEL,  # T5: never the caller's
            inbound.endpoint,
            inbound.size,
        )
        if exchange is not None:
            visit.request_id, exchange.visit = exchange.id, visit
        else:
            visit.request_id = new_request_id()
        visit.stream = inbound.stream
        visit.user = exchange.user if exchange is not None else inbound.user
        live = rt.live.enter(visit)
        trace = None
        tracer = rt.tracer
        if tracer is not None:  # E2: off, this and `trace`'s test at the end are all it costs
            scope = exchange.scope if exchange is not None else None
            headers = scope["headers"] if scope is not None else None
            trace = tracer.begin(visit, inbound.model, inbound.limit, headers)
        # The request's one record of why it stopped early, shared by whoever may stop
        # it: its ticket (admission), its live entry (an operator), its client's watch.
        stop = Stop(live.task)
        live.stop = stop.cancel
        if watch is not None:
            watch.stop = stop
        flight = _Flight(caller, visit, inbound, work, stop, live, hop)
        if waiting is not None:
            own = caller.group.feedback if caller.group else None
            settings = rt.config.feedback.merged(own)
            if settings.enabled:
                flight.narrator = Narrator(waiting, settings, visit.arrived_mono)
        try:
            served = self.gates(inbound, caller)
            if hop and not served.local:
                raise not_found(
                    f"The model '{served.name}' is served here only by peers, and this "
                    "request already crossed a hop from another gateway (it carries "
                    "X-Corrallm-Lane); it is not forwarded again. Send it to a node that "
                    "runs the model.",
                    code="model_not_found",
                )
            visit.model = served.name
            await self._admit_and_work(served, flight)
        except ApiError as exc:
            visit.status, visit.error = exc.status, exc.summary
            for name, value in flight.waited.headers().items():
                exc.headers.setdefault(name, value)
            raise
        except asyncio.CancelledError:
            visit.status, visit.error = 499, "the client went away"
            raise
        finally:
            visit.queue_ms, visit.load_ms = flight.waited.queue_ms, flight.waited.load_ms
            rt.live.leave(live)
            rt.settle(visit)
            if trace is not None:
                trace.end(visit, live.state == "running")

    async def run_http(
        self,
        inbound: Inbound,
        work: Work,
        watch: DisconnectWatch,
        feedback: StreamFeedback | None = None,
    ) -> None:
        """`run()` for an HTTP surface: once done, the client's disconnect is no longer
        watched; and a wait that fails after `feedback` opened the stream ends that stream
        with the surface's error event (a second response cannot be sent)."""
        try:
            await self.run(inbound, work, watch, feedback)
        except ApiError as exc:
            if feedback is None or not feedback.opened:
                raise
            await feedback.fail(exc)
        finally:
            watch.close()

    # -- the phases of one request, once past the gates --------------------------------

    async def _admit_and_work(self, served: ServedModel, flight: _Flight) -> None:
        """limits and spend -> queue -> [load -> work | route again | requeue]... ; an
        interrupt at any phase is read from the request's `Stop` (`_interrupted`)."""
        rt, caller, visit, inbound = self.runtime, flight.caller, flight.visit, flight.inbound
        tiers = served.tiers_for(caller.group, rt.placeable, flight.hop)
        identity = caller.identity
        # T3: the key's (and its user's) rate limits, held until the request is over,
        # whatever ends it (released in `finally`). In memory no coroutine of its own:
        # every await level is walked again at each resume of the request (app.py).
        limits: Hold | None = None
        if identity is not None and identity.limits is not None:
            got = self._rate_limits(flight, identity, tiers[0][0].config)
            limits = got if got is None or isinstance(got, Hold) else await got
        ticket: Ticket | None = None
        try:
            key_limit = identity.spend_limit if identity is not None else None
            over = await rt.ledger.reserve(visit, tiers[0][0].config, inbound.limit, key_limit)
            if over is not None:
                raise spend_limited(over)
            ticket = await self._queue(flight, tiers)
            while ticket is not None:
                flight.ticket = ticket
                if rt.stale(ticket.route):
                    # P6: a reload removed or replaced the backend while this request
                    # waited for it (or for its cold start): route it again under the
                    # config now in force, its slot given back.
                    rt.admission.release(ticket)
                    ticket = flight.ticket = None
                    served = self.lookup(served.name, reloaded=True)
                    tiers = served.tiers_for(caller.group, rt.placeable, flight.hop)
                    if all(rt.stale(r) for tier in tiers for r in tier):
                        await ready(tiers[0][0])  # raises why (X4: every peer of it down)
                    ticket = await self._queue(flight, tiers)
                    continue
                ticket = await self._work(served, flight, ticket, tiers)
        except Rejected as exc:
            raise too_many_requests(exc) from None
        except asyncio.CancelledError:
            why = flight.stop.absorb()
            if why is None:
                raise
            if why.reason is Interrupt.CLIENT_GONE:
                visit.status, visit.error = 499, "the client went away"
                return  # its slot is free and its upstream request dropped
            if why.reason is Interrupt.CANCELLED:
                raise cancelled(flight.live) from None  # queued or loading: nothing sent
            raise
        finally:
            ticket = flight.ticket
            tokens = visit.metered.tokens if visit.metered else 0
            if ticket is not None:
                rt.admission.release(ticket, tokens, rt.ledger.price(visit).cost_usd)
            if limits is not None:
                rt.throttle.release(limits, tokens)

    def _queue(self, flight: _Flight, tiers: Sequence[Sequence[Route]]) -> Awaitable[Ticket]:
        """Queue: a slot on one backend of `tiers`, waiting for it as the lane says."""
        caller, admission = flight.caller, self.runtime.admission
        note = QueueNote(admission.core, tiers[0][0].id)
        admit = admission.acquire(
            caller.group_name, caller.group, tiers, flight.inbound.session, note.queued, flight.stop
        )
        return flight.queued(admit, note)

    async def _work(
        self, served: ServedModel, flight: _Flight, ticket: Ticket, tiers: Sequence[Sequence[Route]]
    ) -> Ticket | None:
        """Load, then work, on the admitted backend; None once the request is over, else
        the ticket to go on with (routed again: P6, X4; requeued: S4)."""
        rt, visit = self.runtime, flight.visit
        route = ticket.route
        # Admitted when its slot was granted: before the load its admission waited for.
        visit.admitted_mono = visit.admitted_mono or time.monotonic() - ticket.loaded_ms / 1000
        visit.backend, visit.backend_id = route.config, route.id
        visit.degraded = served.degraded(route)
        visit.spilled = route not in tiers[0]
        if ticket.progress.stage:
            # An attempt starts from nothing sent; a ticket's first `Progress` is fresh,
            # so a request tried once makes no second one.
            ticket.progress = Progress()
        admitted = Admitted(served, flight.caller, ticket, visit, flight.waited, flight.live)
        try:
            endpoint = route.endpoint
            if not endpoint.enter():  # else ready now: no wait to note
                flight.live.state = "loading"
                cause: Cause = (visit.key, flight.caller.group_name, served.name)  # who pays
                await flight.loading(enter_ready(route, cause), load_note(route, rt.config))
            flight.live.state = "running"
            try:
                visit.status = await flight.work(admitted)
            finally:
                endpoint.leave()
            return None
        except ApiError as exc:
            if exc.code == RETIRED and rt.stale(route):
                flight.stop.note(Interrupt.RETIRED, route.id)
                flight.stop.clear()
                return ticket  # nothing was sent: route it again
            if (
                isinstance(route.endpoint, PeerEndpoint)
                and exc.code in ("backend_error", "peer_down")
                and flight.peer_failures < MAX_PEER_FAILURES
            ):
                # X4: the peer's connection failed before it answered: down now, and this
                # request goes to another backend.
                flight.peer_failures += 1
                rt.peer_failed(route, exc.message)
                return ticket
            if exc.code == "upstream_timeout":
                flight.stop.note(Interrupt.UPSTREAM_TIMEOUT, route.id)
            raise
        except asyncio.CancelledError:
            why = flight.stop.why
            if why is None or why.reason is Interrupt.CLIENT_GONE:
                raise  # the phase above ends it (499), or it was not ours to handle
            if flight.stop.absorb() is None:
                raise
            return await self._interrupted(why, admitted, flight)

    async def _interrupted(
        self, why: Interruption, admitted: Admitted, flight: _Flight
    ) -> Ticket | None:
        """Interrupt handling, by the reason its stopper recorded: route it again or put
        it back in its queue when nothing reached the client; else end the answer under
        way in its dialect's shape, or cut it (a body that cannot end cleanly)."""
        ticket, visit, progress = admitted.ticket, flight.visit, admitted.progress
        nothing_sent = not progress.started or answer_begun() is False
        if why.reason is Interrupt.PEER_DOWN:  # X4
            if nothing_sent:
                flight.stop.clear()
                return ticket  # the route is stale now: routed again
            error = peer_down(ticket.route)
        elif why.reason is Interrupt.CANCELLED:  # O1
            error = cancelled(flight.live)
            if not progress.started or (progress.shielded and answer_begun() is False):
                raise error  # nothing of the backend's answer reached the client
        else:  # S4: preempted
            visit.preempted = True
            if not progress.started:  # only a delay for its client
                note = QueueNote(self.runtime.admission.core, ticket.route.id, ticket.id)
                flight.live.state = "queued"
                requeue = self.runtime.admission.requeue(ticket, flight.caller.group)
                return await flight.queued(requeue, note)
            if progress.render is not None:  # the surface ends what it began, cleanly
                await progress.render(PREEMPTED)
            return None
        visit.status, visit.error = error.status, f"{error.code}: {error.message}"
        if progress.render is not None:
            await progress.render(error)
        return None

    def _rate_limits(
        self, flight: _Flight, identity: Identity, backend: Backend
    ) -> Hold | Awaitable[Hold] | None:
        """T3: admit the request in its key's (and user's) windows, or refuse it (429
        `rate_limited`); the counts after it go on the answer. Decided at once in memory;
        an awaitable for the round trip to a shared store."""
        user = flight.visit.user
        asks = identity.asks if user is None else asks_of(identity, user)
        if not asks:
            return None
        throttle = self.runtime.throttle
        estimate = self.runtime.ledger.costs.estimate_tokens(
            backend, flight.inbound.size, flight.inbound.limit
        )
        verdict = throttle.admit_now(asks, estimate)
        if verdict is not None:
            return _passed(identity, verdict)

        async def shared() -> Hold:
            return _passed(identity, await throttle.admit(asks, estimate))

        return shared()


@dataclass(slots=True)
class _Flight:
    """One request on its way through `Pipeline.run`: who asked, what it waits for, what
    the surface does once it is admitted, and what stops it."""

    caller: Caller
    visit: Visit
    inbound: Inbound
    work: Work
    stop: Stop
    live: LiveRequest
    hop: bool = False  # it came from another gateway: never forwarded to a peer (X1)
    peer_failures: int = 0  # peers that failed it before answering (X4), each routed past
    narrator: Narrator | None = None
    waited: Waited = field(default_factory=Waited)
    ticket: Ticket | None = None  # the slot it holds now, released when it is over

    async def queued(self, admit: Awaitable[Ticket], note: QueueNote) -> Ticket:
        """The ticket `admit` gives; the time it waited in a queue added to `queue_ms`
        (K4): from when the admission queued it (`note.since`), so that a request
        admitted at once waited 0 ms. A load the admission waited for as well (a
        worker's owner loads before it admits) is load time, not queue time (K4, E2)."""
        ticket: Ticket | None = None
        try:
            if self.narrator is None:
                ticket = await admit
            else:
                ticket = await self.narrator.over(
                    admit, note, lambda: self._so_far(note.since, "queue")
                )
            return ticket
        finally:
            loaded = ticket.loaded_ms if ticket is not None else 0.0
            if note.since is not None:
                self.waited.queue_ms += max(0.0, (time.monotonic() - note.since) * 1000 - loaded)
            self.waited.load_ms += loaded

    async def loading(self, ready: Awaitable[None], note: Callable[[], str]) -> None:
        began = time.monotonic()
        try:
            if self.narrator is None:
                return await ready
            return await self.narrator.over(ready, note, lambda: self._so_far(began, "load"))
        finally:
            self.waited.load_ms += (time.monotonic() - began) * 1000

    def _so_far(self, began: float | None, phase: str) -> Waited:
        now = 0.0 if began is None else (time.monotonic() - began) * 1000
        queue, load = self.waited.queue_ms, self.waited.load_ms
        return Waited(queue + now, load) if phase == "queue" else Waited(queue, load + now)


# -- the gates' pieces, shared with the surfaces that use only some of them -------------


def key_refused(refused: Refused) -> ApiError:
    """T2: a secret revoked or rotated away, named by its key (never by the secret)."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(refused.at))
    if refused.reason == "rotated":
        why = (
            f"was rotated at {when}: this secret was replaced by a new one. Send the new "
            "secret (the operator received it from the rotation)."
        )
    else:
        why = f"was revoked at {when}. Ask the gateway's operator for a new key."
    return ApiError(
        401, f"The API key '{refused.name}' {why}", "invalid_api_key", type="authentication_error"
    )


def caller_key(scope: Scope) -> str | None:
    """The caller's API key: `Authorization: Bearer <key>`, `X-Corrallm-Key: <key>`, or
    `x-api-key: <key>` (what Anthropic clients send, SPEC §16 K1)."""
    raw = header(scope, b"x-corrallm-key")
    if raw:
        return raw.decode("latin-1").strip()
    auth = header(scope, b"authorization")
    if auth and auth[:7].lower() == b"bearer ":
        return auth[7:].decode("latin-1").strip() or None
    raw = header(scope, b"x-api-key")
    if raw:
        return raw.decode("latin-1").strip() or None
    return None


# Surfaces an STT model's `modes` gate (SPEC §12 U3); empty modes offer both.
SURFACE_MODE = {
    "/v1/audio/transcriptions": "batch",
    "/v1/audio/translations": "batch",
    "/v1/realtime": "realtime",
}


def names_of(served: ServedModel) -> tuple[str, ...]:
    """What a model answers to: its name and its aliases (T3's allowlist matches either)."""
    return (served.name, *served.config.aliases)


def modes_of(served: ServedModel) -> list[str]:
    modes = {m for r in served.routes for m in r.config.modes}
    return sorted(modes) or ["batch", "realtime"]


def offered(served: ServedModel, mode: str) -> bool:
    return mode in modes_of(served)


async def ready(route: Route, cause: Cause | None = None) -> None:
    """Wait until the route's backend is ready (starting it), errors as the table says."""
    try:
        await route.endpoint.ensure_ready(cause)
    except BackendPaused as exc:
        raise model_paused(route.model) from exc
    except LifecycleError as exc:
        raise lifecycle_failure(exc) from exc


async def enter_ready(route: Route, cause: Cause | None = None) -> None:
    """Wait until the backend is ready and count this request in flight on it."""
    while True:
        await ready(route, cause)
        if route.endpoint.enter():
            return


# X4: a request is routed past this many peers whose connection failed before answering
# (a peer that keeps failing so, yet whose events stream reconnects, must not spin it).
MAX_PEER_FAILURES = 3


def _passed(identity: Identity, verdict: Hold | tuple[LimitRefused, Remaining]) -> Hold:
    """The request's place in its windows, its counts put on the answer; or 429."""
    exchange = CURRENT.get()
    if not isinstance(verdict, Hold):
        refused, remaining = verdict
        if exchange is not None:
            exchange.headers = remaining.headers()
        raise rate_limited(identity.name, refused)
    if exchange is not None:
        exchange.headers = verdict.headers
    return verdict
