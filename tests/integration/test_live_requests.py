"""SPEC §21 O1 through a real gateway and fake backends: the requests corrallm holds now,
cancelling one wherever it is, and the request id on every answer and activity row."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from tests.support.calls import CHAT, Call
from tests.support.observe import request_rows
from tests.support.processes import Gateway, fake_cmd, wait_for


def config(*flags: str) -> str:
    return f"""
models:
  slow:
    backends: [{{cmd: "{fake_cmd(*flags)}", proxy: "${{PORT}}", maxConcurrent: 1}}]
"""


def held(gw: Gateway) -> list[dict[str, Any]]:
    r = gw.api("GET", "requests")
    assert r.status_code == 200, r.text
    return r.json()["requests"]


def test_O1_a_running_stream_and_a_queued_request_are_listed_and_each_cancel_ends_it(
    gateway_factory, calls
):
    gw = gateway_factory(config("--tokens", "400", "--token-delay", "0.02"))
    calls.append(running := Call(gw, "slow", stream=True))
    wait_for(lambda: any(r["state"] == "running" for r in held(gw)), 30, what="running")
    calls.append(queued := Call(gw, "slow", stream=False))
    wait_for(lambda: len(held(gw)) == 2, 30, what="a second request held")
    wait_for(
        lambda: next(r for r in held(gw) if r["stream"])["completion_tokens"] >= 3,
        30,
        what="tokens so far counted",
    )
    listed = {r["state"]: r for r in held(gw)}
    assert {
        state: (r["model"], r["backend"], r["endpoint"], r["stream"], r["age_ms"] > 0)
        for state, r in listed.items()
    } == {
        "running": ("slow", "slow#0", "/v1/chat/completions", True, True),
        "queued": ("slow", None, "/v1/chat/completions", False, True),
    }

    cancel = gw.api("POST", f"requests/{listed['queued']['id']}/cancel")
    assert cancel.json() == {"id": listed["queued"]["id"], "state": "queued", "cancelled": True}
    wait_for(queued.finished, 30, what="the queued request answered")
    assert queued.status == 503
    assert json.loads(queued.body)["error"]["code"] == "cancelled"

    gw.api("POST", f"requests/{listed['running']['id']}/cancel")
    wait_for(running.finished, 30, what="the stream ended")
    assert running.status == 200
    assert running.events[-1] == "[DONE]"
    assert json.loads(running.events[-2])["error"]["code"] == "cancelled"
    tokens = [e for e in running.events[:-2] if '"content"' in e]
    assert 3 <= len(tokens) < 400  # cut short, not finished

    # The backend saw its request dropped; nothing is held; both rows say cancelled.
    port = gw.records()["slow#0"]["port"]
    stats = lambda: httpx.get(f"http://127.0.0.1:{port}/debug/stats").json()  # noqa: E731
    wait_for(lambda: stats()["cancelled"] == 1, 30, what="the backend saw the cancel")
    assert held(gw) == []
    ids = {listed["queued"]["id"], listed["running"]["id"]}
    assert {
        queued.headers["x-corrallm-request-id"],
        running.headers["x-corrallm-request-id"],
    } == ids

    def rows() -> dict[str, dict[str, Any]]:
        return {str(r["request_id"]): r for r in request_rows(gw) if r["request_id"] in ids}

    wait_for(lambda: len(rows()) == 2, 30, what="both activity rows")
    assert sorted((r["status"], str(r["error"]).split(":")[0]) for r in rows().values()) == [
        (503, "cancelled"),
        (503, "cancelled"),
    ]


def test_O1_every_answer_carries_its_request_id_and_its_row_the_same(gateway_factory):
    gw = gateway_factory(config() + "keys: {caller: {secret: caller-secret}}\n")
    served = httpx.post(gw.v1 + "/chat/completions", json={"model": "slow", **CHAT}, timeout=30)
    # A configured key's (T5: a stranger's request for a model nobody serves leaves no row).
    keyed = {"Authorization": "Bearer caller-secret"}
    missing = httpx.post(
        gw.v1 + "/chat/completions", json={"model": "nope", **CHAT}, headers=keyed, timeout=30
    )
    bad = httpx.post(gw.v1 + "/chat/completions", content=b"{not json", timeout=30)
    ids = [r.headers.get("x-corrallm-request-id") for r in (served, missing, bad)]
    assert [r.status_code for r in (served, missing, bad)] == [200, 404, 400]
    assert all(ids) and len(set(ids)) == 3
    wait_for(
        lambda: {r["request_id"] for r in request_rows(gw)} >= set(ids[:2]),
        30,
        what="the rows of the served and the unknown-model request",
    )
    rows = {r["request_id"]: r["status"] for r in request_rows(gw)}
    assert (rows[ids[0]], rows[ids[1]]) == (200, 404)


def test_O1_cancel_of_a_request_not_held_is_404_and_graphql_has_both_twins(gateway_factory, calls):
    gw = gateway_factory(config("--tokens", "400", "--token-delay", "0.02"))
    gone = gw.api("POST", "requests/0123456789abcdef/cancel")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "request_not_found"

    calls.append(running := Call(gw, "slow", stream=True))
    # Streaming already: cancelled while still loading, it would be a 503, not an event.
    wait_for(
        lambda: any(r["completion_tokens"] >= 1 for r in held(gw)), 30, what="a stream running"
    )

    def graphql(query: str) -> dict[str, Any]:
        r = httpx.post(
            gw.url + "/api/graphql",
            json={"query": query},
            headers={"Authorization": f"Bearer {gw.token}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()

    listed = graphql("{ requests { requests { id state model stream } } }")
    (one,) = listed["data"]["requests"]["requests"]
    assert (one["model"], one["stream"]) == ("slow", True)
    done = graphql(f'mutation {{ cancelRequest(id: "{one["id"]}") {{ id cancelled }} }}')
    assert done["data"]["cancelRequest"] == {"id": one["id"], "cancelled": True}
    wait_for(running.finished, 30, what="the stream ended")
    assert json.loads(running.events[-2])["error"]["code"] == "cancelled"


def test_O1_a_request_event_says_when_each_starts_and_ends(gateway_factory):
    gw = gateway_factory(config())
    seen: list[dict[str, Any]] = []
    connected = threading.Event()

    def read() -> None:
        url = gw.url + "/api/v1/events?kinds=request"
        headers = {"Authorization": f"Bearer {gw.token}"}
        with httpx.stream("GET", url, headers=headers, timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith(": connected"):
                    connected.set()
                elif line.startswith("data: "):
                    seen.append(json.loads(line[len("data: ") :]))
                    if len(seen) == 2:
                        return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert connected.wait(10)
    r = httpx.post(gw.v1 + "/chat/completions", json={"model": "slow", **CHAT}, timeout=30)
    reader.join(30)
    rid = r.headers["x-corrallm-request-id"]
    assert [(e["event"], e["id"], e["model"]) for e in seen] == [
        ("started", rid, "slow"),
        ("ended", rid, "slow"),
    ]
    assert (seen[1]["status"], seen[1]["cancelled"]) == (200, False)


def test_O1_a_running_request_whose_answer_has_not_begun_is_a_503_cancelled(gateway_factory, calls):
    gw = gateway_factory(config("--tokens", "400", "--token-delay", "0.02"))
    calls.append(waiting := Call(gw, "slow", stream=False))  # its answer comes whole, in 8 s
    (one,) = wait_for(lambda: [r for r in held(gw) if r["state"] == "running"], 30, what="running")
    gw.api("POST", f"requests/{one['id']}/cancel")
    wait_for(waiting.finished, 30, what="the answer")
    assert waiting.status == 503
    assert json.loads(waiting.body)["error"]["code"] == "cancelled"
    port = gw.records()["slow#0"]["port"]
    wait_for(
        lambda: httpx.get(f"http://127.0.0.1:{port}/debug/stats").json()["cancelled"] == 1,
        30,
        what="the backend saw the cancel",
    )
