"""Metering one request (SPEC §9 C2, C3): usage from the backend's answer, its cost, its row.

Token counts come from the backend's `usage`. For streams corrallm asks for
`stream_options.include_usage` and hides that extra chunk from a client that did not ask
for it. A backend that reports nothing gets estimates, flagged as such.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from corrallm.cost.model import BYTES_PER_TOKEN, Metered

STREAMING_USAGE_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_METERED_BODY = 8 * 1024 * 1024  # a non-streaming answer is kept this far to read usage


def ask_for_usage(path: str, payload: dict[str, Any]) -> bool:
    """Make a stream report usage; True if the client did not ask (its usage chunk is hidden)."""
    if path not in STREAMING_USAGE_ENDPOINTS or payload.get("stream") is not True:
        return False
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    payload["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return True


@dataclass(slots=True)
class Meter:
    strip_usage: bool = False
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    sse: bool = False
    status: int = 0
    bytes_out: int = 0
    events: int = 0
    usage: dict[str, Any] | None = None
    _body: bytearray = field(default_factory=bytearray)
    _keep_body: bool = True

    def start(self, status: int, sse: bool, json: bool = True) -> None:
        self.status, self.sse = status, sse
        self._keep_body = json  # only a JSON answer can carry usage; audio is just counted

    def chunk(self, data: bytes) -> bytes:
        """Every piece of the answer passes here on its way out (whole events for SSE)."""
        if self.first_byte is None:
            self.first_byte = time.monotonic()
        if self.sse:
            self.events += data.count(b"\n\n")
            # Only a usage object is worth parsing; with include_usage every other chunk
            # carries `"usage": null`, and parsing those was a tenth of a stream's cost.
            if b'"usage":{' in data or b'"usage": {' in data:
                data = self._usage_events(data)
            if self.strip_usage and b'"usage":' in data:
                # With include_usage every chunk carries `"usage": null`: not for this client.
                data = data.replace(b',"usage":null', b"").replace(b', "usage": null', b"")
        elif self._keep_body and len(self._body) < MAX_METERED_BODY:
            self._body += data
        self.bytes_out += len(data)
        return data

    def finish(self) -> None:
        if self.sse or not self._body:
            return
        try:
            answer = orjson.loads(self._body)
        except orjson.JSONDecodeError:
            return
        if isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
            self.usage = answer["usage"]

    def metered(self, bytes_in: int) -> Metered:
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        if isinstance(prompt, int):
            return Metered(prompt, int(completion or 0), bytes_in, self.bytes_out)
        # No usage from the backend: a rough count, flagged (C2).
        estimate = self.events if self.sse else len(self._body) // BYTES_PER_TOKEN
        return Metered(bytes_in // BYTES_PER_TOKEN, estimate, bytes_in, self.bytes_out, True)

    def ttfb_ms(self) -> float | None:
        return None if self.first_byte is None else (self.first_byte - self.started) * 1000

    def _usage_events(self, data: bytes) -> bytes:
        kept = []
        for event in data.split(b"\n\n"):
            if (b'"usage":{' in event or b'"usage": {' in event) and event.startswith(b"data: "):
                try:
                    obj = orjson.loads(event[6:])
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]
                    if self.strip_usage and obj.get("choices") == []:
                        continue  # the chunk corrallm asked for, not the client
            kept.append(event)
        return b"\n\n".join(kept)
