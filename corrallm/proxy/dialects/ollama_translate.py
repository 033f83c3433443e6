"""Ollama's API <-> OpenAI Chat Completions, Completions and Embeddings (SPEC §23 E1), pure:
data in, data out.

- `read(path, payload, model)`: an `/api/chat`, `/api/generate`, `/api/embed` or
  `/api/embeddings` request, checked field by field (a malformed one is a 400 naming the
  field), as the OpenAI request to send (`OllamaRequest`).
- `from_chat(answer, echo)`: the backend's answer, held whole (a Chat Completion, a
  Completion or Embeddings), in Ollama's shape (`stream.Translated`'s whole answer).
- the stream (Chat or Completions chunks in, NDJSON lines out) is `ollama_stream.py`'s.
- `error_status` / `error_line`: Ollama's error shape, `{"error": "<message>"}`.

Times come in as numbers (monotonic seconds, wall-clock seconds), or from the echo's two
callables (`OllamaEcho.now`, `.times`), which the dialect (ollama.py) gives: no clock,
no I/O, no logging here.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from corrallm.config.units import parse_duration
from corrallm.http.errors import ApiError, bad_request, quoted
from corrallm.proxy.dialects.stream import TranslationError, tool_arguments

NDJSON = b"application/x-ndjson"
CHAT, GENERATE, EMBED, EMBEDDINGS = "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
LATEST = ":latest"
ROLES = ("system", "user", "assistant", "tool")
# Ollama's `options` that mean the same in an OpenAI request (`num_predict` and `stop` are
# read apart); the rest (num_ctx, num_gpu, mirostat, repeat_penalty...) are the backend's
# load-time or sampler settings and are left out.
_NUMBERS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
# The statuses Ollama's clients are given (SPEC §23 E1); any other of corrallm's becomes one
# of them: a wrong method is a path not served for it (Ollama's router says 404), a paused
# model is unavailable for now, other refusals of the request are 400s, other failures 502.
ERROR_STATUSES = frozenset({400, 401, 403, 404, 429, 502, 503})
_MOVED = {405: 404, 423: 503}
# Image formats by the first bytes of their base64 text (what Ollama's clients send).
_IMAGES = (("iVBORw0KGgo", "image/png"), ("/9j/", "image/jpeg"), ("R0lGOD", "image/gif"))
_WEBP = "UklGR"


@dataclass(frozen=True, slots=True)
class OllamaRequest:
    """An Ollama request as the OpenAI request that serves it."""

    path: str  # the Ollama path it came in on
    upstream: str  # the OpenAI path it goes to
    body: dict[str, Any]  # the OpenAI request (its model: the served name)
    stream: bool
    limit: int | None = None  # num_predict, for the spend estimate
    unload: bool = False  # keep_alive 0: unload the model afterwards when nobody uses it
    empty: bool = False  # no prompt or messages: only load (or unload) the model

    @property
    def kind(self) -> str:
        """`chat` or `generate` (Chat Completions or Completions answers), `embed`,
        `embeddings`."""
        return self.path.rpartition("/")[2]

    @property
    def chat(self) -> bool:
        return self.upstream == CHAT_PATH


def served_name(name: str, known: Container[str]) -> str:
    """`<name>:latest` means `<name>` (E1), unless a model is served under the tagged name."""
    if name in known or not name.endswith(LATEST):
        return name
    return name[: -len(LATEST)]


def read(path: str, payload: dict[str, Any], model: str) -> OllamaRequest:
    """The request on `path` as the OpenAI request for the served model `model`."""
    if path == CHAT:
        return _chat(payload, model)
    if path == GENERATE:
        return _generate(payload, model)
    return _embed(path, payload, model)


# -- requests --------------------------------------------------------------------------------


def _chat(payload: dict[str, Any], model: str) -> OllamaRequest:
    stream = _stream(payload)
    turns = payload.get("messages")
    if turns is None:
        turns = []
    if not isinstance(turns, list):
        raise bad_request("'messages' must be a list of messages.", param="messages")
    body: dict[str, Any] = {"model": model, "messages": messages(turns)}
    if payload.get("tools"):
        body["tools"] = _tools(payload["tools"])
    limit = _sampling(payload, body)
    return _done(CHAT, CHAT_PATH, body, stream, limit, payload, empty=not turns)


def _generate(payload: dict[str, Any], model: str) -> OllamaRequest:
    stream = _stream(payload)
    prompt = _text(payload, "prompt")
    system = _text(payload, "system")
    images = _images(payload.get("images"), "images")
    raw = payload.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise bad_request(f"'raw' must be true or false, not {quoted(raw)}.", param="raw")
    body: dict[str, Any] = {"model": model}
    if raw:
        upstream = COMPLETIONS_PATH
        body["prompt"] = prompt
        suffix = _text(payload, "suffix")
        if suffix:
            body["suffix"] = suffix
    else:
        upstream = CHAT_PATH
        turns: list[dict[str, Any]] = []
        if system:
            turns.append({"role": "system", "content": system})
        turns.append({"role": "user", "content": _with_images(prompt, images)})
        body["messages"] = turns
    limit = _sampling(payload, body)
    empty = not prompt and not images
    return _done(GENERATE, upstream, body, stream, limit, payload, empty=empty)


def _embed(path: str, payload: dict[str, Any], model: str) -> OllamaRequest:
    body: dict[str, Any] = {"model": model}
    if path == EMBED:
        given = payload.get("input", "")
        if not isinstance(given, str) and not (
            isinstance(given, list) and all(isinstance(t, str) for t in given)
        ):
            raise bad_request("'input' must be a string or a list of strings.", param="input")
        body["input"] = given
        dimensions = payload.get("dimensions")
        if dimensions is not None:
            body["dimensions"] = _whole(dimensions, "dimensions")
    else:
        body["input"] = _text(payload, "prompt")
    return _done(path, EMBEDDINGS_PATH, body, False, None, payload)


def _done(
    path: str,
    upstream: str,
    body: dict[str, Any],
    stream: bool,
    limit: int | None,
    payload: dict[str, Any],
    empty: bool = False,
) -> OllamaRequest:
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # the final line's counts (C2)
    unload = unloads(payload.get("keep_alive"))
    return OllamaRequest(path, upstream, body, stream, limit, unload, empty)


def _stream(payload: dict[str, Any]) -> bool:
    """Ollama streams unless told not to."""
    stream = payload.get("stream", True)
    if stream is None:
        return True
    if not isinstance(stream, bool):
        raise bad_request(f"'stream' must be true or false, not {quoted(stream)}.", param="stream")
    return stream


def unloads(keep_alive: Any) -> bool:
    """Whether `keep_alive` is zero (`0`, `"0"`, `"0s"`, `"0m"`...): unload after the
    request. Every other value is accepted and ignored (corrallm's own ttl and eviction
    decide how long a model stays)."""
    if isinstance(keep_alive, bool) or keep_alive is None:
        return False
    if isinstance(keep_alive, int | float):
        return keep_alive == 0
    if isinstance(keep_alive, str):
        try:
            return parse_duration(keep_alive.strip()) == 0
        except ValueError:
            return False
    return False


def _text(payload: Mapping[str, Any], name: str, where: str | None = None) -> str:
    value = payload.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        where = where or name
        raise bad_request(f"'{where}' must be a string.", param=where)
    return value


def _whole(value: Any, where: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{where}' must be a whole number, not {quoted(value)}.", param=where)
    return value


def _sampling(payload: dict[str, Any], body: dict[str, Any]) -> int | None:
    """`options` and `format` into `body`; the token limit asked for (`num_predict`)."""
    options = payload.get("options")
    limit = None
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'options' must be an object.", param="options")
        limit = _options(options, body)
    schema = response_format(payload.get("format"))
    if schema is not None:
        body["response_format"] = schema
    return limit


def _options(options: dict[str, Any], body: dict[str, Any]) -> int | None:
    limit = None
    asked = options.get("num_predict")
    if asked is not None:
        asked = _whole(asked, "options.num_predict")
        if asked > 0:  # -1 (until done) and -2 (fill the context): no limit, as Ollama
            body["max_tokens"] = limit = asked
    for name in _NUMBERS:
        value = options.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise bad_request(f"'options.{name}' must be a number.", param=f"options.{name}")
        body[name] = value
    seed = options.get("seed")
    if seed is not None:
        body["seed"] = _whole(seed, "options.seed")
    stop = options.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("'options.stop' must be a list of strings.", param="options.stop")
        if stop:
            body["stop"] = stop
    return limit


def response_format(given: Any) -> dict[str, Any] | None:
    """`format`: `"json"` is JSON mode, an object a JSON schema the answer must match."""
    if given is None or given == "":
        return None
    if given == "json":
        return {"type": "json_object"}
    if isinstance(given, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": given}}
    raise bad_request(
        f"'format' must be \"json\" or a JSON schema object, not {quoted(given)}.", param="format"
    )


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"'{at}' must be an object with a 'function' that has a 'name'.", param="tools"
            )
        kept = {k: function[k] for k in ("name", "description", "parameters") if k in function}
        out.append({"type": "function", "function": kept})
    return out


def messages(turns: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as Chat messages. A tool call in the history gets an id (Ollama's
    have none, or the client dropped it), and the `tool` result after it the same id:
    the one its `tool_call_id` names, else the first unanswered call of its `tool_name`,
    else the first unanswered call."""
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name): the last assistant turn's calls
    for i, turn in enumerate(turns):
        at = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise bad_request(
                f"'{at}' must be an object whose role is system, user, assistant or tool.",
                param="messages",
            )
        role = turn["role"]
        content = _text(turn, "content", f"{at}.content")
        images = _images(turn.get("images"), f"{at}.images")
        if images and role != "user":
            raise bad_request(f"'{at}.images': images go on user messages.", param="messages")
        if role == "assistant":
            calls = _calls(turn.get("tool_calls"), at, i)
            pending = [(c["id"], c["function"]["name"]) for c in calls]
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                message["content"] = content or None
        elif role == "tool":
            call = _answered(turn, pending, i)
            message = {"role": "tool", "tool_call_id": call, "content": content}
        else:
            message = {"role": role, "content": _with_images(content, images)}
        out.append(message)
    return out


def _calls(calls: Any, at: str, turn: int) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"'{at}.tool_calls' must be a list.", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(
                f"'{at}.tool_calls[{j}]' must have a 'function' with a 'name'.", param="messages"
            )
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):  # Ollama's: an object, not JSON text
            arguments = orjson.dumps(arguments).decode()
        given = call.get("id")
        out.append(
            {
                "id": given if isinstance(given, str) and given else f"call_{turn}_{j}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _answered(turn: dict[str, Any], pending: list[tuple[str, str]], index: int) -> str:
    """The id of the call a `tool` message answers (taken off `pending`)."""
    named = turn.get("tool_call_id")
    if isinstance(named, str) and named:
        pending[:] = [p for p in pending if p[0] != named]
        return named
    name = turn.get("tool_name")
    for k, (call, called) in enumerate(pending):
        if not isinstance(name, str) or called == name:
            del pending[k]
            return call
    return f"call_{index}"  # a result of no call in this history: an id of its own


def _images(images: Any, where: str) -> list[str]:
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise bad_request(f"'{where}' must be a list of base64-encoded images.", param=where)
    return images


def image_url(data: str) -> str:
    """An image as Ollama's clients send it (base64) as a `data:` URL, its type read from
    its first bytes (PNG, JPEG, GIF, WebP; else PNG: vision backends read the bytes)."""
    if data.startswith("data:"):
        return data
    kind = next((k for prefix, k in _IMAGES if data.startswith(prefix)), "image/png")
    if data.startswith(_WEBP):
        kind = "image/webp"
    return f"data:{kind};base64,{data}"


def _with_images(text: str, images: list[str]) -> str | list[dict[str, Any]]:
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    parts.extend({"type": "image_url", "image_url": {"url": image_url(i)}} for i in images)
    return parts


# -- answers ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timings:
    """Where the time of one request went, in nanoseconds (Ollama's durations)."""

    total: int = 0
    load: int = 0
    prompt_eval: int = 0
    eval: int = 0


@dataclass(frozen=True, slots=True)
class OllamaEcho:
    """What an answer repeats of its request, and when it is given (`stream.Translated`'s
    echo): its `kind` (`chat`, `generate`, `embed`, `embeddings`), whether it is answered
    from Chat Completions (`chat`; else a Completion), the model as the client named it;
    `now()` the wall clock (`created_at`), `times()` the request's durations so far (the
    last line's, a whole answer's). Clocks as callables: the translators stay pure."""

    kind: str
    chat: bool
    model: str
    now: Callable[[], float]
    times: Callable[[], Timings]


def timings(
    arrived: float, admitted: float | None, sent: float, first: float | None, end: float
) -> Timings:
    """From monotonic seconds: the request arrived, got its slot, went upstream, its first
    answer byte came, it ended. `load`: from the slot to the upstream request (a cold start,
    if any; a queue wait counts in `total` only); `prompt_eval`: to the first byte;
    `eval`: from the first byte to the end."""
    first = sent if first is None else first

    def ns(a: float, b: float) -> int:
        return max(0, round((b - a) * 1e9))

    return Timings(
        ns(arrived, end),
        ns(sent if admitted is None else admitted, sent),
        ns(sent, first),
        ns(first, end),
    )


def created_at(now: float) -> str:
    """Wall-clock seconds as Ollama writes `created_at`: RFC 3339, microseconds, UTC."""
    seconds = math.floor(now)
    return f"{_second(seconds)}.{min(999_999, round((now - seconds) * 1e6)):06d}Z"


@functools.lru_cache(maxsize=4)
def _second(seconds: int) -> str:
    # A stream's lines fall in a few seconds: the date is formatted once per second.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def done_reason(finish: Any) -> str:
    """Ollama's `done_reason`: `length` when the token limit stopped it, else `stop` (a tool
    call or a content filter too)."""
    return "length" if finish == "length" else "stop"


def counts(usage: Any) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of an OpenAI `usage`, 0 where missing."""
    usage = usage if isinstance(usage, dict) else {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) else 0,
        completion if isinstance(completion, int) else 0,
    )


def final_fields(reason: str, usage: Any, times: Timings) -> dict[str, Any]:
    """What the last line (or a whole answer) carries besides its text."""
    prompt, completion = counts(usage)
    return {
        "done": True,
        "done_reason": reason,
        "total_duration": times.total,
        "load_duration": times.load,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": times.prompt_eval,
        "eval_count": completion,
        "eval_duration": times.eval,
    }


def tool_calls(calls: Any) -> list[dict[str, Any]]:
    """Chat tool calls in Ollama's shape: `function.arguments` an object, not JSON text."""
    out = []
    for i, call in enumerate(calls if isinstance(calls, list) else ()):
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        made: dict[str, Any] = {
            "function": {
                "index": i,
                "name": function.get("name") or "",
                "arguments": tool_arguments(function.get("arguments")),
            }
        }
        if isinstance(call.get("id"), str):
            made["id"] = call["id"]
        out.append(made)
    return out


def _choice(answer: Any) -> dict[str, Any]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise TranslationError("an answer with no choices: not a completion.")
    return choices[0]


def message(choice: dict[str, Any]) -> dict[str, Any]:
    """A Chat answer's message in Ollama's shape."""
    given = choice.get("message")
    given = given if isinstance(given, dict) else {}
    content = given.get("content")
    out: dict[str, Any] = {
        "role": "assistant",
        "content": content if isinstance(content, str) else "",
    }
    thinking = given.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out["thinking"] = thinking
    calls = tool_calls(given.get("tool_calls"))
    if calls:
        out["tool_calls"] = calls
    return out


def from_chat(answer: Any, echo: OllamaEcho) -> dict[str, Any]:
    """The backend's whole answer (a Chat Completion, a Completion, or Embeddings for
    `embed` and `embeddings`) in Ollama's shape, named as the client named the model."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if echo.kind in ("embed", "embeddings"):
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            raise TranslationError("an answer with no data: not an embeddings answer.")
        vectors = [d.get("embedding") for d in data if isinstance(d, dict)]
        if echo.kind == "embeddings":
            return {"embedding": vectors[0] if vectors else []}
        times = echo.times()
        return {
            "model": echo.model,
            "embeddings": vectors,
            "total_duration": times.total,
            "load_duration": times.load,
            "prompt_eval_count": counts(usage)[0],
        }
    choice = _choice(answer)
    out: dict[str, Any] = {"model": echo.model, "created_at": created_at(echo.now())}
    if echo.kind == "chat":
        out["message"] = message(choice)
    elif echo.chat:
        said = message(choice)
        out["response"] = said["content"]
        if "thinking" in said:
            out["thinking"] = said["thinking"]
    else:
        text = choice.get("text")
        out["response"] = text if isinstance(text, str) else ""
    out.update(final_fields(done_reason(choice.get("finish_reason")), usage, echo.times()))
    return out


def settled(request: OllamaRequest, model: str, now: float, reason: str) -> dict[str, Any]:
    """The answer to a request with nothing to generate: the model loaded (`load`) or
    unloaded (`unload`), as Ollama answers it."""
    out: dict[str, Any] = {"model": model, "created_at": created_at(now)}
    if request.kind == "chat":
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update({"done": True, "done_reason": reason})
    return out


# -- errors ----------------------------------------------------------------------------------


def error_status(status: int) -> int:
    """The status an Ollama client is given for one of corrallm's."""
    if status in ERROR_STATUSES:
        return status
    moved = _MOVED.get(status)
    if moved is not None:
        return moved
    return 400 if status < 500 else 502


def error_line(error: ApiError) -> bytes:
    """How a stream ends in an error: one line `{"error": "<message>"}` (what Ollama's
    clients raise)."""
    return orjson.dumps({"error": error.message}) + b"\n"
