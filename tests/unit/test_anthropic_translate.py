"""SPEC §16 K1: Anthropic Messages <-> Chat Completions, pure (proxy/anthropic_translate.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from corrallm.http.errors import ApiError
from corrallm.proxy.dialects.anthropic_stream import AnthropicStream
from corrallm.proxy.dialects.anthropic_translate import (
    MAX_BLOCKS,
    MessageEcho,
    error_body,
    error_shape,
    from_chat,
    to_chat,
)

TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_K1_request_system_text_image_tools_stop_and_sampling_become_chat() -> None:
    chat = to_chat(
        {
            "model": "m",
            "max_tokens": 100,
            "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAA"},
                        },
                    ],
                }
            ],
            "stop_sequences": ["END"],
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 40,
            "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "metadata": {"user_id": "u1"},
            "stream": True,
        }
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be terse.\nBe kind."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
                ],
            },
        ],
        "max_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather in a city",
                    "parameters": TOOL["input_schema"],
                },
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "user": "u1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_K1_tool_choice_maps_to_chat(choice: dict[str, Any], expected: Any) -> None:
    chat = to_chat(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": choice}
    )
    assert chat["tool_choice"] == expected


def test_K1_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    chat = to_chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "rain"}],
                        },
                        {
                            "type": "tool_result",
                            "tool_use_id": "t2",
                            "content": "x",
                            "is_error": True,
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: x"},
        {"role": "user", "content": "Thanks"},
    ]


def test_K1_server_tools_are_left_out() -> None:
    web = {"type": "web_search_20250305", "name": "web_search"}
    chat = to_chat(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [web, TOOL]}
    )
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]


def _user(*blocks: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def _with(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}], **fields}


BAD_USE = {"type": "tool_use", "id": "a", "name": "b", "input": []}
HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("messages missing", {}),
    ("messages empty", {"messages": []}),
    ("messages a string", {"messages": "hi"}),
    ("role unknown", {"messages": [{"role": "system", "content": "x"}]}),
    ("content missing", {"messages": [{"role": "user"}]}),
    ("content a number", {"messages": [{"role": "user", "content": 3}]}),
    ("block not an object", _user("x")),
    ("text not a string", _user({"type": "text", "text": 1})),
    ("tool_use in a user turn", _user({"type": "tool_use"})),
    ("image bad source", _user({"type": "image", "source": {"type": "file"}})),
    ("system a number", _with(system=5)),
    ("tool schema a string", _with(tools=[{"name": "t", "input_schema": "s"}])),
    ("tools an object", _with(tools={"name": "t"})),
    ("tool_choice a string", _with(tool_choice="auto")),
    ("stop_sequences a string", _with(stop_sequences="END")),
    ("temperature a string", _with(temperature="hot")),
    ("tool_use input a list", {"messages": [{"role": "assistant", "content": [BAD_USE]}]}),
    ("too many blocks", _user(*[{"type": "text", "text": "x"}] * 10_000)),
]


@pytest.mark.parametrize(("name", "payload"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_K1_hostile_requests_are_400s(name: str, payload: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as err:
        to_chat({"model": "m", **payload})
    assert err.value.status == 400 and err.value.message


def test_K1_block_limit_counts_the_whole_request() -> None:
    turn = {"role": "user", "content": [{"type": "text", "text": "x"}] * (MAX_BLOCKS // 2)}
    to_chat({"model": "m", "messages": [turn]})
    with pytest.raises(ApiError):
        to_chat({"model": "m", "messages": [turn, turn, turn]})


def _answer(message: dict[str, Any], reason: str, **choice: Any) -> dict[str, Any]:
    return {
        "id": "c1",
        "choices": [{"index": 0, "message": message, "finish_reason": reason, **choice}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }


def test_K1_chat_answer_becomes_a_message() -> None:
    msg = from_chat(
        _answer({"role": "assistant", "content": "Hi!"}, "stop"), MessageEcho("claude-x")
    )
    assert msg == {
        "id": "msg_c1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [{"type": "text", "text": "Hi!"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 7, "output_tokens": 3},
    }


def test_K1_tool_calls_become_tool_use_blocks() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a":1}'}}
    answer = _answer({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls")
    msg = from_chat(answer, MessageEcho("m"))
    assert msg["content"] == [{"type": "tool_use", "id": "call_1", "name": "w", "input": {"a": 1}}]
    assert msg["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("reason", "extra", "expected"),
    [
        ("stop", {}, ("end_turn", None)),
        ("length", {}, ("max_tokens", None)),
        ("tool_calls", {}, ("tool_use", None)),
        ("stop", {"stop_reason": "END"}, ("stop_sequence", "END")),
        (None, {}, ("end_turn", None)),
    ],
)
def test_K1_stop_reasons(
    reason: str | None, extra: dict[str, Any], expected: tuple[str, Any]
) -> None:
    msg = from_chat(_answer({"content": "x"}, reason, **extra), MessageEcho("m", ["END"]))  # type: ignore[arg-type]
    assert (msg["stop_reason"], msg["stop_sequence"]) == expected


def test_K1_an_answer_without_choices_is_a_502() -> None:
    with pytest.raises(ApiError) as err:
        from_chat({"error": "x"}, MessageEcho("m"))
    assert err.value.status == 502


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        kind, data = block.split(b"\n")
        assert kind.startswith(b"event: ") and data.startswith(b"data: ")
        obj = orjson.loads(data[6:])
        assert obj["type"] == kind[7:].decode()
        out.append((obj["type"], obj))
    return out


def _chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
    return {"id": "c9", "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}


def test_K1_stream_of_text_becomes_anthropic_events() -> None:
    stream = AnthropicStream(MessageEcho("claude-x"))
    raw = b"".join(
        [
            stream.feed(_chunk({"role": "assistant", "content": ""})),
            stream.feed(_chunk({"content": "Hel"})),
            stream.feed(_chunk({"content": "lo"})),
            stream.feed(_chunk({}, "length")),
            stream.feed(
                {"id": "c9", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
            ),
            stream.finish(),
            stream.finish(),  # idempotent
        ]
    )
    events = _events(raw)
    assert [kind for kind, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["id"] == "msg_c9"
    assert events[0][1]["message"]["model"] == "claude-x"
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert events[5][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[5][1]["usage"] == {"input_tokens": 4, "output_tokens": 2}


def test_K1_stream_of_text_then_two_tool_calls() -> None:
    stream = AnthropicStream(MessageEcho("m"))
    call0 = {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}
    call1 = {
        "index": 1,
        "id": "b",
        "type": "function",
        "function": {"name": "g", "arguments": "{}"},
    }
    raw = b"".join(
        [
            stream.feed(_chunk({"content": "Let me check."})),
            stream.feed(_chunk({"tool_calls": [call0]})),
            stream.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]})),
            stream.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})),
            stream.feed(_chunk({"tool_calls": [call1]})),
            stream.feed(_chunk({}, "tool_calls")),
            stream.finish(),
        ]
    )
    events = _events(raw)
    starts = [e["content_block"] for k, e in events if k == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "a", "name": "f", "input": {}},
        {"type": "tool_use", "id": "b", "name": "g", "input": {}},
    ]
    partial = [
        e["delta"]["partial_json"]
        for k, e in events
        if k == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert partial == ['{"x":', "1}", "{}"]
    stops = [e["index"] for k, e in events if k == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_K1_a_stream_with_nothing_still_is_a_whole_message() -> None:
    events = _events(AnthropicStream(MessageEcho("m")).finish())
    assert [k for k, _ in events] == ["message_start", "message_delta", "message_stop"]


def test_K1_stream_ignores_junk_chunks() -> None:
    stream = AnthropicStream(MessageEcho("m"))
    assert stream.feed([1, 2]) == b""
    assert stream.feed({"choices": "x"}).startswith(b"event: message_start")
    assert stream.feed({"choices": [{"delta": {"content": 5}}]}) == b""


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, (400, "invalid_request_error")),
        (401, (401, "authentication_error")),
        (403, (403, "permission_error")),
        (404, (404, "not_found_error")),
        (413, (413, "request_too_large")),
        (429, (429, "rate_limit_error")),
        (500, (500, "api_error")),
        (502, (502, "api_error")),
        (503, (529, "overloaded_error")),
        (504, (504, "api_error")),
    ],
)
def test_K1_error_types(status: int, expected: tuple[int, str]) -> None:
    assert error_shape(status) == expected


def test_K1_error_body_keeps_the_429_hint() -> None:
    error = ApiError(429, "busy", "queue_full", headers={"retry-after": "3"})
    error.extra = {"retry_after_seconds": 3}
    assert error_body(error) == (
        429,
        {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": "busy", "retry_after_seconds": 3},
        },
    )
