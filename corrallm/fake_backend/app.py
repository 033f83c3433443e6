"""The fake backend's ASGI app: routes, loading gate, counters and the debug record."""

from __future__ import annotations

import itertools
import os
import re
import secrets
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson

import corrallm.fake_backend.responses as r
from corrallm.fake_backend.exchange import FakeExchange, Receive, Route, Scope, Send
from corrallm.fake_backend.memory import HeldMemory
from corrallm.fake_backend.options import Options
from corrallm.fake_backend.realtime import realtime
from corrallm.fake_backend.sleep import SLEEPING_BODY, SleepMode
from corrallm.fake_backend.slots import Slots

HEALTH_PATHS = frozenset({"/health", "/healthz", "/v1/health"})
HEALTH_OK = b'{"status":"ok"}'
INDEX_HTML = (
    b"<!doctype html><html><head><title>corrallm fake backend</title></head>"
    b"<body><h1>corrallm fake backend</h1><p>An OpenAI-compatible test server.</p>"
    b"<script>document.title = 'scripted';</script></body></html>"
)
INDEX_HEADERS = ((b"set-cookie", b"fake_session=1; Path=/"),)
_FORM_FIELD = re.compile(rb'name="([A-Za-z_]+)"\r\n\r\n([^\r]*)\r\n')
# SPEC §12 U4's shape, fixed so that tests and the dashboard's playground can assert on it.
_TURNS = [
    ("SPEAKER_00", 0.0, 1.2, "Hello from the first speaker."),
    ("SPEAKER_01", 1.2, 3.4, "And this is the second one."),
    ("SPEAKER_00", 3.4, 5.0, "Back to the first speaker."),
]
DIARIZED = orjson.dumps(
    {
        "text": " ".join(turn[3] for turn in _TURNS),
        "segments": [{"speaker": w, "start": a, "end": b, "text": t} for w, a, b, t in _TURNS],
        "num_speakers": 2,
    }
)


class BadRequest(Exception):
    """A client error answered 400 in the OpenAI error shape."""


class FakeBackend:
    """Raw ASGI app. `log` prints one line; `ready_at` is when 'loading' ends (monotonic)."""

    def __init__(self, opts: Options, log: Callable[[str], None], ready_at: float) -> None:
        self.opts = opts
        self.log = log
        self.ready_at = ready_at
        self.requests: deque[dict[str, Any]] = deque(maxlen=100)
        self.stats = {"in_flight": 0, "max_in_flight": 0, "completed": 0, "cancelled": 0}
        self.health_checks = 0
        self._ids = itertools.count(1)
        self._id_prefix = secrets.token_hex(4)
        self._cache: dict[tuple[Any, ...], bytes | tuple[list[bytes], int]] = {}
        self._faulty_left = opts.faulty_requests  # None: every request
        self.sleep = SleepMode(opts, log, HeldMemory())
        self.slots = Slots(opts, log)
        chat, completions = self._chat, self._completions
        self.routes: dict[str, Route] = {
            "/v1/chat/completions": ("POST", chat),
            "/chat/completions": ("POST", chat),
            "/v1/completions": ("POST", completions),
            "/completions": ("POST", completions),
            "/v1/embeddings": ("POST", self._embeddings),
            "/embeddings": ("POST", self._embeddings),
            "/v1/rerank": ("POST", self._rerank),
            "/rerank": ("POST", self._rerank),
            "/v1/audio/transcriptions": ("POST", self._transcription),
            "/v1/audio/translations": ("POST", self._transcription),
            "/v1/audio/speech": ("POST", self._speech),
            "/v1/models": ("GET", self._models),
            "/models": ("GET", self._models),
            "/props": ("GET", self._props),
            "/": ("GET", self._index),
        }
        # Inference (refused while asleep, given the faults) is every POST route above;
        # the control routes below (sleep, slots) are neither, nor in the in-flight counts.
        self.inference = frozenset(p for p, (m, _) in self.routes.items() if m == "POST")
        control = {**self.sleep.routes(), **self.slots.routes()}
        self.control = frozenset(control)
        self.routes.update(control)

    def loaded(self) -> bool:
        return time.monotonic() >= self.ready_at

    # --- dispatch ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == "/v1/realtime":
            if self.sleep.asleep:  # refused before the handshake (an HTTP 403)
                await receive()
                await send({"type": "websocket.close", "code": 1013})
                return
            await realtime(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        ex = FakeExchange(scope, receive, send)
        if path in HEALTH_PATHS:
            self.health_checks += 1
            if self.loaded():
                await ex.respond(200, HEALTH_OK)
            else:
                await ex.respond(503, r.LOADING_BODY)
            return
        if path.startswith("/debug/"):
            await self._debug(ex, path)
            return
        stats = self.stats
        counted = path not in self.control and not path.startswith("/slots/")
        if counted:
            stats["in_flight"] += 1
            stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            await ex.read_body()
            if not self.opts.fast:
                self._record(ex)
            await self._dispatch(ex, path)
        except ConnectionError:
            pass
        finally:
            ex.close()
            if counted:
                stats["in_flight"] -= 1
                stats["completed" if ex.finished else "cancelled"] += 1
            if not self.opts.fast:
                self.log(
                    f"srv  log_server_r: request: {scope['method']} {path} {ex.status or 499}"
                    + ("" if ex.finished else " (client disconnected)")
                )

    async def _dispatch(self, ex: FakeExchange, path: str) -> None:
        route = self.routes.get(path) or self.slots.route(path)
        if route is None:
            await ex.respond(404, r.error_body(f"File Not Found: {path}", "not_found_error", 404))
            return
        method, handler = route
        if ex.scope["method"] != method:
            msg = f"{ex.scope['method']} {path} is not allowed; use {method}"
            await ex.respond(405, r.error_body(msg, "invalid_request_error", 405))
            return
        if not self.loaded():
            await ex.respond(503, r.LOADING_BODY)
            return
        if path in self.inference and self.sleep.asleep:
            await ex.respond(503, SLEEPING_BODY)
            return
        faulty = path in self.inference and self._faulty()
        if faulty and self.opts.hang:
            self.log(f"srv  hang: not answering {path} (--hang)")
            await ex.until_gone()
            return
        try:
            await handler(ex, faulty)
        except BadRequest as exc:
            if not ex.status:
                await ex.respond(400, r.error_body(str(exc), "invalid_request_error", 400))
        except Exception as exc:  # a bug here must still answer, like a real server would
            if ex.status:
                raise
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            await ex.respond(500, r.error_body(f"{type(exc).__name__}: {exc}", "server_error", 500))

    def _faulty(self) -> bool:
        """Whether this inference request gets the injected faults (--faulty-requests)."""
        if self._faulty_left is None:
            return True
        if self._faulty_left == 0:
            return False
        self._faulty_left -= 1
        return True

    def _record(self, ex: FakeExchange) -> None:
        scope = ex.scope
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            key, value = k.decode("latin-1"), v.decode("latin-1")
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        self.requests.append(
            {
                "time": time.time(),
                "method": scope["method"],
                "path": scope["path"],
                "query": scope["query_string"].decode("latin-1"),
                "headers": headers,
                "body": ex.json_or_none(),
            }
        )

    async def _debug(self, ex: FakeExchange, path: str) -> None:
        method = ex.scope["method"]
        if path == "/debug/requests" and method == "DELETE":
            self.requests.clear()
            await ex.respond(200, b'{"cleared":true}')
        elif path == "/debug/requests":
            await ex.respond(200, orjson.dumps(list(self.requests)))
        elif path == "/debug/stats":
            body = {
                **self.stats,
                "health_checks": self.health_checks,
                "loaded": self.loaded(),
                "ready_at": self.ready_at,  # monotonic: comparable across processes here
                **self.sleep.stats(),
                **self.slots.stats(),
            }
            await ex.respond(200, orjson.dumps(body))
        else:
            await ex.respond(404, r.error_body(f"File Not Found: {path}", "not_found_error", 404))

    # --- helpers -----------------------------------------------------------------------------

    def _body(self, ex: FakeExchange) -> dict[str, Any]:
        try:
            body = ex.json()
        except ValueError as exc:
            raise BadRequest(f"Malformed JSON in the request body: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object")
        return body

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self.opts.model_name

    def _new_id(self, prefix: str) -> tuple[str, int]:
        if self.opts.fast:
            return f"{prefix}-fast", 0
        return f"{prefix}-{self._id_prefix}{next(self._ids)}", int(time.time())

    # --- generation --------------------------------------------------------------------------

    async def _chat(self, ex: FakeExchange, faulty: bool = False) -> None:
        body = self._body(ex)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list")
        words = r.prompt_words(messages)
        call = r.tool_call(body) if self.opts.tool_calls else None
        with self.slots.run(body, words, r.plan(body, self.opts.tokens)[0]):
            if call is not None:
                await self._tool_call(ex, body, call, len(words))
            else:
                await self._generate(ex, body, True, len(words), faulty)

    async def _tool_call(
        self, ex: FakeExchange, body: dict[str, Any], call: dict[str, Any], prompt: int
    ) -> None:
        """--tool-calls: answer with a call of a tool the request offers."""
        rid, created = self._new_id("chatcmpl")
        model = self._model(body)
        if body.get("stream") is not True:
            await ex.respond(200, r.tool_call_completion(rid, created, model, call, prompt))
            return
        so = body.get("stream_options")
        include_usage = isinstance(so, dict) and so.get("include_usage") is True
        events = r.tool_call_events(rid, created, model, call, prompt, include_usage)
        await self._stream(ex, events, range(1, 4))

    async def _completions(self, ex: FakeExchange, faulty: bool = False) -> None:
        body = self._body(ex)
        if "prompt" not in body:
            raise BadRequest("'prompt' is required")
        words = r.prompt_words(body["prompt"])
        with self.slots.run(body, words, r.plan(body, self.opts.tokens)[0]):
            await self._generate(ex, body, False, len(words), faulty)

    async def _generate(
        self, ex: FakeExchange, body: dict[str, Any], chat: bool, prompt: int, faulty: bool = False
    ) -> None:
        opts = self.opts
        n, reason = r.plan(body, opts.tokens)
        model = self._model(body)
        stream = body.get("stream") is True
        so = body.get("stream_options")
        include_usage = stream and isinstance(so, dict) and so.get("include_usage") is True
        key = (chat, stream, include_usage, n, reason, prompt, model)
        cached = self._cache.get(key) if opts.fast else None
        if cached is None:
            rid, created = self._new_id("chatcmpl" if chat else "cmpl")
            if stream:
                made, start = r.stream_events(
                    chat, rid, created, model, n, reason, prompt, include_usage
                )
                if opts.sse_crlf:  # JSON holds no raw line ends: every LF is framing
                    made = [e.replace(b"\n", b"\r\n") for e in made]
                cached = (made, start)
            else:
                build = r.chat_completion if chat else r.text_completion
                cached = build(rid, created, model, n, reason, prompt)
            if opts.fast:
                if len(self._cache) > 512:
                    self._cache.clear()
                self._cache[key] = cached
        if not stream:
            assert isinstance(cached, bytes)
            if await ex.pause(opts.latency + n * opts.token_delay):
                return
            if faulty and opts.die_mid_body:
                await ex.start_body(200, len(cached))
                await ex.write(cached[: len(cached) // 2])
                self.log("srv  crash: exiting in the middle of an answer (--die-mid-body)")
                os._exit(1)
            await ex.respond(200, cached)
            return
        assert not isinstance(cached, bytes)
        events, first = cached
        await self._stream(ex, events, range(first, first + n), faulty)

    async def _stream(
        self, ex: FakeExchange, events: list[bytes], token_span: range, faulty: bool = False
    ) -> None:
        """Send every event; `token_span` are the token events, spaced by --token-delay."""
        opts = self.opts
        delay, crash = opts.token_delay, opts.crash_after_tokens
        stall = opts.stall_after_tokens if faulty else None
        # Go silent after the stall-th token chunk (0: right after the headers).
        stall_at = token_span.start + stall - 1 if stall is not None else -2
        if not opts.fast or delay or opts.latency:
            ex.watch_disconnect()
        if await ex.pause(opts.latency):
            return
        await ex.start_stream()
        if crash == 0:
            self._crash(0)
        if stall_at == token_span.start - 1:
            await self._stall(ex, 0)
            return
        # Crash after the crash-th token chunk; a stream shorter than that completes.
        crash_at = token_span.start + crash - 1 if crash and crash <= len(token_span) else -1
        for i, event in enumerate(events):
            if delay and i in token_span and i > token_span.start and await ex.pause(delay):
                return
            if not await ex.write(event):
                return
            if i == crash_at:
                if opts.crash_mid_event and i + 1 < len(events):
                    await ex.write(events[i + 1][: len(events[i + 1]) // 2])  # a torn event
                self._crash(crash or 0)
            if i == stall_at:
                await self._stall(ex, stall or 0)
                return
        await ex.end_stream()

    async def _stall(self, ex: FakeExchange, sent: int) -> None:
        self.log(f"srv  stall: silent after {sent} token chunks (--stall-after-tokens)")
        await ex.until_gone()

    def _crash(self, sent: int) -> None:
        self.log(f"srv  crash: exiting after {sent} token chunks (--crash-after-tokens)")
        os._exit(1)

    # --- other endpoints ---------------------------------------------------------------------

    async def _embeddings(self, ex: FakeExchange, faulty: bool = False) -> None:
        body = self._body(ex)
        if "input" not in body:
            raise BadRequest("'input' is required")
        if await ex.pause(self.opts.latency):
            return
        await ex.respond(200, r.embeddings(body, self._model(body), self.opts.embedding_dim))

    async def _rerank(self, ex: FakeExchange, faulty: bool = False) -> None:
        body = self._body(ex)
        docs = body.get("documents")
        if not isinstance(body.get("query"), str) or not isinstance(docs, list):
            raise BadRequest("'query' (a string) and 'documents' (a list) are required")
        if await ex.pause(self.opts.latency):
            return
        await ex.respond(200, r.rerank(body, self._model(body)))

    async def _transcription(self, ex: FakeExchange, faulty: bool = False) -> None:
        fields = {k.decode(): v.decode("utf-8", "replace") for k, v in _FORM_FIELD.findall(ex.body)}
        text = f"This is a fake transcript ({len(ex.body)} request bytes)."
        if await ex.pause(self.opts.latency):
            return
        if fields.get("response_format") == "text":
            await ex.respond(200, text.encode(), b"text/plain; charset=utf-8")
        elif fields.get("response_format") == "diarized_json":
            await ex.respond(200, DIARIZED)
        else:
            await ex.respond(200, orjson.dumps({"text": text}))

    async def _speech(self, ex: FakeExchange, faulty: bool = False) -> None:
        body = self._body(ex)
        if not isinstance(body.get("input"), str):
            raise BadRequest("'input' (a string) is required")
        ex.watch_disconnect()
        if await ex.pause(self.opts.latency):
            return
        words = max(1, len(body["input"].split()))
        frame = b"\x00\x00" * 1600  # 0.1 s of silence at 16 kHz per word
        await ex.start_stream([(b"content-type", b"audio/wav")])
        if not await ex.write(r.wav_header(len(frame) * words)):
            return
        for i in range(words):
            if i and self.opts.token_delay and await ex.pause(self.opts.token_delay):
                return
            if not await ex.write(frame):
                return
        await ex.end_stream()

    async def _models(self, ex: FakeExchange, faulty: bool = False) -> None:
        opts = self.opts
        model = {
            "id": opts.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "corrallm-fake",
            "meta": {"n_ctx_train": opts.n_ctx},
        }
        await ex.respond(200, orjson.dumps({"object": "list", "data": [model]}))

    async def _props(self, ex: FakeExchange, faulty: bool = False) -> None:
        opts = self.opts
        props = {
            # Like llama-server: n_ctx here is the per-slot context (n_ctx / n_slots).
            "default_generation_settings": {"n_ctx": opts.n_ctx_slot, "n_predict": -1},
            "total_slots": opts.n_slots,
            "model_path": opts.model_file,
            "build_info": "corrallm-fake",
        }
        await ex.respond(200, orjson.dumps(props))

    async def _index(self, ex: FakeExchange, faulty: bool = False) -> None:
        # A web UI with a script and a session cookie, as real backends' pages have: what
        # corrallm's /upstream must sandbox (SPEC §22 T5).
        await ex.respond(200, INDEX_HTML, b"text/html; charset=utf-8", INDEX_HEADERS)
