"""How well and how fast the offline reference audio backends (examples/audio) do, and what
corrallm adds in front of them.

Starts the espeak-ng TTS backend, the PocketSphinx STT backend (digits vocabulary) and
corrallm with both as pure-proxy models in front of the same processes, then for each
voice synthesizes seeded random digit strings and transcribes them back, both straight
to the backend and through corrallm. Prints the word error rate per voice, the decode
real-time factor (seconds decoding per second of audio) and the per-request time through
corrallm as a ratio of direct.

    .venv/bin/python bench/audio_reference.py [--clips 20] [--length 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import free_port, kill_group, running_gateway, wait_for  # noqa: E402
from tests.support.speech import word_error_rate  # noqa: E402

VOICES = ["alloy", "nova", "onyx", "coral", "fable", "shimmer"]
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
EXAMPLES = ROOT / "examples" / "audio"
CONFIG = """
commandCosts:
  stt: {{modality: audio, processWattsPerByte: 0.000001}}
  tts: {{modality: audio, generateWattsPerByte: 0.000001}}
models:
  digits: {{backends: [{{proxy: {digits}, type: stt}}]}}
  voices: {{backends: [{{proxy: {voices}, type: tts}}]}}
"""


def start(script: str, port: int, *flags: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(EXAMPLES / script), "--port", str(port), *flags]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 30, what=f"{script} healthy")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=20, help="digit strings per voice")
    parser.add_argument("--length", type=int, default=6, help="digits per string")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ports = {"digits": free_port(), "voices": free_port()}
    procs = [
        start("stt_server.py", ports["digits"], "--vocabulary", "digits"),
        start("tts_server.py", ports["voices"]),
    ]
    try:
        summary, rows = measure(args, ports)
    finally:
        for proc in procs:
            kill_group(proc.pid)
            proc.wait(10)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{'voice':10} {'clips':>5} {'WER':>6} {'exact':>6} {'decode RTF':>10}")
    for r in rows:
        print(f"{r['voice']:10} {r['clips']:5} {r['wer']:6.3f} {r['exact']:6} {r['rtf']:10.3f}")
    print(f"all voices: WER {summary['wer_all']:.3f}")
    print(
        f"transcription request median: direct {summary['median_ms_direct']} ms, through "
        f"corrallm {summary['median_ms_corrallm']} ms ({summary['corrallm_over_direct']:.3f}x)"
    )


def measure(args: argparse.Namespace, ports: dict[str, int]) -> tuple[dict[str, Any], list[Any]]:
    rng = random.Random(1)
    config = CONFIG.format(**ports)
    with tempfile.TemporaryDirectory() as tmp, running_gateway(config, Path(tmp)) as gw:
        http = httpx.Client(timeout=60)
        direct = {b: f"http://127.0.0.1:{p}/v1" for b, p in ports.items()}
        rows, via_direct, via_gateway = [], [], []
        for voice in VOICES:
            pairs, decode, audio_seconds = [], 0.0, 0.0
            for _ in range(args.clips):
                said = " ".join(rng.choice(DIGITS) for _ in range(args.length))
                wav = speak(http, direct["voices"], said, voice)
                audio_seconds += (len(wav) - 44) / 2 / 22050
                for base, times in ((direct["digits"], via_direct), (gw.v1, via_gateway)):
                    started = time.perf_counter()
                    reply = http.post(
                        base + "/audio/transcriptions",
                        data={"model": "digits"},
                        files={"file": ("d.wav", wav, "audio/wav")},
                    )
                    times.append(time.perf_counter() - started)
                reply.raise_for_status()
                decode += float(reply.headers["x-decode-seconds"])
                pairs.append((said, reply.json()["text"]))
            rows.append(
                {
                    "voice": voice,
                    "clips": len(pairs),
                    "wer": round(word_error_rate(pairs), 3),
                    "exact": sum(a == b for a, b in pairs),
                    "rtf": round(decode / audio_seconds, 3),
                }
            )
        total = word_error_rate_of(rows)
        overhead = statistics.median(via_gateway) / statistics.median(via_direct)
        summary = {
            "rows": rows,
            "wer_all": total,
            "median_ms_direct": round(1000 * statistics.median(via_direct), 1),
            "median_ms_corrallm": round(1000 * statistics.median(via_gateway), 1),
            "corrallm_over_direct": round(overhead, 3),
        }
        http.close()
    return summary, rows


def word_error_rate_of(rows: list[dict[str, float]]) -> float:
    words = sum(r["clips"] for r in rows)
    return round(sum(r["wer"] * r["clips"] for r in rows) / max(1, words), 3)


def speak(http: httpx.Client, base: str, text: str, voice: str) -> bytes:
    reply = http.post(
        base + "/audio/speech", json={"model": "voices", "input": text, "voice": voice}
    )
    reply.raise_for_status()
    return reply.content


if __name__ == "__main__":
    main()
