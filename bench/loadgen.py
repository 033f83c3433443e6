"""Load generator for bench/overhead.py, run in its own process (never beside the servers).

    python bench/loadgen.py '{"mode": "latency", "url": ..., "body": {...}, "n": 2000, ...}'

aiohttp with keep-alive, one connection per worker; `"headers"` in a spec are sent with
every request (an API key). Prints one JSON object: summaries in
milliseconds (percentiles are nearest-rank), request counts and errors; `"raw": true` in
a latency spec adds every request's time (`times_ms`), for merging runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from typing import Any

import aiohttp

JSON_HEADERS = {"content-type": "application/json"}


def pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no data."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def summary(seconds: list[float], prefix: str = "") -> dict[str, float | None]:
    ms = [x * 1000 for x in seconds]
    return {
        f"{prefix}p50": pct(ms, 50),
        f"{prefix}p99": pct(ms, 99),
        f"{prefix}mean": sum(ms) / len(ms) if ms else None,
    }


async def post(session: aiohttp.ClientSession, url: str, data: bytes) -> int:
    async with session.post(url, data=data, headers=JSON_HEADERS) as r:
        await r.read()
        return r.status


async def latency(spec: dict[str, Any]) -> dict[str, Any]:
    """Sequential requests on one kept-alive connection."""
    data = json.dumps(spec["body"]).encode()
    times, errors = [], 0
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, headers=spec.get("headers")) as s:
        for _ in range(spec.get("warmup", 0)):
            await post(s, spec["url"], data)
        for _ in range(spec["n"]):
            t0 = time.perf_counter()
            status = await post(s, spec["url"], data)
            times.append(time.perf_counter() - t0)
            errors += status != 200
    raw = {"times_ms": [x * 1000 for x in times]} if spec.get("raw") else {}
    return {**summary(times), "requests": len(times), "errors": errors, **raw}


async def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    """`n` requests over `concurrency` kept-alive connections, as fast as they go."""
    data, left, errors = json.dumps(spec["body"]).encode(), [spec["n"]], [0]

    async def worker(s: aiohttp.ClientSession) -> None:
        while left[0] > 0:
            left[0] -= 1
            errors[0] += await post(s, spec["url"], data) != 200

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=spec["concurrency"]), headers=spec.get("headers")
    ) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(spec["concurrency"])))
        elapsed = time.perf_counter() - t0
    return {"rps": spec["n"] / elapsed, "requests": spec["n"], "errors": errors[0]}


async def streams(spec: dict[str, Any]) -> dict[str, Any]:
    """`n` SSE streams, `concurrency` at a time: time to first event and gaps between tokens."""
    data, left = json.dumps(spec["body"]).encode(), [spec["n"]]
    ttft: list[float] = []
    gaps: list[float] = []
    errors = [0]
    events = [0]

    async def one(s: aiohttp.ClientSession) -> None:
        t0 = time.perf_counter()
        stamps: list[float] = []
        async with s.post(spec["url"], data=data, headers=JSON_HEADERS) as r:
            if r.status != 200:
                errors[0] += 1
                await r.read()
                return
            first = True
            async for line in r.content:
                now = time.perf_counter()
                events[0] += line.startswith(b"data: ")
                if first and line.startswith(b"data: "):
                    ttft.append(now - t0)
                    first = False
                if b'"content"' in line and b'"role"' not in line:
                    stamps.append(now)
        if len(stamps) != spec["tokens"]:
            errors[0] += 1
        gaps.extend(b - a for a, b in itertools.pairwise(stamps))

    async def worker(s: aiohttp.ClientSession) -> None:
        while left[0] > 0:
            left[0] -= 1
            await one(s)

    connector = aiohttp.TCPConnector(limit=spec["concurrency"])
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        await asyncio.gather(*(worker(s) for _ in range(spec["concurrency"])))
    return {
        **summary(ttft, "ttft_"),
        **summary(gaps, "gap_"),
        "streams": len(ttft),
        "errors": errors[0],
        "events": events[0],
    }


MODES = {"latency": latency, "throughput": throughput, "streams": streams}


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        print(json.dumps(runner.run(MODES[spec["mode"]](spec))))


if __name__ == "__main__":
    main(sys.argv[1])
