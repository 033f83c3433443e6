"""SPEC §10 P3-P5 and §14: one service layer behind REST, GraphQL and the live SSE
events; every REST endpoint has its GraphQL twin; all of it behind the admin token."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import orjson
import pytest

from tests.support.processes import fake_cmd

CONFIG = f"""
servers: {{box: {{pools: {{gpu0: 8GB}}}}}}
extensions:
  shared: {{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}
models:
  m:
    backends:
      - cmd: "{fake_cmd("--load-seconds", "0.3")}"
        proxy: ${{PORT}}
        ramUsage: {{gpu0: 1GB}}
  hosted: {{backends: [{{extension: shared}}]}}
"""

NOT_GRAPHQL = {"GET /api/v1/events"}  # a live stream: SSE is its one surface


def graphql(gw, query: str, token: str | None = "auto") -> httpx.Response:
    token = gw.token if token == "auto" else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(gw.url + "/api/graphql", json={"query": query}, headers=headers, timeout=60)


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(CONFIG)


def test_P5_every_rest_endpoint_has_its_graphql_twin(gw):
    paths = gw.api("GET", "openapi.json").json()["paths"]
    rest = {
        f"{method.upper()} {path}"
        for path, methods in paths.items()
        for method in methods
        if path not in ("/api/v1/openapi.json", "/api/v1/docs")
    }
    introspection = graphql(
        gw,
        "{ __schema { queryType { fields { name description } } "
        "mutationType { fields { name description } } } }",
    ).json()["data"]["__schema"]
    twins = {
        f["description"]: f["name"]
        for kind in ("queryType", "mutationType")
        for f in introspection[kind]["fields"]
    }
    missing = sorted(rest - NOT_GRAPHQL - set(twins))
    assert not missing, f"REST endpoints without a GraphQL twin: {missing}"
    assert len(rest) >= 20  # the whole §3 management surface


def test_P5_rest_and_graphql_answer_with_the_same_data(gw):
    assert gw.api("POST", "models/load", {"model": "m"}).status_code == 200
    rest = gw.api("GET", "overview").json()
    data = graphql(
        gw,
        "{ overview { models { name state persistent backends { id state maxConcurrent pid nCtx } }"
        " servers { name pools } } }",
    ).json()["data"]["overview"]
    assert [(m["name"], m["state"]) for m in data["models"]] == [
        (m["name"], m["state"]) for m in rest["models"]
    ]
    rest_b, gql_b = rest["models"][0]["backends"][0], data["models"][0]["backends"][0]
    assert (gql_b["id"], gql_b["pid"], gql_b["maxConcurrent"], gql_b["nCtx"]) == (
        rest_b["id"],
        rest_b["pid"],
        rest_b["max_concurrent"],
        rest_b["n_ctx"],
    )
    assert data["servers"][0]["pools"] == rest["servers"][0]["pools"]


def test_P5_graphql_actions_and_errors_come_from_the_same_services(gw):
    paused = graphql(gw, 'mutation { pauseModel(model: "m", until: "1h") { paused pausedUntil } }')
    assert paused.json()["data"]["pauseModel"]["paused"] is True
    rest = gw.api("GET", "overview").json()["models"][0]
    assert rest["paused"] is True
    refused = graphql(gw, 'mutation { loadModel(model: "m") { state } }').json()
    assert refused["errors"][0]["extensions"] == {"code": "paused", "status": 423}
    unknown = graphql(gw, 'mutation { unpauseModel(model: "nope") { paused } }').json()
    assert unknown["errors"][0]["extensions"]["code"] == "model_not_found"
    assert "nope" in unknown["errors"][0]["message"]


def test_P3_graphql_and_events_need_the_admin_token(gw):
    assert graphql(gw, "{ lanes { lanes { name } } }", token=None).status_code == 401
    assert graphql(gw, "{ lanes { lanes { name } } }", token="wrong").status_code == 401
    assert httpx.get(gw.url + "/api/v1/events", timeout=10).status_code == 401


def test_P4_events_deliver_a_ready_transition_within_a_second(gw):
    received: list[tuple[float, dict]] = []
    subscribed = threading.Event()
    done = threading.Event()

    def listen() -> None:
        headers = {"Authorization": f"Bearer {gw.token}"}
        with httpx.stream(
            "GET", gw.url + "/api/v1/events?kinds=lifecycle,log", headers=headers, timeout=30
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            event = ""
            for line in r.iter_lines():
                if line.startswith(": connected"):
                    subscribed.set()
                if line.startswith("event: "):
                    event = line[7:]
                if line.startswith("data: ") and event == "lifecycle":
                    data = orjson.loads(line[6:])
                    received.append((time.time(), data))
                    if data["new"] == "ready":
                        done.set()
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert subscribed.wait(10)
    assert gw.api("POST", "models/load", {"model": "m"}).status_code == 200
    assert done.wait(10)
    arrived, ready = received[-1]
    assert (ready["backend"], ready["models"], ready["old"]) == ("m#0", ["m"], "starting")
    assert arrived - ready["t"] < 1.0  # delivered within a second of the transition
    assert [d["new"] for _, d in received] == ["starting", "ready"]


def test_P5_dump_graphql_prints_the_sdl():
    out = subprocess.run(
        [sys.executable, "-m", "corrallm", "dump-graphql"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "type Query {" in out.stdout and "type Mutation {" in out.stdout
    assert "pauseModel(model: String!, until: String = null): PauseResult!" in out.stdout
