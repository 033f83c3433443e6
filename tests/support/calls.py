"""A chat request in a thread of its own, for tests that act while it is held (list it,
cancel it) and then read what its client got: the status, the head, the body and, for a
stream, its `data:` events."""

from __future__ import annotations

import threading

import httpx

from tests.support.processes import Gateway

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class Call(threading.Thread):
    def __init__(self, gw: Gateway, model: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.gw, self.model, self.stream = gw, model, stream
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.body = b""
        self.events: list[str] = []
        self.start()

    def run(self) -> None:
        body = {"model": self.model, "stream": self.stream, **CHAT}
        with httpx.stream("POST", self.gw.v1 + "/chat/completions", json=body, timeout=60) as r:
            self.status, self.headers = r.status_code, r.headers
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])
                self.body += line.encode() + b"\n"

    def finished(self) -> bool:
        self.join(0)
        return not self.is_alive()
