"""The fake backend's realtime transcription WebSocket (the OpenAI Realtime transcription
events, enough to exercise corrallm's relay): audio appended, committed, then transcript
deltas and a completed event."""

from __future__ import annotations

import base64
import secrets
from typing import Any

import orjson

from corrallm.fake_backend.exchange import Receive, Scope, Send


async def realtime(scope: Scope, receive: Receive, send: Send) -> None:
    first = await receive()
    if first["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    buffered = 0

    async def emit(event: dict[str, Any]) -> None:
        await send({"type": "websocket.send", "text": orjson.dumps(event).decode()})

    await emit({"type": "transcription_session.created", "session": {"id": secrets.token_hex(6)}})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        try:
            event = orjson.loads(message.get("text") or message.get("bytes") or b"")
        except orjson.JSONDecodeError:
            await emit({"type": "error", "error": {"message": "not JSON", "code": "bad_event"}})
            continue
        kind = event.get("type") if isinstance(event, dict) else None
        if kind in ("session.update", "transcription_session.update"):
            await emit({"type": "transcription_session.updated", "session": event.get("session")})
        elif kind == "input_audio_buffer.append":
            buffered += len(base64.b64decode(event.get("audio") or b""))
        elif kind == "input_audio_buffer.clear":
            buffered = 0
            await emit({"type": "input_audio_buffer.cleared"})
        elif kind == "input_audio_buffer.commit":
            item = "item_" + secrets.token_hex(4)
            await emit({"type": "input_audio_buffer.committed", "item_id": item})
            words = ["heard", str(buffered), "bytes"]
            for word in words:
                await emit(
                    {
                        "type": "conversation.item.input_audio_transcription.delta",
                        "item_id": item,
                        "delta": word + " ",
                    }
                )
            await emit(
                {
                    "type": "conversation.item.input_audio_transcription.completed",
                    "item_id": item,
                    "transcript": " ".join(words),
                }
            )
            buffered = 0
        elif kind == "close":
            await send({"type": "websocket.close", "code": 4000, "reason": "closed on request"})
            return
        else:
            await emit({"type": "error", "error": {"message": f"unknown event {kind!r}"}})
