"""The one shape of a dialect's answer translators, and the codec that relays an answer
translated by them (SPEC §16 K1, K2; CONVENTIONS "One relay, one codec per dialect").

A dialect that asks its backends in Chat Completions and answers its clients in a shape
of its own (Anthropic's Messages, OpenAI's Responses, Ollama's NDJSON) translates the
answer with two pure pieces, the same for every such dialect:

- **the whole answer**: `from_chat(answer, echo) -> dict`, a Chat Completion (its JSON,
  parsed) as the dialect's answer object; `echo` is what that answer repeats of its
  request (the model asked for, stop sequences, a Response's settings...), one small
  type per dialect.
- **the stream**: a `StreamTranslator`, made per answer with its request's echo. Every
  method returns the bytes to send, framed as the dialect frames its stream (SSE events,
  NDJSON lines; `content_type` says which): `start()` what opens the stream (b"" when
  it opens with the first chunk), `feed(chunk)` what one Chat chunk (a `data:` object,
  parsed) means, `finish()` what closes it (b"" once it has), `fail(error)` what ends a
  stream that broke off or was interrupted. `finished` is true once the stream's end
  went out (a client leaving after it was served, S7).

Both raise `TranslationError` for an answer they cannot translate: the client gets a 502
that names the backend. `Translated` is the relay's codec (`relay.Codec`) for any such
pair: the upstream's whole SSE events parsed into chunks and fed, `[DONE]` finishing
the stream, the rest closed when the upstream ends. A new translated dialect writes its
`from_chat` and its `StreamTranslator` and returns a `Translated` from its
`Dialect.answer()`; the relay needs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import orjson

from corrallm.http.client import UpstreamError
from corrallm.http.errors import ApiError, bad_gateway
from corrallm.proxy.metering import Meter
from corrallm.proxy.relay import Mode

E = TypeVar("E")


class TranslationError(ApiError):
    """An upstream answer (or chunk) that is not what the translation needs, such as a
    Chat Completion without choices. A 502; the codec says which backend sent it."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, "backend_error", type="api_error")


def tool_arguments(arguments: Any) -> dict[str, Any]:
    """A Chat tool call's `arguments` (a JSON string, as OpenAI sends them) as the object
    Anthropic's `input` and Ollama's `arguments` are; text that is not a JSON object is
    kept rather than lost."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = orjson.loads(arguments or "{}")
    except (orjson.JSONDecodeError, TypeError):
        return {"_unparsed_arguments": str(arguments)}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


class StreamTranslator(Protocol):
    """Chat Completions stream chunks in, the dialect's stream out (see the module's
    docstring). Pure: no I/O, no clock but what ids and timestamps need."""

    content_type: bytes
    finished: bool

    def start(self) -> bytes: ...

    def feed(self, chunk: Any) -> bytes: ...

    def finish(self) -> bytes: ...

    def fail(self, error: ApiError) -> bytes: ...


FromChat = Callable[[Any, E], dict[str, Any]]


class Translated(Generic[E]):
    """relay.Codec of a Chat Completions answer translated for the client: a stream fed
    to `stream` event by event, a whole answer given to `from_chat` with `echo`. `modes`
    is the dialect's choice of `Mode` per status and content type (what it translates,
    passes on as it came, or refuses)."""

    __slots__ = ("echo", "from_chat", "meter", "modes", "stream", "stream_type")

    cuttable = True

    def __init__(
        self,
        stream: StreamTranslator,
        from_chat: FromChat[E],
        echo: E,
        modes: Callable[[int, str], Mode],
        meter: Meter | None = None,
    ) -> None:
        self.stream, self.from_chat, self.echo, self.modes = stream, from_chat, echo, modes
        self.stream_type = stream.content_type
        self.meter = meter if meter is not None else Meter()

    def mode(self, status: int, kind: str) -> Mode:
        return self.modes(status, kind)

    def whole(self, body: bytes, backend: str) -> bytes:
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise bad_gateway(
                f"backend '{backend}' answered with JSON that does not parse; its log "
                "(GET /api/v1/models/logs) may say why."
            ) from None
        try:
            return orjson.dumps(self.from_chat(answer, self.echo))
        except TranslationError as exc:
            raise bad_gateway(f"backend '{backend}' answered: {exc.message}") from None

    def begin(self) -> bytes:
        return self.stream.start()

    def events(self, data: bytes) -> bytes:
        """Whole Chat SSE events in, the dialect's frames out; `[DONE]` finishes the
        stream, a `data:` line that is not JSON is skipped (as a client would), and a
        chunk the translator refuses breaks the answer off (a 502, as a backend gone)."""
        stream = self.stream
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        out = []
        for line in data.split(b"\n"):
            if not line.startswith(b"data:") or stream.finished:
                continue
            text = line[5:].strip()
            if text == b"[DONE]":
                out.append(stream.finish())
                continue
            try:
                chunk = orjson.loads(text)
            except orjson.JSONDecodeError:
                continue
            try:
                out.append(stream.feed(chunk))
            except TranslationError as exc:
                # As a backend breaking off: the relay records it (502) and ends the
                # stream with `fail`; what this data already meant is dropped with it.
                raise UpstreamError(f"its stream could not be translated: {exc.message}") from None
        return b"".join(out)

    def done(self, sent: bytes) -> bool:
        return self.stream.finished

    def close(self, tail: bytes) -> bytes:
        return (self.events(tail) if tail else b"") + self.stream.finish()

    def fail(self, error: ApiError) -> bytes:
        return self.stream.fail(error)
