"""R1-R4: the eviction planner, by example and by property (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.residency.planner import Resident, eviction_order, free_space, plan
from tests.support.residents import residents

GB = 10**9
CAP = {"gpu0": 32 * GB, "system": 64 * GB}
RESERVE = {"gpu0": 1 * GB}


def r(id: str, gpu: int, **kw) -> Resident:
    return Resident(id, {"gpu0": gpu * GB}, kw.pop("idle", True), **kw)


def test_R1_a_backend_that_fits_every_pool_loads_without_evictions():
    assert plan(CAP, RESERVE, [r("a", 10)], {"gpu0": 20 * GB, "system": 4 * GB}, 0).evict == ()


def test_R1_the_reserve_is_never_handed_out():
    result = plan(CAP, RESERVE, [], {"gpu0": 32 * GB}, 0)
    assert not result.fits and result.short == {"gpu0": 1 * GB}


def test_R2_ttl_expired_first_then_evict_cost_then_least_recently_used():
    residents = [
        r("lru-old-high", 8, last_used=1, evict_cost="high"),
        r("cheap-recent", 8, last_used=50, evict_cost="low"),
        r("medium-old", 8, last_used=2),
        r("expired-high", 8, last_used=99, evict_cost="high", ttl_expires_at=5),
    ]
    order = [x.id for x in eviction_order(residents, now=10)]
    assert order == ["expired-high", "cheap-recent", "medium-old", "lru-old-high"]
    assert plan(CAP, {}, residents, {"gpu0": 8 * GB}, 10).evict == ("expired-high",)
    assert plan(CAP, {}, residents, {"gpu0": 16 * GB}, 10).evict == (
        "expired-high",
        "cheap-recent",
    )


def test_R2_busy_and_pinned_residents_are_never_victims():
    residents = [r("busy", 16, idle=False), r("pinned", 15, pinned=True)]
    result = plan(CAP, RESERVE, residents, {"gpu0": 4 * GB}, 0)
    assert not result.fits and result.evict == ()


def test_R2_only_as_many_as_needed_are_evicted():
    # Order says small first, but the big one alone is enough: the small one is spared.
    residents = [r("small", 2, evict_cost="low"), r("big", 28, evict_cost="high")]
    assert plan(CAP, RESERVE, residents, {"gpu0": 20 * GB}, 0).evict == ("big",)


def test_R2_residents_holding_nothing_we_lack_are_not_evicted():
    residents = [Resident("ram-only", {"system": 60 * GB}, True), r("gpu", 30)]
    assert plan(CAP, RESERVE, residents, {"gpu0": 10 * GB}, 0).evict == ("gpu",)


POOLS = ["gpu0", "gpu1", "system"]
pools = st.sampled_from(POOLS)
residents_st = residents(POOLS, pools_each=3)


@settings(max_examples=300, deadline=None)
@given(
    residents=residents_st,
    need=st.dictionaries(pools, st.integers(1, 60), min_size=1, max_size=3),
    now=st.floats(0, 100),
)
def test_R2_planner_properties(residents, need, now):
    capacity = {"gpu0": 60, "gpu1": 60, "system": 100}
    reserve = {"gpu0": 4}
    # Residents as the gateway admits them: together they never exceed what is handed out.
    admitted: list[Resident] = []
    for res in residents:
        if all(v >= 0 for v in free_space(capacity, reserve, [*admitted, res]).values()):
            admitted.append(res)
    result = plan(capacity, reserve, admitted, need, now)
    by_id = {x.id: x for x in admitted}
    victims = [by_id[i] for i in result.evict]
    assert all(v.idle and not v.pinned for v in victims)  # never a busy or pinned victim
    assert len(set(result.evict)) == len(result.evict)

    def fits_without(gone: set[str]) -> bool:
        left = [x for x in admitted if x.id not in gone]
        free = free_space(capacity, reserve, left)
        return all(free.get(p, 0) >= n for p, n in need.items())

    if result.fits:
        assert fits_without(set(result.evict))  # never over capacity
        for victim in result.evict:  # minimal: each victim is needed
            assert not fits_without(set(result.evict) - {victim})
        # Order respected: a spared candidate identical in usage ranks after every victim.
        order = [x.id for x in eviction_order(admitted, now)]
        for victim in victims:
            for other in admitted:
                if (
                    other.id in order
                    and other.id not in result.evict
                    and other.usage == victim.usage
                ):
                    assert order.index(victim.id) < order.index(other.id)
    else:
        evictable = {x.id for x in admitted if x.idle and not x.pinned}
        assert not fits_without(evictable)  # no eviction at all could make room
