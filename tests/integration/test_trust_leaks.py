"""SPEC §22 T1: nothing corrallm writes or answers contains a key's secret.

One real gateway with a named key (its secret from the environment), a short-form key
and a key made at runtime is used through every dialect, streamed and not, with a
failure (so captures keep it) and the secrets echoed back in bodies. Then every surface is
read and searched for the secrets: each REST GET of the management API (from its OpenAPI
document), every GraphQL query (from introspection, every field selected), the events
stream, /metrics, the dashboard's page and every section, the captures, the gateway's log
and every file under its home, the store's bytes included.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from corrallm.config.schema import short_key_name
from tests.support.clients import closed_at_end
from tests.support.processes import Gateway, fake_cmd, wait_for

NAMED = "sk-named-" + secrets.token_hex(16)
SHORT = "sk-short-" + secrets.token_hex(16)
UNKNOWN = "sk-stranger-" + secrets.token_hex(16)  # never configured: not kept either
CONFIG = f"""
models:
  m:
    backends:
      - cmd: {fake_cmd()}
        proxy: ${{PORT}}
keys:
  alice:
    secret: ${{ALICE_KEY}}
  "${{SHORT_KEY}}": default
capture: {{bodies: all}}
"""
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture
def gw(gateway_factory) -> Gateway:
    return gateway_factory(CONFIG, env={"ALICE_KEY": NAMED, "SHORT_KEY": SHORT})


def test_T1_no_surface_file_or_log_line_contains_a_key_secret(gw: Gateway) -> None:
    runtime = gw.api("POST", "keys", {"name": "bot", "group": "default"})
    made = runtime.json().get("secret") if runtime.status_code == 201 else None
    configured = [NAMED, SHORT, *([made] if made else [])]
    events = _events(gw)
    for secret in configured:
        client = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key=secret, max_retries=0))
        echoed = [{"role": "user", "content": f"my key is {secret}, repeat it"}]
        client.chat.completions.create(model="m", messages=echoed)
        stream = client.chat.completions.create(model="m", messages=CHAT, stream=True)
        assert [c for c in stream]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=echoed)
        anthropic = httpx.post(
            gw.v1 + "/messages",
            headers={"x-api-key": secret, "anthropic-version": "2023-06-01"},
            json={"model": "m", "max_tokens": 16, "messages": CHAT},
            timeout=60,
        )
        assert anthropic.status_code == 200
        client.responses.create(model="m", input=f"again: {secret}")
    stranger = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key=UNKNOWN, max_retries=0))
    stranger.chat.completions.create(model="m", messages=CHAT)

    names = {short_key_name(SHORT), "alice", "unknown", *(["bot"] if made else [])}
    wait_for(lambda: names <= _keys_in_activity(gw), 15, what="every caller's rows, by name")
    seen = {
        "events": events.stop(),
        "metrics": httpx.get(gw.url + "/metrics", timeout=30).text,
        **_rest(gw),
        **_graphql(gw),
        **_dashboard(gw),
        "log": gw.log(),
    }
    seen.update(_home_files(gw))
    assert "alice" in seen["events"] and "alice" in seen["GET /api/v1/activity"]
    assert any("redacted" in text for name, text in seen.items() if "captures/" in name)
    for secret in [*configured, UNKNOWN]:
        leaks = [where for where, text in seen.items() if secret in text]
        assert not leaks, f"a key secret ({secret[:9]}…) is in: {leaks}"
    # The store holds digests only: none of the secrets, in any encoding corrallm uses.
    for secret in configured:
        assert secret.encode() not in b"".join(_home_bytes(gw))


# -- reading every surface ----------------------------------------------------------------


class _Reader:
    def __init__(self, gw: Gateway) -> None:
        self.text: list[str] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(gw,), daemon=True)
        self.thread.start()
        assert self.ready.wait(15), "the events stream did not connect"

    def _read(self, gw: Gateway) -> None:
        headers = {"Authorization": f"Bearer {gw.token}"}
        url = gw.url + "/api/v1/events"
        try:
            with httpx.stream("GET", url, headers=headers, timeout=None) as r:
                for line in r.iter_lines():
                    if line.startswith(": connected"):
                        self.ready.set()
                    self.text.append(line)
                    if self.done.is_set():
                        return
        except httpx.HTTPError:
            return  # the gateway stopped at the test's end

    def stop(self) -> str:
        self.done.set()
        return "\n".join(self.text)


def _events(gw: Gateway) -> _Reader:
    return _Reader(gw)


def _keys_in_activity(gw: Gateway) -> set[str]:
    rows = gw.api("GET", "activity?limit=1000").json()["rows"]
    return {r["key"] for r in rows if r["key"]}


def _rest(gw: Gateway) -> dict[str, str]:
    paths = gw.api("GET", "openapi.json").json()["paths"]
    out = {}
    for path, methods in paths.items():
        if "get" not in methods or "{" in path or path.endswith(("/events", "/docs")):
            continue
        response = gw.api("GET", path.removeprefix("/api/v1/"))
        out[f"GET {path}"] = response.text
    for record in gw.api("GET", "captures?limit=1000").json()["captures"]:
        rid = record["request_id"]
        out[f"GET captures/{rid}"] = gw.api("GET", f"captures/{rid}").text
    return out


def _graphql(gw: Gateway) -> dict[str, str]:
    """Every query field that needs no argument, with every field under it selected."""
    schema = _post_graphql(gw, _INTROSPECTION)["data"]["__schema"]
    types = {t["name"]: t for t in schema["types"]}
    out = {}
    for field in types[schema["queryType"]["name"]]["fields"]:
        if any(a["type"]["kind"] == "NON_NULL" for a in field["args"]):
            continue
        selection = _select(_named(field["type"]), types, 0)
        query = "{ " + field["name"] + (f" {{ {selection} }}" if selection else "") + " }"
        answer = _post_graphql(gw, query)
        assert "errors" not in answer, (query, answer)
        out[f"graphql {field['name']}"] = json.dumps(answer)
    return out


def _post_graphql(gw: Gateway, query: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {gw.token}"}
    r = httpx.post(gw.url + "/api/graphql", json={"query": query}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


_TYPE = "kind name ofType { kind name ofType { kind name ofType { kind name } } }"
_INTROSPECTION = (
    "{ __schema { queryType { name } types { name kind fields { name "
    f"args {{ name type {{ {_TYPE} }} }} type {{ {_TYPE} }} }} }} }} }}"
)


def _named(ref: dict[str, Any]) -> str:
    while ref.get("ofType"):
        ref = ref["ofType"]
    return str(ref["name"])


def _select(name: str, types: dict[str, Any], depth: int) -> str:
    kind = types[name]["kind"]
    if kind not in ("OBJECT", "INTERFACE"):
        return ""
    parts = []
    for field in types[name]["fields"]:
        if any(a["type"]["kind"] == "NON_NULL" for a in field["args"]):
            continue
        inner = _named(field["type"])
        if types[inner]["kind"] in ("OBJECT", "INTERFACE"):
            if depth < 5:
                sub = _select(inner, types, depth + 1)
                if sub:
                    parts.append(f"{field['name']} {{ {sub} }}")
        else:
            parts.append(field["name"])
    return " ".join(parts)


def _dashboard(gw: Gateway) -> dict[str, str]:
    from corrallm.ui import views

    with httpx.Client(base_url=gw.url, timeout=30) as client:
        assert client.post("/signin", data={"token": gw.token}).status_code == 303
        out = {"dashboard /": client.get("/").text}
        for name in views.FRAGMENTS:
            out[f"dashboard {name}"] = client.get(f"/ui/section/{name}").text
    return out


def _home_bytes(gw: Gateway) -> Iterator[bytes]:
    for path in sorted(gw.home.rglob("*")):
        if path.is_file():
            yield path.read_bytes()


def _home_files(gw: Gateway) -> dict[str, str]:
    return {
        f"file {p.relative_to(gw.home)}": p.read_bytes().decode("latin-1")
        for p in sorted(gw.home.rglob("*"))
        if p.is_file()
    }
