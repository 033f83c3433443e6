"""W1: the eviction planner with sleepers — sleep vs stop, by example and by property."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.residency.planner import Resident, free_space, plan, settle_idle

GB = 10**9
CAP = {"gpu0": 24 * GB, "system": 32 * GB}


def vllm(id: str, gpu: int, asleep_system: int, **kw) -> Resident:
    """A vLLM-like backend: holds `gpu` GB on the GPU awake, `asleep_system` GB of RAM asleep."""
    return Resident(
        id,
        {"gpu0": gpu * GB},
        True,
        sleep_usage={"system": asleep_system * GB},
        load_seconds=kw.pop("load", 60.0),
        wake_seconds=kw.pop("wake", 2.0),
        **kw,
    )


def asleep(r: Resident) -> Resident:
    assert r.sleep_usage is not None
    return replace(r, usage=r.sleep_usage, asleep=True, sleep_usage=None)


def test_W1_a_resident_that_can_sleep_is_put_to_sleep_instead_of_stopped():
    result = plan(CAP, {}, [vllm("big", 20, 16)], {"gpu0": 20 * GB}, 0)
    assert (result.fits, result.sleep, result.evict, result.cost) == (True, ("big",), (), 2.0)


def test_W1_it_is_stopped_when_its_sleep_usage_does_not_fit():
    ram_hog = Resident("ram", {"system": 20 * GB}, False)  # busy: stays
    result = plan(CAP, {}, [vllm("big", 20, 16), ram_hog], {"gpu0": 20 * GB}, 0)
    assert (result.sleep, result.evict) == ((), ("big",))


def test_W1_it_is_stopped_when_waking_is_not_cheaper_than_loading():
    result = plan(CAP, {}, [vllm("big", 20, 16, load=1.0, wake=2.0)], {"gpu0": 20 * GB}, 0)
    assert (result.sleep, result.evict) == ((), ("big",))


def test_W1_a_sleeper_holds_its_sleep_usage_and_is_stopped_when_that_is_needed():
    sleeper = asleep(vllm("s", 20, 16))
    assert free_space(CAP, {}, [sleeper]) == {"gpu0": 24 * GB, "system": 16 * GB}
    result = plan(CAP, {}, [sleeper], {"system": 20 * GB}, 0)
    assert (result.evict, result.cost) == (("s",), 58.0)


def test_W1_a_sleeper_is_stopped_before_a_resident_only_when_that_is_cheaper():
    sleeper = asleep(vllm("s", 8, 16, load=30.0, wake=2.0))  # stopping it costs 28 s later
    cheap = Resident("r", {"system": 16 * GB}, True, load_seconds=10.0)
    dear = replace(cheap, load_seconds=60.0)
    need = {"system": 16 * GB}
    assert plan(CAP, {}, [sleeper, cheap], need, 0).evict == ("r",)
    assert plan(CAP, {}, [sleeper, dear], need, 0).evict == ("s",)


def test_W1_a_slept_victim_is_stopped_when_sleeping_frees_too_little():
    # Asleep it would still hold 10 GB of the GPU (a level-1 sleep on a unified-memory box).
    r = Resident(
        "r", {"gpu0": 20 * GB}, True, sleep_usage={"gpu0": 10 * GB}, load_seconds=60, wake_seconds=2
    )
    assert plan(CAP, {}, [r], {"gpu0": 8 * GB}, 0).sleep == ("r",)
    assert plan(CAP, {}, [r], {"gpu0": 20 * GB}, 0).evict == ("r",)


def test_W1_ttl_puts_a_backend_to_sleep_when_its_sleep_usage_fits_else_stops_it():
    r = vllm("big", 20, 16)
    assert settle_idle(free_space(CAP, {}, [r]), r) == "sleep"
    crowded = free_space(CAP, {}, [r, Resident("x", {"system": 20 * GB}, False)])
    assert settle_idle(crowded, r) == "stop"
    assert settle_idle(free_space(CAP, {}, [r]), replace(r, sleep_usage=None)) == "stop"


# -- properties ----------------------------------------------------------------------

POOLS = ["gpu0", "system"]
vectors = st.dictionaries(st.sampled_from(POOLS), st.integers(0, 40), max_size=2)
residents_st = st.lists(
    st.builds(
        Resident,
        id=st.uuids().map(str),
        usage=vectors,
        idle=st.booleans(),
        pinned=st.booleans(),
        last_used=st.floats(0, 100),
        ttl_expires_at=st.none() | st.floats(0, 100),
        evict_cost=st.sampled_from(["low", "medium", "high"]),
        asleep=st.booleans(),
        sleep_usage=st.none() | vectors,
        load_seconds=st.floats(0, 100),
        wake_seconds=st.floats(0, 100),
    ).map(lambda r: replace(r, sleep_usage=None, idle=True) if r.asleep else r),
    max_size=6,
    unique_by=lambda x: x.id,
)
CAPACITY = {"gpu0": 60, "system": 60}


def _after(residents: list[Resident], result) -> list[Resident]:
    """The residents once the plan is carried out: stopped ones gone, slept ones asleep."""
    out = []
    for r in residents:
        if r.id in result.evict:
            continue
        if r.id in result.sleep:
            r = replace(r, usage=r.sleep_usage or {}, asleep=True, sleep_usage=None)
        out.append(r)
    return out


@settings(max_examples=400, deadline=None)
@given(residents_st, st.dictionaries(st.sampled_from(POOLS), st.integers(1, 60), min_size=1))
def test_W1_a_plan_that_fits_never_overcommits_and_sleepers_always_count(residents, need):
    before = free_space(CAPACITY, {}, residents)
    result = plan(CAPACITY, {}, residents, need, 50)
    if not result.fits:
        return
    free = free_space(CAPACITY, {}, _after(residents, result))  # sleepers counted at their usage
    for pool, n in need.items():
        assert free.get(pool, 0) >= n
    for pool in set(POOLS) - set(need):  # a sleep never pushes a pool below zero (or lower)
        assert free.get(pool, 0) >= min(0, before.get(pool, 0))
    by_id = {r.id: r for r in residents}
    for victim in result.evict + result.sleep:
        r = by_id[victim]
        assert r.idle and not r.pinned
    for slept in result.sleep:
        assert by_id[slept].may_sleep()
    assert not set(result.evict) & set(result.sleep)


@settings(max_examples=400, deadline=None)
@given(residents_st, st.dictionaries(st.sampled_from(POOLS), st.integers(1, 60), min_size=1))
def test_W1_a_sleeper_is_stopped_before_a_resident_is_evicted_only_when_cheaper(residents, need):
    result = plan(CAPACITY, {}, residents, need, 50)
    sleepers = {r.id for r in residents if r.asleep}
    if not result.fits or not set(result.evict) & sleepers:
        return
    spared = [replace(r, pinned=True) if r.asleep else r for r in residents]
    without = plan(CAPACITY, {}, spared, need, 50)
    # Never dearer than sparing the sleepers. A tie is allowed: the residents-first plan
    # (taken on ties) may itself stop a sleeper where another resident's eviction costs
    # the same seconds (hypothesis found one: two victims of cost 1.0 each way).
    assert not without.fits or result.cost <= without.cost


@settings(max_examples=300, deadline=None)
@given(residents_st, st.sampled_from(POOLS), st.integers(0, 60))
def test_W1_waking_a_sleeper_never_overcommits_a_pool(residents, pool, awake_size):
    """A wake is a plan for the sleeper's whole footprint, with it counted as gone."""
    sleepers = [r for r in residents if r.asleep]
    if not sleepers:
        return
    waking = sleepers[0]
    others = [r for r in residents if r.id != waking.id]
    need = {pool: awake_size}
    result = plan(CAPACITY, {}, others, need, 50)
    if result.fits:
        free = free_space(CAPACITY, {}, _after(others, result))
        assert free.get(pool, 0) >= awake_size
