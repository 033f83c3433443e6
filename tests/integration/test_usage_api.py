"""SPEC §14 usage and activity endpoints: in-process over a real store with known rows (exact
JSON), then through a real gateway (admin token, shapes, parameter errors, a metered row
showing up)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from corrallm.api.rest import build_rest
from corrallm.config.schema import short_key_name
from corrallm.store import queries
from corrallm.store.activity import Activity, ActivityLog
from corrallm.store.db import Store
from tests.support.processes import fake_cmd, wait_for

T0 = 1_767_225_600  # 2026-01-01T00:00:00Z
DAY = "since=2026-01-01T00:00:00Z&until=2026-01-02T00:00:00Z"
ENDPOINTS = [
    "usage/by-key",
    "usage/by-user",
    "usage/rollup",
    "usage/series",
    "usage/series-by-group",
    "usage/queue-depth",
    "activity",
]
SUMS = {
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "bytes",
    "energy_wh",
    "cost_usd",
    "dwell_ms_avg",
}


@pytest.fixture
async def api(tmp_path):
    store = Store(tmp_path / "corrallm.db")
    await store.open()
    log = ActivityLog(store)
    chat = "/v1/chat/completions"
    rows = [
        Activity(T0 + 60, "load", "alice", "team", "m", "m#0", "load", 200, 9000, 9000,
                 energy_wh=2.5, cost_usd=0.5),
        Activity(T0 + 70, "request", "alice", "team", "m", "m#0", chat, 200, 9000.0, 9500.0,
                 120.5, 12, 34, energy_wh=0.25, cost_usd=0.125, degraded=True,
                 usr="ada@example.com"),
        Activity(T0 + 4000, "request", None, "default", "m", "m#0", chat, 502, 10.0, 5.0,
                 error="backend_error: connection refused"),
    ]  # fmt: skip
    for row in rows:
        log.record(row)
    await log.flush()
    await queries.record_queue_depth(store, T0 + 5, [("m#0", 3, 1)])
    app = build_rest(SimpleNamespace(store=store))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c
    await store.close()


async def test_C4_usage_by_key_and_rollup_answer_the_section_14_shape(api):
    body = (await api.get(f"/api/v1/usage/by-key?{DAY}")).json()
    assert body == {
        "since": "2026-01-01T00:00:00Z",
        "until": "2026-01-02T00:00:00Z",
        "rows": [
            {
                "key": None,
                "group": "default",
                "requests": 1,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "bytes": 0,
                "energy_wh": 0.0,
                "cost_usd": 0.0,
                "dwell_ms_avg": 10.0,
            },
            {
                "key": "alice",
                "group": "team",
                "requests": 1,
                "prompt_tokens": 12,
                "completion_tokens": 34,
                "bytes": 0,
                "energy_wh": 2.75,
                "cost_usd": 0.625,
                "dwell_ms_avg": 9000.0,
            },
        ],
    }
    rollup = (await api.get(f"/api/v1/usage/rollup?{DAY}")).json()["rows"]
    assert [(r["group"], r["model"], r["requests"], r["cost_usd"]) for r in rollup] == [
        ("default", "m", 1, 0.0),
        ("team", "m", 1, 0.625),
    ]
    assert all(set(r) == SUMS | {"group", "model"} for r in rollup)


async def test_T4_usage_by_user_sums_the_rows_that_name_a_user(api):
    body = (await api.get(f"/api/v1/usage/by-user?{DAY}")).json()
    assert body["rows"] == [
        {
            "user": "ada@example.com",
            "key": "alice",
            "requests": 1,
            "prompt_tokens": 12,
            "completion_tokens": 34,
            "bytes": 0,
            "energy_wh": 0.25,  # its own; the load row names no user
            "cost_usd": 0.125,
            "dwell_ms_avg": 9000.0,
        }
    ]
    only = (await api.get(f"/api/v1/activity?{DAY}&user=ada@example.com")).json()["rows"]
    assert [r["id"] for r in only] == [2]


async def test_C4_series_have_aligned_rfc3339_buckets(api):
    body = (await api.get(f"/api/v1/usage/series?{DAY}&bucket=1h")).json()
    assert body["bucket_seconds"] == 3600 and len(body["points"]) == 24
    first, second = body["points"][:2]
    assert first["t"] == "2026-01-01T00:00:00Z" and second["t"] == "2026-01-01T01:00:00Z"
    assert (first["requests"], first["energy_wh"], second["requests"]) == (1, 2.75, 1)
    assert set(first) == SUMS | {"t"}
    default = (await api.get(f"/api/v1/usage/series?{DAY}")).json()
    assert default["bucket_seconds"] == 300 and len(default["points"]) == 288
    grouped = (await api.get(f"/api/v1/usage/series-by-group?{DAY}&bucket=1d")).json()
    assert grouped["bucket_seconds"] == 86400
    assert [(p["t"], p["group"], p["requests"]) for p in grouped["points"]] == [
        ("2026-01-01T00:00:00Z", "default", 1),
        ("2026-01-01T00:00:00Z", "team", 1),
    ]


async def test_C4_queue_depth_points(api):
    body = (await api.get(f"/api/v1/usage/queue-depth?{DAY}&bucket=1m")).json()
    assert body["points"] == [
        {"t": "2026-01-01T00:00:00Z", "backend": "m#0", "waiting": 3, "in_flight": 1}
    ]


async def test_C3_activity_rows_newest_first_with_json_booleans_and_rfc3339(api):
    rows = (await api.get(f"/api/v1/activity?{DAY}")).json()["rows"]
    assert [r["id"] for r in rows] == [3, 2, 1]
    assert rows[1] == {
        "id": 2,
        "t": "2026-01-01T00:01:10Z",
        "kind": "request",
        "key": "alice",
        "group": "team",
        "model": "m",
        "backend": "m#0",
        "endpoint": "/v1/chat/completions",
        "status": 200,
        "dwell_ms": 9000.0,
        "duration_ms": 9500.0,
        "ttfb_ms": 120.5,
        "prompt_tokens": 12,
        "completion_tokens": 34,
        "bytes": 0,
        "energy_wh": 0.25,
        "cost_usd": 0.125,
        "estimated": False,
        "degraded": True,
        "spilled": False,
        "preempted": False,
        "error": None,
        "request_id": None,
        "user": "ada@example.com",
    }
    assert rows[0]["user"] is None and rows[2]["user"] is None
    assert rows[0]["error"] == "backend_error: connection refused" and rows[2]["kind"] == "load"
    only = (await api.get(f"/api/v1/activity?{DAY}&key=alice&limit=1")).json()["rows"]
    assert [r["id"] for r in only] == [2]
    assert (await api.get(f"/api/v1/activity?{DAY}&group=default")).json()["rows"][0]["id"] == 3
    assert (await api.get(f"/api/v1/activity?{DAY}&model=other")).json()["rows"] == []


@pytest.mark.parametrize(
    ("query", "param", "says"),
    [
        ("usage/by-key?since=yesterday", "since", "'since' must be an RFC 3339 time"),
        ("usage/rollup?until=soon", "until", "'until' must be an RFC 3339 time"),
        ("usage/series?since=2h&until=3h", "since", "must be before 'until'"),
        ("usage/series?bucket=fortnight", "bucket", "'bucket' must be a whole number"),
        ("usage/series-by-group?since=30d&bucket=1s", "bucket", "use a bucket of at least"),
        ("usage/queue-depth?bucket=0", "bucket", "from 1 to"),
        ("activity?since=1e400", "since", "'since' must be"),
    ],
)
async def test_C4_bad_parameters_are_400_in_the_openai_shape(api, query, param, says):
    r = await api.get(f"/api/v1/{query}")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["code"] == f"invalid_{param}" and says in error["message"]


@pytest.mark.parametrize("limit", ["0", "10001", "ten"])
async def test_C3_activity_limit_is_1_to_10000(api, limit):
    r = await api.get(f"/api/v1/activity?limit={limit}")
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]


async def test_C3_activity_limit_10000_is_allowed(api):
    assert (await api.get(f"/api/v1/activity?{DAY}&limit=10000")).status_code == 200


# -- through a real gateway -------------------------------------------------------------

CONFIG = f"""
keys: {{ sk-alice: team }}
priorityGroups: {{ team: {{ weight: 1 }} }}
models:
  m:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
"""


def test_C4_usage_endpoints_need_the_admin_token_and_answer_through_a_gateway(gateway_factory):
    gw = gateway_factory(CONFIG)
    for path in ENDPOINTS:
        assert httpx.get(f"{gw.url}/api/v1/{path}").status_code == 401, path
        r = gw.api("GET", path)
        assert r.status_code == 200, (path, r.text)
        body = r.json()
        assert {"since", "until"} <= set(body) and ("rows" in body or "points" in body)
    assert gw.api("GET", "usage/by-key").json()["rows"] == []
    series = gw.api("GET", "usage/series?since=2h").json()
    assert series["bucket_seconds"] == 60 and len(series["points"]) in (120, 121)
    bad = gw.api("GET", "usage/by-key?since=tomorrow")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    assert gw.api("GET", "activity?limit=0").status_code == 400
    spec = httpx.get(
        f"{gw.url}/api/v1/openapi.json", headers={"Authorization": f"Bearer {gw.token}"}
    ).json()
    assert {f"/api/v1/{p}" for p in ENDPOINTS} <= set(spec["paths"])


ALICE = short_key_name("sk-alice")  # T1: a short-form key's name


def test_C3_C4_a_metered_request_shows_in_activity_and_usage(gateway_factory):
    gw = gateway_factory(CONFIG)
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": "Bearer sk-alice"},
        timeout=60,
    )
    assert r.status_code == 200
    usage = r.json()["usage"]

    def requests() -> list[dict]:
        rows = gw.api("GET", f"activity?key={ALICE}").json()["rows"]
        return [row for row in rows if row["kind"] == "request"]

    (row,) = wait_for(requests, 10, what="the request's activity row (batched writer)")
    assert (row["model"], row["group"], row["status"]) == ("m", "team", 200)
    assert row["completion_tokens"] == usage["completion_tokens"]
    by_key = {r["key"]: r for r in gw.api("GET", "usage/by-key").json()["rows"]}
    assert by_key[ALICE]["requests"] == 1  # T1: shown by name, never by secret
    assert by_key[ALICE]["prompt_tokens"] == usage["prompt_tokens"]
    assert "sk-alice" not in str(by_key)
