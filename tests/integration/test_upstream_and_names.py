"""SPEC §22 T5, no side doors: `/upstream/<model>/…` is for operators unless opened to keys,
and then it passes the same gates as /v1; its answers are sandboxed; names callers choose
never grow state. Real gateways and fake backends; the `openai` SDK where a client is needed.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.clients import closed_at_end
from tests.support.processes import fake_cmd, wait_for

CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def config(extra: str = "") -> str:
    return f"""
keys:
  alice: {{secret: alice-secret, group: team}}
priorityGroups: {{team: {{}}}}
models:
  chat:
    backends:
      - name: primary
        cmd: "{fake_cmd()}"
        proxy: ${{PORT}}
        headers: {{Authorization: "Bearer backend-secret"}}
{extra}"""


def backend_saw(gw, path: str, key: str | None = None) -> list[dict]:
    """What the fake backend recorded for `path` (asked as the operator, or with `key`
    where /upstream is open to keys)."""
    if key is None:
        seen = gw.upstream("GET", "chat/debug/requests").json()
    else:
        auth = {"Authorization": f"Bearer {key}"}
        seen = httpx.get(gw.url + "/upstream/chat/debug/requests", headers=auth).json()
    return [q for q in seen if q["path"] == path]


def requests_of(gw, **filters: str) -> list[dict]:
    """Request rows of the activity log (not backend loads)."""
    query = "&".join(f"{k}={v}" for k, v in filters.items())
    rows = gw.api("GET", f"activity?since=0&{query}").json()["rows"]
    return [r for r in rows if r["endpoint"] != "load"]


def test_T5_upstream_needs_the_admin_token_and_anonymous_never_reaches_the_backend(
    gateway_factory,
):
    gw = gateway_factory(config())
    anonymous = httpx.get(gw.url + "/upstream/chat/props", timeout=30)
    keyed = httpx.get(
        gw.url + "/upstream/chat/props", headers={"Authorization": "Bearer alice-secret"}
    )
    forged = httpx.get(gw.url + "/upstream/chat/props", cookies={"corrallm_token": "guess"})
    for refused in (anonymous, keyed, forged):
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "unauthorized"
        assert "admin token" in refused.json()["error"]["message"]
        assert refused.headers["content-security-policy"] == "sandbox"
    # Nothing of it reached the backend: it was not even started for them.
    assert gw.state("primary") == "stopped"
    # The operator passes with the bearer token or the dashboard's cookie.
    by_token = gw.upstream("GET", "chat/props?x=1")
    by_cookie = httpx.get(
        gw.url + "/upstream/chat/props?x=2", cookies={"corrallm_token": gw.token}, timeout=30
    )
    assert (by_token.status_code, by_cookie.status_code) == (200, 200)
    seen = backend_saw(gw, "/props")
    assert [q["query"] for q in seen] == ["x=1", "x=2"]
    # The backend's configured headers are added behind the gate; the admin token is not
    # passed on (nor is the cookie).
    for q in seen:
        headers = {k.lower(): v for k, v in q["headers"].items()}
        assert headers["authorization"] == "Bearer backend-secret"
        assert gw.token not in str(q)


def test_T5_upstream_answers_are_sandboxed_and_never_set_cookies(gateway_factory):
    gw = gateway_factory(config())
    page = gw.upstream("GET", "chat/")
    assert page.status_code == 200 and b"<script>" in page.content
    assert page.headers["content-security-policy"] == "sandbox"
    assert "set-cookie" not in page.headers and not page.cookies
    # The backend does set one: corrallm drops it.
    direct = httpx.get(gw.records()["primary"]["base_url"] + "/", timeout=10)
    assert direct.headers["set-cookie"].startswith("fake_session=")
    # Errors on the surface are sandboxed too.
    missing = gw.upstream("GET", "nope/")
    assert missing.status_code == 404
    assert missing.headers["content-security-policy"] == "sandbox"


KEYS = "upstream: {access: keys}\nscheduler: {requireKeys: true}\n"


def test_T5_upstream_with_access_keys_passes_the_v1_gates_and_is_recorded(gateway_factory):
    gw = gateway_factory(config(KEYS))
    alice = {"Authorization": "Bearer alice-secret"}
    served = httpx.get(gw.url + "/upstream/chat/props?y=1", headers=alice, timeout=30)
    assert served.status_code == 200, served.text
    assert served.headers["content-security-policy"] == "sandbox"
    assert served.headers["x-corrallm-backend"] == "primary"
    # Its activity row: the key's name, endpoint /upstream (never the caller's path).
    rows = wait_for(lambda: requests_of(gw, key="alice"), 10, what="the activity row")
    assert [(r["key"], r["group"], r["model"], r["endpoint"], r["status"]) for r in rows] == [
        ("alice", "team", "chat", "/upstream", 200)
    ]
    # The backend got its configured headers, and never the caller's key.
    seen = backend_saw(gw, "/props", "alice-secret")[-1]
    assert {k.lower(): v for k, v in seen["headers"].items()}["authorization"] == (
        "Bearer backend-secret"
    )
    assert "alice-secret" not in str(seen)
    # Metrics count it as any request.
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'corrallm_requests_total{backend="primary",group="team",model="chat",status="200"}' in (
        metrics
    )
    # An unknown key under requireKeys: 401 from the head; the admin token is no key here.
    for secret in ("not-a-key", gw.token):
        refused = httpx.get(
            gw.url + "/upstream/chat/props", headers={"Authorization": f"Bearer {secret}"}
        )
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
    # A paused model is refused like on /v1.
    assert gw.api("POST", "models/pause", {"model": "chat"}).status_code == 200
    paused = httpx.get(gw.url + "/upstream/chat/props", headers=alice, timeout=30)
    assert paused.status_code == 503 and paused.json()["error"]["code"] == "paused"
    client = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key="alice-secret", max_retries=0))
    with pytest.raises(openai.APIStatusError) as same_on_v1:
        client.chat.completions.create(model="chat", messages=CHAT["messages"])
    assert same_on_v1.value.status_code == 503


def series(gw) -> list[str]:
    """Every sample line of /metrics (one per series)."""
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_T5_model_names_callers_choose_are_unknown_in_rows_events_and_metrics(gateway_factory):
    gw = gateway_factory(config())
    long_name = "made-up-" + "x" * 5000
    anonymous = httpx.post(gw.v1 + "/chat/completions", json={**CHAT, "model": long_name})
    assert anonymous.status_code == 404
    message = anonymous.json()["error"]["message"]
    # The message quotes the name's first 128 characters only.
    assert ("'" + long_name[:128] + "…'") in message and long_name[:129] not in message
    stranger = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key="not-configured", max_retries=0))
    for name in ("one", "two", "three"):
        with pytest.raises(openai.NotFoundError):
            stranger.chat.completions.create(model=name, messages=CHAT["messages"])
    # Last (rows are written in order): a configured key's.
    client = closed_at_end(openai.OpenAI(base_url=gw.v1, api_key="alice-secret", max_retries=0))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="made-up-by-alice", messages=CHAT["messages"])
    # alice is a configured key: her refusal is recorded, as `unknown`, and its error
    # does not quote the name.
    rows = wait_for(lambda: requests_of(gw, key="alice"), 10, what="alice's row")
    assert [(r["model"], r["status"]) for r in rows] == [("unknown", 404)]
    assert "made-up" not in str(rows)
    # Anonymous and unknown callers asking for names nobody serves leave no row at all.
    everything = gw.api("GET", "activity?since=0").json()["rows"]
    assert [r["key"] for r in everything] == ["alice"]
    # One metric series for all of them, under the label `unknown`.
    lines = [line for line in series(gw) if line.startswith("corrallm_requests_total")]
    assert lines == [
        'corrallm_requests_total{backend="",group="default",model="unknown",status="404"} 4.0',
        'corrallm_requests_total{backend="",group="team",model="unknown",status="404"} 1.0',
    ]
    assert not [line for line in series(gw) if "made-up" in line or '"one"' in line]
