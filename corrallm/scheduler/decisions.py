"""What the scheduling core is told and what it answers: specs, requests, decisions.

Requests and decisions are values nothing changes once made, but not frozen dataclasses:
one is made for every request (SPEC §13), and a frozen one's `__init__` sets each field
through `object.__setattr__`, about 100 ns a field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Currency = Literal["requests", "slotSeconds", "tokens", "dollars"]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    name: str
    weight: float = 1.0
    currency: Currency = "requests"
    interruptible: bool = False
    max_queue_depth: int | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    preempt: bool = False
    spill: bool = False
    queue: bool = False


@dataclass(slots=True)
class Request:
    id: int
    group: str
    arrived: float


# -- decisions -------------------------------------------------------------------------


@dataclass(slots=True)
class Admit:
    request: int
    backend: str


@dataclass(slots=True)
class Queued:
    request: int
    backend: str


@dataclass(slots=True)
class Preempt:
    """Take `victim`'s slot on `backend`; `request` is admitted once the victim releases."""

    request: int
    victim: int
    backend: str


@dataclass(slots=True)
class Reject:
    request: int
    backend: str
    reason: Literal["saturated", "queue_full"]
    retry_after: float
    capacity: int
    in_flight: int
    waiting: int


Decision = Admit | Queued | Preempt | Reject
