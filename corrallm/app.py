"""The ASGI application: the /v1 surface in raw ASGI (the hot path), liveness, the
management API and the dashboard, and lifespan. It composes the layers below it (the
gateway's owners, the request pipeline and its surfaces, the management API, the
dashboard) and nothing below imports it.

Raw ASGI rather than Starlette routing on /v1: the overhead benchmark (bench/overhead.py)
is what decides, and every microsecond here is added to every request.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from corrallm.api.auth import authorized, canonical
from corrallm.gateway import Gateway
from corrallm.http.asgi import (
    ASGIApp,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    header,
    send_bytes,
)
from corrallm.http.bodies import Bodies, BodyLimits
from corrallm.http.errors import ApiError, internal, not_found, quoted
from corrallm.observe.context import CURRENT, HEADER, Exchange, new_request_id
from corrallm.observe.metrics import CONTENT_TYPE
from corrallm.peers import lanes
from corrallm.proxy import passthrough, reservations
from corrallm.proxy.dialects import anthropic, audio, ollama, openai, realtime, responses
from corrallm.proxy.dialects.ollama_catalog import PATHS as OLLAMA_CATALOG
from corrallm.proxy.dialects.ollama_catalog import OllamaCatalog, not_managed, unserved
from corrallm.proxy.models import ModelCatalog
from corrallm.proxy.pipeline import Pipeline
from corrallm.ui.app import Dashboard, is_dashboard_path

log = logging.getLogger("corrallm.proxy")

Handler = Callable[[Pipeline, Scope, Receive, Send, bytes], Awaitable[None]]
ErrorWriter = Callable[[ApiError, Send], Awaitable[None]]


async def openai_error(error: ApiError, send: Send) -> None:
    await error.send(send)


@dataclass(frozen=True, slots=True)
class Surface:
    """A /v1 path that takes a body through the pipeline: its method (None: any), its
    codec's handler, how its errors are written (every error on it, 405 and 413
    included), and whether it is for operators only (the admin token instead of a key)."""

    method: str | None
    handler: Handler
    errors: ErrorWriter = openai_error
    operator: bool = False


SURFACES: dict[str, Surface] = {
    "/v1/chat/completions": Surface("POST", openai.serve),
    "/v1/completions": Surface("POST", openai.serve),
    "/v1/embeddings": Surface("POST", openai.serve),
    "/v1/rerank": Surface("POST", openai.serve),
    "/rerank": Surface("POST", openai.serve),
    "/v1/audio/speech": Surface("POST", openai.serve),
    "/v1/audio/transcriptions": Surface("POST", audio.transcribe),
    "/v1/audio/translations": Surface("POST", audio.transcribe),
    "/v1/messages": Surface("POST", anthropic.serve, anthropic.write_error),
    "/v1/messages/count_tokens": Surface("POST", anthropic.count_tokens, anthropic.write_error),
    "/v1/responses": Surface("POST", responses.serve),
    # SPEC §23 E1: Ollama's API, errors in its shape (its catalog paths are `_route`'s).
    "/api/chat": Surface("POST", ollama.serve, ollama.write_error),
    "/api/generate": Surface("POST", ollama.serve, ollama.write_error),
    "/api/embed": Surface("POST", ollama.serve, ollama.write_error),
    "/api/embeddings": Surface("POST", ollama.serve, ollama.write_error),
}
# T5: `/upstream/<model>/…`, for operators (the default) or for keyed callers through the
# pipeline (`upstream: {access: keys}`).
UPSTREAM = {
    "admin": Surface(None, passthrough.operator, operator=True),
    "keys": Surface(None, passthrough.keyed),
}
_HEALTH = orjson.dumps({"status": "ok"})
# What a refused lane signature is, in the 401's words (T5).
LANE_REFUSALS = {
    "bad_signature": "not a valid signature of this request",
    "stale": "more than 30 s away from this node's clock",
    "replayed": "a replay: its nonce was used already",
}
METRICS_CONTENT_TYPE = CONTENT_TYPE.encode()


class CorrallmApp:
    def __init__(
        self,
        gateway: Gateway,
        admin_token: str,
        web_root: Path | None = None,
        body_limits: BodyLimits | None = None,
        *,
        owns_process: bool = True,
    ) -> None:
        self.gateway = gateway
        # False when the process is not the gateway's alone (tests serving it from a
        # thread): no SIGHUP handler, the garbage collector's settings left alone.
        self._owns_process = owns_process
        self.pipeline = Pipeline(gateway)
        self._admin_token = admin_token
        self.captures = gateway.captures
        self.captures.also_redact(admin_token)  # T5: never shown in a capture or the log
        self.lanes_ignored = gateway.metrics.lanes_ignored
        # Run once the gateway has started, and before it stops (`serve --workers`: the
        # relaying workers' owner, corrallm/workers/owner.py).
        self.started: list[Callable[[], Awaitable[None]]] = []
        self.stopping: list[Callable[[], Awaitable[None]]] = []
        self.models = ModelCatalog(self.pipeline)
        self.ollama = OllamaCatalog(self.pipeline)
        self._apis: dict[str, ASGIApp] = {}
        self._building = asyncio.Lock()
        # T5: every body read whole goes through this one reader (idle timeout, memory).
        self.bodies = Bodies(body_limits)
        self.nonces = lanes.Nonces()  # T5: the lane signatures' nonces seen lately
        self.dashboard = Dashboard(gateway, admin_token, web_root, self.bodies)

    # The hot path's coroutines are few on purpose (SPEC §13): every level of `await`
    # between the server and the upstream read is walked again each time the request
    # resumes. So `__call__` hands over the coroutine it picked (a plain function), and
    # `_http` runs a surface's request and its errors in one frame.

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        kind = scope["type"]
        if kind == "http":
            return self._http(scope, receive, send)
        if kind == "websocket":
            return self._websocket(scope, receive, send)
        if kind == "lifespan":
            return self._lifespan(receive, send)
        return _ignored()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/v1/realtime":
            await realtime.relay(self.pipeline, scope, receive, send)
        else:
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        surface = SURFACES.get(path)
        if surface is None:
            if not path.startswith("/upstream/"):
                await self._answer(self._route(scope, receive, send), openai_error, send, scope)
                return
            surface = UPSTREAM[self.pipeline.runtime.config.upstream.access]
            send = passthrough.sandboxed(send)  # errors included
        # A request through the pipeline: its id on every answer, its exchange captured.
        exchange = Exchange(new_request_id(), scope)
        token = CURRENT.set(exchange)
        out = _answering(send, exchange)
        body = b""
        try:
            self._hop(scope, exchange)
            if surface.method is not None:
                _require(scope["method"], surface.method, path)
            if surface.operator:
                self._operator(
                    scope,
                    "/upstream/<model>/…",
                    " (or set upstream.access: keys in the config to open it to API keys)",
                )
            else:
                exchange.caller = self.pipeline.identify(scope, exchange.lane)
            body = await self._body(scope, receive)
            exchange.capture = self.captures.open(exchange.id, scope, body)
            await surface.handler(self.pipeline, scope, receive, out, body)
        except Exception as exc:
            await self._failed(exc, surface.errors, out, scope, exchange.id)
        finally:
            # The pipeline is done with the body (it may have been forwarded again after
            # a reload or a preemption until now): its bytes no longer count (T5).
            self.bodies.release(len(body))
            CURRENT.reset(token)
            if exchange.capture is not None:
                self.captures.close(exchange)

    def _hop(self, scope: Scope, exchange: Exchange) -> None:
        """X3: a request another gateway forwarded carries its caller's lane, signed with
        this node's admin token for this very request (method, path, a nonce used once);
        trusted only if the signature checks out and is fresh. T5: under requireKeys a
        replayed, stale or badly signed lane is refused; otherwise it is ignored."""
        lane, signature = header(scope, lanes.LANE), header(scope, lanes.SIGNATURE)
        if lane is None and signature is None:
            return
        exchange.hop = True
        raw: bytes = scope.get("raw_path") or scope["path"].encode("latin-1")
        path = raw.decode("latin-1")
        verdict = lanes.verify(
            self._admin_token, lane, signature, scope["method"], path, time.time(), self.nonces
        )
        if verdict == "signed":
            assert lane is not None
            exchange.lane = lane.decode()
            return
        self.lanes_ignored[verdict] += 1
        if verdict != "unsigned" and self.pipeline.runtime.config.scheduler.require_keys:
            log.warning("request=%s lane refused: %s", exchange.id, verdict)
            raise ApiError(
                401,
                f"The X-Corrallm-Lane-Signature of this request is {LANE_REFUSALS[verdict]}; "
                "this gateway serves only configured keys and correctly signed lanes "
                "(scheduler.requireKeys). A peer must sign each request afresh with this "
                "node's admin token (peers.<name>.token) and a clock within 30 s of it.",
                "invalid_lane_signature",
                type="authentication_error",
            )
        log.warning("request=%s lane header ignored: %s", exchange.id, verdict)

    async def _answer(
        self,
        work: Awaitable[None],
        errors: ErrorWriter,
        send: Send,
        scope: Scope,
        request_id: str | None = None,
    ) -> None:
        """Run `work`; an error becomes the surface's error answer (`_failed`)."""
        try:
            await work
        except Exception as exc:
            await self._failed(exc, errors, send, scope, request_id)

    @staticmethod
    async def _failed(
        exc: Exception,
        errors: ErrorWriter,
        send: Send,
        scope: Scope,
        request_id: str | None = None,
    ) -> None:
        """In an `except`: an `ApiError` becomes the surface's error answer, and an
        unexpected error a 500 naming the request id under which the log has its
        traceback. A client gone needs no answer."""
        if isinstance(exc, ApiError):
            await errors(exc, send)
        elif not isinstance(exc, ClientGone):
            request_id = request_id or new_request_id()
            log.exception("request=%s %s %s failed", request_id, scope["method"], scope["path"])
            error = internal(
                f"corrallm hit an unexpected error (request {request_id}); "
                "the gateway log has the details."
            )
            await errors(error, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Everything but the pipeline's surfaces."""
        path: str = scope["path"]
        method: str = scope["method"]
        if path == "/v1/capabilities":
            _require(method, "GET", path)
            await audio.send_capabilities(self.gateway, scope, send)
        elif path == "/v1/reservations":
            caller = reservations.judge(self.pipeline, scope)  # T5: before any body byte
            await self._with_body(
                scope,
                receive,
                lambda body: reservations.handle(self.pipeline, caller, scope, send, body),
            )
        elif path in ("/health", "/healthz"):
            await send_bytes(send, 200, _HEALTH)
        elif path == "/metrics":
            _require(method, "GET", path)
            body = await self.gateway.metrics.scrape()
            await send_bytes(send, 200, body, content_type=METRICS_CONTENT_TYPE)
        elif path == "/v1/models" or path.startswith("/v1/models/"):
            _require(method, "GET", path)
            await self.models.send(scope, send)
        elif (expected := OLLAMA_CATALOG.get(path)) is not None:
            await self._answer(
                self._ollama_catalog(scope, receive, send, expected),
                ollama.write_error,
                send,
                scope,
            )
        elif unserved(path):
            await ollama.write_error(not_managed(path), send)
        elif path == "/api" or path.startswith("/api/"):
            await self._management_api(scope, receive, send)
        elif is_dashboard_path(path):
            await self.dashboard(scope, receive, send)
        else:
            raise not_found(
                f"No endpoint {quoted(method)} {quoted(path)}. corrallm serves POST "
                + ", ".join(sorted(SURFACES))
                + ", GET /v1/models, GET /v1/models/{id}, GET /v1/capabilities, Ollama's "
                "GET /api/tags, /api/ps, /api/version, POST /api/show, and "
                "/upstream/<model>/<path>."
            )

    async def _ollama_catalog(
        self, scope: Scope, receive: Receive, send: Send, method: str
    ) -> None:
        """E1: Ollama's `/api/tags`, `/api/ps`, `/api/show`, `/api/version` (no slot, like
        /v1/models)."""
        path: str = scope["path"]
        _require(scope["method"], method, path)
        await self._with_body(
            scope, receive, lambda body: self.ollama.answer(path, scope, body, send)
        )

    async def _management_api(self, scope: Scope, receive: Receive, send: Send) -> None:
        """P3: the whole /api subtree is behind the admin token, checked before routing."""
        if not canonical(scope):
            raise not_found(
                f"No endpoint {quoted(scope['path'])}: management paths are plain /api/v1/<name>."
            )
        self._operator(scope, "The management API")
        app = await self._api("graphql" if scope["path"] == "/api/graphql" else "rest")
        await app(scope, receive, send)

    def _operator(self, scope: Scope, what: str, hint: str = "") -> None:
        """P3, T5: 401 unless the request carries the admin token."""
        if not authorized(scope, self._admin_token):
            raise ApiError(
                401,
                f"{what} needs the admin token (the file admin.token in corrallm's home "
                "folder) as 'Authorization: Bearer <token>' or the corrallm_token cookie"
                f"{hint}.",
                type="authentication_error",
                code="unauthorized",
                headers={"www-authenticate": "Bearer"},
            )

    async def _api(self, name: str) -> ASGIApp:
        """The REST or GraphQL app, built on first use in a worker thread. FastAPI and
        Strawberry with their schemas are about 20 MB that an idle gateway need not hold
        (SPEC §13: idle RSS <= 80 MB), and building them on the event loop would stall
        every stream in flight for the half second it takes."""
        app = self._apis.get(name)
        if app is None:
            async with self._building:
                app = self._apis.get(name)
                if app is None:
                    app = await asyncio.to_thread(_API_BUILDERS[name], self.gateway)
                    self._apis[name] = app
        return app

    async def _with_body(
        self, scope: Scope, receive: Receive, use: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """`use` the request's whole body; its bytes given back once that is over."""
        body = await self._body(scope, receive)
        try:
            await use(body)
        finally:
            self.bodies.release(len(body))

    def _body(self, scope: Scope, receive: Receive) -> Awaitable[bytes]:
        """The whole body (T5: under the idle timeout and the memory bound); the caller
        gives its bytes back with `bodies.release` once the request is over."""
        config = self.pipeline.runtime.config
        return self.bodies.read(scope, receive, config.max_body_size, "maxBodySize")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.gateway.start()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                if self._owns_process:
                    _reload_on_sighup(self.gateway)
                    settle_garbage_collector()
                for start in self.started:
                    await start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    for stop in self.stopping:
                        await stop()
                    await self.gateway.stop()
                finally:
                    await self.pipeline.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _build_rest(gateway: Gateway) -> ASGIApp:
    from corrallm.api.rest import build_rest

    return build_rest(gateway)


def _build_graphql(gateway: Gateway) -> ASGIApp:
    from corrallm.api.graphql import build_graphql

    return build_graphql(gateway)


_API_BUILDERS: dict[str, Callable[[Gateway], ASGIApp]] = {
    "rest": _build_rest,
    "graphql": _build_graphql,
}


def settle_garbage_collector() -> None:
    """What startup built (modules, the app, the OpenAPI and GraphQL schemas) lives as long
    as the process, so it is frozen out of the collector, and the young generation is made
    larger. With CPython's defaults, under load (bench/overhead.py's wrk run, 3,500
    req/s) full collections walked all of it 25 times in 10 s, up to 71 ms each, about
    a fifth of the event loop's time; frozen, with these thresholds: none, 4,000 req/s,
    p99 81 -> 30 ms."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def _reload_on_sighup(gateway: Gateway) -> None:
    """SIGHUP re-reads the config (SPEC §10 P6); a bad file is logged and refused."""
    from corrallm.api.reload import read_config, reload
    from corrallm.config import ConfigError

    async def on_sighup() -> None:
        try:
            await reload(gateway, read_config(gateway))
        except ConfigError as exc:
            log.error("SIGHUP: config refused, the old one stays in force:\n%s", exc.report())

    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def spawn() -> None:
        task = loop.create_task(on_sighup())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, spawn)


async def _ignored() -> None:
    """A scope type this app does not speak: nothing to do."""


def _answering(send: Send, exchange: Exchange) -> Send:
    """`send` with `X-Corrallm-Request-Id` on the answer's head (SPEC §21 O1) and the
    headers the pipeline left on the exchange (T3: the key's x-ratelimit-* counts), on
    every answer, success, stream or error; feeding the exchange's capture, if any, what
    goes out (O2)."""
    rid = exchange.id.encode()

    def answering(message: Message) -> Awaitable[None]:  # no coroutine of its own
        capture = exchange.capture
        if message["type"] == "http.response.start":
            exchange.answered = True
            extra = exchange.headers
            if extra is None and exchange.counts is not None:
                extra = exchange.counts()  # answered before its limits counted it
            headers = [*message.get("headers", ()), (HEADER, rid), *(extra or ())]
            message = {**message, "headers": headers}
            if capture is not None:
                capture.start(message["status"], headers)
        elif capture is not None:
            capture.body(message.get("body", b""))
        return send(message)

    return answering


def _require(method: str, expected: str, path: str) -> None:
    if method != expected:
        raise ApiError(
            405,
            f"{path} takes {expected}, not {method}.",
            code="method_not_allowed",
            headers={"allow": expected},
        )
