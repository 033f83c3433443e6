"""SPEC §12 U2/U3: the realtime transcription WebSocket relayed through corrallm: model from
the query or the first session.update, the upgrade held through a cold start, deltas and a
final transcript, modes gating, one slot per session, 1013 when saturated, idle reaping."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import websockets

from tests.support.processes import fake_cmd

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


async def test_U3_a_batch_only_model_is_refused_on_realtime(ws_url):
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        async with websockets.connect(ws_url + "?model=batch-only"):
            pass
    assert refused.value.response.status_code == 403


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
