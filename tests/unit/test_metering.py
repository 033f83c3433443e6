"""C2: usage read from answers; the usage chunk hidden from clients that did not ask;
estimates, flagged, where a backend reports none."""

import orjson

from corrallm.proxy.metering import Meter, ask_for_usage


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_C2_a_stream_is_asked_for_usage_only_when_the_client_did_not():
    payload = {"stream": True, "stream_options": {"foo": 1}}
    assert ask_for_usage("/v1/chat/completions", payload)
    assert payload["stream_options"] == {"foo": 1, "include_usage": True}
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert not ask_for_usage("/v1/chat/completions", asked)
    assert not ask_for_usage("/v1/chat/completions", {"stream": False})
    assert not ask_for_usage("/v1/embeddings", {"stream": True})


def test_C2_the_usage_chunk_is_read_and_hidden_from_a_client_that_did_not_ask():
    meter = Meter(strip_usage=True)
    meter.start(200, sse=True)
    chunk = event({"choices": [{"delta": {"content": "hi"}}], "usage": None})
    tail = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    out = meter.chunk(chunk + tail + b"data: [DONE]\n\n")
    assert out == event({"choices": [{"delta": {"content": "hi"}}]}) + b"data: [DONE]\n\n"
    m = meter.metered(bytes_in=100)
    assert (m.prompt_tokens, m.completion_tokens, m.estimated) == (7, 3, False)


def test_C2_a_client_that_asked_keeps_its_usage_chunk():
    meter = Meter(strip_usage=False)
    meter.start(200, sse=True)
    tail = event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    assert meter.chunk(tail) == tail


def test_C2_json_usage_is_read_and_missing_usage_is_estimated_and_flagged():
    meter = Meter()
    meter.start(200, sse=False)
    meter.chunk(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2}}')
    meter.finish()
    assert meter.metered(40).tokens == 7
    bare = Meter()
    bare.start(200, sse=False)
    bare.chunk(b'{"choices": [{"message": {"content": "twelve chars"}}]}')
    bare.finish()
    m = bare.metered(bytes_in=400)
    assert m.estimated and m.prompt_tokens == 100 and m.completion_tokens > 0
