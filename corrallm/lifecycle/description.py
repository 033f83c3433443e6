"""What an endpoint says of itself (`Endpoint.describe()`, routing/router.py): one small
typed shape for a supervised process, a pure proxy and a peer's model, so the views, the
routing and the gateway read what they need without asking which kind it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from corrallm.lifecycle.logs import LogBuffer
from corrallm.lifecycle.state import State

# process: a process this gateway supervises (its own, or an extension's);
# proxy: a backend with no cmd, always ready (L7); peer: a model another node serves (X1).
Kind = Literal["process", "proxy", "peer"]


@dataclass(frozen=True, slots=True)
class Description:
    kind: Kind
    state: State
    url: str  # where requests go: the backend's base URL, or the peer's
    node: str | None = None  # the peer node serving it (kind peer)
    pid: int | None = None  # an owned process's
    last_error: str | None = None
    load_seconds: float | None = None  # its latest start took this long (measured)
    sleeps: bool = False  # it can be put to sleep (W1)
    retired: bool = False  # a reload removed it, or its peer stopped serving it
    logs: LogBuffer | None = None  # a supervised process's log (tail, n_ctx, n_slots)
