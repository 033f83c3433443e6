"""SPEC §22 T4 through a real `corrallm serve` and a fake backend, driven by the official
`openai` SDK: the user a trusted key names in `auth.userHeader` (as Open WebUI sends
`X-OpenWebUI-User-Email`) on activity rows, per-user usage (REST and GraphQL), live
requests, captures and usage events; every other caller's user header ignored."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest

from tests.support.clients import closed_at_end
from tests.support.observe import request_rows
from tests.support.processes import Gateway, fake_cmd, wait_for

HEADER = "X-OpenWebUI-User-Email"
WEBUI = "ck-webui-secret-7a1f"  # trustUserHeader: true
SCRIPT = "ck-script-secret-42c9"  # an ordinary key
MESSAGES: Any = [{"role": "user", "content": "hi"}]


def config(auth: bool = True, *flags: str) -> str:
    return f"""
{f"auth: {{userHeader: {HEADER}}}" if auth else ""}
capture: {{bodies: all}}
keys:
  webui: {{secret: {WEBUI}, trustUserHeader: true}}
  script: {{secret: {SCRIPT}}}
models:
  chat:
    backends: [{{cmd: "{fake_cmd("--tokens", "8", *flags)}", proxy: "${{PORT}}", maxConcurrent: 4}}]
"""


def client(gw: Gateway, key: str, user: str | None) -> openai.OpenAI:
    headers = {HEADER: user} if user is not None else {}
    return closed_at_end(
        openai.OpenAI(
            base_url=gw.v1, api_key=key, default_headers=headers, max_retries=0, timeout=60
        )
    )


def chat(gw: Gateway, key: str | None, user: str) -> str:
    """One chat completion; its request id. Without a key, a plain HTTP request (the SDK
    always sends one)."""
    if key is None:
        r = httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
            headers={HEADER: user},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r.headers["x-corrallm-request-id"]
    raw = client(gw, key, user).chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES
    )
    assert raw.http_response.status_code == 200
    return raw.headers["x-corrallm-request-id"]


def rows_of(gw: Gateway, *request_ids: str) -> dict[str, dict[str, Any]]:
    """The activity rows of these requests, by request id, once all are written."""

    def written() -> dict[str, dict[str, Any]] | None:
        rows = {str(r["request_id"]): r for r in request_rows(gw)}
        return rows if all(rid in rows for rid in request_ids) else None

    found = wait_for(written, 15, what="the requests' activity rows (batched writer)")
    return {rid: found[rid] for rid in request_ids}


def by_user(gw: Gateway) -> list[dict[str, Any]]:
    r = gw.api("GET", "usage/by-user")
    assert r.status_code == 200, r.text
    return r.json()["rows"]


def dashboard(gw: Gateway, section: str) -> str:
    """One section of the dashboard, as its page fetches it."""
    r = httpx.get(
        f"{gw.url}/ui/section/{section}",
        headers={"Authorization": f"Bearer {gw.token}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.text


class UsageEvents(threading.Thread):
    """The `usage` events of /api/v1/events, from the moment it is connected."""

    def __init__(self, gw: Gateway, wanted: int) -> None:
        super().__init__(daemon=True)
        self.gw, self.wanted = gw, wanted
        self.seen: list[dict[str, Any]] = []
        self.connected = threading.Event()
        self.start()
        assert self.connected.wait(10), "the events stream did not connect"

    def run(self) -> None:
        url = self.gw.url + "/api/v1/events?kinds=usage"
        headers = {"Authorization": f"Bearer {self.gw.token}"}
        with httpx.stream("GET", url, headers=headers, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith(": connected"):
                    self.connected.set()
                elif line.startswith("data: "):
                    self.seen.append(json.loads(line[len("data: ") :]))
                    if len(self.seen) == self.wanted:
                        return


def test_T4_a_trusted_keys_user_shows_on_live_requests_activity_usage_captures_and_events(
    gateway_factory,
):
    # 60 tokens 50 ms apart: the request is held for 3 s once its answer has begun.
    gw = gateway_factory(config(True, "--tokens", "60", "--token-delay", "0.05"))
    events = UsageEvents(gw, 1)
    ada = "ada@example.com"
    stream = client(gw, WEBUI, ada).chat.completions.create(
        model="chat", messages=MESSAGES, stream=True
    )
    rid = stream.response.headers["x-corrallm-request-id"]
    next(iter(stream))  # the answer has begun: the request is held until its end
    (live,) = gw.api("GET", "requests").json()["requests"]
    assert (live["id"], live["key"], live["user"]) == (rid, "webui", ada)
    assert f'<span class="muted" data-field="user">{ada}</span>' in dashboard(gw, "requests")
    for _ in stream:  # the rest of the answer
        pass

    row = rows_of(gw, rid)[rid]
    assert (row["key"], row["user"], row["status"]) == ("webui", ada, 200)
    assert [r["request_id"] for r in request_rows(gw, user=ada)] == [rid]
    assert f'<span class="muted" data-field="user">{ada}</span>' in dashboard(gw, "activity")

    (mine,) = by_user(gw)
    (keyed,) = [r for r in gw.api("GET", "usage/by-key").json()["rows"] if r["key"] == "webui"]
    sums = {k: v for k, v in keyed.items() if k not in ("key", "group")}
    assert mine == {"user": ada, "key": "webui", **sums}  # every webui request named ada
    assert mine["requests"] == 1 and mine["completion_tokens"] == 60
    graphql = httpx.post(
        gw.url + "/api/graphql",
        json={"query": "{ usageByUser { rows { user key requests completionTokens } } }"},
        headers={"Authorization": f"Bearer {gw.token}"},
        timeout=30,
    ).json()
    assert graphql["data"]["usageByUser"]["rows"] == [
        {"user": ada, "key": "webui", "requests": 1, "completionTokens": 60}
    ]

    (listed,) = gw.api("GET", "captures").json()["captures"]
    assert (listed["request_id"], listed["user"]) == (rid, ada)
    assert gw.api("GET", f"captures/{rid}").json()["user"] == ada

    events.join(15)
    (usage,) = events.seen
    assert (usage["key"], usage["user"], usage["completion_tokens"]) == ("webui", ada, 60)


def test_T4_other_keys_and_unkeyed_callers_user_headers_are_ignored(gateway_factory):
    gw = gateway_factory(config(True))
    trusted = chat(gw, WEBUI, "ada@example.com")
    other = chat(gw, SCRIPT, "mallory@example.com")
    unkeyed = chat(gw, None, "eve@example.com")
    unknown = chat(gw, "ck-not-a-key", "eve@example.com")
    rows = rows_of(gw, trusted, other, unkeyed, unknown)
    assert {rid: (r["key"], r["user"]) for rid, r in rows.items()} == {
        trusted: ("webui", "ada@example.com"),
        other: ("script", None),
        unkeyed: (None, None),
        unknown: ("unknown", None),
    }
    assert [(r["user"], r["key"], r["requests"]) for r in by_user(gw)] == [
        ("ada@example.com", "webui", 1)
    ]
    assert request_rows(gw, user="mallory@example.com") == []
    users = {c["request_id"]: c["user"] for c in gw.api("GET", "captures").json()["captures"]}
    assert users == {trusted: "ada@example.com", other: None, unkeyed: None, unknown: None}


def test_T4_a_300_character_user_is_cut_to_128(gateway_factory):
    gw = gateway_factory(config(True))
    long = "".join(chr(ord("a") + i % 26) for i in range(300))
    rid = chat(gw, WEBUI, long)
    assert rows_of(gw, rid)[rid]["user"] == long[:128]
    assert [r["user"] for r in by_user(gw)] == [long[:128]]
    assert gw.api("GET", f"captures/{rid}").json()["user"] == long[:128]


def test_T4_without_auth_user_header_no_user_is_read(gateway_factory):
    gw = gateway_factory(config(False))
    rid = chat(gw, WEBUI, "ada@example.com")
    row = rows_of(gw, rid)[rid]
    assert (row["key"], row["user"]) == ("webui", None)
    assert by_user(gw) == []
    assert gw.api("GET", f"captures/{rid}").json()["user"] is None


def test_T4_T3_per_user_limits_count_each_user_behind_a_key_apart(gateway_factory):
    """`limits.perUser`: each user a trusted key names has its own rpm; the key's own
    limit still counts them all."""
    gw = gateway_factory(
        config().replace(
            "trustUserHeader: true}",
            "trustUserHeader: true, limits: {rpm: 5, perUser: {rpm: 2}}}",
        )
    )
    for _ in range(2):
        chat(gw, WEBUI, "ann@example.com")
    with pytest.raises(openai.RateLimitError) as ann:
        client(gw, WEBUI, "ann@example.com").chat.completions.create(
            model="chat", messages=MESSAGES
        )
    assert ann.value.code == "rate_limited" and "perUser" in ann.value.message
    for _ in range(2):  # another user of the same key is not held back by ann
        chat(gw, WEBUI, "bob@example.com")
    chat(gw, WEBUI, "cy@example.com")  # the key's fifth request
    with pytest.raises(openai.RateLimitError) as key:  # the key's own rpm: 5 in all
        client(gw, WEBUI, "dee@example.com").chat.completions.create(
            model="chat", messages=MESSAGES
        )
    assert key.value.code == "rate_limited" and "perUser" not in key.value.message
