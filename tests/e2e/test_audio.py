"""SPEC §12 U1-U5 (batch surfaces) end to end with the official openai SDK, against the
fake backend's audio endpoints: uploads held through a cold start and forwarded byte for
byte, speech streamed back, modes gating, metering by bytes, capabilities."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.processes import fake_cmd, wait_for

COLD = fake_cmd("--load-seconds", "0.5")
CONFIG = f"""
costPerKwh: 0.5
commandCosts:
  chat: {{generateWattsPerToken: 0.001}}
  stt: {{modality: audio, processWattsPerByte: 0.001}}
  tts: {{modality: audio, generateWattsPerByte: 0.0001}}
models:
  ears:
    backends:
      - {{cmd: "{COLD}", proxy: "${{PORT}}", type: stt, modes: [batch], model: whisper-up,
         diarization: true}}
  live-ears:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: stt, modes: [realtime]}}]
  voice:
    backends: [{{cmd: "{fake_cmd("--token-delay", "0.01")}", proxy: "${{PORT}}", type: tts}}]
  chat:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}", type: chat}}]
"""
WAV = b"RIFF" + b"\\x00" * 40 + b"fake audio " * 100


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory(CONFIG)


@pytest.fixture
def client(gw) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.v1, api_key="k", max_retries=0, timeout=30) as sdk:
        yield sdk


def test_U2_transcription_upload_is_held_through_a_cold_start_and_forwarded_whole(gw, client):
    result = client.audio.transcriptions.create(model="ears", file=("clip.wav", WAV, "audio/wav"))
    assert "fake transcript" in result.text
    text = client.audio.transcriptions.create(
        model="ears", file=("clip.wav", WAV, "audio/wav"), response_format="text"
    )
    assert "fake transcript" in str(text)
    seen = gw.upstream("GET", "ears/debug/requests").json()
    upload = next(q for q in seen if q["path"] == "/v1/audio/transcriptions")
    headers = {k.lower(): v for k, v in upload["headers"].items()}
    assert headers["content-type"].startswith("multipart/form-data; boundary=")
    assert "authorization" not in headers  # the caller's key stays with corrallm
    assert upload["body"] is None  # still the multipart upload, not re-encoded as JSON


def test_U2_speech_is_streamed_back_as_audio(client):
    with client.audio.speech.with_streaming_response.create(
        model="voice", voice="alloy", input="one two three four"
    ) as response:
        assert response.headers["content-type"] == "audio/wav"
        audio = b"".join(response.iter_bytes())
    assert audio.startswith(b"RIFF") and len(audio) == 44 + 4 * 3200


def test_U3_modes_gate_each_surface(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.audio.transcriptions.create(model="live-ears", file=("a.wav", WAV, "audio/wav"))
    assert "modes are realtime" in refused.value.message


def test_U1_audio_models_are_listed_with_their_modality_and_metered_by_bytes(gw, client):
    models = {m["id"]: m for m in httpx.get(gw.v1 + "/models").json()["data"]}
    assert models["ears"]["modality"] == "audio" and models["chat"]["modality"] == "text"
    client.audio.transcriptions.create(model="ears", file=("clip.wav", WAV, "audio/wav"))

    def row():
        db = sqlite3.connect(f"file:{gw.home / 'corrallm.db'}?mode=ro", uri=True)
        try:
            return db.execute(
                "SELECT bytes, energy_wh FROM activity WHERE model = 'ears' AND kind = 'request'"
            ).fetchone()
        finally:
            db.close()

    sent_bytes, energy = wait_for(row, 10, what="the transcription's activity row")
    assert sent_bytes > len(WAV) and energy > 0


def test_U5_capabilities_list_endpoints_models_examples_and_the_diarized_shape(gw):
    caps = httpx.get(gw.v1 + "/capabilities").json()
    by_path = {e["path"]: e for e in caps["endpoints"]}
    assert by_path["/v1/audio/transcriptions"]["models"] == ["ears"]  # mode filtered
    assert "-F model=ears -F file=@" in by_path["/v1/audio/transcriptions"]["example"]
    assert by_path["/v1/chat/completions"]["models"] == ["chat"]
    assert by_path["/v1/audio/speech"]["models"] == ["voice"]
    assert caps["modes"] == {"ears": ["batch"], "live-ears": ["realtime"]}
    assert (
        by_path["/v1/realtime"]["models"] == ["live-ears"] and by_path["/v1/realtime"]["websocket"]
    )
    assert "ws://" in by_path["/v1/realtime"]["example"]
    assert set(caps["diarized_response_shape"]) == {"text", "segments", "num_speakers"}
    assert caps["diarizing_models"] == ["ears"]  # the `diarization` key is not ignored
