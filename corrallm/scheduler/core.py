"""The scheduling core (SPEC §6 S1-S5, §7, §8 F1, §16 K6): a plain object, the clock passed in.

It knows backends (slots), groups (weights, share currency), queues, running requests and
leases, and answers with decisions; it never awaits, sleeps, logs or touches a socket.
The async wrapper (`admission.py`) carries the decisions out and reports back.

- Fairshare (S3): when a slot frees, the next request comes from the waiting group with
  the lowest decayed usage / weight; FIFO within a group. A group that becomes active is
  lifted to the current minimum, so idle time is not banked.
- Policies (S2), per request: preempt -> spill -> queue -> reject.
- Affinity (K6): among the equal backends of a tier, a request goes to the one its
  conversation last ran on (`submit(..., prefer=)`) while that one has room; the memory
  of where conversations ran is the caller's (`routing/affinity.py`).
- Leases (V2): other lanes see `capacity - unused slots reserved by other lanes`; a lease
  never takes a slot from a running request.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Literal

from corrallm.scheduler.decisions import (
    Admit,
    Currency,
    Decision,
    GroupSpec,
    Policy,
    Preempt,
    Queued,
    Reject,
    Request,
)
from corrallm.scheduler.state import HALF_LIFE_SECONDS, Backend, Group, Running

__all__ = [
    "HALF_LIFE_SECONDS",
    "Admit",
    "Currency",
    "Decision",
    "GroupSpec",
    "Policy",
    "Preempt",
    "Queued",
    "Reject",
    "Request",
    "Scheduler",
]

EWMA = 0.2  # weight of the newest sample in the dwell and service-time averages


class Scheduler:
    def __init__(
        self,
        groups: Sequence[GroupSpec],
        max_queue_depth: int,
        default_group: str = "default",
    ) -> None:
        self.groups = {g.name: Group(g) for g in groups}
        if default_group not in self.groups:
            self.groups[default_group] = Group(GroupSpec(default_group))
        self.max_queue_depth = max_queue_depth
        self.backends: dict[str, Backend] = {}
        self._where: dict[int, str] = {}  # request id -> backend, queued or running
        self._turn = 0

    def add_backend(self, backend: str, capacity: int) -> None:
        self.backends[backend] = Backend(backend, capacity)

    def reconfigure(
        self,
        groups: Sequence[GroupSpec],
        max_queue_depth: int,
        default_group: str,
        capacities: dict[str, int],
        now: float,
    ) -> list[Admit]:
        """A config reload: new group specs (usage kept), new backends and capacities.

        Requests already running or queued stay where they are; a backend no longer
        configured keeps its state until they are gone.
        """
        for spec in groups:
            if spec.name in self.groups:
                self.groups[spec.name].spec = spec
            else:
                self.groups[spec.name] = Group(spec)
        if default_group not in self.groups:
            self.groups[default_group] = Group(GroupSpec(default_group))
        self.max_queue_depth = max_queue_depth
        admits: list[Admit] = []
        for backend, capacity in capacities.items():
            if backend not in self.backends:
                self.add_backend(backend, capacity)
            elif self.backends[backend].capacity != capacity:
                self.backends[backend].capacity = capacity
                admits += self._fill(self.backends[backend], now)
        return admits

    # -- arrivals ------------------------------------------------------------------------

    def submit(
        self,
        request: Request,
        tiers: Sequence[Sequence[str]],
        policy: Policy,
        now: float,
        prefer: str | None = None,
        rank: Mapping[str, tuple[float, ...]] | None = None,
    ) -> Decision:
        """Place a new request on the first tier with room, else by its policy (S2, F1).

        `rank` (X2): a live order of backends, lowest first (ready with a free slot, then
        the shortest expected wait, then local before peer); among a tier's backends with
        room only the best-ranked are candidates.

        `prefer` (K6): the backend the request's conversation last ran on. Within the tier
        that has room, it is taken while it has room itself; otherwise the normal choice
        (least loaded, then in turn) stands, so a preference never makes a request wait
        while an equal backend is free. When it has to queue, it queues there if no other
        backend of the first tier has fewer waiting.
        """
        group = self.groups[request.group]
        if not (group.in_flight or group.waiting):
            self._activate(group, now)
        for position, tier in enumerate(tiers):
            if backend := self._least_loaded(tier, request.group, prefer, rank):
                return self._admit(request, backend, now)
            if policy.preempt and (victim := self._victim(tier, group.spec)):
                return self._preempt(request, victim, now)
            if policy.spill and position + 1 < len(tiers):
                continue
            break
        return self._queue(request, group, tiers[0], policy, now, prefer)

    def _queue(
        self,
        request: Request,
        group: Group,
        tier: Sequence[str],
        policy: Policy,
        now: float,
        prefer: str | None,
    ) -> Decision:
        """No room on its tiers: it queues on the first tier's backend with the fewest
        waiting, or is refused as its policy says (S2, S5). (Apart from `submit`, whose
        admissions then make no closures: perf, SPEC §13.)"""
        assert tier, "a request needs at least one backend"
        first = [self.backends[b] for b in tier]
        if prefer in tier:  # K6: a tie on waiting goes to the conversation's backend
            first.sort(key=lambda b: b.id != prefer)
        home = min(first, key=lambda b: b.waiting)
        if not policy.queue:
            return self._reject(request, home, "saturated", now)
        group_limit = group.spec.max_queue_depth
        if home.waiting >= self.max_queue_depth or (
            group_limit is not None and len(home.queues.get(request.group, ())) >= group_limit
        ):
            return self._reject(request, home, "queue_full", now)
        home.queues.setdefault(request.group, deque()).append(request)
        home.queued[request.id] = request
        group.waiting += 1
        self._where[request.id] = home.id
        return Queued(request.id, home.id)

    # -- departures ----------------------------------------------------------------------

    def release(self, request_id: int, now: float, usage: float = 0.0) -> list[Admit]:
        """A running request finished, failed or was cancelled: its slot frees (S7)."""
        backend = self.backends[self._where.pop(request_id)]
        running = backend.running.pop(request_id)
        backend.counts[running.request.group] -= 1
        group = self.groups[running.request.group]
        group.in_flight -= 1
        group.admitted_sum -= running.admitted
        held = now - running.admitted
        backend.service = _average(backend.service, held)
        currency = group.spec.currency
        charge = 0.0 if currency == "requests" else held if currency == "slotSeconds" else usage
        group.decayed(now)
        group.usage += charge
        return self._fill(backend, now)

    def requeue(self, request_id: int, now: float) -> list[Admit]:
        """A preempted victim that had sent nothing goes back to the head of its queue (S4)."""
        backend = self.backends[self._where[request_id]]
        running = backend.running.pop(request_id)
        backend.counts[running.request.group] -= 1
        group = self.groups[running.request.group]
        group.in_flight -= 1
        group.admitted_sum -= running.admitted
        group.waiting += 1
        backend.queues.setdefault(running.request.group, deque()).appendleft(running.request)
        backend.queued[request_id] = running.request
        return self._fill(backend, now)

    def withdraw(self, request_id: int, now: float) -> list[Admit]:
        """A queued request leaves (its client went away, or maxWait passed)."""
        where = self._where.get(request_id)
        if where is None:
            return []
        backend = self.backends[where]
        # Fix: a request admitted in the same instant it was withdrawn (maxWait firing as
        # its Admit arrived) is running: free its slot (S7) instead of forgetting where it
        # runs, which leaked the slot and made a later release() raise KeyError.
        if request_id in backend.running:
            return self.release(request_id, now)
        del self._where[request_id]
        for victim, taker in list(backend.handoffs.items()):
            if taker.id == request_id:
                del backend.handoffs[victim]
                backend.running[victim].preempted_by = None
                self.groups[taker.group].waiting -= 1
                return self._fill(backend, now)
        request = backend.queued.pop(request_id, None)  # perf: no scan of every queue
        if request is None:
            return []
        queue = backend.queues[request.group]
        for i, queued in enumerate(queue):
            if queued is request:
                del queue[i]
                break
        self.groups[request.group].waiting -= 1
        return self._fill(backend, now)

    # -- leases (V1-V3) ------------------------------------------------------------------

    def lease(self, group: str, backend: str, slots: int, until: float, now: float) -> list[Admit]:
        """Reserve or renew; a renewal with fewer slots hands the freed ones out at once."""
        target = self.backends[backend]
        target.leases[group] = (slots, until)
        return self._fill(target, now)

    def unlease(self, group: str, backend: str, now: float) -> list[Admit]:
        target = self.backends[backend]
        if target.leases.pop(group, None) is None:
            return []
        return self._fill(target, now)

    def expire_leases(self, now: float) -> list[Admit]:
        admits: list[Admit] = []
        for backend in self.backends.values():
            for group, (_, until) in list(backend.leases.items()):
                if until <= now:
                    del backend.leases[group]
                    admits += self._fill(backend, now)
        return admits

    # -- views ---------------------------------------------------------------------------

    def load(self, backend: str) -> tuple[int, int, int]:
        """(capacity, in flight, waiting) of a backend."""
        b = self.backends[backend]
        return b.capacity, len(b.running), b.waiting

    def position(self, request_id: int) -> tuple[str, int, int] | None:
        """Where a queued request waits: (backend, its place by arrival, how many wait
        there); None once it is no longer queued. Fairshare may serve another lane first:
        the place is by arrival, what a waiting client is told (K4)."""
        for backend in self.backends.values():
            own = backend.queued.get(request_id)
            if own is not None:
                ahead = sum(
                    1 for r in backend.queued.values() if (r.arrived, r.id) < (own.arrived, own.id)
                )
                return backend.id, ahead + 1, len(backend.queued)
        return None

    def retry_after(self, backend: str) -> float:
        """Seconds a turned-away caller should wait: the measured average dwell (S5)."""
        b = self.backends[backend]
        estimate = b.dwell if b.dwell else (b.service or 1.0) * (b.waiting + 1) / b.capacity
        return float(max(1, math.ceil(estimate)))

    def usage_share(self, now: float) -> dict[str, float]:
        total = sum(g.decayed(now) for g in self.groups.values())
        return {n: (g.usage / total if total else 0.0) for n, g in self.groups.items()}

    def preempting(self, request_id: int) -> bool:
        where = self._where.get(request_id)
        running = self.backends[where].running.get(request_id) if where else None
        return running is not None and running.preempted_by is not None

    # -- the machinery -------------------------------------------------------------------

    def _admit(self, request: Request, backend: Backend, now: float) -> Admit:
        group = self.groups[request.group]
        backend.running[request.id] = Running(request, backend.id, now)
        backend.counts[request.group] += 1
        self._where[request.id] = backend.id
        group.in_flight += 1
        group.admitted_sum += now
        if group.spec.currency == "requests":
            group.decayed(now)
            group.usage += 1.0
        return Admit(request.id, backend.id)

    def _least_loaded(
        self,
        tier: Sequence[str],
        group: str,
        prefer: str | None = None,
        rank: Mapping[str, tuple[float, ...]] | None = None,
    ) -> Backend | None:
        """A backend of the tier this group may enter now: among the best ranked (X2), the
        preferred one if it may (K6), else the fewest in flight, then in turn. A rank
        comes first: a conversation does not wait on a busy peer while another is free."""
        if len(tier) == 1:  # perf (SPEC §13): what `_choose` comes to for one backend
            only = self.backends[tier[0]]
            if not only.room_for(group) or (only.queued and self._waiters_fit(only)):
                return None
            if prefer != only.id:  # (the preferred one is taken without a turn)
                self._turn += 1
            return only
        return self._choose(tier, group, prefer, rank)

    def _choose(
        self,
        tier: Sequence[str],
        group: str,
        prefer: str | None,
        rank: Mapping[str, tuple[float, ...]] | None,
    ) -> Backend | None:
        open_ = [
            self.backends[b]
            for b in tier
            if self.backends[b].room_for(group) and not self._waiters_fit(self.backends[b])
        ]
        if not open_:
            return None
        if rank is not None:
            best = min(rank[b.id] for b in open_)
            open_ = [b for b in open_ if rank[b.id] == best]
        if prefer is not None and any(b.id == prefer for b in open_):
            return self.backends[prefer]
        self._turn += 1
        fewest = min(len(b.running) for b in open_)
        ties = [b for b in open_ if len(b.running) == fewest]
        return ties[self._turn % len(ties)]

    def _waiters_fit(self, backend: Backend) -> bool:
        """Someone already waiting could take the free slot: a newcomer must not jump it (S1)."""
        if not backend.queued:  # every request in `queues` is in `queued`: nobody waits
            return False
        return any(q and backend.room_for(g) for g, q in backend.queues.items())

    def _victim(self, tier: Sequence[str], taker: GroupSpec) -> Running | None:
        """S4: the newest request of the lowest-weight interruptible group below the taker."""
        candidates = [
            r
            for b in tier
            for r in self.backends[b].running.values()
            if r.preempted_by is None
            and self.groups[r.request.group].spec.interruptible
            and self.groups[r.request.group].spec.weight < taker.weight
            # Fix: a request running in its own lane's reserved slots is not a victim, or a
            # preemption would hand a reserved slot to another lane (V2).
            and (
                r.request.group not in self.backends[b].leases
                or self.backends[b].beyond_lease(r.request.group) > 0
            )
        ]
        if not candidates:
            return None
        return min(
            candidates, key=lambda r: (self.groups[r.request.group].spec.weight, -r.admitted)
        )

    def _preempt(self, request: Request, victim: Running, now: float) -> Preempt:
        backend = self.backends[victim.backend]
        victim.preempted_by = request.id
        backend.handoffs[victim.request.id] = request
        self.groups[request.group].waiting += 1
        self._where[request.id] = backend.id
        return Preempt(request.id, victim.request.id, backend.id)

    def _fill(self, backend: Backend, now: float) -> list[Admit]:
        """Hand freed slots out: first to preemption takers, then by weighted fairshare."""
        admits: list[Admit] = []
        if backend.handoffs:
            for victim, taker in list(backend.handoffs.items()):
                if victim not in backend.running:
                    del backend.handoffs[victim]
                    admits.append(self._from_queue(taker, backend, now))
        if not backend.queued:
            return admits  # perf (SPEC §13): nobody waits here, the common case
        while len(backend.running) + len(backend.handoffs) < backend.capacity:  # perf: full
            choice = self._next_group(backend, now)
            if choice is None:
                break
            request = backend.queues[choice].popleft()
            del backend.queued[request.id]
            admits.append(self._from_queue(request, backend, now))
        return admits

    def _from_queue(self, request: Request, backend: Backend, now: float) -> Admit:
        self.groups[request.group].waiting -= 1
        backend.dwell = _average(backend.dwell, now - request.arrived)
        return self._admit(request, backend, now)

    def _next_group(self, backend: Backend, now: float) -> str | None:
        # Perf (SPEC §13): room_for(name) of every waiting group, lease sums taken once.
        unused = {g: max(0, n - backend.counts[g]) for g, (n, _) in backend.leases.items()}
        busy = len(backend.running) + len(backend.handoffs)
        free = backend.capacity - busy - sum(unused.values())
        best: tuple[float, float, str] | None = None
        for name, queue in backend.queues.items():
            if not queue or free + unused.get(name, 0) <= 0:
                continue
            rank = (self._normalised(self.groups[name], now), queue[0].arrived, name)
            if best is None or rank < best:
                best = rank
        return best[2] if best else None

    def _normalised(self, group: Group, now: float) -> float:
        usage = group.decayed(now)
        if group.spec.currency == "slotSeconds":  # what its running requests have held so far
            usage += group.in_flight * now - group.admitted_sum
        return usage / group.spec.weight

    def _activate(self, group: Group, now: float) -> None:
        """A group that was idle starts at the current minimum: idle time is not banked."""
        if group.in_flight or group.waiting:
            return
        active = [g for g in self.groups.values() if g is not group and (g.in_flight or g.waiting)]
        if active:
            floor = min(self._normalised(g, now) for g in active)
            group.decayed(now)
            group.usage = max(group.usage, floor * group.spec.weight)

    def _reject(
        self,
        request: Request,
        backend: Backend,
        reason: Literal["saturated", "queue_full"],
        now: float,
    ) -> Reject:
        capacity, in_flight, waiting = self.load(backend.id)
        return Reject(
            request.id,
            backend.id,
            reason,
            self.retry_after(backend.id),
            capacity,
            in_flight,
            waiting,
        )


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA) * old + EWMA * sample
