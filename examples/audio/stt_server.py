"""Reference speech-to-text backend on PocketSphinx (PyPI `pocketsphinx`, whose en-us model
ships inside the wheel): OpenAI's batch `POST /v1/audio/transcriptions|translations` and
the realtime transcription WebSocket `GET /v1/realtime`, with optional diarization.

    python examples/audio/stt_server.py --port 8302 --vocabulary digits [--diarize]

`--vocabulary digits` recognizes spoken digit strings well; `general` (the default) is the
wheel's open-English model, which is weak on synthesized speech. English only: a
translation is the English transcript. `--diarize` makes `json` answers diarized
(`diarized_json` works either way).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from diarize import cluster, voice
from openai_shapes import ApiError, arguments, service
from realtime_session import RealtimeSession
from speech import VOCABULARIES, Audio, AudioError, Recognizer, read_wav, speech_segments
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

FORMATS = ("json", "text", "verbose_json", "srt", "vtt", "diarized_json")
MAX_UPLOAD = 25 * 1024 * 1024  # as OpenAI


class Transcriber:
    def __init__(self, vocabulary: str, diarize: bool, model: str) -> None:
        self.recognizer = Recognizer(vocabulary)
        self.diarize, self.model = diarize, model
        self.ready = False
        self._loading: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve at once, with health 503 until a decoder is built (0.25 s), as a real
        engine answers while its model loads."""
        self._loading = asyncio.create_task(self._load())

    async def _load(self) -> None:
        stream = await asyncio.to_thread(self.recognizer.decoder, 16000, False)
        stream.release()
        self.ready = True

    def segments(self, audio: Audio, speakers: int | None, diarized: bool) -> list[dict[str, Any]]:
        """One entry per stretch of speech, each decoded on its own (blocking: run in a
        worker thread)."""
        spans = speech_segments(audio) or ([(0.0, audio.seconds)] if audio.seconds else [])
        clips = [audio.slice(a, b) for a, b in spans]
        out = [
            {
                "id": i,
                "start": round(a, 2),
                "end": round(b, 2),
                "text": self.recognizer.transcribe(c),
            }
            for i, ((a, b), c) in enumerate(zip(spans, clips, strict=True))
        ]
        if diarized and out:
            for seg, who in zip(out, cluster([voice(c) for c in clips], speakers), strict=True):
                seg["speaker"] = f"SPEAKER_{who:02d}"
        return [s for s in out if s["text"] or diarized]


async def transcribe(request: Request) -> Response:
    t: Transcriber = request.app.state.engine
    form = await request.form(max_part_size=MAX_UPLOAD)
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "Send the audio as the multipart file field 'file'.", "file")
    fmt = str(form.get("response_format") or "json")
    if fmt not in FORMATS:
        raise ApiError(
            400, f"response_format must be one of {', '.join(FORMATS)}.", "response_format"
        )
    language = str(form.get("language") or "en")
    if not language.lower().startswith("en"):
        raise ApiError(400, f"This backend transcribes English only, not {language!r}.", "language")
    speakers = _speakers(form.get("num_speakers"))
    try:
        audio = read_wav(await upload.read())
    except AudioError as exc:
        raise ApiError(400, str(exc), "file") from None
    diarized = fmt == "diarized_json" or (fmt == "json" and t.diarize)
    started = time.monotonic()
    segments = await asyncio.to_thread(t.segments, audio, speakers, diarized)
    text = " ".join(s["text"] for s in segments if s["text"])
    usage = {"type": "duration", "seconds": round(audio.seconds, 2)}
    headers = {"x-decode-seconds": f"{time.monotonic() - started:.3f}"}
    if str(form.get("stream") or "").lower() == "true":
        return StreamingResponse(_events(segments, text, usage), media_type="text/event-stream")
    if diarized:
        body = {
            "task": "transcribe",
            "text": text,
            # OpenAI's diarized segment shape (its SDK parses these), speakers as SPEAKER_00.
            "segments": [
                {**s, "id": f"seg_{s['id']}", "type": "transcript.text.segment"} for s in segments
            ],
            "num_speakers": len({s["speaker"] for s in segments}),
            "duration": round(audio.seconds, 2),
            "usage": usage,
        }
        return JSONResponse(body, headers=headers)
    if fmt == "json":
        return JSONResponse({"text": text, "usage": usage}, headers=headers)
    if fmt == "verbose_json":
        task = "translate" if request.url.path.endswith("translations") else "transcribe"
        return JSONResponse(
            {
                "task": task,
                "language": "english",
                "duration": round(audio.seconds, 2),
                "text": text,
                "segments": segments,
                "usage": usage,
            },
            headers=headers,
        )
    if fmt == "text":
        return PlainTextResponse(text + "\n", headers=headers)
    return PlainTextResponse(_subtitles(segments, fmt), headers=headers)


def _speakers(value: object) -> int | None:
    """`num_speakers` (not an OpenAI field): the diarizer's cluster count when known."""
    if value in (None, ""):
        return None
    try:
        n = int(str(value))
    except ValueError:
        n = 0
    if not 1 <= n <= 32:
        raise ApiError(400, "num_speakers must be a whole number from 1 to 32.", "num_speakers")
    return n


async def _events(
    segments: list[dict[str, Any]], text: str, usage: dict[str, Any]
) -> AsyncIterator[str]:
    """OpenAI's streamed transcription: a delta per segment, then the whole text."""
    for seg in segments:
        if seg["text"]:
            yield _sse({"type": "transcript.text.delta", "delta": seg["text"] + " "})
    yield _sse({"type": "transcript.text.done", "text": text, "usage": usage})


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event)}\n\n"


def _subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    def stamp(t: float) -> str:
        seconds, ms = divmod(round(t * 1000), 1000)
        minutes, seconds = divmod(seconds, 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours:02d}:{minutes:02d}:{seconds:02d}{',' if fmt == 'srt' else '.'}{ms:03d}"

    cues = [s for s in segments if s["text"]]
    if fmt == "srt":
        return "".join(
            f"{i}\n{stamp(s['start'])} --> {stamp(s['end'])}\n{s['text']}\n\n"
            for i, s in enumerate(cues, 1)
        )
    return "WEBVTT\n\n" + "".join(
        f"{stamp(s['start'])} --> {stamp(s['end'])}\n{s['text']}\n\n" for s in cues
    )


async def realtime(ws: WebSocket) -> None:
    t: Transcriber = ws.app.state.engine
    await RealtimeSession(ws, t.recognizer, t.model).run()


def build(vocabulary: str, diarize: bool, model: str) -> Starlette:
    routes = [
        Route("/v1/audio/transcriptions", transcribe, methods=["POST"]),
        Route("/v1/audio/translations", transcribe, methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime),
    ]
    return service(Transcriber(vocabulary, diarize, model), routes)


def main() -> None:
    parser = arguments("OpenAI speech-to-text (batch and realtime) on PocketSphinx", "pocketsphinx")
    parser.add_argument("--vocabulary", choices=VOCABULARIES, default="general")
    parser.add_argument("--diarize", action="store_true", help="answer json as diarized_json")
    args = parser.parse_args()
    app = build(args.vocabulary, args.diarize, args.model_name)
    uvicorn.run(app, host=args.host, port=args.port, ws="websockets", log_level="info")


if __name__ == "__main__":
    main()
