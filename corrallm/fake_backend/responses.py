"""OpenAI-shaped bodies the fake backend answers with (pure: data in, bytes out)."""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

import orjson

_SENTENCE = (
    "Hello from the fake backend of corrallm . This reply is generated one token at a time "
    "so streams , usage and timing can be checked without a model ."
)
WORDS = tuple(_SENTENCE.split(" "))


def error_body(message: str, kind: str, code: int | str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


LOADING_BODY = orjson.dumps(
    {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
)


def tokens(n: int) -> list[str]:
    """The n completion tokens: words of a fixed sentence, the first without a leading space."""
    return [("" if i == 0 else " ") + WORDS[i % len(WORDS)] for i in range(n)]


def count_words(value: Any) -> int:
    """Rough token estimate: whitespace-separated words in strings, one per int in token lists."""
    return len(prompt_words(value))


def prompt_words(value: Any) -> list[str]:
    """The prompt's words in order (ints of a token list as words): what a slot's cache holds."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, int) and not isinstance(value, bool):
        return [str(value)]
    if isinstance(value, list):
        return [word for v in value for word in prompt_words(v)]
    if isinstance(value, dict):
        if "content" in value:
            return prompt_words(value["content"])
        if value.get("type") == "text":
            return prompt_words(value.get("text"))
    return []


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def plan(body: dict[str, Any], default_tokens: int) -> tuple[int, str]:
    """How many tokens to generate and the finish reason, honouring max_tokens-style caps."""
    n = default_tokens
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        cap = body.get(key)
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0 and cap < n:
            return cap, "length"
    return n, "stop"


def chat_completion(rid: str, created: int, model: str, n: int, reason: str, prompt: int) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": "fp_corrallm_fake",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "".join(tokens(n)),
                        "refusal": None,
                    },
                    "logprobs": None,
                    "finish_reason": reason,
                }
            ],
            "usage": usage(prompt, n),
        }
    )


def text_completion(rid: str, created: int, model: str, n: int, reason: str, prompt: int) -> bytes:
    return orjson.dumps(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": "fp_corrallm_fake",
            "choices": [
                {"index": 0, "text": "".join(tokens(n)), "logprobs": None, "finish_reason": reason}
            ],
            "usage": usage(prompt, n),
        }
    )


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def stream_events(
    chat: bool,
    rid: str,
    created: int,
    model: str,
    n: int,
    reason: str,
    prompt: int,
    include_usage: bool,
) -> tuple[list[bytes], int]:
    """All SSE events of one stream, and the index of the first token event.

    Chat: a role chunk, one chunk per token, a finish chunk; completions: one chunk per
    token and a finish chunk. With include_usage every chunk carries `"usage": null` and a
    last chunk with `"choices": []` and the usage precedes `[DONE]`, as OpenAI does.
    """
    base: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "fp_corrallm_fake",
    }

    def chunk(choice: dict[str, Any]) -> bytes:
        obj = {**base, "choices": [{"index": 0, **choice, "logprobs": None}]}
        if include_usage:
            obj["usage"] = None
        return _event(obj)

    events: list[bytes] = []
    if chat:
        events.append(chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
    first = len(events)
    for tok in tokens(n):
        if chat:
            events.append(chunk({"delta": {"content": tok}, "finish_reason": None}))
        else:
            events.append(chunk({"text": tok, "finish_reason": None}))
    events.append(
        chunk(
            {"delta": {}, "finish_reason": reason}
            if chat
            else {"text": "", "finish_reason": reason}
        )
    )
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": usage(prompt, n)}))
    events.append(DONE)
    return events, first


def tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tool call a `--tool-calls` backend makes for this chat request, if any: of the
    tool `tool_choice` names, else the first; every required property set to "fake"."""
    tools = body.get("tools")
    messages = body.get("messages")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools or choice == "none":
        return None
    if not isinstance(messages, list) or not isinstance(messages[-1], dict):
        return None
    if messages[-1].get("role") != "user":
        return None  # a tool result came back: answer in words
    functions = [t["function"] for t in tools if isinstance(t, dict) and "function" in t]
    if isinstance(choice, dict):
        named = choice.get("function", {}).get("name")
        functions = [f for f in functions if f.get("name") == named] or functions
    if not functions:
        return None
    function = functions[0]
    params = function.get("parameters") or {}
    args = {name: "fake" for name in params.get("required", [])}
    return {"name": function.get("name", ""), "arguments": orjson.dumps(args).decode()}


def tool_call_completion(
    rid: str, created: int, model: str, call: dict[str, Any], prompt: int
) -> bytes:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{rid}", "type": "function", "function": call}],
    }
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "tool_calls"}
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(prompt, 1),
        }
    )


def tool_call_events(
    rid: str, created: int, model: str, call: dict[str, Any], prompt: int, include_usage: bool
) -> list[bytes]:
    """A streamed tool call as OpenAI sends it: id and name first, arguments in two pieces."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    args = call["arguments"]
    half = len(args) // 2
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": None},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": f"call_{rid}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": args[:half]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]},
        {},
    ]
    events = []
    for i, delta in enumerate(deltas):
        reason = "tool_calls" if i == len(deltas) - 1 else None
        obj: dict[str, Any] = {
            **base,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }
        if include_usage:
            obj["usage"] = None
        events.append(_event(obj))
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": usage(prompt, 1)}))
    events.append(DONE)
    return events


def embedding_vector(item: Any, dim: int) -> list[float]:
    """A deterministic unit vector from a hash of the input."""
    seed = orjson.dumps(item)
    raw = b""
    counter = 0
    while len(raw) < 4 * dim:
        raw += hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    ints = struct.unpack(f"<{dim}I", raw[: 4 * dim])
    vec = [(v / 0xFFFFFFFF) * 2.0 - 1.0 for v in ints]
    norm = sum(x * x for x in vec) ** 0.5 or 1.0
    return [x / norm for x in vec]


def embeddings(body: dict[str, Any], model: str, dim: int) -> bytes:
    raw = body.get("input")
    items: list[Any]
    if isinstance(raw, list) and raw and not all(isinstance(x, int) for x in raw):
        items = raw
    else:
        items = [raw]
    as_base64 = body.get("encoding_format") == "base64"
    data = []
    for i, item in enumerate(items):
        vec = embedding_vector(item, dim)
        value: Any = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode() if as_base64 else vec
        data.append({"object": "embedding", "index": i, "embedding": value})
    n = count_words(items)
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
    )


def _relevance(query: str, doc: str) -> float:
    """Word overlap (Jaccard) plus a tiny hash tie-break, so ranking is meaningful and stable."""
    q, d = set(query.lower().split()), set(doc.lower().split())
    overlap = len(q & d) / len(q | d) if q | d else 0.0
    tie = hashlib.blake2b(doc.encode(), digest_size=2).digest()
    return round(overlap + int.from_bytes(tie, "little") / 65535 * 1e-3, 6)


def rerank(body: dict[str, Any], model: str) -> bytes:
    query = str(body["query"])
    docs = [d if isinstance(d, str) else str(d.get("text", "")) for d in body["documents"]]
    results: list[dict[str, Any]] = [
        {"index": i, "relevance_score": _relevance(query, doc)} for i, doc in enumerate(docs)
    ]
    results.sort(key=lambda r: -r["relevance_score"])
    top_n = body.get("top_n")
    if isinstance(top_n, int) and top_n >= 0:
        results = results[:top_n]
    if body.get("return_documents"):
        for r in results:
            r["document"] = {"text": docs[r["index"]]}
    n = count_words(query) + count_words(docs)
    return orjson.dumps(
        {
            "model": model,
            "object": "list",
            "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
    )


def wav_header(data_bytes: int, rate: int = 16000) -> bytes:
    """A 16-bit mono PCM WAV header for `data_bytes` of samples."""
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data_bytes)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )
