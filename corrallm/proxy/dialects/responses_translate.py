"""OpenAI Responses <-> Chat Completions, pure (SPEC §16 K2): data in, data out, no I/O.

- `to_chat(payload)`: a stateless Responses request as a Chat Completions request, or
  `Refused` saying what cannot be translated and what to send instead;
- `from_chat(chat, echo)`: a Chat Completions answer as a Response object (the shape of
  every dialect's whole-answer translator: proxy/dialects/stream.py);
- the stream (Chat chunks in, Responses events out) is `responses_stream.py`'s.

`check_request(payload)` is what both ways (native and translated) need to hold: the
fields corrallm reads have the right types and the input is of a bounded size.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from corrallm.http.errors import quoted

MAX_INPUT_ITEMS = 4096  # input items, and content parts per message: far past any context
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "refusal"})
# State only OpenAI keeps: refused on a translated request, with what to do instead.
_STATEFUL = {
    "previous_response_id": "send the whole conversation in 'input' instead",
    "conversation": "send the whole conversation in 'input' instead",
    "prompt": "send the prompt's text in 'instructions'/'input' instead",
    "background": "send the request without 'background' and wait for its answer",
}


class Refused(ValueError):
    """A request that cannot be served this way: the message says why and what to do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the request ---------------------------------------------------------------------------


def _whole(payload: dict[str, Any], name: str) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refused(f"'{name}' must be a whole number of tokens, at least 1.", name)
    return value


def check_request(payload: dict[str, Any]) -> int | None:
    """The checks any Responses request passes here, native or translated; returns
    `max_output_tokens` (for the spend estimate)."""
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Refused(f"'stream' must be true or false, not {quoted(stream)}.", "stream")
    if "input" not in payload or payload["input"] is None:
        raise Refused(
            "Missing 'input': send the prompt as a string or a list of messages.", "input"
        )
    given = payload["input"]
    if not isinstance(given, str | list):
        raise Refused("'input' must be a string or a list of messages/input items.", "input")
    if isinstance(given, list):
        _bounded(given, "input")
        for i, item in enumerate(given):
            if not isinstance(item, dict):
                raise Refused(f"'input[{i}]' must be an object (a message or input item).", "input")
            content = item.get("content")
            if isinstance(content, list):
                _bounded(content, f"input[{i}].content")
    if payload.get("instructions") is not None and not isinstance(payload["instructions"], str):
        raise Refused("'instructions' must be a string.", "instructions")
    for name in ("temperature", "top_p"):
        value = payload.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise Refused(f"'{name}' must be a number.", name)
    tools = payload.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise Refused("'tools' must be a list of tool objects.", "tools")
        _bounded(tools, "tools")
    return _whole(payload, "max_output_tokens")


def _bounded(items: list[Any], where: str) -> None:
    if len(items) > MAX_INPUT_ITEMS:
        raise Refused(
            f"'{where}' has {len(items)} entries; corrallm takes at most {MAX_INPUT_ITEMS}. "
            "Send fewer (merge texts, drop old turns).",
            where.split("[", 1)[0].split(".", 1)[0],
        )


def to_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """A Chat Completions request for a stateless Responses request (`check_request` first)."""
    for name, instead in _STATEFUL.items():
        if payload.get(name) not in (None, False, ""):
            raise Refused(
                f"'{name}' needs state that this model's backend cannot keep (it does not "
                f"speak the Responses API natively: apis has no 'responses'); {instead}.",
                name,
            )
    if payload.get("store") is True:
        raise Refused(
            "'store': true needs state that this model's backend cannot keep (it does not "
            "speak the Responses API natively: apis has no 'responses'). Send 'store': false "
            "and the whole conversation in 'input' each time.",
            "store",
        )
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = payload["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    else:
        for i, item in enumerate(given):
            _add_item(messages, item, i)
    chat: dict[str, Any] = {"model": payload["model"], "messages": messages}
    limit = _whole(payload, "max_output_tokens")
    if limit is not None:
        chat["max_tokens"] = limit
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "top_logprobs"):
        if payload.get(name) is not None:
            chat[name] = payload[name]
    if payload.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(payload["tools"])]
    if payload.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(payload["tool_choice"])
    response_format = _response_format(payload.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if payload.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], i: int) -> None:
    kind = item.get("type", "message")
    where = f"input[{i}]"
    if kind == "message":
        given = item.get("role")
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise Refused(
                f"'{where}.role' must be one of user, assistant, system, developer.", "input"
            )
        content = _content(item.get("content"), f"{where}.content", role)
        messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = {
            "id": _text(item.get("call_id"), f"{where}.call_id"),
            "type": "function",
            "function": {
                "name": _text(item.get("name"), f"{where}.name"),
                "arguments": _text(item.get("arguments", ""), f"{where}.arguments", empty=True),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        elif last is not None and last["role"] == "assistant" and last.get("content"):
            last["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = (
            output
            if isinstance(output, str)
            else _joined(_content(output, f"{where}.output", "tool"))
        )
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"),
                "content": text,
            }
        )
    elif kind == "reasoning":
        return  # a model's earlier reasoning: not part of a Chat conversation
    elif kind == "item_reference":
        raise Refused(
            f"'{where}' refers to a stored item, which this model's backend cannot keep; "
            "send the item itself.",
            "input",
        )
    else:
        raise Refused(
            f"'{where}' is a '{kind}' item, which cannot be translated to Chat Completions; "
            "send messages, function_call and function_call_output items.",
            "input",
        )


def _text(value: Any, where: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty):
        raise Refused(f"'{where}' must be a non-empty string.", "input")
    return value


def _content(content: Any, where: str, role: str) -> Any:
    """A message's content in Chat form: a string, or a list of text/image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Refused(f"'{where}' must be a string or a list of content parts.", "input")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None
        if kind in _TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            parts.append({"type": "text", "text": _text(text, f"{where}[{j}].text", empty=True)})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise Refused(
                    f"'{where}[{j}]' needs an 'image_url' (a URL or a data: URL); stored "
                    "files ('file_id') are not available here.",
                    "input",
                )
            image: dict[str, Any] = {"url": url}
            detail = part.get("detail")
            if isinstance(detail, str):
                image["detail"] = detail
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise Refused(
                f"'{where}[{j}]' is a {kind!r} part; here a message holds input_text, "
                "output_text and input_image parts.",
                "input",
            )
    if role != "user" or all(p["type"] == "text" for p in parts):
        if any(p["type"] != "text" for p in parts):
            raise Refused(f"'{where}': only a user message may hold images.", "input")
        return _joined(parts)
    return parts


def _joined(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise Refused(
            f"'tools[{i}]' is the built-in tool {kind!r}, which only OpenAI runs; this "
            "model's backend takes function tools only ({'type': 'function', 'name', "
            "'parameters'}). Remove it or define it as a function.",
            "tools",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise Refused(f"'tools[{i}].name' must be a non-empty string.", "tools")
    function: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        if not isinstance(tool["description"], str):
            raise Refused(f"'tools[{i}].description' must be a string.", "tools")
        function["description"] = tool["description"]
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise Refused(f"'tools[{i}].parameters' must be a JSON Schema object.", "tools")
        function["parameters"] = parameters
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
    raise Refused(
        "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': "
        "...} here (built-in tools are OpenAI's own).",
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return None
    fmt = text["format"]
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return None


# -- the answer ----------------------------------------------------------------------------


@dataclass(slots=True)
class Echo:
    """What a Response object repeats of its request."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, payload: dict[str, Any]) -> Echo:
        return cls(
            model=payload["model"],
            instructions=payload.get("instructions"),
            max_output_tokens=_whole(payload, "max_output_tokens"),
            temperature=payload.get("temperature"),
            top_p=payload.get("top_p"),
            tools=payload.get("tools") or [],
            tool_choice=payload.get("tool_choice") or "auto",
            parallel_tool_calls=payload.get("parallel_tool_calls") is not False,
        )

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete":
            reason = "content_filter" if finish == "content_filter" else "max_output_tokens"
            incomplete = {"reason": reason}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": {},
        }


def status_of(finish: str | None) -> str:
    return "incomplete" if finish in ("length", "content_filter") else "completed"


def usage_of(chat_usage: Any) -> dict[str, Any] | None:
    if not isinstance(chat_usage, dict):
        return None
    prompt = chat_usage.get("prompt_tokens")
    completion = chat_usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    out_details = chat_usage.get("completion_tokens_details")
    reasoning = out_details.get("reasoning_tokens") if isinstance(out_details, dict) else None
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached if isinstance(cached, int) else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": reasoning if isinstance(reasoning, int) else 0
        },
        "total_tokens": prompt + completion,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def from_chat(chat: Any, echo: Echo) -> dict[str, Any]:
    """A Response object for a Chat Completions answer (a dict parsed from its JSON): the
    shape of every dialect's whole-answer translator (proxy/dialects/stream.py). One
    without choices is a Response with no output, as the backend gave none."""
    choices = chat.get("choices") if isinstance(chat, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    message = message if isinstance(message, dict) else {}
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    output: list[dict[str, Any]] = []
    content = message.get("content")
    if isinstance(content, str) and content:
        output.append(message_item(new_id("msg"), content, status_of(finish)))
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        output.append(
            call_item(
                new_id("fc"),
                str(call.get("id") or new_id("call")),
                str(function.get("name") or ""),
                arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode(),
            )
        )
    usage = usage_of(chat.get("usage") if isinstance(chat, dict) else None)
    return echo.response(status_of(finish), output, usage, finish)
