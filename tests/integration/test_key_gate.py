"""SPEC §22 T1/T5 through a real gateway: a key is judged from the request head, before any
body byte is read; an expired key is refused as such."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from tests.support.clients import closed_at_end
from tests.support.processes import Gateway, fake_cmd

CONFIG = f"""
models:
  m:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
keys:
  old: {{secret: sk-old-key, expires: 2020-01-01}}
  fresh: {{secret: sk-fresh-key}}
scheduler: {{requireKeys: true}}
"""
HI = [{"role": "user", "content": "hi"}]


def head_only(
    gw: Gateway, key: str | None, path: str = "/v1/chat/completions"
) -> tuple[bytes, float]:
    """A request's head declaring a 40 MB body, and no body byte: the answer and how long
    it took."""
    port = int(gw.url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        began = time.monotonic()
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\n{auth}Content-Length: 40000000\r\n\r\n"
            ).encode()
        )
        answer = b""
        while not answer.endswith(b"}}"):  # the error's JSON body, whole
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer, time.monotonic() - began


def test_T5_a_key_is_judged_from_the_head_before_any_body_byte(gateway_factory):
    gw = gateway_factory(CONFIG)
    for key, code in ((None, b"invalid_api_key"), ("sk-stranger", b"invalid_api_key")):
        answer, took = head_only(gw, key)
        # Not after CORRALLM_BODY_TIMEOUT (15 s): the 40 MB were never waited for.
        assert answer.startswith(b"HTTP/1.1 401 ") and took < 5, (answer[:200], took)
        assert b'"code":"' + code + b'"' in answer
    answer, took = head_only(gw, "sk-old-key")
    assert answer.startswith(b"HTTP/1.1 401 ") and b'"code":"key_expired"' in answer
    # Every surface that reads a body: a reservation's too.
    answer, took = head_only(gw, "sk-stranger", "/v1/reservations")
    assert answer.startswith(b"HTTP/1.1 401 ") and took < 5, (answer[:200], took)


def test_T1_an_expired_key_is_refused_as_expired(gateway_factory):
    gw = gateway_factory(CONFIG)
    old = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key="sk-old-key", max_retries=0))
    with pytest.raises(openai.AuthenticationError) as refused:
        old.chat.completions.create(model="m", messages=HI)
    assert refused.value.code == "key_expired" and "'old' has expired" in refused.value.message
    fresh = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key="sk-fresh-key", max_retries=0))
    assert fresh.chat.completions.create(model="m", messages=HI).choices
