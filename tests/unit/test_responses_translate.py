"""K2: OpenAI Responses <-> Chat Completions, both ways, streaming included (pure)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from corrallm.http.errors import ApiError
from corrallm.proxy.dialects.responses_stream import ResponsesStream, encode
from corrallm.proxy.dialects.responses_translate import (
    MAX_INPUT_ITEMS,
    Echo,
    Refused,
    check_request,
    from_chat,
    to_chat,
)

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def refusal(payload: dict[str, Any]) -> Refused:
    with pytest.raises(Refused) as caught:
        check_request(payload)
        to_chat(payload)
    return caught.value


def test_K2_a_string_input_with_instructions_is_a_system_and_a_user_message():
    chat = to_chat(
        {
            "model": "m",
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 50,
            "temperature": 0.2,
            "top_p": 0.9,
        }
    )
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.9,
    }


def test_K2_input_items_become_chat_messages_with_tool_calls_and_results():
    chat = to_chat(
        {
            "model": "m",
            "stream": True,
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is in "},
                        {"type": "input_image", "image_url": "data:image/png;base64,AA"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
                {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "zoom", "arguments": '{"x":1}'},
                {"type": "reasoning", "summary": []},
                {"type": "function_call_output", "call_id": "c1", "output": "a cat"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "big"}],
                },
            ],
            "tools": [
                {
                    "type": "function",
                    "name": "look",
                    "description": "Look",
                    "parameters": {"type": "object", "properties": {}},
                    "strict": True,
                }
            ],
            "tool_choice": {"type": "function", "name": "look"},
            "parallel_tool_calls": False,
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "zoom", "arguments": '{"x":1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        {"role": "tool", "tool_call_id": "c2", "content": "big"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "look",
                "description": "Look",
                "parameters": {"type": "object", "properties": {}},
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "look"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_K2_text_format_json_schema_becomes_response_format():
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    chat = to_chat({"model": "m", "input": "Hi", "text": {"format": fmt}})
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }


@pytest.mark.parametrize(
    ("payload", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
        ({"store": True}, "store", "'store': false"),
        ({"conversation": "conv_1"}, "conversation", "whole conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools", "Schema"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice", "function"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "stored item"),
        ({"input": [{"type": "web_search_call"}]}, "input", "'web_search_call'"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input", "role"),
        ({"input": [{"role": "user", "content": [{"type": ["x"]}]}]}, "input", "part"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "image_url"),
        ({"input": [{"role": "user", "content": 5}]}, "input", "string or a list"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
        ({"input": None}, "input", "Missing 'input'"),
        ({"input": 7}, "input", "string or a list"),
        ({"input": ["x"]}, "input", "object"),
        ({"input": [{}] * (MAX_INPUT_ITEMS + 1)}, "input", "at most"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"max_output_tokens": "9"}, "max_output_tokens", "whole number"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"instructions": ["x"]}, "instructions", "string"),
        ({"tools": "f"}, "tools", "list"),
    ],
)
def test_K2_what_cannot_be_translated_is_refused_with_the_field_and_the_fix(payload, param, words):
    exc = refusal({"model": "m", "input": "Hi", **payload})
    assert exc.param == param and words in exc.message


def test_K2_a_chat_answer_is_a_response_object_the_sdk_reads():
    chat = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hello there",
                    "tool_calls": [
                        {
                            "id": "call_9",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a":1}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }
    body = from_chat(chat, Echo(model="m", max_output_tokens=30))
    response = Response.model_validate(body)  # the SDK's own type, strictly
    assert response.status == "completed" and response.model == "m"
    assert response.output_text == "Hello there"
    assert [item.type for item in response.output] == ["message", "function_call"]
    call = response.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_9", "f", '{"a":1}')
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 3)
    assert response.usage.total_tokens == 10
    assert body["id"].startswith("resp_") and body["object"] == "response"


def test_K2_an_answer_cut_at_the_token_limit_is_incomplete():
    chat = {"choices": [{"message": {"content": "Hel"}, "finish_reason": "length"}]}
    body = from_chat(chat, Echo(model="m"))
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"] is None


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> Any:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"object": "chat.completion.chunk", "choices": choices, **extra}


def decoded(raw: bytes) -> list[dict[str, Any]]:
    """The translator's named SSE events, back into their objects."""
    return [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]


def run_stream(chunks: list[Any]) -> list[dict[str, Any]]:
    translator = ResponsesStream(Echo(model="m"))
    raw = translator.start()
    for c in chunks:
        raw += translator.feed(c)
    raw += translator.finish()
    return decoded(raw)


def test_K2_a_chat_stream_becomes_the_responses_event_sequence():
    events = run_stream(
        [
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Hel"}),
            chunk({"content": "lo"}),
            chunk({}, "stop"),
            chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
        ]
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENTS.validate_python(e)  # each one as the SDK types it, strictly
    done = Response.model_validate(events[-1]["response"])
    assert done.output_text == "Hello" and done.status == "completed"
    assert done.usage is not None and done.usage.output_tokens == 2
    assert events[6]["text"] == "Hello"
    assert events[0]["response"]["id"] == done.id


def test_K2_streamed_tool_calls_become_function_call_items_with_argument_deltas():
    events = run_stream(
        [
            chunk({"content": "Checking."}),
            chunk({"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f"}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
            chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g"}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
            chunk({}, "tool_calls"),
        ]
    )
    for e in events:
        EVENTS.validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert kinds.count("response.function_call_arguments.done") == 2
    assert kinds.count("response.output_item.done") == 3
    done = Response.model_validate(events[-1]["response"])
    assert [i.type for i in done.output] == ["message", "function_call", "function_call"]
    first, second = done.output[1], done.output[2]
    assert first.type == "function_call" and second.type == "function_call"
    assert (first.call_id, first.name, first.arguments) == ("call_a", "f", '{"x":1}')
    assert (second.call_id, second.name, second.arguments) == ("call_b", "g", "")
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2]


def test_K2_a_stream_cut_at_the_token_limit_ends_with_response_incomplete():
    events = run_stream([chunk({"content": "Hi"}), chunk({}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_K2_a_broken_stream_ends_with_an_error_event_and_response_failed():
    translator = ResponsesStream(Echo(model="m"))
    raw = translator.start() + translator.feed(chunk({"content": "Hal"}))
    raw += translator.fail(ApiError(502, "backend 'b' broke off its answer", "backend_error"))
    events = decoded(raw)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "backend_error"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "backend_error"
    assert failed["output"][0]["content"][0]["text"] == "Hal"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_K2_events_are_encoded_as_named_sse_events():
    data = encode([{"type": "response.created", "sequence_number": 0}])
    assert (
        data
        == b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    )
    assert orjson.loads(data.split(b"data: ")[1]) == {
        "type": "response.created",
        "sequence_number": 0,
    }
