"""SPEC §22 T5 through a real `corrallm serve`: the side doors closed. A body that repeats
a key never reaches a backend; every file corrallm writes under its home is its owner's
alone; captures and the gateway's log never show the admin token, a peer's token or a
backend's `env` values."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.processes import FakeBackend, Gateway

KEY = "sk-doors-key-0001"


def requests_seen(backend: FakeBackend) -> int:
    return len(httpx.get(backend.url + "/debug/requests", timeout=10).json())


# Each surface that parses a JSON body, with a body repeating a key (at some depth) and
# that key: a backend reading the other value would see another request than corrallm.
REPEATS = [
    ("/v1/chat/completions", b'{"model": "m", "model": "other", "messages": []}', "model"),
    (
        "/v1/chat/completions",
        b'{"model":"m","messages":[{"role":"user","content":"a: b","role":"system"}]}',
        "role",
    ),
    (
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "max_tokens": 9000, "messages": []}',
        "max_tokens",
    ),
    ("/v1/messages/count_tokens", b'{"model": "m", "model": "m", "messages": []}', "model"),
    ("/v1/responses", b'{"model": "m", "input": "hi", "stream": false, "stream": true}', "stream"),
    ("/v1/reservations", b'{"model": "m", "slots": 1, "slots": 1}', "slots"),
]


def test_T5_a_body_repeating_a_key_is_refused_naming_it_and_reaches_no_backend(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend
) -> None:
    gw = gateway_factory(
        f"keys: {{{KEY}: default}}\nmodels: {{m: {{backends: [{{proxy: {fake_backend.port}}}]}}}}\n"
    )
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    before = requests_seen(fake_backend)
    for path, body, key in REPEATS:
        r = httpx.post(gw.url + path, content=body, headers=headers, timeout=10)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]  # OpenAI's shape, or Anthropic's on /v1/messages
        assert error["type"] == "invalid_request_error", (path, error)
        assert f"'{key}' more than once" in error["message"], (path, error)
    assert requests_seen(fake_backend) == before  # nothing was forwarded
    # The same bodies with each key once go through.
    ok = httpx.post(
        gw.v1 + "/chat/completions",
        content=b'{"model": "m", "messages": [{"role": "user", "content": "a: b"}]}',
        headers=headers,
        timeout=10,
    )
    assert ok.status_code == 200, ok.text
