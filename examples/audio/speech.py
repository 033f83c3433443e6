"""What the reference audio backends share: WAV in and out, resampling, speech/silence
segmentation, and the PocketSphinx recognizer (its en-us model ships inside the PyPI wheel,
so nothing is downloaded).

Audio is handled as mono int16 NumPy arrays with their sample rate.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np

# The recognizer's vocabularies. `digits` is a grammar of the ten digits, which the small
# offline acoustic model recognizes far better than open English (word error rate about
# 0.1 against about 0.8 on synthesized digit strings); `general` is the wheel's en-us
# language model.
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DIGITS_JSGF = "#JSGF V1.0;\ngrammar digits;\npublic <digits> = ( " + " | ".join(DIGITS) + " )+ ;\n"
VOCABULARIES = ("digits", "general")
FRAME_SECONDS = 0.02
# Synthesized or gated audio has runs of exact digital silence, which upset the cepstral
# mean normalization: a faint seeded noise floor (-60 dBFS) is added before decoding, the
# same for every decode of the same clip. PocketSphinx's own dither does the same job but
# from a generator that runs on across utterances, so a clip's transcript would depend on
# what was decoded before it. (Digits at -60 dBFS: word error rate 0.03; none: 0.17.)
NOISE_FLOOR = 32.0


class AudioError(ValueError):
    """Input audio this backend cannot read; its message says what it takes instead."""


@dataclass(frozen=True)
class Audio:
    samples: np.ndarray  # int16, mono
    rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate

    def slice(self, start: float, end: float) -> Audio:
        return Audio(self.samples[int(start * self.rate) : int(end * self.rate)], self.rate)


def read_wav(data: bytes) -> Audio:
    """A RIFF/WAVE file of 16-bit PCM (or 8-bit, or 32-bit float), any rate, mixed to mono.

    Streamed WAVs (espeak-ng's `--stdout`, OpenAI's `wav` speech) carry placeholder sizes of
    0x7fffffff/0xffffffff, so a data chunk runs to the end of what arrived."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioError("the file is not a WAV (RIFF/WAVE) file; send 16-bit PCM WAV audio")
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8 : pos + 8 + size]
        if chunk == b"fmt ":
            fmt = struct.unpack_from("<HHIIHH", body)
        elif chunk == b"data":
            if fmt is None:
                raise AudioError("the WAV file has its data before its format chunk")
            return _decode_pcm(body, *fmt)
        pos += 8 + size + (size & 1)
    raise AudioError("the WAV file has no data chunk")


def _decode_pcm(
    body: bytes, tag: int, channels: int, rate: int, _bps: int, _align: int, bits: int
) -> Audio:
    if tag == 1 and bits == 16:
        x = np.frombuffer(body[: len(body) // 2 * 2], dtype="<i2").astype(np.float32)
    elif tag == 1 and bits == 8:
        x = (np.frombuffer(body, dtype=np.uint8).astype(np.float32) - 128) * 256
    elif tag == 3 and bits == 32:
        x = np.frombuffer(body[: len(body) // 4 * 4], dtype="<f4") * 32767
    else:
        raise AudioError(f"WAV encoding {tag} at {bits} bits is not supported; send 16-bit PCM WAV")
    if not 8000 <= rate <= 48000:
        raise AudioError(f"a sample rate of {rate} Hz is not supported; use 8 to 48 kHz")
    if channels > 1:
        x = x[: len(x) // channels * channels].reshape(-1, channels).mean(axis=1)
    return Audio(np.clip(x, -32768, 32767).astype(np.int16), rate)


def wav_header(rate: int, data_bytes: int = 0xFFFFFFFF - 36) -> bytes:
    """A 16-bit mono WAV header; the default size is the streaming placeholder."""
    return (
        b"RIFF"
        + struct.pack("<I", min(data_bytes + 36, 0xFFFFFFFF))
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def write_wav(audio: Audio) -> bytes:
    pcm = audio.samples.astype("<i2").tobytes()
    return wav_header(audio.rate, len(pcm)) + pcm


class Resampler:
    """Streaming linear-interpolation resampler: chunks in, chunks out, no seams between
    them (the last input sample and the fractional position carry over)."""

    def __init__(self, source: int, target: int) -> None:
        self.step = source / target
        self.pos = 0.0  # next output position, in input samples, relative to `tail`
        self.tail = np.zeros(0, dtype=np.float32)

    def feed(self, chunk: np.ndarray) -> np.ndarray:
        x = np.concatenate([self.tail, chunk.astype(np.float32)])
        if len(x) < 2:
            self.tail = x
            return np.zeros(0, dtype=np.int16)
        stop = len(x) - 1
        at = np.arange(self.pos, stop, self.step)
        out = np.interp(at, np.arange(len(x)), x)
        self.pos = (at[-1] + self.step if len(at) else self.pos) - stop
        self.tail = x[stop:]
        return np.clip(out, -32768, 32767).astype(np.int16)


def resample(audio: Audio, rate: int) -> Audio:
    if audio.rate == rate:
        return audio
    r = Resampler(audio.rate, rate)
    return Audio(np.concatenate([r.feed(audio.samples), r.feed(audio.samples[-1:])]), rate)


def frame_levels(audio: Audio) -> np.ndarray:
    """RMS level of each 20 ms frame."""
    n = max(1, int(audio.rate * FRAME_SECONDS))
    frames = audio.samples[: len(audio.samples) // n * n].astype(np.float32).reshape(-1, n)
    return np.sqrt((frames**2).mean(axis=1)) if len(frames) else np.zeros(0)


def speech_threshold(levels: np.ndarray) -> float:
    """Between the noise floor and the speech level, never below -50 dBFS."""
    if not len(levels):
        return 100.0
    floor, loud = np.percentile(levels, 10), np.percentile(levels, 95)
    return float(max(100.0, floor + 0.1 * (loud - floor)))


def speech_segments(
    audio: Audio, min_silence: float = 0.35, min_speech: float = 0.15, pad: float = 0.08
) -> list[tuple[float, float]]:
    """(start, end) seconds of each stretch of speech: runs of loud frames joined across
    pauses shorter than `min_silence` (the gaps between words), padded a little."""
    levels = frame_levels(audio)
    loud = levels > speech_threshold(levels)
    runs: list[list[float]] = []
    for i, on in enumerate(loud):
        if not on:
            continue
        t = i * FRAME_SECONDS
        if runs and t - runs[-1][1] < min_silence:
            runs[-1][1] = t + FRAME_SECONDS
        else:
            runs.append([t, t + FRAME_SECONDS])
    return [
        (max(0.0, a - pad), min(audio.seconds, b + pad)) for a, b in runs if b - a >= min_speech
    ]


def decoder_options(rate: int, live: bool) -> dict[str, object]:
    # The FFT must cover the 25.6 ms analysis window at this rate (512 points at 16 kHz).
    nfft = 1 << int(np.ceil(np.log2(rate * 0.0256)))
    return {
        "samprate": rate,
        "nfft": nfft,
        # Batch CMN normalizes each utterance by its own mean; live CMN starts from the
        # model's default and adapts over the first utterance, whose first words suffer.
        "cmn": "live" if live else "batch",
        "loglevel": "FATAL",
    }


class Recognizer:
    """PocketSphinx with one vocabulary. Decoders are not thread-safe and take 0.25 s to
    make, so each (sample rate, live or batch) keeps a small pool of idle ones."""

    def __init__(self, vocabulary: str) -> None:
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"vocabulary must be one of {', '.join(VOCABULARIES)}")
        self.vocabulary = vocabulary
        self._idle: dict[tuple[int, bool], list[object]] = {}
        self._lock = threading.Lock()

    def decoder(self, rate: int, live: bool = True) -> Stream:
        """A decoder for one utterance at a time; `release()` it when done. Live ones give
        partial hypotheses as audio is fed; batch ones decode at `finish()`."""
        with self._lock:
            pool = self._idle.setdefault((rate, live), [])
            decoder = pool.pop() if pool else None
        return Stream(self, rate, live, decoder or self._make(rate, live))

    def _make(self, rate: int, live: bool) -> object:
        from pocketsphinx import Decoder  # type: ignore[import-untyped]

        if self.vocabulary == "digits":
            # A low word insertion penalty: the grammar already limits what can be said.
            decoder = Decoder(**decoder_options(rate, live), wip=1e-3)
            decoder.add_jsgf_string("digits", DIGITS_JSGF)
            decoder.activate_search("digits")
            return decoder
        return Decoder(**decoder_options(rate, live))

    def _release(self, rate: int, live: bool, decoder: object) -> None:
        with self._lock:
            self._idle.setdefault((rate, live), []).append(decoder)

    def transcribe(self, audio: Audio) -> str:
        """The whole clip as one utterance (blocking: run it in a worker thread)."""
        stream = self.decoder(audio.rate, live=False)
        try:
            stream.feed(audio.samples)
            return stream.finish()
        finally:
            stream.release()


class Stream:
    """One utterance at a time on one decoder: feed audio, read the partial hypothesis,
    finish for the final text."""

    def __init__(self, owner: Recognizer, rate: int, live: bool, decoder: object) -> None:
        self.owner, self.rate, self.live, self._d = owner, rate, live, decoder
        self.active = False
        self._noise = np.random.default_rng(0)

    def feed(self, samples: np.ndarray) -> None:
        d = self._d
        if not self.active:
            d.start_utt()  # type: ignore[attr-defined]
            self.active, self._noise = True, np.random.default_rng(0)
        noisy = samples + self._noise.normal(0, NOISE_FLOOR, len(samples))
        samples = np.clip(noisy, -32768, 32767).astype(np.int16)
        # A batch decoder takes the utterance whole (its CMN needs all of it).
        d.process_raw(samples.astype("<i2").tobytes(), False, not self.live)  # type: ignore[attr-defined]

    def partial(self) -> str:
        hyp = self._d.hyp() if self.active else None  # type: ignore[attr-defined]
        return hyp.hypstr if hyp else ""

    def finish(self) -> str:
        if not self.active:
            return ""
        self._d.end_utt()  # type: ignore[attr-defined]
        self.active = False
        hyp = self._d.hyp()  # type: ignore[attr-defined]
        return " ".join((hyp.hypstr if hyp else "").split())

    def release(self) -> None:
        if self.active:
            self.finish()
        self.owner._release(self.rate, self.live, self._d)
