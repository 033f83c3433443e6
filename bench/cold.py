"""What a rate-limited request's limiter work costs warm, and cold: in a tight loop, where
its code and data stay in the CPU's caches, and right after the caches were flushed, as
they are, in part, when a gateway's other work runs between two requests of a key.

    .venv/bin/python bench/cold.py [--rounds 300] [--flush-mb 8]

Each step is timed alone with `time.perf_counter` around one call: warm, the median of
`--rounds` calls in a row; cold, the median of `--rounds` calls each after a sweep over
`--flush-mb` MiB and a walk over 50,000 small objects (what evicts the step's lines from
L1 and L2). The reference rows calibrate: an empty call is what the timing itself costs,
and each other row less it is the step's own. The steps are `Limiter.counted` (admit one
request of a key with rpm/tpm/concurrent limits, with its x-ratelimit-* headers) and
`Limiter.release` (settle it), on the window of a key that has been counting for 60 s,
with bench/keys.py's limits; then what they are made of.

To see whether compiling the limiter changes the cold cost, build a copy with mypyc and
put it first on the path:

    mkdir /tmp/c && cp -r corrallm /tmp/c/
    (cd /tmp/c && "$OLDPWD/.venv/bin/mypyc" corrallm/auth/limits.py)   # this checkout's venv
    PYTHONPATH=/tmp/c .venv/bin/python bench/cold.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from corrallm.auth import limits as limits_module
from corrallm.auth.limits import REMAINING_REQUESTS, Ask, Hold, Limiter
from corrallm.config.schema import KeyLimits

ESTIMATE, USED = 300, 316  # tokens: a chat completion's estimate and its metered usage


def steps() -> list[tuple[str, Callable[[], object]]]:
    ask = Ask("key:caller", KeyLimits(rpm=100_000_000, tpm=100_000_000_000, concurrent=10_000))
    asks = (ask,)
    limiter = Limiter()
    # A minute of traffic at 5,000 requests a second: the window holds its 6,000 entries.
    start = time.time() - 60
    for i in range(6000):
        now = start + i * 0.01
        hold = limiter.counted(asks, ESTIMATE, now)
        assert isinstance(hold, Hold)
        limiter.release(hold, USED, now)
    holds: list[Hold] = []

    def counted() -> object:
        hold = limiter.counted(asks, ESTIMATE, time.time())
        assert isinstance(hold, Hold)
        holds.append(hold)
        return hold

    def release() -> object:
        if not holds:
            counted()
        limiter.release(holds.pop(), USED, time.time())
        return None

    window = limiter._windows[ask.subject]  # one step of `counted` alone

    def nothing() -> object:
        return None

    return [
        ("an empty call (the timing's own cost)", nothing),
        ("time.time()", time.time),
        ('b"%d" % n', lambda: b"%d" % 12345),
        ("a tuple of two", lambda: (REMAINING_REQUESTS, b"1")),
        ("a Hold (a slotted dataclass)", lambda: Hold(ask.alone, ESTIMATE, 0.0, [])),
        ("the window's dict lookup", lambda: limiter._windows.get(ask.subject)),
        ("Window.add (one request)", lambda: window.add(window.requests, time.time(), 1)),
        ("Limiter.counted", counted),
        ("Limiter.release", release),
    ]


def flusher(mb: int) -> Callable[[], None]:
    sweep = bytearray(mb << 20)
    objects = [[i] for i in range(200_000)]
    ones = b"\x01" * len(sweep[::64])

    def flush() -> None:
        sweep[::64] = ones
        total = 0
        for item in objects[::4]:
            total += item[0]

    return flush


def timed(step: Callable[[], object], rounds: int, flush: Callable[[], None] | None) -> float:
    """The median µs of one call of `step`, each after `flush` (None: warm, in a row)."""
    samples = []
    for _ in range(rounds):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="calls per step and state")
    parser.add_argument("--flush-mb", type=int, default=8, help="MiB swept before a cold call")
    args = parser.parse_args()
    flush = flusher(args.flush_mb)
    rows = []
    for name, step in steps():
        for _ in range(50):
            step()  # specialised by the interpreter before either is timed
        rows.append((name, timed(step, args.rounds, None), timed(step, args.rounds, flush)))
    where = Path(limits_module.__file__ or "?")
    print(f"auth/limits.py: {'interpreted' if where.suffix == '.py' else 'compiled'} ({where})")
    print("| step | warm µs | cold µs | cold ÷ warm |")
    print("|---|---:|---:|---:|")
    for name, warm, cold in rows:
        print(f"| {name} | {warm:.2f} | {cold:.2f} | {cold / warm:.1f}x |")
    print(
        f"- median of {args.rounds} calls each; cold: after sweeping {args.flush_mb} MiB "
        "and walking 50,000 objects; subtract the empty call's row from the others"
    )


if __name__ == "__main__":
    main()
