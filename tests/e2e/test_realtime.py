"""SPEC §12 U2/U3: the realtime transcription WebSocket relayed through corrallm: model from
the query or the first session.update, the upgrade held through a cold start, deltas and a
final transcript, modes gating, one slot per session, 1013 when saturated, idle reaping."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest
import websockets

from tests.support.processes import fake_cmd, wait_for

LIVE = fake_cmd("--load-seconds", "0.5")
CONFIG = f"""
realtime: {{idleTimeout: 2s, maxDuration: 1h}}
priorityGroups: {{strict: {{onSaturated: reject}}}}
keys: {{skey: strict}}
commandCosts:
  stt: {{modality: audio, processWattsPerByte: 0.000001}}
models:
  live:
    backends:
      - {{cmd: "{LIVE}", proxy: "${{PORT}}", type: stt, maxConcurrent: 1}}
  batch-only:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, modes: [batch]}}]
"""
AUDIO = base64.b64encode(bytes(1600)).decode()


@pytest.fixture
def ws_url(gateway_factory) -> str:
    gw = gateway_factory(CONFIG)
    return gw.url.replace("http://", "ws://") + "/v1/realtime"


async def transcribe(ws) -> tuple[list[str], str]:
    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": AUDIO}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    deltas = []
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if event["type"].endswith("transcription.delta"):
            deltas.append(event["delta"])
        if event["type"].endswith("transcription.completed"):
            return deltas, event["transcript"]


async def test_U2_realtime_by_query_parameter_held_through_a_cold_start(ws_url):
    async with websockets.connect(ws_url + "?model=live") as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert created["type"] == "transcription_session.created"
        deltas, transcript = await transcribe(ws)
    assert deltas == ["heard ", "1600 ", "bytes "] and transcript == "heard 1600 bytes"


async def test_U2_realtime_model_from_the_first_session_update(ws_url):
    async with websockets.connect(ws_url) as ws:
        update = {"type": "transcription_session.update", "session": {"model": "live"}}
        await ws.send(json.dumps(update))
        kinds = [json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] for _ in range(2)]
        assert kinds == ["transcription_session.created", "transcription_session.updated"]
        _, transcript = await transcribe(ws)
    assert transcript == "heard 1600 bytes"


async def test_U3_T5_a_batch_only_model_is_refused_on_realtime_before_the_upgrade(ws_url):
    assert await upgrade_refusal(ws_url + "?model=batch-only") == (404, "model_not_found")


async def test_U2_one_slot_per_session_a_second_is_closed_1013_and_idle_sessions_reaped(ws_url):
    async with websockets.connect(ws_url + "?model=live") as first:
        await asyncio.wait_for(first.recv(), 10)
        strict = {"Authorization": "Bearer skey"}  # a lane that rejects when saturated
        async with websockets.connect(ws_url, additional_headers=strict) as second:
            await second.send(json.dumps({"type": "session.update", "session": {"model": "live"}}))
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                await asyncio.wait_for(second.recv(), 30)
            assert closed.value.rcvd.code == 1013 and "retry after" in closed.value.rcvd.reason
        # The first, left idle past realtime.idleTimeout (2 s), is reaped.
        with pytest.raises(websockets.exceptions.ConnectionClosed) as reaped:
            while True:
                await asyncio.wait_for(first.recv(), 10)
        assert reaped.value.rcvd.code == 1000 and "idle" in reaped.value.rcvd.reason


# -- a session is a request like any other (one pipeline, issue 13) ----------------------
# It counts in flight on its backend for its whole life, so neither the ttl reaper nor an
# eviction takes the backend from under it and an unload drains it; and it passes the
# same gates: requireKeys, the lane's spendLimit, a pause.


def box_config(ttl: str | None = None) -> str:
    """`kept` (a realtime model) and `other` (chat) each need 6 of the box's 10GB."""
    sticky = f"sticky: {{ttl: {ttl}}}, " if ttl else ""
    box = 'proxy: "${PORT}", server: box, ramUsage: {ram: 6GB}'
    return f"""
realtime: {{idleTimeout: 60s, maxDuration: 1h}}
scheduler: {{maxWait: 30s}}
servers: {{box: {{pools: {{ram: 10GB}}}}}}
commandCosts: {{stt: {{modality: audio}}, chat: {{}}}}
models:
  kept: {{{sticky}backends: [{{cmd: "{LIVE}", type: stt, {box}}}]}}
  other: {{backends: [{{cmd: "{fake_cmd()}", {box}}}]}}
"""


def ws_of(gw) -> str:
    return gw.url.replace("http://", "ws://") + "/v1/realtime"


async def until(condition, seconds: float = 20.0, what: str = ""):
    """Wait for `condition` (a blocking check) off the event loop, with a deadline."""
    return await asyncio.to_thread(wait_for, condition, seconds, 0.05, what)


def states_during(gw, backend: str, seconds: float) -> list[str]:
    """Every state the backend showed over a window of `seconds` (sampled, in order)."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = gw.state(backend)
        if not seen or seen[-1] != state:
            seen.append(state)
        time.sleep(0.05)
    return seen


def resident_in_flight(gw, backend: str) -> int | None:
    for server in gw.api("GET", "residency").json()["servers"]:
        for resident in server["residents"]:
            if resident["backend"] == backend:
                return int(resident["in_flight"])
    return None


async def heard(ws) -> str:
    """The transcript of one utterance, or how the session was closed instead."""
    try:
        return (await transcribe(ws))[1]
    except websockets.exceptions.ConnectionClosed as closed:
        return f"closed: {closed.rcvd.code if closed.rcvd else None}"


async def refusal(ws, model: str) -> tuple[int, str] | str:
    """Name the model in a first session.update; the close code and reason it gets (or
    what was served instead)."""
    await ws.send(json.dumps({"type": "session.update", "session": {"model": model}}))
    try:
        event = json.loads(await asyncio.wait_for(ws.recv(), 15))
    except websockets.exceptions.ConnectionClosed as closed:
        assert closed.rcvd is not None
        return closed.rcvd.code, closed.rcvd.reason
    return f"served: {event['type']}"


async def upgrade_refusal(url: str, key: str | None = None) -> tuple[int, str | None]:
    """T5: the HTTP status and error code of an upgrade refused before it was accepted
    (101 and None when the session was opened)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with websockets.connect(url, additional_headers=headers, open_timeout=15):
            return 101, None
    except websockets.exceptions.InvalidStatus as refused:
        response = refused.response
        assert response.headers["content-type"] == "application/json"
        return response.status_code, json.loads(response.body)["error"]["code"]


async def upgrade_status(url: str, key: str | None = None) -> int:
    """The HTTP status of the upgrade (101 when the session was opened)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with websockets.connect(url, additional_headers=headers, open_timeout=15):
            return 101
    except websockets.exceptions.InvalidStatus as refused:
        return refused.response.status_code


async def test_U2_R4_a_live_session_counts_in_flight_so_the_ttl_reaper_keeps_its_backend(
    gateway_factory,
):
    gw = gateway_factory(box_config(ttl="1s"))
    async with websockets.connect(ws_of(gw) + "?model=kept") as ws:
        await asyncio.wait_for(ws.recv(), 10)  # created: the backend is ready
        counted = await asyncio.to_thread(
            lambda: (gw.overview_backend("kept#0")["in_flight"], resident_in_flight(gw, "kept#0"))
        )
        # The session outlives the ttl (1 s) and two turns of the reaper (every 1 s).
        during = await asyncio.to_thread(states_during, gw, "kept#0", 3.5)
        transcript = await heard(ws)
    # Ended, the session no longer holds it: the ttl unloads it.
    await until(lambda: gw.state("kept#0") == "stopped", 15, "ttl unload after the session")
    assert [counted, during, transcript] == [(1, 1), ["ready"], "heard 1600 bytes"]


async def test_R2_a_live_session_is_not_evicted_by_another_models_cold_start(gateway_factory):
    gw = gateway_factory(box_config())
    async with websockets.connect(ws_of(gw) + "?model=kept") as ws:
        await asyncio.wait_for(ws.recv(), 10)
        body = {"model": "other", "messages": [{"role": "user", "content": "hi"}]}
        cold = asyncio.create_task(
            asyncio.to_thread(httpx.post, gw.v1 + "/chat/completions", json=body, timeout=60)
        )
        # `other` needs kept's memory: it waits for room (maxWait 30 s) while the session is live.
        await until(lambda: gw.state("other#0") != "stopped", 15, "other's cold start")
        during = await asyncio.to_thread(states_during, gw, "kept#0", 1.5)
        transcript = await heard(ws)
    response = await asyncio.wait_for(cold, 60)  # the session ended: kept makes room now
    after = await asyncio.to_thread(gw.state, "kept#0")
    assert [during, transcript, response.status_code, after] == [
        ["ready"],
        "heard 1600 bytes",
        200,
        "stopped",
    ]


async def test_L4_an_unload_drains_a_live_session_before_stopping_its_backend(gateway_factory):
    gw = gateway_factory(box_config())
    async with websockets.connect(ws_of(gw) + "?model=kept") as ws:
        await asyncio.wait_for(ws.recv(), 10)
        unload = asyncio.create_task(
            asyncio.to_thread(gw.api, "POST", "models/unload", {"model": "kept"})
        )
        draining = await until(
            lambda: (state := gw.state("kept#0")) != "ready" and state, 15, "the unload"
        )
        transcript = await heard(ws)  # the session goes on while it drains
    response = await asyncio.wait_for(unload, 60)
    assert [draining, transcript, response.status_code, response.json()["state"]] == [
        "draining",
        "heard 1600 bytes",
        200,
        "stopped",
    ]


KEYS_CONFIG = f"""
scheduler: {{requireKeys: true}}
priorityGroups: {{team: {{}}}}
keys: {{good: team}}
commandCosts: {{stt: {{modality: audio}}}}
models:
  live: {{backends: [{{cmd: "{LIVE}", proxy: "${{PORT}}", type: stt}}]}}
"""


async def test_S1_T5_realtime_honours_require_keys_before_the_upgrade(gateway_factory):
    url = ws_of(gateway_factory(KEYS_CONFIG))
    # T5: the key is judged from the head, with or without a model named: an HTTP 401.
    without_model = await upgrade_refusal(url, "nope")
    with_model = await upgrade_refusal(url + "?model=live", "nope")
    anonymous = await upgrade_refusal(url + "?model=live")
    async with websockets.connect(
        url + "?model=live", additional_headers={"X-Corrallm-Key": "good"}
    ) as ws:
        served = json.loads(await asyncio.wait_for(ws.recv(), 10))["type"]
    assert [without_model, with_model, anonymous, served] == [
        (401, "invalid_api_key"),
        (401, "invalid_api_key"),
        (401, "invalid_api_key"),
        "transcription_session.created",
    ]


SPEND_CONFIG = f"""
costPerKwh: 1.0
priorityGroups: {{capped: {{spendLimit: {{usd: 0.000001, window: 1h}}}}}}
keys: {{ckey: capped}}
commandCosts: {{stt: {{modality: audio, processWattsPerByte: 0.001}}}}
models:
  live: {{backends: [{{cmd: "{LIVE}", proxy: "${{PORT}}", type: stt}}]}}
"""


def spent(gw, lane: str) -> float:
    lanes = {row["name"]: row for row in gw.api("GET", "lanes").json()["lanes"]}
    return float(lanes[lane]["spend_usd_window"])


async def test_S6_realtime_honours_the_lanes_spend_limit(gateway_factory):
    gw = gateway_factory(SPEND_CONFIG)
    key = {"Authorization": "Bearer ckey"}
    async with websockets.connect(ws_of(gw) + "?model=live", additional_headers=key) as ws:
        await asyncio.wait_for(ws.recv(), 10)
        await transcribe(ws)  # ~2 kB in at 1 mWh a byte: about $0.002, over the $0.000001
    await until(lambda: spent(gw, "capped") > 0.000001, 15, "the first session's cost settled")
    async with websockets.connect(ws_of(gw), additional_headers=key) as ws:
        refused = await refusal(ws, "live")
    before_upgrade = await upgrade_refusal(ws_of(gw) + "?model=live", "ckey")
    code, reason = refused if isinstance(refused, tuple) else (0, refused)
    assert [code, reason.startswith("spend_limit: retry after"), before_upgrade] == [
        1013,
        True,
        (429, "spend_limit"),
    ]


async def test_P1_F3_realtime_refuses_a_paused_model_and_serves_it_once_unpaused(
    gateway_factory, fake_backend
):
    # A pure proxy: no process to pause, so only the pipeline's pause gate can refuse it.
    gw = gateway_factory(
        f"""
commandCosts: {{stt: {{modality: audio}}}}
models:
  remote: {{backends: [{{proxy: "{fake_backend.url}", type: stt}}]}}
"""
    )
    paused = await asyncio.to_thread(gw.api, "POST", "models/pause", {"model": "remote"})
    async with websockets.connect(ws_of(gw)) as ws:
        refused = await refusal(ws, "remote")
    before_upgrade = await upgrade_refusal(ws_of(gw) + "?model=remote")
    await asyncio.to_thread(gw.api, "POST", "models/unpause", {"model": "remote"})
    after_unpause = await upgrade_status(ws_of(gw) + "?model=remote")
    code, reason = refused if isinstance(refused, tuple) else (0, refused)
    # F3: a pause is a decision, not congestion: 1008 (refused), not 1013 (try again).
    assert [paused.status_code, code, "paused" in reason, before_upgrade, after_unpause] == [
        200,
        1008,
        True,
        (503, "paused"),
        101,
    ]


async def test_T5_realtime_unknown_models_are_refused_before_the_upgrade(ws_url):
    assert await upgrade_refusal(ws_url + "?model=" + "n" * 300) == (404, "model_not_found")
    assert await upgrade_refusal(ws_url + "?model=live", "skey") == (101, None)


SILENT_CONFIG = f"""
realtime: {{idleTimeout: 60s, maxDuration: 1h}}
commandCosts: {{stt: {{modality: audio}}}}
models:
  live: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, maxConcurrent: 2}}]}}
"""


async def test_T5_a_session_that_sends_no_event_within_10s_is_closed_1008(gateway_factory):
    url = ws_of(gateway_factory(SILENT_CONFIG))

    async def silent(model: str | None) -> tuple[int, str, float]:
        async with websockets.connect(url + (f"?model={model}" if model else "")) as ws:
            opened = time.monotonic()
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                while True:  # the backend's `created` event may come; the client says nothing
                    await asyncio.wait_for(ws.recv(), 20)
            assert closed.value.rcvd is not None
            return closed.value.rcvd.code, closed.value.rcvd.reason, time.monotonic() - opened

    named, unnamed = await asyncio.gather(silent("live"), silent(None))
    for code, reason, after in (named, unnamed):
        assert (code, reason) == (1008, "no event within 10s of the upgrade")
        assert 9.5 <= after <= 13  # not the idleTimeout (60 s)
