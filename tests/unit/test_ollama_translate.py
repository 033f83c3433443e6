"""SPEC §23 E1: Ollama's API <-> OpenAI Chat Completions, Completions and Embeddings, pure
(proxy/dialects/ollama_translate.py, ollama_stream.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from corrallm.http.errors import ApiError
from corrallm.proxy.dialects.ollama_stream import Lines, note
from corrallm.proxy.dialects.ollama_translate import (
    OllamaEcho,
    OllamaRequest,
    Timings,
    error_line,
    error_status,
    from_chat,
    image_url,
    read,
    served_name,
    settled,
    timings,
    unloads,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOW = 1_700_000_000.25
TIMES = Timings(total=5_000, load=1_000, prompt_eval=2_000, eval=2_000)
PNG = "iVBORw0KGgoAAAANSUhEUg"


def echo(kind: str, chat: bool, model: str) -> OllamaEcho:
    """An answer's echo whose clocks say NOW and TIMES."""
    return OllamaEcho(kind, chat, model, lambda: NOW, lambda: TIMES)


def answer(request: OllamaRequest, body: Any, model: str) -> dict[str, Any]:
    return from_chat(body, echo(request.kind, request.chat, model))


def chat(payload: dict[str, Any], model: str = "m") -> OllamaRequest:
    return read("/api/chat", {"model": model, **payload}, model)


def test_E1_latest_tag_means_the_name_unless_the_tagged_name_is_served() -> None:
    assert served_name("llama3:latest", {"llama3"}) == "llama3"
    assert served_name("llama3", {"llama3"}) == "llama3"
    assert served_name("qwen:latest", {"qwen:latest"}) == "qwen:latest"
    assert served_name("qwen:7b", {"qwen"}) == "qwen:7b"  # another tag: not ours to drop


def test_E1_chat_options_format_tools_and_stream_become_a_chat_completion() -> None:
    request = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "options": {
                "num_predict": 64.0,
                "temperature": 0.2,
                "top_p": 0.9,
                "top_k": 40,
                "seed": 7,
                "stop": "\n\n",
                "min_p": 0.05,
                "num_ctx": 8192,  # a load-time setting: left out
                "mirostat": 1,
            },
            "format": "json",
            "tools": [TOOL],
            "keep_alive": "5m",
        }
    )
    assert (request.path, request.upstream, request.kind) == (
        "/api/chat",
        "/v1/chat/completions",
        "chat",
    )
    assert request.stream and request.limit == 64 and not request.unload and not request.empty
    assert request.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [TOOL],
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "stop": ["\n\n"],
        "response_format": {"type": "json_object"},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_E1_a_schema_format_is_json_schema_and_negative_num_predict_no_limit() -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    request = chat(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "format": schema,
            "stream": False,
            "options": {"num_predict": -1},
        }
    )
    assert request.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": schema},
        },
    }
    assert request.limit is None and not request.stream


def test_E1_images_become_data_url_parts_of_the_user_turn() -> None:
    request = chat(
        {"messages": [{"role": "user", "content": "What is it?", "images": [PNG, "/9j/4AAQ"]}]}
    )
    assert request.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
            ],
        }
    ]
    assert image_url("UklGRhYAAABXRUJQ").startswith("data:image/webp;base64,")
    assert image_url("data:image/gif;base64,R0lG") == "data:image/gif;base64,R0lG"


def test_E1_tool_calls_get_ids_and_each_tool_result_the_id_of_its_call() -> None:
    request = chat(
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"function": {"name": "get_time", "arguments": {"city": "Rome"}}},
                    ],
                },
                # answered out of order, by name; then one with no name (the next unanswered)
                {"role": "tool", "content": "12:00", "tool_name": "get_time"},
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "tool_calls": [{"id": "c9", "function": {"name": "f"}}]},
                {"role": "tool", "content": "done", "tool_call_id": "c9"},
            ]
        }
    )
    assert request.body["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_1_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "sunny"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c9", "content": "done"},
    ]


def test_E1_generate_is_system_then_prompt_and_raw_is_a_completion() -> None:
    request = read(
        "/api/generate",
        {"model": "m", "prompt": "Why?", "system": "Be brief.", "images": [PNG], "stream": False},
        "m",
    )
    assert request.upstream == "/v1/chat/completions" and request.kind == "generate"
    assert request.body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Why?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            ],
        },
    ]
    raw = read(
        "/api/generate",
        {"model": "m", "prompt": "[INST] Why? [/INST]", "raw": True, "suffix": "end"},
        "m",
    )
    assert raw.upstream == "/v1/completions" and not raw.chat
    assert raw.body == {
        "model": "m",
        "prompt": "[INST] Why? [/INST]",
        "suffix": "end",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    ("keep_alive", "zero"),
    [
        *((zero, True) for zero in (0, 0.0, "0", "0s", "0m")),
        *((other, False) for other in ("5m", -1, "forever", None, False, 300)),
    ],
)
def test_E1_keep_alive_zero_unloads_and_nothing_else_does(keep_alive: Any, zero: bool) -> None:
    assert unloads(keep_alive) is zero


def test_E1_no_prompt_or_messages_only_loads_or_unloads() -> None:
    load = read("/api/generate", {"model": "m"}, "m")
    unload = chat({"messages": [], "keep_alive": 0})
    assert load.empty and not load.unload
    assert unload.empty and unload.unload
    said = settled(unload, "m:latest", NOW, "unload")
    assert said == {
        "model": "m:latest",
        "created_at": "2023-11-14T22:13:20.250000Z",
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "unload",
    }
    assert settled(load, "m", NOW, "load")["response"] == ""


def test_E1_embed_and_embeddings_become_embeddings_requests() -> None:
    embed = read("/api/embed", {"model": "e", "input": ["a", "b"], "dimensions": 4}, "e")
    assert (embed.upstream, embed.body, embed.stream) == (
        "/v1/embeddings",
        {"model": "e", "input": ["a", "b"], "dimensions": 4},
        False,
    )
    old = read("/api/embeddings", {"model": "e", "prompt": "a", "keep_alive": 0}, "e")
    assert old.body == {"model": "e", "input": "a"} and old.unload and old.kind == "embeddings"


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/api/chat", {"messages": "hi"}, "messages"),
        ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/api/chat", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ("/api/chat", {"messages": [{"role": "user", "images": "x"}]}, "messages[0].images"),
        ("/api/chat", {"messages": [{"role": "system", "images": [PNG]}]}, "messages"),
        ("/api/chat", {"messages": [], "stream": "yes"}, "stream"),
        ("/api/chat", {"messages": [], "options": []}, "options"),
        ("/api/chat", {"messages": [], "options": {"num_predict": "9"}}, "options.num_predict"),
        ("/api/chat", {"messages": [], "options": {"temperature": True}}, "options.temperature"),
        ("/api/chat", {"messages": [], "options": {"stop": [1]}}, "options.stop"),
        ("/api/chat", {"messages": [], "format": "yaml"}, "format"),
        ("/api/chat", {"messages": [], "tools": [{"function": {}}]}, "tools"),
        (
            "/api/chat",
            {"messages": [{"role": "assistant", "tool_calls": [{"function": 1}]}]},
            "messages",
        ),
        ("/api/generate", {"prompt": ["x"]}, "prompt"),
        ("/api/generate", {"prompt": "x", "raw": "yes"}, "raw"),
        ("/api/embed", {"input": [1, 2]}, "input"),
        ("/api/embed", {"input": "x", "dimensions": 1.5}, "dimensions"),
    ],
)
def test_E1_malformed_requests_are_400s_naming_the_field(
    path: str, payload: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as err:
        read(path, {"model": "m", **payload}, "m")
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_E1_a_chat_answer_has_ollamas_message_tool_calls_counts_and_durations() -> None:
    body = {
        "id": "x",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "Paris, then.",
                    "tool_calls": [
                        {
                            "id": "call_a",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7},
    }
    request = chat({"messages": [{"role": "user", "content": "hi"}], "stream": False})
    assert answer(request, body, "m:latest") == {
        "model": "m:latest",
        "created_at": "2023-11-14T22:13:20.250000Z",
        "message": {
            "role": "assistant",
            "content": "",
            "thinking": "Paris, then.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        "done": True,
        "done_reason": "stop",
        "total_duration": 5_000,
        "load_duration": 1_000,
        "prompt_eval_count": 12,
        "prompt_eval_duration": 2_000,
        "eval_count": 7,
        "eval_duration": 2_000,
    }


def test_E1_generate_and_raw_answers_put_the_text_in_response() -> None:
    chat_body = {"choices": [{"message": {"content": "Blue."}, "finish_reason": "length"}]}
    text_body = {"choices": [{"text": "Blue!", "finish_reason": "stop"}], "usage": {}}
    generate = read("/api/generate", {"model": "m", "prompt": "?", "stream": False}, "m")
    raw = read("/api/generate", {"model": "m", "prompt": "?", "raw": True}, "m")
    said = answer(generate, chat_body, "m")
    assert (said["response"], said["done_reason"], said["eval_count"]) == ("Blue.", "length", 0)
    assert "message" not in said
    assert answer(raw, text_body, "m")["response"] == "Blue!"
    with pytest.raises(ApiError) as err:
        answer(generate, {"object": "list"}, "m")
    assert err.value.status == 502


def test_E1_embed_answers() -> None:
    body = {
        "data": [{"embedding": [0.1, 0.2]}, {"embedding": [0.3, 0.4]}],
        "usage": {"prompt_tokens": 4},
    }
    embed = read("/api/embed", {"model": "e", "input": ["a", "b"]}, "e")
    old = read("/api/embeddings", {"model": "e", "prompt": "a"}, "e")
    assert answer(embed, body, "e") == {
        "model": "e",
        "embeddings": [[0.1, 0.2], [0.3, 0.4]],
        "total_duration": 5_000,
        "load_duration": 1_000,
        "prompt_eval_count": 4,
    }
    assert answer(old, body, "e") == {"embedding": [0.1, 0.2]}


def test_E1_durations_are_nanoseconds_split_at_admission_upstream_and_first_byte() -> None:
    assert timings(10.0, 10.5, 12.5, 12.75, 13.0) == Timings(
        total=3_000_000_000, load=2_000_000_000, prompt_eval=250_000_000, eval=250_000_000
    )
    # no first byte (an empty answer), no admission known: nothing counted twice
    assert timings(10.0, None, 10.5, None, 11.0) == Timings(1_000_000_000, 0, 0, 500_000_000)


def lines_of(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines()]


def test_E1_a_chat_stream_is_ndjson_lines_ending_with_done_counts_and_durations() -> None:
    lines = Lines(echo("chat", True, "m"))
    out = lines.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert out == b""  # nothing said yet: no line
    out += lines.feed({"choices": [{"delta": {"content": "Hel"}}]})
    out += lines.feed({"choices": [{"delta": {"reasoning_content": "hmm"}}]})
    out += lines.feed({"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]})
    out += lines.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    out += lines.finish()
    assert lines.finished and lines.finish() == b""
    stamp = "2023-11-14T22:13:20.250000Z"
    assert lines_of(out) == [
        {
            "model": "m",
            "created_at": stamp,
            "message": {"role": "assistant", "content": "Hel"},
            "done": False,
        },
        {
            "model": "m",
            "created_at": stamp,
            "message": {"role": "assistant", "content": "", "thinking": "hmm"},
            "done": False,
        },
        {
            "model": "m",
            "created_at": stamp,
            "message": {"role": "assistant", "content": "lo"},
            "done": False,
        },
        {
            "model": "m",
            "created_at": stamp,
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "length",
            "total_duration": 5_000,
            "load_duration": 1_000,
            "prompt_eval_count": 3,
            "prompt_eval_duration": 2_000,
            "eval_count": 2,
            "eval_duration": 2_000,
        },
    ]


def test_E1_streamed_tool_call_deltas_are_sent_as_one_whole_call() -> None:
    lines = Lines(echo("chat", True, "m"))
    call = {"index": 0, "id": "call_x", "function": {"name": "get_weather", "arguments": ""}}
    out = lines.feed({"choices": [{"delta": {"tool_calls": [call]}}]})
    for piece in ('{"city"', ':"Paris"}'):
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        out += lines.feed({"choices": [{"delta": delta}]})
    assert out == b""  # gathered until the choice finishes
    out += lines.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    out += lines.finish()
    first, last = lines_of(out)
    assert first["message"]["tool_calls"] == [
        {
            "id": "call_x",
            "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    assert last["done"] is True and last["done_reason"] == "stop"


def test_E1_a_generate_stream_and_a_backends_error_event() -> None:
    lines = Lines(echo("generate", False, "m"))
    out = lines.feed({"choices": [{"text": "Blue", "finish_reason": None}]})
    out += lines.feed({"error": {"message": "context full", "code": 500}})
    assert lines.finished and lines.finish() == b""
    assert lines_of(out) == [
        {
            "model": "m",
            "created_at": "2023-11-14T22:13:20.250000Z",
            "response": "Blue",
            "done": False,
        },
        {"error": "context full"},
    ]
    said = orjson.loads(note("generate", "m", NOW, "queued: position 1 of 1"))
    assert said["response"] == "" and said["done"] is False
    assert said["corrallm"] == "queued: position 1 of 1"


@pytest.mark.parametrize(
    ("status", "sent"),
    [
        *((same, same) for same in (400, 401, 403, 404, 429, 502, 503)),
        *((405, 404), (413, 400), (409, 400), (423, 503), (500, 502), (504, 502)),
    ],
)
def test_E1_errors_carry_one_of_ollamas_statuses(status: int, sent: int) -> None:
    assert error_status(status) == sent


def test_E1_an_error_line_is_ollamas_error_object() -> None:
    assert error_line(ApiError(503, "Preempted.")) == b'{"error":"Preempted."}\n'
