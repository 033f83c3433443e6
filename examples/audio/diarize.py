"""Who spoke when, with no model to download: each stretch of speech is described by its
voice (median pitch, and the average shape of its spectrum as mel-cepstral coefficients),
and stretches are clustered bottom-up until the closest two clusters no longer sound
alike.

Pitch carries most of it (two voices an octave apart are 12 semitones apart; one voice
wanders a semitone or two); the cepstrum separates voices of similar pitch by timbre.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from speech import Audio

PITCH_RANGE = (60.0, 400.0)  # Hz: low male to high child voices
SEMITONES_ALIKE = 3.0  # one voice's median pitch varies less than this between stretches
CEPSTRUM_ALIKE = 40.0  # mean-cepstrum distance within one voice over different words
SAME_VOICE = 1.0  # combined distance below which two clusters are one speaker


@dataclass(frozen=True)
class Voice:
    pitch: float  # median F0 of the voiced frames, in semitones above 55 Hz; NaN if none
    cepstrum: np.ndarray  # mean mel-cepstral coefficients c1..c12


def voice(audio: Audio) -> Voice:
    x = audio.samples.astype(np.float32) / 32768
    n = int(audio.rate * 0.04)  # 40 ms frames: two periods of the lowest pitch
    hop = n // 2
    if len(x) < n:
        x = np.pad(x, (0, n - len(x)))
    frames = np.lib.stride_tricks.sliding_window_view(x, n)[::hop] * np.hanning(n)
    energy = (frames**2).mean(axis=1)
    voiced = frames[energy > 0.1 * energy.max()] if energy.max() > 0 else frames[:0]
    pitches = [p for p in (_pitch(f, audio.rate) for f in voiced) if p]
    pitch = 12 * np.log2(np.median(pitches) / 55) if pitches else float("nan")
    return Voice(float(pitch), _mean_cepstrum(voiced, audio.rate))


def _pitch(frame: np.ndarray, rate: int) -> float | None:
    """F0 by autocorrelation; None for an unvoiced frame (no clear period)."""
    spectrum = np.fft.rfft(frame, 2 * len(frame))
    ac = np.fft.irfft(np.abs(spectrum) ** 2)[: len(frame)]
    if ac[0] <= 0:
        return None
    lo, hi = int(rate / PITCH_RANGE[1]), int(rate / PITCH_RANGE[0])
    lag = lo + int(np.argmax(ac[lo:hi]))
    return rate / lag if ac[lag] / ac[0] > 0.4 else None


def _mel_filters(rate: int, nfft: int, bands: int = 24) -> np.ndarray:
    mel = np.linspace(0, 2595 * np.log10(1 + min(rate / 2, 8000) / 700), bands + 2)
    hz = 700 * (10 ** (mel / 2595) - 1)
    bins = np.floor((nfft + 1) * hz / rate).astype(int)
    filters = np.zeros((bands, nfft // 2 + 1))
    for i in range(bands):
        a, b, c = bins[i], bins[i + 1], max(bins[i + 2], bins[i + 1] + 1)
        filters[i, a:b] = np.linspace(0, 1, b - a, endpoint=False)
        filters[i, b:c] = np.linspace(1, 0, c - b, endpoint=False)
    return filters


def _mean_cepstrum(frames: np.ndarray, rate: int) -> np.ndarray:
    if not len(frames):
        return np.zeros(12)
    nfft = 1 << int(np.ceil(np.log2(frames.shape[1])))
    power = np.abs(np.fft.rfft(frames, nfft)) ** 2
    logmel = np.log(power @ _mel_filters(rate, nfft).T + 1e-10)
    k = np.arange(logmel.shape[1])
    dct = np.cos(np.pi * np.outer(np.arange(1, 13), k + 0.5) / logmel.shape[1])
    return (logmel @ dct.T).mean(axis=0)  # type: ignore[no-any-return]


def distance(a: Voice, b: Voice) -> float:
    """1.0 is "just about the same voice"; unvoiced stretches count by timbre alone."""
    timbre = float(np.linalg.norm(a.cepstrum - b.cepstrum)) / CEPSTRUM_ALIKE
    if np.isnan(a.pitch) or np.isnan(b.pitch):
        return timbre
    return float(np.hypot(abs(a.pitch - b.pitch) / SEMITONES_ALIKE, timbre) / np.sqrt(2))


def cluster(voices: list[Voice], speakers: int | None = None) -> list[int]:
    """Speaker index per stretch, numbered in order of first appearance. Average-linkage
    agglomeration: stop at `speakers` clusters when given, else when no two clusters are
    closer than SAME_VOICE."""
    groups = [[i] for i in range(len(voices))]
    pair = np.array([[distance(a, b) for b in voices] for a in voices])
    target = max(1, speakers or 1)
    while len(groups) > target:
        best, bi, bj = np.inf, 0, 0
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                d = float(pair[np.ix_(groups[i], groups[j])].mean())
                if d < best:
                    best, bi, bj = d, i, j
        if speakers is None and best >= SAME_VOICE:
            break
        groups[bi] += groups.pop(bj)
    # Numbered by first appearance, so the first voice heard is SPEAKER_00.
    label = {i: n for n, g in enumerate(sorted(groups, key=min)) for i in g}
    return [label[i] for i in range(len(voices))]
