"""Chat Completions or Completions stream chunks in, Ollama's NDJSON lines out (SPEC §23 E1),
pure: `Lines` (a `stream.StreamTranslator`) writes one line per chunk that carries text, a
line with each finished round of tool calls, and a last line with `done: true`, the
`done_reason`, the token counts and the durations in nanoseconds. `note` is the line that
tells a waiting client why it waits (K4).
"""

from __future__ import annotations

from typing import Any

import orjson

from corrallm.http.errors import ApiError
from corrallm.proxy.dialects.ollama_translate import (
    NDJSON,
    OllamaEcho,
    created_at,
    done_reason,
    error_line,
    final_fields,
    tool_calls,
)


def _line(kind: str, model: str, now: float, said: dict[str, Any]) -> dict[str, Any]:
    """A line not done yet, saying `said` (content, thinking, tool calls) as `kind` does:
    a chat's in its `message`, a generate's text in `response` and the rest beside it."""
    line: dict[str, Any] = {"model": model, "created_at": created_at(now)}
    if kind == "chat":
        line["message"] = {"role": "assistant", "content": "", **said}
    else:
        line["response"] = said.pop("content", "")
        line.update(said)
    line["done"] = False
    return line


def note(kind: str, model: str, now: float, text: str) -> bytes:
    """A line that says nothing to the answer (empty text) and tells a waiting client why
    it waits (K4) in a field of corrallm's own."""
    return orjson.dumps({**_line(kind, model, now, {}), "corrallm": text}) + b"\n"


class Lines:
    """Chat (`echo.chat`: an `/api/chat` or `/api/generate` answer from Chat Completions)
    or Completions chunks, parsed, in; NDJSON lines (bytes) out, named `echo.model`, each
    stamped `echo.now()` (`stream.StreamTranslator`).

    Ollama sends a tool call whole, never its arguments piece by piece: the Chat deltas
    of the calls are gathered and sent as one line once the choice finishes (or the
    stream ends)."""

    content_type = NDJSON

    def __init__(self, echo: OllamaEcho) -> None:
        self.echo = echo
        self.kind, self.chat, self.model, self.now = echo.kind, echo.chat, echo.model, echo.now
        self.finished = False
        self.reason = "stop"
        self.usage: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # Chat tool calls by index, gathering
        # A line that carries text alone (nearly every line) is written from these parts,
        # the same bytes as `_line` makes, without building and dumping a dict per token.
        self._head = b'{"model":' + orjson.dumps(echo.model) + b',"created_at":'
        if echo.kind == "chat":
            self._text = b',"message":{"role":"assistant","content":'
            self._tail = b'},"done":false}\n'
        else:
            self._text, self._tail = b',"response":', b',"done":false}\n'

    def _text_line(self, now: float, text: str) -> bytes:
        stamp = orjson.dumps(created_at(now))
        return self._head + stamp + self._text + orjson.dumps(text) + self._tail

    def _said(self, now: float, said: dict[str, Any]) -> bytes:
        return orjson.dumps(_line(self.kind, self.model, now, said)) + b"\n"

    def start(self) -> bytes:
        return b""  # an NDJSON stream has no opening: its first line is the first text

    def feed(self, chunk: Any) -> bytes:
        """The lines for one chunk (`data:` JSON, parsed)."""
        if not isinstance(chunk, dict) or self.finished:
            return b""
        error = chunk.get("error")
        if error is not None:  # the backend's error event: the stream ends with it
            self.finished = True
            message = error.get("message") if isinstance(error, dict) else error
            return orjson.dumps({"error": str(message)}) + b"\n"
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return b""
        choice = choices[0]
        said: dict[str, Any] = {}
        if self.chat:
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            text = delta.get("content")
            thinking = delta.get("reasoning_content")
            if isinstance(thinking, str) and thinking:
                said["thinking"] = thinking
            for call in delta.get("tool_calls") or ():
                if isinstance(call, dict):
                    self._gather(call)
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            if not said:
                out = self._text_line(self.now(), text)
            else:
                said["content"] = text
                out = self._said(self.now(), said)
        else:
            out = self._said(self.now(), said) if said else b""
        finish = choice.get("finish_reason")
        if finish:
            self.reason = done_reason(finish)
            out += self._calls()
        return out

    def _gather(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        held = self.calls.setdefault(
            index if isinstance(index, int) else 0,
            {"id": None, "function": {"name": "", "arguments": ""}},
        )
        if isinstance(call.get("id"), str):
            held["id"] = call["id"]
        function = call.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str):
                held["function"]["name"] += function["name"]
            if isinstance(function.get("arguments"), str):
                held["function"]["arguments"] += function["arguments"]

    def _calls(self) -> bytes:
        """The gathered tool calls as one line (none: nothing)."""
        if not self.calls:
            return b""
        gathered = [self.calls[i] for i in sorted(self.calls)]
        self.calls = {}
        made = tool_calls([c if c["id"] else {"function": c["function"]} for c in gathered])
        return self._said(self.now(), {"tool_calls": made})

    def finish(self) -> bytes:
        """The closing line (after any tool calls still gathered); b"" once sent."""
        if self.finished:
            return b""
        self.finished = True
        out = self._calls()
        last = _line(self.kind, self.model, self.now(), {})
        last.update(final_fields(self.reason, self.usage, self.echo.times()))
        return out + orjson.dumps(last) + b"\n"

    def fail(self, error: ApiError) -> bytes:
        """What ends a stream that broke off or was interrupted: an error line."""
        self.finished = True
        return error_line(error)
