"""One realtime transcription session: OpenAI's Realtime transcription events over a
WebSocket, decoded as the audio arrives.

Audio is `pcm16` (16-bit little-endian mono at 24 kHz), appended as base64. With server VAD
(the default, as OpenAI) an utterance starts when the level rises and is committed after
`silence_duration_ms` of quiet; with `turn_detection: null` the client commits. Words are
sent as `delta` events as soon as the live decoder's partial hypothesis is stable behind
them; the `completed` transcript is a second, batch pass over the whole utterance, which
normalizes it by its own statistics and so gets the first words right more often.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import secrets
from collections import deque
from typing import Any

import numpy as np
from speech import FRAME_SECONDS, Audio, Recognizer, Stream
from starlette.websockets import WebSocket, WebSocketDisconnect

RATE = 24000
FRAME = int(RATE * FRAME_SECONDS)
DEFAULT_VAD = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
}
EVENT = "conversation.item.input_audio_transcription."


def vad_level(threshold: float) -> float:
    """OpenAI's 0 to 1 `threshold` as an RMS level: 0.5 is -40 dBFS, 0 is -60, 1 is -20."""
    return 32768 * 10 ** ((-60 + 40 * min(1.0, max(0.0, threshold))) / 20)


class RealtimeSession:
    def __init__(self, ws: WebSocket, recognizer: Recognizer, model: str) -> None:
        self.ws, self.recognizer = ws, recognizer
        self.session: dict[str, Any] = {
            "id": "sess_" + secrets.token_hex(8),
            "object": "realtime.transcription_session",
            "input_audio_format": "pcm16",
            "input_audio_transcription": {"model": model, "language": "en"},
            "turn_detection": dict(DEFAULT_VAD),
        }
        self.stream: Stream | None = None
        self.item: str | None = None
        self.previous: str | None = None
        self.sent: list[str] = []  # words sent as deltas for the current item
        self.utterance: list[np.ndarray] = []
        self.fed_ms = 0.0  # audio received, for speech_started/stopped timestamps
        self.quiet_ms = 0.0
        self.in_speech = False
        self.prefix: deque[np.ndarray] = deque()
        self.residue = np.zeros(0, dtype=np.int16)

    async def run(self) -> None:
        await self.ws.accept()
        self.stream = await asyncio.to_thread(self.recognizer.decoder, RATE)
        try:
            await self.emit("transcription_session.created", session=self.session)
            while True:
                try:
                    event = await self.ws.receive_json()
                except WebSocketDisconnect:
                    return
                except ValueError:
                    await self.error("The event is not JSON.", "invalid_json")
                    continue
                await self.handle(event if isinstance(event, dict) else {})
        finally:
            stream, self.stream = self.stream, None
            await asyncio.to_thread(stream.release)

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in ("transcription_session.update", "session.update"):
            await self.update(kind, event.get("session") or {})
        elif kind == "input_audio_buffer.append":
            try:
                pcm = base64.b64decode(event.get("audio") or "", validate=True)
            except (binascii.Error, ValueError):
                await self.error("'audio' must be base64 of 16-bit PCM at 24 kHz.", "invalid_audio")
                return
            await self.append(np.frombuffer(pcm[: len(pcm) // 2 * 2], dtype="<i2"))
        elif kind == "input_audio_buffer.commit":
            if self.item is None:
                await self.error(
                    "The input audio buffer is empty.", "input_audio_buffer_commit_empty"
                )
            else:
                await self.commit()
        elif kind == "input_audio_buffer.clear":
            if self.stream is not None and self.stream.active:
                await asyncio.to_thread(self.stream.finish)
            self.item, self.in_speech, self.sent, self.utterance = None, False, [], []
            self.prefix.clear()
            await self.emit("input_audio_buffer.cleared")
        else:
            await self.error(f"Unknown event type {kind!r}.", "unknown_event")

    async def update(self, kind: str, changes: dict[str, Any]) -> None:
        # Both the beta shape (input_audio_format, turn_detection at the top) and the GA
        # one (audio.input.{format,turn_detection,transcription}) are understood.
        audio_in = (changes.get("audio") or {}).get("input") or {}
        fmt = changes.get("input_audio_format") or (audio_in.get("format") or {})
        if isinstance(fmt, dict):
            fmt = "pcm16" if fmt in ({}, {"type": "audio/pcm", "rate": RATE}) else str(fmt)
        if fmt not in ("pcm16",) and fmt:
            await self.error(
                f"Input audio format {fmt!r} is not supported here; send pcm16 at 24 kHz.",
                "unsupported_audio_format",
            )
            return
        if "turn_detection" in changes or "turn_detection" in audio_in:
            vad = changes.get("turn_detection", audio_in.get("turn_detection"))
            self.session["turn_detection"] = None if vad is None else {**DEFAULT_VAD, **vad}
        transcription = changes.get("input_audio_transcription") or audio_in.get("transcription")
        if transcription:
            self.session["input_audio_transcription"].update(transcription)
        reply = "session.updated" if kind == "session.update" else "transcription_session.updated"
        await self.emit(reply, session=self.session)

    async def append(self, samples: np.ndarray) -> None:
        vad = self.session["turn_detection"]
        if vad is None:
            await self.feed(samples)
            return
        samples = np.concatenate([self.residue, samples])
        whole = len(samples) // FRAME * FRAME
        self.residue = samples[whole:]
        level, padding = vad_level(vad["threshold"]), vad["prefix_padding_ms"]
        for frame in samples[:whole].reshape(-1, FRAME):
            self.fed_ms += FRAME_SECONDS * 1000
            loud = float(np.sqrt((frame.astype(np.float32) ** 2).mean())) > level
            if not self.in_speech:
                self.prefix.append(frame)
                while len(self.prefix) * FRAME_SECONDS * 1000 > padding + FRAME_SECONDS * 1000:
                    self.prefix.popleft()
                if loud:
                    self.in_speech, self.quiet_ms = True, 0.0
                    await self.feed(np.concatenate(self.prefix))
                    self.prefix.clear()
                    start = max(0, int(self.fed_ms - padding))
                    await self.emit(
                        "input_audio_buffer.speech_started", audio_start_ms=start, item_id=self.item
                    )
                continue
            await self.feed(frame)
            self.quiet_ms = 0.0 if loud else self.quiet_ms + FRAME_SECONDS * 1000
            if self.quiet_ms >= vad["silence_duration_ms"]:
                self.in_speech = False
                await self.emit(
                    "input_audio_buffer.speech_stopped",
                    audio_end_ms=int(self.fed_ms),
                    item_id=self.item,
                )
                await self.commit()

    async def feed(self, samples: np.ndarray) -> None:
        if not len(samples) or self.stream is None:
            return
        if self.item is None:
            self.item, self.sent, self.utterance = "item_" + secrets.token_hex(8), [], []
        self.utterance.append(samples)
        stream = self.stream
        partial = await asyncio.to_thread(lambda: (stream.feed(samples), stream.partial())[1])
        # The last word may still change as more audio arrives; the ones before it are sent.
        await self.send_words(partial.split()[:-1])

    async def send_words(self, words: list[str]) -> None:
        """Send the words beyond those already sent, if what was sent is still their start
        (a revised hypothesis cannot take back a delta; `completed` is authoritative)."""
        if len(words) > len(self.sent) and words[: len(self.sent)] == self.sent:
            delta = " ".join(words[len(self.sent) :]) + " "
            self.sent = words
            await self.emit(EVENT + "delta", item_id=self.item, content_index=0, delta=delta)

    async def commit(self) -> None:
        assert self.stream is not None
        item, stream = self.item, self.stream
        await self.emit(
            "input_audio_buffer.committed", previous_item_id=self.previous, item_id=item
        )
        heard = Audio(np.concatenate(self.utterance), RATE)
        await asyncio.to_thread(stream.finish)
        transcript = await asyncio.to_thread(self.recognizer.transcribe, heard)
        await self.send_words(transcript.split())
        await self.emit(EVENT + "completed", item_id=item, content_index=0, transcript=transcript)
        self.previous, self.item, self.sent, self.utterance = item, None, [], []

    async def emit(self, kind: str, **fields: Any) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self.ws.send_json(
                {"event_id": "event_" + secrets.token_hex(6), "type": kind, **fields}
            )

    async def error(self, message: str, code: str) -> None:
        await self.emit(
            "error", error={"type": "invalid_request_error", "code": code, "message": message}
        )
