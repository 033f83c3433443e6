"""SPEC §16 K1, K2: every translated dialect's answer translators have one shape
(proxy/dialects/stream.py): stream translators that speak bytes and end once, whole-answer
translators `from_chat(answer, echo)`, one `TranslationError`, and the `Translated` codec
the relay uses for any of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from corrallm.http.client import UpstreamError
from corrallm.http.errors import ApiError
from corrallm.proxy.dialects import (
    anthropic,
    anthropic_translate,
    ollama,
    ollama_translate,
    responses,
    responses_translate,
)
from corrallm.proxy.dialects.anthropic_stream import AnthropicStream
from corrallm.proxy.dialects.anthropic_translate import MessageEcho
from corrallm.proxy.dialects.ollama_stream import Lines
from corrallm.proxy.dialects.ollama_translate import NDJSON, OllamaEcho, Timings
from corrallm.proxy.dialects.responses_stream import ResponsesStream
from corrallm.proxy.dialects.responses_translate import Echo
from corrallm.proxy.dialects.stream import StreamTranslator, Translated, TranslationError
from corrallm.proxy.relay import SSE, Mode

CHUNK = {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
BROKEN = ApiError(502, "backend 'b' broke off its answer", "backend_error")


def anthropic_codec() -> Translated[Any]:
    echo = MessageEcho("m")
    return Translated(AnthropicStream(echo), anthropic_translate.from_chat, echo, anthropic.modes)


def responses_codec() -> Translated[Any]:
    echo = Echo(model="m")
    return Translated(ResponsesStream(echo), responses_translate.from_chat, echo, responses.whole)


def ollama_echo() -> OllamaEcho:
    return OllamaEcho("chat", True, "m", lambda: 1_700_000_000.0, Timings)


def ollama_codec() -> Translated[Any]:
    echo = ollama_echo()
    return Translated(Lines(echo), ollama_translate.from_chat, echo, ollama.streamed)


CODECS = {"anthropic": anthropic_codec, "responses": responses_codec, "ollama": ollama_codec}
STREAMS: dict[str, Callable[[], StreamTranslator]] = {
    "anthropic": lambda: AnthropicStream(MessageEcho("m")),
    "responses": lambda: ResponsesStream(Echo(model="m")),
    "ollama": lambda: Lines(ollama_echo()),
}
# How each frames its stream, and the error that ends one.
FRAMING = {
    "anthropic": (SSE, b"event: error"),
    "responses": (SSE, b"event: error"),
    "ollama": (NDJSON, b'{"error":'),
}


def sse(*objects: Any) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objects)


@pytest.mark.parametrize("name", STREAMS)
def test_K1_K2_stream_translators_return_frames_and_end_once(name: str) -> None:
    stream = STREAMS[name]()
    said = [stream.start(), stream.feed(CHUNK)]
    assert not stream.finished
    said.append(stream.finish())
    assert stream.finished and stream.finish() == b"" and stream.feed(CHUNK) == b""
    assert all(isinstance(frames, bytes) for frames in said)
    assert stream.content_type == FRAMING[name][0]
    assert b"Hi" in b"".join(said)


@pytest.mark.parametrize("name", STREAMS)
def test_K1_K2_a_stream_that_fails_is_over(name: str) -> None:
    stream = STREAMS[name]()
    stream.start()
    stream.feed(CHUNK)
    ended = stream.fail(BROKEN)
    assert FRAMING[name][1] in ended and b"broke off its answer" in ended
    assert stream.finished and stream.finish() == b""


@pytest.mark.parametrize("name", CODECS)
def test_K1_K2_done_finishes_a_translated_stream_and_nothing_follows(name: str) -> None:
    codec = CODECS[name]()
    out = codec.begin() + codec.events(sse(CHUNK) + b"data: [DONE]\n\n")
    assert codec.done(out)
    assert codec.events(sse(CHUNK)) == b"" and codec.close(b"") == b""


@pytest.mark.parametrize("name", CODECS)
def test_K1_K2_the_upstream_ending_without_done_still_closes_the_stream(name: str) -> None:
    codec = CODECS[name]()
    codec.begin()
    # The last event came without its blank line: it is translated, then the stream closed.
    tail = codec.close(b"data: " + orjson.dumps(CHUNK))
    assert b"Hi" in tail and codec.done(tail)


@pytest.mark.parametrize("name", CODECS)
def test_K1_K2_a_whole_answer_that_is_not_json_is_a_502_naming_the_backend(name: str) -> None:
    with pytest.raises(ApiError) as refused:
        CODECS[name]().whole(b"{not json", "m#0")
    assert refused.value.status == 502 and "backend 'm#0'" in refused.value.message


def test_K1_a_whole_answer_the_translator_refuses_is_a_502_naming_the_backend() -> None:
    with pytest.raises(ApiError) as refused:
        anthropic_codec().whole(b'{"error": "x"}', "m#0")
    error = refused.value
    assert (error.status, error.code) == (502, "backend_error")
    assert error.message.startswith("backend 'm#0' answered: an answer with no choices")


class Refusing:
    """A translator that cannot translate what it is fed (as a future dialect's may)."""

    content_type = b"text/event-stream"
    finished = False

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: Any) -> bytes:
        raise TranslationError("a chunk with no choices")

    def finish(self) -> bytes:
        return b""

    def fail(self, error: ApiError) -> bytes:
        return b""


def test_K1_a_chunk_the_translator_refuses_breaks_the_answer_off() -> None:
    codec = Translated(Refusing(), anthropic_translate.from_chat, MessageEcho("m"), anthropic.modes)
    with pytest.raises(UpstreamError, match="could not be translated: a chunk with no choices"):
        codec.events(sse(CHUNK))


def test_K1_K2_each_dialect_says_which_answers_it_translates() -> None:
    assert [anthropic.modes(200, kind) for kind in ("text/event-stream", "application/json")] == [
        Mode.EVENTS,
        Mode.WHOLE,
    ]
    assert anthropic.modes(500, "application/json") is Mode.REFUSE
    assert responses.streamed(200, "text/event-stream") is Mode.EVENTS
    assert responses.whole(200, "application/json") is Mode.WHOLE
    assert responses.whole(400, "application/json") is Mode.AS_IS
    assert ollama.streamed(200, "text/event-stream") is Mode.EVENTS
    assert ollama.streamed(200, "application/json") is Mode.REFUSE
    assert ollama.whole(200, "application/json") is Mode.WHOLE
    assert ollama.whole(200, "text/event-stream") is Mode.REFUSE
    assert ollama.whole(404, "application/json") is Mode.REFUSE
