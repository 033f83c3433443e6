"""Metering one request (SPEC §9 C2, C3): usage from the backend's answer, its cost, its row.

Token counts come from the backend's `usage`. For streams corrallm asks for
`stream_options.include_usage` and hides that extra chunk from a client that did not ask
for it. A backend that reports nothing gets estimates, flagged as such.

SSE framing lives here too: an event ends at a blank line, whatever the line endings
(`\n\n`, `\r\n\r\n`, `\r\r` or a mix: sse-starlette frames with CRLF by default).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from corrallm.cost.model import BYTES_PER_TOKEN, Metered

STREAMING_USAGE_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_METERED_BODY = 8 * 1024 * 1024  # a non-streaming answer is kept this far to read usage


# A blank line: two line ends in a row, a line end being CRLF, a lone CR or a lone LF.
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")


def split_events(data: bytes) -> tuple[bytes, bytes]:
    """Whole SSE events (up to the last blank line), and the partial one still arriving.

    The hot path: a piece that ends with a blank line and holds no CR (nearly every read
    of an LF-framed stream, as reads end at event boundaries) is whole as it is; other
    LF-framed data is one `rfind`, and a `find` for a CR after it. With CRs, a blank line
    is any of LF LF, CR CR or LF CR in a row, plus the LF that may end the second line end
    when it is a CRLF. A CR last in `data` is cut after: the LF of its CRLF, if one
    follows, opens the next piece (the bytes relayed are unchanged).
    """
    if data.endswith(b"\n\n") and data.find(b"\r") < 0:
        return data, b""  # a stream's usual piece: whole LF-framed events, nothing torn
    cut = data.rfind(b"\n\n")
    if cut >= 0:
        cut += 2
        if data.find(b"\r", cut) < 0:  # no CR after it: no later blank line either
            return data[:cut], data[cut:]
    elif b"\r" not in data:
        return b"", data
    for pair in (b"\r\r", b"\n\r"):
        at = data.rfind(pair)
        if at >= 0:
            end = at + 2
            if data[end : end + 1] == b"\n":
                end += 1
            cut = max(cut, end)
    if cut < 0:
        return b"", data
    return data[:cut], data[cut:]


def count_events(data: bytes) -> int:
    """Blank lines in `data` (whole events), whatever the line endings."""
    if b"\r" not in data:
        return data.count(b"\n\n")
    # Each blank line holds one of these pairs (see `split_events`); no copy is made.
    return data.count(b"\n\n") + data.count(b"\r\r") + data.count(b"\n\r")


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
    # Set when the answer broke off (backend crash, idle timeout): one line for the row.
    error: str | None = None
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
            # LF framing; else count the CR kinds too.
            self.events += data.count(b"\n\n") or count_events(data)
            # One scan per chunk where no event names usage (most backends' token chunks).
            # Only a usage object is worth parsing; with include_usage every other chunk
            # carries `"usage": null`, and parsing those was a tenth of a stream's cost.
            if data.find(b'"usage":') >= 0:
                if b'"usage":{' in data or b'"usage": {' in data:
                    data = self._usage_events(data)
                if self.strip_usage and b'"usage":' in data:
                    # With include_usage every chunk carries `"usage": null`: not for this
                    # client.
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

    def fail(self, status: int, error: str) -> None:
        """The answer broke off: record it as failed, whatever the backend's status was."""
        self.status, self.error = status, error

    def _usage_events(self, data: bytes) -> bytes:
        if b"\r" not in data:
            return b"\n\n".join(e for e in data.split(b"\n\n") if self._keep(e))
        # CR in the framing: cut after each blank line, terminators kept as they came.
        kept, start = [], 0
        for blank in _BLANK_LINE.finditer(data):
            event = data[start : blank.end()]
            start = blank.end()
            if self._keep(event):
                kept.append(event)
        if start < len(data):
            kept.append(data[start:])
        return b"".join(kept)

    def _keep(self, event: bytes) -> bool:
        """Read usage from one event; False if it is the usage chunk this client did not ask for."""
        if b'"usage":{' not in event and b'"usage": {' not in event:
            return True
        line = event.lstrip(b"\r\n")
        if not line.startswith(b"data:"):
            return True
        try:
            obj = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            return True
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
            if self.strip_usage and obj.get("choices") == []:
                return False  # the chunk corrallm asked for, not the client
        return True
