"""Reference text-to-speech backend: OpenAI's `POST /v1/audio/speech` on espeak-ng
(Debian's `espeak-ng` package; its voices ship with it, nothing is downloaded).

    python examples/audio/tts_server.py --port 8301

Audio is streamed as espeak-ng produces it: `wav` (16-bit mono, 22,050 Hz, a streaming
header) or `pcm` (raw 16-bit little-endian mono at 24 kHz, as OpenAI's `pcm`). OpenAI's
voice names map to espeak-ng voices; any espeak-ng voice name (`en-gb`, `en-us+f3`) works
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import uvicorn
from openai_shapes import ApiError, arguments, service
from speech import Resampler
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

ESPEAK_RATE = 22050
PCM_RATE = 24000
WAV_HEADER = 44
MAX_INPUT = 4096  # characters, as OpenAI
# OpenAI's voices as espeak-ng voices: distinct pitch and timbre, male and female.
VOICES = {
    "alloy": ("en-us", 50),
    "ash": ("en-us+m3", 40),
    "ballad": ("en-gb+m2", 45),
    "coral": ("en-us+f3", 55),
    "echo": ("en-us+m7", 45),
    "fable": ("en-gb", 50),
    "onyx": ("en-us+m1", 25),
    "nova": ("en-us+f2", 65),
    "sage": ("en-us+f4", 55),
    "shimmer": ("en-us+f5", 70),
    "verse": ("en-us+m4", 50),
}
FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}


class Speaker:
    def __init__(self, espeak: str, model: str) -> None:
        self.espeak, self.model = espeak, model
        self.voices: set[str] = set()

    @property
    def ready(self) -> bool:
        return bool(self.voices)

    async def start(self) -> None:
        """The installed voice names, so a wrong voice is a 400 naming the choices."""
        proc = await asyncio.create_subprocess_exec(
            self.espeak, "--voices=en", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        for line in out.decode(errors="replace").splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 4:
                self.voices.update({parts[1], parts[3]})

    def command(self, body: dict[str, Any]) -> tuple[list[str], str]:
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "'input' must be the text to speak (a non-empty string).", "input")
        if len(text) > MAX_INPUT:
            raise ApiError(400, f"'input' is {len(text)} characters; at most {MAX_INPUT}.", "input")
        fmt = body.get("response_format") or "wav"
        if fmt not in FORMATS:
            raise ApiError(
                400,
                f"response_format {fmt!r} is not produced here; ask for 'wav' or 'pcm' "
                "(this espeak-ng backend has no mp3/opus/aac/flac encoder).",
                "response_format",
            )
        speed = body.get("speed", 1.0)
        if not isinstance(speed, int | float) or not 0.25 <= speed <= 4.0:
            raise ApiError(400, "'speed' must be a number from 0.25 to 4.0.", "speed")
        name = body.get("voice") or "alloy"
        if isinstance(name, dict):  # OpenAI's custom-voice object: {"id": ...}
            name = name.get("id", "")
        base = str(name).split("+")[0]
        if name in VOICES:
            voice, pitch = VOICES[name]
        elif base in self.voices:
            voice, pitch = str(name), 50
        else:
            raise ApiError(
                400,
                f"Unknown voice {name!r}. Use one of {', '.join(VOICES)} or an espeak-ng "
                "voice such as en-gb or en-us+f3.",
                "voice",
            )
        words_per_minute = int(min(450, max(80, 160 * speed)))
        cmd = [self.espeak, "-b", "1", "-v", voice, "-p", str(pitch), "-s", str(words_per_minute)]
        return [*cmd, "--stdout"], fmt


async def speech(request: Request) -> Response:
    speaker: Speaker = request.app.state.engine
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, 'The body must be JSON: {"model", "input", "voice"}.') from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.")
    cmd, fmt = speaker.command(body)
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    proc.stdin.write(body["input"].encode())
    proc.stdin.close()
    return StreamingResponse(_audio(proc, fmt), media_type=FORMATS[fmt])


async def _audio(proc: asyncio.subprocess.Process, fmt: str) -> AsyncIterator[bytes]:
    """espeak-ng's output as it comes; the process is killed if the client goes away."""
    assert proc.stdout is not None
    resampler = Resampler(ESPEAK_RATE, PCM_RATE)
    skip, odd = (WAV_HEADER if fmt == "pcm" else 0), b""
    try:
        while chunk := await proc.stdout.read(8192):
            if fmt == "wav":
                yield chunk
                continue
            chunk, skip = chunk[skip:], max(0, skip - len(chunk))
            data = odd + chunk
            odd = data[len(data) // 2 * 2 :]
            samples = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2")
            if len(samples):
                yield resampler.feed(samples).astype("<i2").tobytes()
        await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def build(espeak: str, model: str) -> Starlette:
    return service(Speaker(espeak, model), [Route("/v1/audio/speech", speech, methods=["POST"])])


def main() -> None:
    parser = arguments("OpenAI /v1/audio/speech on espeak-ng", "espeak-ng")
    parser.add_argument("--espeak", default="espeak-ng", help="the espeak-ng executable")
    args = parser.parse_args()
    espeak = shutil.which(args.espeak)
    if espeak is None:
        sys.exit(f"{args.espeak} not found: install it (Debian: apt-get install espeak-ng)")
    uvicorn.run(build(espeak, args.model_name), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
