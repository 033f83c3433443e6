"""`corrallm verify --model M` (SPEC §11 D2): the whole unattended scale-to-zero cycle against
a running corrallm (asleep -> request -> wakes -> responds -> idle -> asleep), each step
printed with its timing; any failure exits non-zero.

Asleep is stopped (or failed) for most backends. One with a `sleep` config (SPEC §18 W1)
must really fall asleep when its `sticky.ttl` runs out, so the cycle's last step waits for
`asleep` (its process kept) and the wake is a wake, not a cold start."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

ASLEEP = ("stopped", "failed")
SLEEPING = ("asleep",)  # W1: a backend with a `sleep` config, put to sleep by its ttl


class VerifyFailed(Exception):
    pass


@dataclass
class Verify:
    base_url: str
    model: str
    token: str
    timeout: float = 300.0
    say: Callable[[str], None] = print
    steps: list[tuple[str, float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.base_url.rstrip("/"), timeout=self.timeout)
        self.admin = {"Authorization": f"Bearer {self.token}"}

    def run(self) -> list[tuple[str, float, str]]:
        try:
            backend = self._step("find the model", self._find)
            if backend["state"] not in ASLEEP + SLEEPING:
                self._step("put it to sleep (unload)", self._unload)
            first = self._step("confirm asleep", lambda: self._expect(ASLEEP + SLEEPING))
            how = "asleep: wakes it" if first in SLEEPING else "cold: wakes it"
            answer = self._step(f"request ({how})", lambda: self._request(backend))
            self._step("responds", lambda: answer)
            self._step("confirm awake", lambda: self._expect(("ready",)))
            ttl = self._ttl()
            if ttl is None:
                self._step("idle -> asleep (no sticky.ttl: unload)", self._unload)
                self._step("confirm asleep", lambda: self._expect(ASLEEP))
                return self.steps
            asleep = SLEEPING if backend.get("sleeps") else ASLEEP
            self._step(
                f"idle -> asleep (sticky.ttl {ttl:g}s)",
                lambda: self._wait_state(asleep, ttl + 30),
            )
            self._step("confirm asleep", lambda: self._expect(asleep))
            if asleep is SLEEPING:
                again = self._step("request (asleep: wakes it)", lambda: self._request(backend))
                self._step("responds", lambda: again)
                self._step("confirm awake", lambda: self._expect(("ready",)))
                self._step(
                    f"idle -> asleep again (sticky.ttl {ttl:g}s)",
                    lambda: self._wait_state(SLEEPING, ttl + 30),
                )
        finally:
            self.http.close()
        return self.steps

    # -- steps ---------------------------------------------------------------------

    def _step(self, name: str, fn: Callable[[], Any]) -> Any:
        began = time.monotonic()
        try:
            result = fn()
        except (httpx.HTTPError, KeyError, ValueError, VerifyFailed) as exc:
            elapsed = time.monotonic() - began
            self.steps.append((name, elapsed, f"FAILED: {exc}"))
            self.say(f"FAIL {name:<42} {elapsed * 1000:9.1f} ms  {exc}")
            raise VerifyFailed(f"{name}: {exc}") from exc
        elapsed = time.monotonic() - began
        detail = result if isinstance(result, str) else ""
        self.steps.append((name, elapsed, detail))
        self.say(f"ok   {name:<42} {elapsed * 1000:9.1f} ms  {detail}")
        return result

    def _overview_backend(self) -> dict[str, Any]:
        r = self.http.get("/api/v1/overview", headers=self.admin)
        if r.status_code != 200:
            raise VerifyFailed(f"GET /api/v1/overview answered {r.status_code}: {r.text[:200]}")
        for model in r.json()["models"]:
            if self.model == model["name"] or self.model in model.get("aliases", []):
                backend: dict[str, Any] = model["backends"][0]
                return backend
        raise VerifyFailed(f"no model {self.model!r} in /api/v1/overview")

    def _find(self) -> dict[str, Any]:
        return self._overview_backend()

    def _unload(self) -> str:
        r = self.http.post("/api/v1/models/unload", json={"model": self.model}, headers=self.admin)
        if r.status_code != 200:
            raise VerifyFailed(f"unload answered {r.status_code}: {r.text[:200]}")
        return self._wait_state(ASLEEP, self.timeout)

    def _expect(self, states: tuple[str, ...]) -> str:
        state = str(self._overview_backend()["state"])
        if state not in states:
            raise VerifyFailed(f"state is {state}, expected {' or '.join(states)}")
        return state

    def _wait_state(self, states: tuple[str, ...], within: float) -> str:
        deadline = time.monotonic() + within
        while True:
            state = str(self._overview_backend()["state"])
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise VerifyFailed(f"still {state} after {within:g}s")
            time.sleep(0.2)

    def _request(self, backend: dict[str, Any]) -> str:
        kind = backend.get("type", "chat")
        body: dict[str, Any]
        if kind in ("embed", "embedding", "embeddings"):
            path, body = "/v1/embeddings", {"model": self.model, "input": "verify"}
        else:
            path = "/v1/chat/completions"
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": "Say OK."}],
                "max_tokens": 8,
            }
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise VerifyFailed(f"{path} answered {r.status_code}: {r.text[:300]}")
        return f"HTTP 200 from {r.headers.get('x-corrallm-backend', '?')}"

    def _ttl(self) -> float | None:
        r = self.http.get("/api/v1/overview", headers=self.admin)
        r.raise_for_status()
        for model in r.json()["models"]:
            if self.model == model["name"] or self.model in model.get("aliases", []):
                ttl = model.get("ttl_seconds")
                return None if ttl is None else float(ttl)
        return None
