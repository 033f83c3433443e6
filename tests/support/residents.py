"""Hypothesis strategies for the residency planners' property tests (R1/R2, M3)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from corrallm.residency.planner import Resident


def residents(pools: Sequence[str], *, pools_each: int) -> st.SearchStrategy[list[Resident]]:
    """Up to 8 residents with unique ids, each holding up to `pools_each` of `pools`."""
    return st.lists(
        st.builds(
            Resident,
            id=st.uuids().map(str),
            usage=st.dictionaries(st.sampled_from(pools), st.integers(0, 40), max_size=pools_each),
            idle=st.booleans(),
            pinned=st.booleans(),
            last_used=st.floats(0, 100),
            ttl_expires_at=st.none() | st.floats(0, 100),
            evict_cost=st.sampled_from(["low", "medium", "high"]),
        ),
        max_size=8,
        unique_by=lambda x: x.id,
    )
