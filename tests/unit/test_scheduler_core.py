"""S1-S5, S7, V2, F1, K6: the pure scheduling core, by example. Each test is an event
sequence with the clock passed in; the properties live in test_scheduler_properties.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from corrallm.scheduler.core import (
    HALF_LIFE_SECONDS,
    Admit,
    Decision,
    GroupSpec,
    Policy,
    Preempt,
    Queued,
    Reject,
    Request,
    Scheduler,
)

QUEUE = Policy(queue=True)
PREEMPT = Policy(preempt=True)
HI, LO = GroupSpec("hi", 10), GroupSpec("lo", 1, interruptible=True)


def make(*groups: GroupSpec, depth: int = 64, **capacity: int) -> Scheduler:
    s = Scheduler(groups, depth)
    for backend, slots in capacity.items():
        s.add_backend(backend, slots)
    return s


def sub(
    s: Scheduler,
    rid: int,
    group: str = "default",
    now: float = 0.0,
    policy: Policy = QUEUE,
    tiers: Sequence[Sequence[str]] = (("b",),),
    prefer: str | None = None,
) -> Decision:
    return s.submit(Request(rid, group, now), tiers, policy, now, prefer)


def serve_in_turn(s: Scheduler, running: int, usages: Sequence[float] = (), now: float = 0.0):
    """On a one-slot backend: release whoever runs (with the next usage) until nobody waits."""
    order, usages = [], list(usages)
    while admits := s.release(running, now, usages.pop(0) if usages else 0.0):
        running = admits[0].request
        order.append(running)
    return order


# -- S1 ---------------------------------------------------------------------------------


def test_S1_admitted_at_once_while_nobody_waits():
    s = make(b=2)
    assert [sub(s, 1), sub(s, 2), sub(s, 3)] == [Admit(1, "b"), Admit(2, "b"), Queued(3, "b")]
    assert s.load("b") == (2, 2, 1)


def test_S1_a_freed_slot_goes_to_the_waiter_not_to_a_newcomer():
    s = make(b=1)
    sub(s, 1), sub(s, 2)
    assert s.release(1, 1.0) == [Admit(2, "b")]
    assert sub(s, 3, now=1.0) == Queued(3, "b")


# -- S2 ---------------------------------------------------------------------------------

TWO_TIERS = (("a",), ("b",))


def test_S2_preempt_comes_before_spill_and_spill_before_queue():
    s = make(HI, LO, a=1, b=1)
    everything = Policy(preempt=True, spill=True, queue=True)
    assert sub(s, 1, "lo", tiers=TWO_TIERS) == Admit(1, "a")
    assert sub(s, 2, "hi", policy=everything, tiers=TWO_TIERS) == Preempt(2, 1, "a")
    assert sub(s, 3, "hi", policy=everything, tiers=TWO_TIERS) == Admit(3, "b")  # no victim
    assert sub(s, 4, "hi", policy=everything, tiers=TWO_TIERS) == Queued(4, "a")


@pytest.mark.parametrize(
    ("word", "policy", "room_and_victim", "nothing_to_take"),
    [
        ("preempt", Policy(preempt=True), Preempt, "saturated"),
        ("spill", Policy(spill=True), Admit, "saturated"),
        ("queue", Policy(queue=True), Queued, "queued"),
        ("reject", Policy(), Reject, "saturated"),
    ],
)
def test_S2_single_word_policies(word, policy, room_and_victim, nothing_to_take):
    # A victim on the full first tier and room on the next: each word does only its own thing.
    s = make(HI, LO, a=1, b=1)
    sub(s, 1, "lo", tiers=[["a"]])
    assert type(sub(s, 2, "hi", policy=policy, tiers=TWO_TIERS)) is room_and_victim, word
    # Both tiers full of equal-weight work: only `queue` waits, the others are turned away.
    s = make(HI, a=1, b=1)
    sub(s, 1, "hi", tiers=[["a"]]), sub(s, 2, "hi", tiers=[["b"]])
    decision = sub(s, 3, "hi", policy=policy, tiers=TWO_TIERS)
    assert getattr(decision, "reason", "queued") == nothing_to_take


def test_S2_queue_full_by_the_global_max_queue_depth():
    s = make(depth=2, b=1)
    assert [type(sub(s, i)) for i in (1, 2, 3)] == [Admit, Queued, Queued]
    assert sub(s, 4) == Reject(4, "b", "queue_full", 3.0, capacity=1, in_flight=1, waiting=2)


def test_S2_queue_full_by_the_groups_max_queue_depth():
    s = make(GroupSpec("small", max_queue_depth=1), GroupSpec("none", max_queue_depth=0), b=1)
    assert [type(sub(s, 1)), type(sub(s, 2, "small"))] == [Admit, Queued]
    assert [getattr(sub(s, i, g), "reason", None) for i, g in ((3, "small"), (4, "none"))] == [
        "queue_full",
        "queue_full",
    ]
    assert sub(s, 5) == Queued(5, "b")  # other groups still queue


# -- S3 ---------------------------------------------------------------------------------


def test_S3_the_next_request_comes_from_the_lowest_usage_per_weight():
    s = make(GroupSpec("a", 1), GroupSpec("b", 3), b=1)
    sub(s, 11, "a")  # a has used 1
    for rid in (12, 13, 14, 15):
        sub(s, rid, "a")
    for rid in (21, 22, 23, 24):
        sub(s, rid, "b")  # b joins at a's level: 3 used / weight 3
    assert serve_in_turn(s, 11) == [12, 21, 22, 23, 13, 24, 14, 15]


def test_S3_fifo_within_a_group():
    s = make(b=1)
    for rid, t in ((1, 0.0), (4, 1.0), (3, 2.0), (2, 3.0)):
        sub(s, rid, now=t)
    assert serve_in_turn(s, 1, now=3.0) == [4, 3, 2]


def test_S3_a_newly_active_group_starts_at_the_current_minimum_no_banked_idle_time():
    s = make(GroupSpec("a"), GroupSpec("b"), b=1)
    for rid in range(1, 10):  # a serves alone for a while; b is idle
        sub(s, rid, "a"), s.release(rid, 0.0)
    sub(s, 10, "a")
    for rid in (11, 12, 13, 14):
        sub(s, rid, "a")
    for rid in (21, 22, 23, 24):
        sub(s, rid, "b")
    # b does not get four turns in a row for having been idle: the two alternate.
    assert serve_in_turn(s, 10) == [11, 21, 12, 22, 13, 23, 14, 24]


def test_S3_usage_decays_by_half_every_half_life():
    s = make(GroupSpec("a"), b=4)
    for rid in (1, 2, 3, 4):
        sub(s, rid, "a")
    assert s.groups["a"].decayed(HALF_LIFE_SECONDS) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("currency", "usages", "order"),
    [
        ("requests", [100, 60, 60, 1], [2, 21, 22, 23]),  # one per admission; usage ignored
        ("tokens", [100, 60, 60, 1], [21, 22, 2, 23]),
        ("dollars", [1.0, 0.6, 0.6, 0.01], [21, 22, 2, 23]),
    ],
)
def test_S3_share_currency_counts_what_release_reports(currency, usages, order):
    s = make(GroupSpec("a", currency=currency), GroupSpec("b", currency=currency), b=1)
    sub(s, 1, "a"), sub(s, 2, "a")
    for rid in (21, 22, 23):
        sub(s, rid, "b")
    assert serve_in_turn(s, 1, usages) == order


def test_S3_share_currency_slot_seconds_counts_time_held():
    s = make(GroupSpec("a", currency="slotSeconds"), GroupSpec("b", currency="slotSeconds"), b=1)
    sub(s, 1, "a"), sub(s, 2, "a")
    for rid in range(21, 33):
        sub(s, rid, "b")
    order, t = s.release(1, 0.0105), 0.0105  # a held the slot for 10.5 ms
    while order[-1].request != 2:  # each b request holds it for 1 ms
        t += 0.001
        order += s.release(order[-1].request, t)
    assert [a.request for a in order] == [*range(21, 32), 2]


# -- S4 ---------------------------------------------------------------------------------


def test_S4_only_lower_weight_interruptible_groups_are_victims():
    mid, peer = GroupSpec("mid", 5), GroupSpec("peer", 10, interruptible=True)
    s = make(HI, mid, peer, LO, b=3)
    sub(s, 1, "mid"), sub(s, 2, "peer")
    assert sub(s, 3, "hi", policy=PREEMPT) == Admit(3, "b")
    assert sub(s, 4, "hi", policy=PREEMPT).reason == "saturated"  # type: ignore[union-attr]
    s.release(3, 1.0), sub(s, 5, "lo", now=1.0)
    assert sub(s, 6, "hi", 1.0, PREEMPT) == Preempt(6, 5, "b")


def test_S4_the_victim_is_the_newest_request_of_the_lowest_weight():
    s = make(HI, LO, GroupSpec("lo2", 2, interruptible=True), b=3)
    sub(s, 1, "lo", 0.0), sub(s, 2, "lo", 1.0), sub(s, 3, "lo2", 2.0)
    takers = [sub(s, rid, "hi", 3.0, PREEMPT) for rid in (7, 8, 9, 10)]
    assert takers[:3] == [Preempt(7, 2, "b"), Preempt(8, 1, "b"), Preempt(9, 3, "b")]
    assert takers[3].reason == "saturated"  # type: ignore[union-attr]


def test_S4_the_hand_off_admits_the_taker_when_the_victim_releases():
    s = make(HI, LO, b=1)
    sub(s, 1, "lo"), sub(s, 2, "lo")
    assert sub(s, 9, "hi", policy=PREEMPT) == Preempt(9, 1, "b")
    assert (s.preempting(1), s.preempting(2)) == (True, False)
    assert sub(s, 3, "lo") == Queued(3, "b")  # the slot is promised
    assert s.release(1, 1.0) == [Admit(9, "b")]
    assert s.load("b") == (1, 1, 2)


def test_S4_requeue_puts_the_victim_back_at_the_head_of_its_queue():
    s = make(HI, LO, b=1)
    sub(s, 1, "lo"), sub(s, 2, "lo"), sub(s, 9, "hi", policy=PREEMPT)
    assert s.requeue(1, 1.0) == [Admit(9, "b")]
    assert serve_in_turn(s, 9, now=2.0) == [1, 2]


def test_S4_withdrawing_the_taker_cancels_the_hand_off():
    s = make(HI, LO, b=1)
    sub(s, 1, "lo"), sub(s, 2, "lo"), sub(s, 9, "hi", policy=PREEMPT)
    assert s.withdraw(9, 1.0) == []
    assert not s.preempting(1)
    assert sub(s, 10, "hi", 1.0, PREEMPT) == Preempt(10, 1, "b")  # a victim again
    s.withdraw(10, 1.0)
    assert s.release(1, 2.0) == [Admit(2, "b")]


# -- S5 ---------------------------------------------------------------------------------


def test_S5_retry_after_follows_the_measured_dwell():
    s = make(b=1)
    sub(s, 1), sub(s, 2)
    s.release(1, 10.0)  # 2 waited 10 s
    assert s.retry_after("b") == 10.0
    sub(s, 3, now=10.0), s.release(2, 15.0)  # 3 waited 5 s: 0.8 * 10 + 0.2 * 5
    assert s.retry_after("b") == 9.0


def test_S5_retry_after_before_any_dwell_comes_from_service_time():
    s = make(b=2)
    assert s.retry_after("b") == 1.0  # nothing measured yet
    sub(s, 1), s.release(1, 4.0)  # service 4 s, nobody waited
    sub(s, 2, now=4.0), sub(s, 3, now=4.0), sub(s, 4, now=4.0)
    assert s.retry_after("b") == 4.0  # 4 s x (1 waiting + 1) / 2 slots


def test_S5_a_reject_carries_capacity_in_flight_and_waiting():
    s = make(b=2)
    sub(s, 1), sub(s, 2), sub(s, 3)
    assert sub(s, 4, policy=Policy()) == Reject(4, "b", "saturated", 1.0, 2, 2, 1)


# -- S7 ---------------------------------------------------------------------------------


def test_S7_release_frees_the_slot():
    s = make(b=1)
    sub(s, 1)
    assert s.release(1, 1.0) == []
    assert s.load("b") == (1, 0, 0)
    assert sub(s, 2, now=1.0) == Admit(2, "b")


def test_S7_withdraw_frees_the_place_in_the_queue():
    s = make(b=1)
    sub(s, 1), sub(s, 2), sub(s, 3)
    assert s.withdraw(2, 1.0) == [] and s.withdraw(99, 1.0) == []
    assert s.load("b") == (1, 1, 1)
    assert s.release(1, 2.0) == [Admit(3, "b")]


def test_S7_withdrawing_a_request_admitted_in_the_same_instant_frees_its_slot():
    s = make(b=1)
    sub(s, 1), sub(s, 2), sub(s, 3)
    assert s.release(1, 1.0) == [Admit(2, "b")]
    assert s.withdraw(2, 1.0) == [Admit(3, "b")]  # its maxWait fired as the Admit came
    assert s.release(3, 2.0) == [] and s.load("b") == (1, 0, 0)


# -- V2 ---------------------------------------------------------------------------------

LANE, OTHER = GroupSpec("lane"), GroupSpec("other")


def test_V2_other_lanes_see_capacity_minus_unused_reserved_slots():
    s = make(LANE, OTHER, b=3)
    s.lease("lane", "b", 2, until=100.0, now=0.0)
    assert [sub(s, 1, "other"), sub(s, 2, "other")] == [Admit(1, "b"), Queued(2, "b")]
    assert [sub(s, 3, "lane"), sub(s, 4, "lane")] == [Admit(3, "b"), Admit(4, "b")]
    assert s.release(3, 1.0) == []  # the freed slot is the lane's again
    assert sub(s, 5, "lane", 1.0) == Admit(5, "b")


def test_V2_a_lease_never_takes_a_running_slot():
    s = make(LANE, OTHER, b=2)
    sub(s, 1, "other"), sub(s, 2, "other")
    s.lease("lane", "b", 1, until=100.0, now=0.0)
    assert s.load("b") == (2, 2, 0)
    assert sub(s, 3, "lane") == Queued(3, "b")
    assert s.release(1, 1.0) == [Admit(3, "b")]


def test_V2_unlease_and_expiry_admit_the_waiters():
    s = make(LANE, OTHER, b=1)
    s.lease("lane", "b", 1, until=10.0, now=0.0)
    sub(s, 1, "other")
    assert s.expire_leases(5.0) == []
    assert s.expire_leases(10.0) == [Admit(1, "b")]
    s.release(1, 11.0), s.lease("lane", "b", 1, until=100.0, now=11.0), sub(s, 2, "other", 11.0)
    assert s.unlease("lane", "b", 12.0) == [Admit(2, "b")]
    assert s.unlease("lane", "b", 12.0) == []


def test_V2_a_request_in_its_lanes_reserved_slot_is_not_a_victim():
    s = make(HI, LO, b=3)
    s.lease("lo", "b", 1, until=100.0, now=0.0)
    sub(s, 1, "lo", 0.0), sub(s, 2, "lo", 1.0), sub(s, 3, "hi", 2.0)
    assert sub(s, 4, "hi", 3.0, PREEMPT) == Preempt(4, 2, "b")  # beyond its lease
    assert sub(s, 5, "hi", 3.0, PREEMPT).reason == "saturated"  # type: ignore[union-attr]


# -- F1 ---------------------------------------------------------------------------------


def test_F1_least_loaded_then_round_robin_within_a_tier():
    s = make(b1=4, b2=4)
    tier = [["b1", "b2"]]
    assert sub(s, 1, tiers=[["b1"]]) == Admit(1, "b1")
    assert sub(s, 2, tiers=tier) == Admit(2, "b2")  # fewest in flight
    turns = []
    for rid in range(3, 9):
        turns.append(sub(s, rid, tiers=tier).backend)  # type: ignore[union-attr]
        s.release(rid, 0.0)
    assert turns[:2] in (["b1", "b2"], ["b2", "b1"]) and turns == turns[:2] * 3


def test_F1_spill_to_the_next_tier_only_with_policy_spill():
    s = make(a=1, b=1)
    sub(s, 1, tiers=TWO_TIERS)
    assert sub(s, 2, tiers=TWO_TIERS) == Queued(2, "a")
    assert sub(s, 3, policy=Policy(spill=True, queue=True), tiers=TWO_TIERS) == Admit(3, "b")


def test_F1_a_waiting_request_queues_on_the_least_waiting_backend_of_its_first_tier():
    s = make(b1=1, b2=1)
    tier = [["b1", "b2"]]
    decisions = [sub(s, rid, tiers=tier) for rid in (1, 2, 3, 4, 5)]
    assert [type(d).__name__ for d in decisions] == ["Admit"] * 2 + ["Queued"] * 3
    assert [d.backend for d in decisions[2:]] == ["b1", "b2", "b1"]  # type: ignore[union-attr]


# -- K6 ---------------------------------------------------------------------------------

EQUALS = (("b1", "b2", "b3"),)


def test_K6_the_conversations_backend_is_taken_while_it_has_room_even_if_busier():
    s = make(b1=4, b2=4, b3=4)
    sub(s, 1, tiers=[["b3"]]), sub(s, 2, tiers=[["b3"]])
    assert [sub(s, rid, tiers=EQUALS, prefer="b3") for rid in (3, 4)] == [
        Admit(3, "b3"),
        Admit(4, "b3"),
    ]


def test_K6_a_full_preferred_backend_falls_back_to_the_least_loaded_never_to_a_queue():
    s = make(b1=1, b2=2, b3=2)
    sub(s, 1, tiers=[["b1"]]), sub(s, 2, tiers=[["b2"]])
    assert sub(s, 3, tiers=EQUALS, prefer="b1") == Admit(3, "b3")


def test_K6_a_preferred_backend_whose_free_slots_are_leased_to_another_lane_is_not_taken():
    s = make(LANE, OTHER, b1=1, b2=1)
    s.lease("lane", "b1", 1, until=100.0, now=0.0)
    assert sub(s, 1, "other", tiers=[["b1", "b2"]], prefer="b1") == Admit(1, "b2")


def test_K6_a_preference_never_overrides_the_order_of_tiers():
    s = make(a=1, b1=1, b2=1)
    tiers = (("a",), ("b1", "b2"))
    assert sub(s, 1, policy=Policy(spill=True), tiers=tiers, prefer="b2") == Admit(1, "a")
    assert sub(s, 2, policy=Policy(spill=True), tiers=tiers, prefer="b2") == Admit(2, "b2")


def test_K6_a_preference_for_a_backend_not_in_the_tiers_is_ignored():
    s = make(b1=1, b2=1)
    sub(s, 1, tiers=[["b1"]])
    assert sub(s, 2, tiers=[["b1", "b2"]], prefer="gone") == Admit(2, "b2")


def test_K6_when_every_equal_backend_is_full_it_queues_where_its_conversation_ran():
    s = make(b1=1, b2=1)
    sub(s, 1, tiers=[["b1"]]), sub(s, 2, tiers=[["b2"]])
    decisions = [sub(s, rid, tiers=[["b1", "b2"]], prefer="b2") for rid in (3, 4)]
    assert decisions == [Queued(3, "b2"), Queued(4, "b1")]  # but not behind a longer queue


# -- K4 ---------------------------------------------------------------------------------


def test_K4_a_queued_request_knows_its_place_by_arrival_and_loses_it_once_admitted():
    s = make(HI, LO, b=1)
    sub(s, 1, "lo", 0.0)  # runs
    sub(s, 2, "lo", 1.0)
    sub(s, 3, "hi", 2.0)
    sub(s, 4, "lo", 3.0)
    before = [s.position(r) for r in (1, 2, 3, 4)]
    s.release(1, 4.0)  # hi starts level with lo (nothing banked): a tie, the earlier goes
    after = [s.position(r) for r in (2, 3, 4)]
    assert (before, after) == (
        [None, ("b", 1, 3), ("b", 2, 3), ("b", 3, 3)],
        [None, ("b", 1, 2), ("b", 2, 2)],
    )
