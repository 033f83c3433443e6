"""`corrallm bench` (SPEC §11 D3): time to first token, tokens/s and latency percentiles of
streamed chat completions against any OpenAI-compatible endpoint (corrallm, llama-server,
vLLM…)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Sample:
    ok: bool
    ttft: float | None = None  # seconds to the first content token
    latency: float = 0.0
    tokens: int = 0
    error: str | None = None


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    began = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                return Sample(False, error=f"HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("error"):
                    return Sample(False, error=str(event["error"].get("message")))
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
    except (httpx.HTTPError, ValueError) as exc:
        return Sample(False, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else chunks
    return Sample(True, None if first is None else first - began, end - began, tokens)


async def run(
    base_url: str,
    model: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    prompt: str,
    api_key: str | None,
    request_timeout: float,
) -> dict[str, Any]:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    samples: list[Sample] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    began = time.perf_counter()
    async with httpx.AsyncClient(headers=headers, timeout=request_timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                samples.append(await one(client, url, body))

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    wall = time.perf_counter() - began
    return summarize(samples, wall, concurrency)


def summarize(samples: list[Sample], wall: float, concurrency: int) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    rates = [
        s.tokens / (s.latency - s.ttft) for s in ok if s.ttft is not None and s.latency > s.ttft
    ]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "concurrency": concurrency,
        "wall_seconds": round(wall, 3),
        "ttft_ms": _percentiles(ttfts, 1000),
        "latency_ms": _percentiles([s.latency for s in ok], 1000),
        "tokens_per_second": _percentiles(rates, 1),
        "completion_tokens": sum(s.tokens for s in ok),
        "aggregate_tokens_per_second": round(sum(s.tokens for s in ok) / wall, 2) if wall else 0,
        "first_errors": [s.error for s in samples if not s.ok][:3],
    }


def _percentiles(values: list[float], scale: float) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(v * scale for v in values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "mean": round(statistics.fmean(ordered), 3),
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        ("TTFT (ms)", result["ttft_ms"]),
        ("latency (ms)", result["latency_ms"]),
        ("tokens/s per request", result["tokens_per_second"]),
    ]
    lines = [
        f"requests {result['requests']}, errors {result['errors']}, concurrency "
        f"{result['concurrency']}, wall {result['wall_seconds']} s, "
        f"{result['completion_tokens']} tokens, {result['aggregate_tokens_per_second']} tokens/s "
        "overall",
        "",
        "| metric | p50 | p90 | p99 | mean |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in rows:
        lines.append(f"| {name} | {p['p50']} | {p['p90']} | {p['p99']} | {p['mean']} |")
    for error in result["first_errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
