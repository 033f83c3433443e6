"""S2-S4, V2, F1, K6: the scheduling core's invariants, by property (hypothesis).

A state machine drives random submits (some preferring a backend, as affinity does),
releases, requeues, withdrawals, leases and clock ticks and checks after every step that
no slot is double-booked, that leases hold, that no waiter is left behind beside a slot it
may use, that preemption only takes from lower-weight interruptible groups, and that a
preference never makes a request wait while an equal backend is free. Two simulations
check fairshare: no starvation under sustained contention, and served shares converging
to weight shares.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from corrallm.scheduler.core import (
    Admit,
    Currency,
    GroupSpec,
    Policy,
    Preempt,
    Queued,
    Reject,
    Request,
    Scheduler,
)

GROUPS = [
    GroupSpec("hi", 4.0, "requests"),
    GroupSpec("mid", 2.0, "slotSeconds", interruptible=True),
    GroupSpec("lo", 1.0, "tokens", interruptible=True, max_queue_depth=3),
    GroupSpec("default", 1.0, "dollars", interruptible=True),
]
SPEC = {g.name: g for g in GROUPS}
CAPACITY = {"b1": 2, "b2": 1, "b3": 3}
TIERS = [(("b1",),), (("b1", "b2"),), (("b1",), ("b3",)), (("b2",), ("b1", "b3"))]
policies = st.builds(Policy, st.booleans(), st.booleans(), st.booleans())


class SchedulerMachine(RuleBasedStateMachine):
    """The model: which ids the decisions say run and wait; the core must agree."""

    @initialize()
    def start(self):
        self.s = Scheduler(GROUPS, max_queue_depth=5)
        for backend, slots in CAPACITY.items():
            self.s.add_backend(backend, slots)
        self.now, self.ids = 0.0, itertools.count(1)
        self.running: dict[int, str] = {}
        self.waiting: dict[int, str] = {}
        self.excess = {b: 0 for b in CAPACITY}
        self.tolerate: set[str] = set()

    def _took(self, admits):
        for admit in admits:
            assert admit.request in self.waiting, admit
            self.running[admit.request] = self.waiting.pop(admit.request)

    def _before(self):
        """A hand-off whose victim's lane holds a lease there may end inside that lease
        (the victim was beyond it when chosen); those backends may exceed for a moment."""
        self.tolerate = {
            b.id
            for b in self.s.backends.values()
            for victim in b.handoffs
            if b.running[victim].request.group in b.leases
        }

    @rule(
        group=st.sampled_from(sorted(SPEC)),
        tiers=st.sampled_from(TIERS),
        policy=policies,
        prefer=st.sampled_from([None, "gone", *sorted(CAPACITY)]),
    )
    def submit(self, group, tiers, policy, prefer):
        self._before()
        rid = next(self.ids)
        # Where it may go at once: nobody waits beside a free slot (invariant below), so
        # a backend with room for its lane is one it may enter now.
        free = [{b for b in t if self.s.backends[b].room_for(group)} for t in tiers]
        d = self.s.submit(Request(rid, group, self.now), tiers, policy, self.now, prefer)
        tier = next((i for i, t in enumerate(tiers) if d.backend in t), None)
        assert tier is not None
        if free[0]:  # K6: a preference never makes it wait while an equal backend is free
            assert isinstance(d, Admit) and d.backend in free[0], (d, free)
        if isinstance(d, Admit):
            assert tier == 0 or policy.spill  # F1: the next tier only with spill
            assert d.backend in free[tier]
            if prefer in free[tier]:
                assert d.backend == prefer  # K6: its conversation's backend while it has room
            self.running[rid] = group
        elif isinstance(d, Preempt):
            assert policy.preempt and (tier == 0 or policy.spill)
            victim = SPEC[self.running[d.victim]]
            assert victim.interruptible and victim.weight < SPEC[group].weight  # S4
            assert self.s.preempting(d.victim)
            b = self.s.backends[d.backend]  # V2: never a victim inside its lane's lease
            assert victim.name not in b.leases or b.beyond_lease(victim.name) >= 0
            self.waiting[rid] = group
        elif isinstance(d, Queued):
            assert policy.queue and tier == 0
            self.waiting[rid] = group
        else:
            assert isinstance(d, Reject) and tier == 0
            assert (d.reason == "queue_full") == policy.queue
            assert (d.capacity, d.in_flight, d.waiting) == self.s.load(d.backend)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), usage=st.floats(0, 100))
    def release(self, data, usage):
        self._before()
        rid = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[rid]
        self._took(self.s.release(rid, self.now, usage))

    @precondition(lambda self: any(self.s.preempting(r) for r in self.running))
    @rule(data=st.data())
    def requeue(self, data):
        self._before()
        rid = data.draw(st.sampled_from(sorted(r for r in self.running if self.s.preempting(r))))
        self.waiting[rid] = self.running.pop(rid)
        self._took(self.s.requeue(rid, self.now))

    @rule(data=st.data())
    def withdraw(self, data):
        self._before()
        rid = data.draw(st.sampled_from([0, *sorted(self.waiting), *sorted(self.running)]))
        self.waiting.pop(rid, None), self.running.pop(rid, None)
        self._took(self.s.withdraw(rid, self.now))

    @rule(
        group=st.sampled_from(sorted(SPEC)),
        backend=st.sampled_from(sorted(CAPACITY)),
        slots=st.integers(1, 3),
        ttl=st.floats(0.5, 20),
    )
    def lease(self, group, backend, slots, ttl):
        held = self.s.backends[backend].leases.get(group, (0, 0.0))[0]
        slots = max(held, min(slots, CAPACITY[backend]))  # renewals do not shrink: see report
        self.s.lease(group, backend, slots, self.now + ttl, self.now)
        self.tolerate = {backend}  # a lease never takes a running slot: excess may appear

    @rule(group=st.sampled_from(sorted(SPEC)), backend=st.sampled_from(sorted(CAPACITY)))
    def unlease(self, group, backend):
        self._before()
        self._took(self.s.unlease(group, backend, self.now))

    @rule(dt=st.floats(0.0, 10.0))
    def tick(self, dt):
        self._before()
        self.now += dt
        self._took(self.s.expire_leases(self.now))

    @invariant()
    def no_slot_is_double_booked(self):
        seen: Counter[int] = Counter()
        for b in self.s.backends.values():
            assert len(b.running) <= b.capacity
            seen.update(list(b.running))
            seen.update(r.id for q in b.queues.values() for r in q)
            seen.update(t.id for t in b.handoffs.values())
            assert self.s.load(b.id)[1:] == (len(b.running), b.waiting)
        assert max(seen.values(), default=1) == 1  # never both queued and running, ids unique
        running = {r for b in self.s.backends.values() for r in b.running}
        assert running == set(self.running) and set(seen) - running == set(self.waiting)

    @invariant()
    def nobody_waits_beside_a_slot_they_may_use(self):
        for b in self.s.backends.values():
            assert not any(q and b.room_for(g) for g, q in b.queues.items()), b.id

    @invariant()
    def others_stay_within_capacity_minus_unused_reservations(self):
        for b in self.s.backends.values():
            unused = sum(max(0, n - b.in_flight_of(g)) for g, (n, _) in b.leases.items())
            excess = max(0, len(b.running) + unused - b.capacity)
            assert b.id in self.tolerate or excess <= self.excess[b.id], b.id
            self.excess[b.id] = excess

    @invariant()
    def group_counters_match(self):
        for name, g in self.s.groups.items():
            assert g.in_flight == sum(1 for x in self.running.values() if x == name)
            assert g.waiting == sum(1 for x in self.waiting.values() if x == name)

    def teardown(self):
        """When slots keep freeing (and leases end), every waiting request gets its turn."""
        self._took(self.s.expire_leases(float("inf")))
        while self.running:
            rid = min(self.running)
            del self.running[rid]
            self._took(self.s.release(rid, self.now))
        assert not self.waiting
        assert all(self.s.load(b) == (c, 0, 0) for b, c in CAPACITY.items())


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_scheduler_state_machine = SchedulerMachine.TestCase


# -- fairshare simulations --------------------------------------------------------------


def saturate(weights, steps, cap=1, currency: Currency = "requests", backlog=4):
    """Groups keep `backlog` requests waiting on one backend; each request holds its slot
    for one step (usage 1). Returns served counts and each request's wait in admissions."""
    names = [f"g{i}" for i in range(len(weights))]
    s = Scheduler([GroupSpec(n, w, currency) for n, w in zip(names, weights, strict=True)], 10**6)
    s.add_backend("b", cap)
    ids, now, admitted = itertools.count(), 0.0, 0
    group_of: dict[int, str] = {}
    queued_at: dict[int, int] = {}
    served: Counter[str] = Counter()
    waits: list[tuple[str, int]] = []
    running: list[int] = []

    def took(rid: int) -> None:
        nonlocal admitted
        admitted += 1
        served[group_of[rid]] += 1
        running.append(rid)
        if rid in queued_at:
            waits.append((group_of[rid], admitted - queued_at.pop(rid)))

    def top_up() -> None:
        for n in names:
            while sum(1 for r in queued_at if group_of[r] == n) < backlog:
                rid = next(ids)
                group_of[rid] = n
                d = s.submit(Request(rid, n, now), [["b"]], Policy(queue=True), now)
                if isinstance(d, Admit):
                    took(rid)
                else:
                    queued_at[rid] = admitted

    top_up()
    for _ in range(steps):
        now += 1.0
        done, running[:] = list(running), []
        for rid in done:
            for admit in s.release(rid, now, 1.0):
                took(admit.request)
        top_up()
    waits += [(group_of[r], admitted - at) for r, at in queued_at.items()]
    return [served[n] for n in names], waits


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 20), min_size=2, max_size=4),
    cap=st.integers(1, 3),
    backlog=st.integers(1, 4),
    currency=st.sampled_from(["requests", "slotSeconds", "tokens", "dollars"]),
)
def test_S3_no_group_starves_under_sustained_contention(weights, cap, backlog, currency):
    total = sum(weights)
    bound = {f"g{i}": 2 * ((backlog + 2) * total / w + cap) for i, w in enumerate(weights)}
    steps = int(2 * max(bound.values()) / cap) + 20
    _, waits = saturate(weights, steps, cap, currency, backlog)
    # Every request, the last ones still waiting included, waits at most a bounded number
    # of admissions: about its place in line times total weight / its weight.
    assert all(wait <= bound[g] for g, wait in waits)


@pytest.mark.parametrize("currency", ["requests", "slotSeconds", "tokens"])
@pytest.mark.parametrize("weights", [(10, 1), (3, 1), (1, 1, 1)])
def test_S3_served_share_converges_to_weight_share(weights, currency):
    deviation = []
    for steps in (100, 1000, 5000):
        served, _ = saturate(weights, steps, currency=currency)
        want = [w / sum(weights) for w in weights]
        errors = [abs(n / sum(served) - x) for n, x in zip(served, want, strict=True)]
        deviation.append(max(errors))
        relative = [e / x for e, x in zip(errors, want, strict=True)]
    assert deviation == sorted(deviation, reverse=True), deviation
    assert deviation[-1] < 0.05 and max(relative) < 0.05, (deviation, relative)
