"""The audio surface (SPEC §12 U1-U5): uploads for speech-to-text, and what is offered where.

`/v1/audio/transcriptions` and `/translations` are multipart: the `model` field is read from
the spooled body (so a cold request is held like any other) and the body is forwarded
unchanged with its content type and boundary. `/v1/audio/speech` is JSON in and audio
streamed out, through the ordinary path.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from corrallm.gateway import Gateway
from corrallm.http.asgi import Receive, Scope, Send, header, send_bytes
from corrallm.http.errors import bad_request
from corrallm.proxy.dialects.openai import serve_parsed
from corrallm.proxy.pipeline import Pipeline, modes_of, offered
from corrallm.routing.router import ServedModel

_BOUNDARY = re.compile(rb'boundary="?([^";]+)"?', re.IGNORECASE)
_NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)


def form_field(body: bytes, content_type: bytes, name: str) -> str | None:
    """One text field of a multipart/form-data body, without parsing the file parts."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        return None
    delimiter = b"--" + match.group(1)
    for part in body.split(delimiter):
        head, sep, value = part.partition(b"\r\n\r\n")
        if not sep:
            continue
        named = _NAME.search(head)
        if named and named.group(1).decode("utf-8", "replace") == name and b"filename=" not in head:
            return value.removesuffix(b"\r\n").decode("utf-8", "replace").strip()
    return None


async def transcribe(
    pipeline: Pipeline, scope: Scope, receive: Receive, send: Send, body: bytes
) -> None:
    content_type = header(scope, b"content-type") or b""
    if not content_type.lower().startswith(b"multipart/form-data"):
        raise bad_request(
            f"{scope['path']} takes multipart/form-data with 'model' and 'file' fields "
            "(as the OpenAI SDKs send it).",
        )
    model = form_field(body, content_type, "model")
    if not model:
        raise bad_request("Missing 'model' form field: name the speech-to-text model.", "model")
    await serve_parsed(pipeline, scope, receive, send, body, {"model": model}, model)


def speaks(served: ServedModel) -> bool:
    """Text-to-speech rather than speech-to-text: its `type` names it (`tts`, `speech`)."""
    kind = served.primary.config.type.lower()
    return "tts" in kind or "speech" in kind


def batch_stt(gateway: Gateway) -> list[ServedModel]:
    """The speech-to-text models that take uploads: audio, not TTS, offered in mode batch."""
    return [
        s
        for s in gateway.served
        if gateway.ledger.costs.audio(s.primary.config) and not speaks(s) and offered(s, "batch")
    ]


def diarizes(served: ServedModel) -> bool:
    """Whether the model answers with speaker segments. Every backend must say so: a
    fall-through to one that does not would silently drop the speakers a client relies on."""
    return all(r.config.diarization for r in served.routes)


DIARIZED_SHAPE = {
    "text": "full transcript",
    "segments": [{"speaker": "SPEAKER_00", "start": 0.0, "end": 1.5, "text": "..."}],
    "num_speakers": 2,
}


def capabilities(gateway: Gateway, base_url: str) -> dict[str, Any]:
    """SPEC §12 U5: every endpoint, the models each serves (mode filtered), examples."""
    text = [s.name for s in gateway.served if not gateway.ledger.costs.audio(s.primary.config)]
    audio = [s for s in gateway.served if gateway.ledger.costs.audio(s.primary.config)]
    speech = [s.name for s in audio if speaks(s)]
    batch_models = batch_stt(gateway)
    batch = [s.name for s in batch_models]
    realtime = [s.name for s in audio if not speaks(s) and offered(s, "realtime")]
    ws = base_url.replace("http://", "ws://").replace("https://", "wss://")
    example_text = text[0] if text else "MODEL"
    example_stt = batch[0] if batch else "STT_MODEL"

    def curl(path: str, data: str) -> str:
        return (
            f"curl -s {base_url}{path} -H 'Content-Type: application/json' "
            f"-H 'Authorization: Bearer $KEY' -d '{data}'"
        )

    endpoints = [
        {
            "method": "POST",
            "path": "/v1/chat/completions",
            "models": text,
            "example": curl(
                "/v1/chat/completions",
                f'{{"model": "{example_text}", "messages": [{{"role": "user", "content": "Hi"}}]}}',
            ),
        },
        {"method": "POST", "path": "/v1/completions", "models": text},
        {"method": "POST", "path": "/v1/embeddings", "models": text},
        {"method": "POST", "path": "/v1/rerank", "models": text},
        {
            "method": "POST",
            "path": "/v1/audio/transcriptions",
            "models": batch,
            "example": f"curl -s {base_url}/v1/audio/transcriptions -H 'Authorization: Bearer "
            f"$KEY' -F model={example_stt} -F file=@speech.wav",
        },
        {"method": "POST", "path": "/v1/audio/translations", "models": batch},
        {
            "method": "POST",
            "path": "/v1/audio/speech",
            "models": speech,
            "example": curl("/v1/audio/speech", '{"model": "TTS_MODEL", "input": "Hello"}')
            + " -o speech.wav",
        },
        {
            "method": "GET",
            "path": "/v1/realtime",
            "websocket": True,
            "models": realtime,
            "example": f"websocat '{ws}/v1/realtime?model="
            f"{realtime[0] if realtime else 'STT_MODEL'}' (then send "
            '{"type": "input_audio_buffer.append", "audio": "<base64 PCM16>"} and '
            '{"type": "input_audio_buffer.commit"})',
        },
        {"method": "GET", "path": "/v1/models", "models": [s.name for s in gateway.served]},
    ]
    return {
        "endpoints": endpoints,
        "modes": {s.name: modes_of(s) for s in audio if not speaks(s)},
        # The `diarization` key of their backends: these answer in the shape below.
        "diarizing_models": [s.name for s in batch_models if diarizes(s)],
        "diarized_response_shape": DIARIZED_SHAPE,
    }


async def send_capabilities(gateway: Gateway, scope: Scope, send: Send) -> None:
    host = (header(scope, b"host") or b"127.0.0.1:6502").decode("latin-1")
    scheme = scope.get("scheme", "http")
    await send_bytes(send, 200, orjson.dumps(capabilities(gateway, f"{scheme}://{host}")))
