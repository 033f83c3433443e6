"""Chat Completions stream chunks in, OpenAI Responses stream events out (SPEC §16 K2), pure:
`ResponsesStream` (a `stream.StreamTranslator`) emits `response.created` ...
`response.completed` (or `incomplete`, `failed`), each with its `sequence_number`, as
named SSE events (`encode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from corrallm.http.errors import ApiError
from corrallm.proxy.dialects.responses_translate import (
    Echo,
    call_item,
    message_item,
    new_id,
    status_of,
    usage_of,
)
from corrallm.proxy.relay import SSE

# -- the stream ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    index: int  # its output index
    item_id: str
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class ResponsesStream:
    """Chat Completions chunks in (parsed `data:` objects), Responses events out, encoded
    (`stream.StreamTranslator`).

    `start()` opens the response; `feed(chunk)` turns each chunk into the events it means;
    `finish()` closes every open item and ends with `response.completed` (or
    `response.incomplete` when the backend stopped at the token limit); `fail()` ends a
    broken stream with an `error` event and `response.failed`. Items stay open until the
    end, each at its own `output_index`, so tool calls may interleave.
    """

    echo: Echo
    sequence: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    finished: bool = False
    content_type = SSE
    _text_item: tuple[int, str] | None = None  # (output index, item id)
    _text: list[str] = field(default_factory=list)
    _calls: dict[int, _Call] = field(default_factory=dict)  # by the chat tool-call index
    _outputs: int = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> bytes:
        created = self.echo.response("in_progress", [])
        return encode(
            [
                self._event("response.created", response=created),
                self._event("response.in_progress", response=created),
            ]
        )

    def feed(self, chunk: Any) -> bytes:
        events = self._events_of(chunk)
        return encode(events) if events else b""

    def _events_of(self, chunk: Any) -> list[dict[str, Any]]:
        if not isinstance(chunk, dict) or self.finished:
            return []
        events: list[dict[str, Any]] = []
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return events
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return events
        text = delta.get("content")
        if isinstance(text, str) and text:
            events.extend(self._text_delta(text))
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict):
                    events.extend(self._call_delta(call))
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._text_item is None:
            self._text_item = (self._outputs, new_id("msg"))
            self._outputs += 1
            index, item_id = self._text_item
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item={**message_item(item_id, "", "in_progress"), "content": []},
                )
            )
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        index, item_id = self._text_item
        self._text.append(text)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item_id,
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        position = delta.get("index")
        position = position if isinstance(position, int) else len(self._calls)
        function = delta.get("function")
        function = function if isinstance(function, dict) else {}
        call = self._calls.get(position)
        if call is None:
            call_id = delta.get("id")
            call = _Call(
                self._outputs,
                new_id("fc"),
                call_id if isinstance(call_id, str) and call_id else new_id("call"),
                str(function.get("name") or ""),
            )
            self._calls[position] = call
            self._outputs += 1
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=call.index,
                    item=call_item(call.item_id, call.call_id, call.name, "", "in_progress"),
                )
            )
        elif not call.name and function.get("name"):
            call.name = str(function["name"])
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            call.arguments += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item_id,
                    output_index=call.index,
                    delta=arguments,
                )
            )
        return events

    def output(self, status: str) -> list[dict[str, Any]]:
        """The output items so far, in output order."""
        items: list[tuple[int, dict[str, Any]]] = []
        if self._text_item is not None:
            index, item_id = self._text_item
            items.append((index, message_item(item_id, "".join(self._text), status)))
        for c in self._calls.values():
            items.append((c.index, call_item(c.item_id, c.call_id, c.name, c.arguments, status)))
        return [item for _, item in sorted(items, key=lambda pair: pair[0])]

    def finish(self) -> bytes:
        """The closing events (b"" once the stream is finished)."""
        if self.finished:
            return b""
        self.finished = True
        status = status_of(self.finish_reason)
        events: list[dict[str, Any]] = []
        output = self.output(status)
        by_id = {item["id"]: item for item in output}
        if self._text_item is not None:
            index, item_id = self._text_item
            item = by_id[item_id]
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        closing = []
        if self._text_item is not None:
            closing.append((self._text_item[0], by_id[self._text_item[1]]))
        for c in self._calls.values():
            closing.append((c.index, by_id[c.item_id]))
        for index, item in sorted(closing, key=lambda pair: pair[0]):
            if item["type"] == "function_call":
                events.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        final = self.echo.response(status, output, usage_of(self.usage), self.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=final))
        return encode(events)

    def fail(self, error: ApiError) -> bytes:
        """End a stream that broke off (backend gone, timeout, preemption): an `error`
        event and `response.failed` with what was said so far."""
        self.finished = True
        code, message = error.code or "error", error.message
        failed = self.echo.response(
            "failed",
            self.output("incomplete"),
            usage_of(self.usage),
            error={"code": code, "message": message},
        )
        return encode(
            [
                self._event("error", code=code, message=message, param=None),
                self._event("response.failed", response=failed),
            ]
        )


def encode(events: list[dict[str, Any]]) -> bytes:
    """Events as SSE, each named by its type (as OpenAI sends them)."""
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )
