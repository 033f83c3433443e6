"""Putting a backend to sleep and waking it (SPEC §18 W1): the HTTP calls of each kind.

`vllm`: POST /sleep?level=N, POST /wake_up, GET /is_sleeping (vLLM's OpenAI server with
`--enable-sleep-mode` and VLLM_SERVER_DEV_MODE=1), each confirmed with /is_sleeping.
`http`: the configured sleep and wake calls; any 2xx is taken as done. Nothing here
raises on a network error or logs: each action answers None when done, else what went
wrong, for the supervisor's log and its fallback (a failed sleep stops the process, a
failed wake restarts it).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from corrallm.config.schema import HttpSleep, VllmSleep

__all__ = ["Call", "HttpSleep", "SleepSpec", "VllmSleep", "fall_asleep", "is_sleeping", "wake"]

# (method, url, JSON body or None, timeout seconds) -> (status, or None if nothing
# answered in time; the body).
Call = Callable[[str, str, Any, float], Awaitable[tuple[int | None, bytes]]]
SleepSpec = VllmSleep | HttpSleep

STATUS_TIMEOUT = 5.0  # GET /is_sleeping: a cheap query


async def fall_asleep(call: Call, origin: str, spec: SleepSpec, within: float) -> str | None:
    if isinstance(spec, VllmSleep):
        problem = await _act(call, "POST", f"{origin}/sleep?level={spec.level}", within)
        return problem or await _confirm(call, origin, want=True)
    return await _act(call, spec.sleep.method, origin + spec.sleep.path, within)


async def wake(call: Call, origin: str, spec: SleepSpec, within: float) -> str | None:
    if isinstance(spec, VllmSleep):
        problem = await _act(call, "POST", f"{origin}/wake_up", within)
        return problem or await _confirm(call, origin, want=False)
    return await _act(call, spec.wake.method, origin + spec.wake.path, within)


async def is_sleeping(call: Call, origin: str) -> bool | None:
    """vLLM's own answer (None: no clear answer)."""
    status, body = await call("GET", f"{origin}/is_sleeping", None, STATUS_TIMEOUT)
    if status != 200:
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    value = answer.get("is_sleeping") if isinstance(answer, dict) else None
    return value if isinstance(value, bool) else None


async def _act(call: Call, method: str, url: str, within: float) -> str | None:
    status, body = await call(method, url, None, within)
    if status is None:
        return f"{method} {url}: no answer within {within:g}s"
    if not 200 <= status < 300:
        return f"{method} {url} answered {status}: {_snippet(body)}"
    return None


async def _confirm(call: Call, origin: str, *, want: bool) -> str | None:
    sleeping = await is_sleeping(call, origin)
    if sleeping is want:
        return None
    said = "no clear answer" if sleeping is None else f"is_sleeping={str(sleeping).lower()}"
    return f"GET {origin}/is_sleeping gave {said} after the call"


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", "replace").strip().replace("\n", " ")
    return (text[:limit] + "…") if len(text) > limit else (text or "(empty body)")
