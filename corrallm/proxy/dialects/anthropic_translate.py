"""Anthropic Messages <-> OpenAI Chat Completions (SPEC §16 K1), pure: data in, data out.

- `to_chat(payload)`: a Messages request, checked field by field (a malformed one is a 400
  naming the field, never a 5xx further on), as a Chat Completions request.
- `from_chat(answer, echo)`: a Chat Completions answer as a Messages answer (the shape
  of every dialect's whole-answer translator: proxy/dialects/stream.py).
- the stream (Chat chunks in, Anthropic's events out) is `anthropic_stream.py`'s.
- `error_shape(status)` / `error_event(...)`: Anthropic's error types and statuses.

No I/O, no clock, no logging: the codec (proxy/anthropic.py) does those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from corrallm.http.errors import ApiError, bad_request
from corrallm.proxy.dialects.stream import TranslationError, tool_arguments

# A request holds at most this many content blocks in all (a hostile one holds 10,000).
MAX_BLOCKS = 4096
ROLES = ("user", "assistant")
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}
# status -> (status sent, Anthropic error type); 503 (congestion, a start under way) is
# Anthropic's 529 overloaded_error, which its clients retry.
_ERRORS = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    405: (405, "invalid_request_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
}


def error_shape(status: int) -> tuple[int, str]:
    """The status and Anthropic error type for one of corrallm's statuses."""
    known = _ERRORS.get(status)
    if known is not None:
        return known
    return (status, "api_error") if status >= 500 else (status, "invalid_request_error")


def error_body(error: ApiError) -> tuple[int, dict[str, Any]]:
    status, kind = error_shape(error.status)
    return status, {
        "type": "error",
        "error": {"type": kind, "message": error.message, **error.extra},
    }


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(error: ApiError) -> bytes:
    return event("error", error_body(error)[1])


# -- request: Messages -> Chat --------------------------------------------------------------


class _Count:
    def __init__(self) -> None:
        self.blocks = 0

    def add(self, n: int) -> None:
        self.blocks += n
        if self.blocks > MAX_BLOCKS:
            raise bad_request(
                f"The request holds more than {MAX_BLOCKS} content blocks; join text blocks "
                "or split the conversation.",
                param="messages",
            )


def _text_of(value: Any, where: str, count: _Count) -> str:
    """A string, or a list of text blocks joined (system prompts, tool results)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text blocks.", param=where)
    count.add(len(value))
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_request(f"'{where}[{i}]' must be a text block.", param=where)
        parts.append(_string(block.get("text"), f"{where}[{i}].text"))
    return "\n".join(parts)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"'{where}' must be a string.", param=where)
    return value


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad_request(f"'{where}.source' must be an object.", param=where)
    if source.get("type") == "base64":
        media = _string(source.get("media_type"), f"{where}.source.media_type")
        data = _string(source.get("data"), f"{where}.source.data")
        url = f"data:{media};base64,{data}"
    elif source.get("type") == "url":
        url = _string(source.get("url"), f"{where}.source.url")
    else:
        raise bad_request(f"'{where}.source.type' must be 'base64' or 'url'.", param=where)
    return {"type": "image_url", "image_url": {"url": url}}


def _message(role: str, content: Any, where: str, count: _Count) -> list[dict[str, Any]]:
    """One Messages turn as Chat messages: tool results become `tool` messages first."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of blocks.", param=where)
    count.add(len(content))
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(block.get("text"), at + ".text")})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"'{at}.input' must be an object.", param=at)
            calls.append(
                {
                    "id": _string(block.get("id"), at + ".id"),
                    "type": "function",
                    "function": {
                        "name": _string(block.get("name"), at + ".name"),
                        "arguments": orjson.dumps(args).decode(),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            text = _text_of(block.get("content", ""), at + ".content", count)
            if block.get("is_error") is True:
                text = "Error: " + text
            call = _string(block.get("tool_use_id"), at + ".tool_use_id")
            results.append({"role": "tool", "tool_call_id": call, "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the model's own reasoning: not part of a Chat history
        else:
            raise bad_request(
                f"'{at}' is not a content block a {role} turn can hold here "
                "(text, image and tool_result for user; text and tool_use for assistant).",
                param=at,
            )
    out = results
    if role == "assistant":
        text = "".join(p["text"] for p in parts)
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = calls
        if text or calls:
            out.append(msg)
    elif parts:
        plain = all(p["type"] == "text" for p in parts)
        out.append(
            {"role": "user", "content": "\n".join(p["text"] for p in parts) if plain else parts}
        )
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"'{at}' must be an object.", param="tools")
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool (web search...): Anthropic runs those, a local model cannot
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"'{at}.input_schema' must be a JSON Schema object.", param="tools")
        function: dict[str, Any] = {"name": _string(tool.get("name"), at + ".name")}
        if tool.get("description") is not None:
            function["description"] = _string(tool.get("description"), at + ".description")
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """The Chat tool_choice, and whether parallel tool calls are turned off."""
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise bad_request("'tool_choice' must be an object with a 'type'.", param="tool_choice")
    kind = choice["type"]
    serial = choice.get("disable_parallel_tool_use") is True
    if kind == "tool":
        name = _string(choice.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, serial
    if kind not in _TOOL_CHOICE:
        raise bad_request(
            "'tool_choice.type' must be auto, any, tool or none.", param="tool_choice"
        )
    return _TOOL_CHOICE[kind], serial


def _number(payload: dict[str, Any], name: str) -> float | int | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{name}' must be a number.", param=name)
    return value


def to_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as a Chat Completions request (the model name left as sent)."""
    count = _Count()
    chat: dict[str, Any] = {"model": payload["model"]}
    messages: list[dict[str, Any]] = []
    system = payload.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system", count)})
    turns = payload.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_request("'messages' is required: a non-empty list of turns.", param="messages")
    for i, turn in enumerate(turns):
        at = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise bad_request(
                f"'{at}' must be an object whose role is user or assistant.", param="messages"
            )
        if "content" not in turn:
            raise bad_request(f"'{at}.content' is required.", param="messages")
        messages.extend(_message(turn["role"], turn["content"], at, count))
    chat["messages"] = messages
    limit = payload.get("max_tokens")
    if limit is not None:
        chat["max_tokens"] = limit  # checked by the codec (inference.token_limit)
    for name in ("temperature", "top_p", "top_k"):
        value = _number(payload, name)
        if value is not None:
            chat[name] = value
    stops = payload.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request("'stop_sequences' must be a list of strings.", param="stop_sequences")
        if stops:
            chat["stop"] = stops
    if payload.get("tools") is not None:
        chat["tools"] = _tools(payload["tools"])
    if payload.get("tool_choice") is not None:
        chat["tool_choice"], serial = _tool_choice(payload["tool_choice"])
        if serial:
            chat["parallel_tool_calls"] = False
    metadata = payload.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    if payload.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # metered (C2), never shown
    return chat


def prompt_text(chat: dict[str, Any]) -> str:
    """Every text of a translated request, for a token count without a chat template."""
    texts = []
    for msg in chat["messages"]:
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if p.get("type") == "text")
        for call in msg.get("tool_calls", ()):
            texts.append(call["function"]["name"] + call["function"]["arguments"])
    for tool in chat.get("tools", ()):
        texts.append(orjson.dumps(tool["function"]).decode())
    return "\n".join(texts)


# -- answer: Chat -> Messages ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MessageEcho:
    """What a Message repeats of its request: the model asked for, and the stop sequences
    (one that matched is named as the stop sequence)."""

    model: str
    stops: Sequence[str] = ()


def stop_reason(choice: dict[str, Any], stops: Sequence[str]) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence when the backend says which matched
    (vLLM's `stop_reason`; Chat Completions has no field for it)."""
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def usage_of(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, dict) else {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return {
        "input_tokens": prompt if isinstance(prompt, int) else 0,
        "output_tokens": completion if isinstance(completion, int) else 0,
    }


def from_chat(answer: Any, echo: MessageEcho) -> dict[str, Any]:
    """A Chat Completions answer as a Messages answer, named after the model asked for."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise TranslationError("an answer with no choices: not a chat completion.")
    choice = choices[0]
    message: dict[str, Any] = choice.get("message") or {}
    if not isinstance(message, dict):
        raise TranslationError("an answer with no message: not a chat completion.")
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for i, call in enumerate(message.get("tool_calls") or ()):
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or f"toolu_{i}",
                "name": function.get("name", ""),
                "input": tool_arguments(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(choice, echo.stops)
    return {
        "id": "msg_" + str(answer.get("id", "")),
        "type": "message",
        "role": "assistant",
        "model": echo.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_of(answer.get("usage")),
    }
