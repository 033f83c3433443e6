"""Chat Completions stream chunks in, Anthropic Messages events out (SPEC §16 K1), pure:
`AnthropicStream` (a `stream.StreamTranslator`) emits `message_start`, `content_block_*`
(text and `input_json` deltas), `message_delta` and `message_stop` as the chunks come.
"""

from __future__ import annotations

from typing import Any

from corrallm.http.errors import ApiError
from corrallm.proxy.dialects.anthropic_translate import (
    MessageEcho,
    error_event,
    event,
    stop_reason,
    usage_of,
)
from corrallm.proxy.relay import SSE

# -- streaming: Chat chunks -> Anthropic events ---------------------------------------------


class AnthropicStream:
    """Chat SSE chunks (parsed) in, Anthropic SSE events (bytes) out
    (`stream.StreamTranslator`).

    One content block is open at a time: text, or one tool call (a Chat tool call's
    `index` says which); a delta of another kind closes it and opens the next. The
    stream opens with the first chunk (`message_start` carries its id).
    """

    content_type = SSE

    def __init__(self, echo: MessageEcho) -> None:
        self.echo = echo
        self.started = False
        self.finished = False
        self.index = -1  # the content block open, -1: none
        self.open_kind: str | None = None  # "text" or "tool"
        self.open_call: int | None = None  # the Chat tool call index of the open block
        self.stop_reason = "end_turn"
        self.stop_sequence: str | None = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def start(self) -> bytes:
        return b""  # `message_start` goes out with the first chunk, whose id it carries

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        message: dict[str, Any] = {
            "id": "msg_" + str(chunk.get("id", "")),
            "type": "message",
            "role": "assistant",
            "model": self.echo.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = self.open_call = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _open(self, block: dict[str, Any], kind: str) -> bytes:
        out = self._close()
        self.index += 1
        self.open_kind = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return out + event("content_block_start", start)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return event("content_block_delta", data)

    def feed(self, chunk: Any) -> bytes:
        """The events for one Chat chunk (`data:` JSON, parsed)."""
        if not isinstance(chunk, dict) or self.finished:
            return b""
        out = b"" if self.started else self._start(chunk)
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage_of(chunk["usage"])
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return out
        choice = choices[0]
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self.open_kind != "text":
                    out += self._open({"type": "text", "text": ""}, "text")
                out += self._delta({"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    out += self._tool_delta(call)
        if choice.get("finish_reason"):
            self.stop_reason, self.stop_sequence = stop_reason(choice, self.echo.stops)
        return out

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        out = b""
        which = call.get("index", 0)
        function = call.get("function")
        if not isinstance(function, dict):
            function = {}
        if self.open_kind != "tool" or self.open_call != which:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{self.index + 1}",
                "name": function.get("name") or "",
                "input": {},
            }
            out += self._open(block, "tool")
            self.open_call = which
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out

    def finish(self) -> bytes:
        """The closing events: the open block, the stop reason and usage, message_stop."""
        if self.finished:
            return b""
        out = b"" if self.started else self._start({})
        self.finished = True
        out += self._close()
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        out += event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage}
        )
        return out + event("message_stop", {"type": "message_stop"})

    def fail(self, error: ApiError) -> bytes:
        """What ends a stream that broke off or was interrupted: an `error` event."""
        self.finished = True
        return error_event(error)
