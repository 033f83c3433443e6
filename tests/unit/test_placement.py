"""M3: GPU placement, by example and by property (hypothesis).

A backend asking for `gpu` may run on any of its server's `gpus`: the one where it fits
with no eviction, else the fewest, then the cheapest evictions, then the most free; ties
by the order of `gpus`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.residency.placement import Choice, concrete_need, gpu_index, place
from corrallm.residency.planner import Plan, Resident, free_space
from tests.support.residents import residents

GB = 10**9
GPUS = ("gpu0", "gpu1")
CAP = {"gpu0": 24 * GB, "gpu1": 24 * GB, "system": 64 * GB}


def on(gpu: str, id: str, size: int, **kw) -> Resident:
    return Resident(id, {gpu: size * GB}, kw.pop("idle", True), **kw)


def chosen(residents: list[Resident], need: dict[str, int], gpus=GPUS, cap=CAP) -> tuple:
    choice = place(cap, {}, residents, need, gpus, now=10)
    return choice.gpu, choice.evict


def test_M3_the_second_backend_lands_on_the_other_gpu_without_evicting_the_first():
    assert chosen([on("gpu0", "a", 18)], {"gpu": 18 * GB}) == ("gpu1", ())


def test_M3_no_eviction_beats_more_free_memory():
    residents = [on("gpu0", "a", 2), on("gpu1", "b", 12)]
    assert chosen(residents, {"gpu": 12 * GB}) == ("gpu0", ())


def test_M3_among_fits_without_eviction_the_most_free_wins():
    residents = [on("gpu0", "a", 10), on("gpu1", "b", 4)]
    assert chosen(residents, {"gpu": 8 * GB}) == ("gpu1", ())


def test_M3_ties_go_by_the_order_of_gpus():
    assert chosen([], {"gpu": 8 * GB}, gpus=("gpu1", "gpu0")) == ("gpu1", ())


def test_M3_fewest_evictions_win():
    residents = [on("gpu0", "a1", 10), on("gpu0", "a2", 10), on("gpu1", "b", 20)]
    assert chosen(residents, {"gpu": 20 * GB}) == ("gpu1", ("b",))


def test_M3_cheapest_evictions_win_when_their_number_ties():
    residents = [on("gpu0", "dear", 20, evict_cost="high"), on("gpu1", "cheap", 20)]
    assert chosen(residents, {"gpu": 20 * GB}) == ("gpu1", ("cheap",))


def test_M3_a_ttl_expired_victim_is_cheaper_than_a_low_cost_one():
    residents = [
        on("gpu0", "low", 20, evict_cost="low", last_used=9),
        on("gpu1", "expired", 20, evict_cost="high", ttl_expires_at=5),
    ]
    assert chosen(residents, {"gpu": 20 * GB}) == ("gpu1", ("expired",))


def test_M3_pinned_and_busy_residents_rule_their_gpu_out():
    residents = [on("gpu0", "pinned", 20, pinned=True), on("gpu1", "busy", 20, idle=False)]
    choice = place(CAP, {}, residents, {"gpu": 8 * GB}, GPUS, now=0)
    assert choice == Choice(
        None,
        Plan(False, short={"gpu0": 4 * GB}),
        short={"gpu0": {"gpu0": 4 * GB}, "gpu1": {"gpu1": 4 * GB}},
    )


def test_M3_other_pools_of_the_need_are_planned_too():
    residents = [on("gpu0", "a", 4), Resident("ram", {"system": 60 * GB}, True)]
    choice = place(CAP, {}, residents, {"gpu": 8 * GB, "system": 8 * GB}, GPUS, now=0)
    assert (choice.gpu, choice.evict, choice.need) == (
        "gpu1",
        ("ram",),
        {"gpu1": 8 * GB, "system": 8 * GB},
    )


def test_M3_the_reserve_is_never_handed_out_on_any_gpu():
    reserve = {"gpu0": 8 * GB, "gpu1": 2 * GB}
    choice = place(CAP, reserve, [], {"gpu": 20 * GB}, GPUS, now=0)
    assert (choice.gpu, choice.why) == ("gpu1", "the only GPU it fits on")


def test_M3_a_need_without_gpu_is_planned_as_it_is():
    choice = place(CAP, {}, [on("gpu0", "a", 20)], {"gpu0": 8 * GB}, GPUS, now=0)
    assert (choice.gpu, choice.evict) == (None, ("a",))


def test_M3_the_choice_says_why():
    residents = [on("gpu0", "a", 10), on("gpu1", "b", 4)]
    choice = place(CAP, {}, residents, {"gpu": 8 * GB}, GPUS, now=0)
    assert choice.why == "most free after the start (12GB left; gpu0: 6GB)"


def test_M3_gpu_index_is_the_number_ending_the_pool_name_else_its_position():
    assert [
        gpu_index("gpu1", ["gpu0", "gpu1"]),
        gpu_index("gpu12", ["gpu12"]),
        gpu_index("big", ["small", "big"]),
    ] == ["1", "12", "1"]


def test_M3_the_concrete_need_counts_gpu_on_the_chosen_pool():
    assert concrete_need({"gpu": 5, "system": 2}, "gpu1") == {"gpu1": 5, "system": 2}


# -- properties ----------------------------------------------------------------------

POOLS = ["gpu0", "gpu1", "gpu2", "system"]
residents_st = residents(POOLS, pools_each=2)
gpus_st = st.lists(st.sampled_from(POOLS[:3]), min_size=1, max_size=3, unique=True)
need_st = st.fixed_dictionaries(
    {"gpu": st.integers(1, 60)}, optional={"system": st.integers(1, 60)}
)
CAPACITY = {"gpu0": 60, "gpu1": 50, "gpu2": 40, "system": 100}
RESERVE = {"gpu0": 4}


def admitted(residents: list[Resident]) -> list[Resident]:
    """Residents as the gateway admits them: together never over what is handed out."""
    kept: list[Resident] = []
    for r in residents:
        if all(v >= 0 for v in free_space(CAPACITY, RESERVE, [*kept, r]).values()):
            kept.append(r)
    return kept


def fits_without(residents: list[Resident], gone: set[str], need: dict[str, int]) -> bool:
    free = free_space(CAPACITY, RESERVE, [r for r in residents if r.id not in gone])
    return all(free.get(p, 0) >= n for p, n in need.items())


@settings(max_examples=400, deadline=None)
@given(residents=residents_st, need=need_st, gpus=gpus_st, now=st.floats(0, 100))
def test_M3_placement_properties(residents, need, gpus, now):
    residents = admitted(residents)
    choice = place(CAPACITY, RESERVE, residents, need, gpus, now)
    by_id = {r.id: r for r in residents}
    no_eviction = [g for g in gpus if fits_without(residents, set(), concrete_need(need, g))]
    if choice.fits:
        assert choice.gpu in gpus
        # Counted on exactly one pool of `gpus`, never on two, never as `gpu`.
        assert [p for p in choice.need if p in gpus] == [choice.gpu]
        assert "gpu" not in choice.need and choice.need == concrete_need(need, choice.gpu)
        # Never over capacity on any GPU (or other pool) once the victims are gone.
        assert fits_without(residents, set(choice.evict), dict(choice.need))
        # Pinned or busy residents are never evicted.
        assert all(by_id[v].idle and not by_id[v].pinned for v in choice.evict)
        # A choice that needs no eviction is always preferred when one exists.
        if no_eviction:
            assert choice.evict == () and choice.gpu in no_eviction
    else:
        assert not no_eviction and choice.gpu is None
        evictable = {r.id for r in residents if r.idle and not r.pinned}
        for gpu in gpus:  # no eviction at all could make room on any GPU
            assert not fits_without(residents, evictable, concrete_need(need, gpu))
        assert set(choice.short) == set(gpus)
