"""F1/F2: tiers of consecutive same type+quality backends; degrade only where accepted."""

from corrallm.config.schema import BackendConfig as Backend
from corrallm.config.schema import PriorityGroup
from corrallm.routing.tiers import may_serve, tiers


def b(quality: int = 100, type: str = "chat") -> Backend:
    return Backend(proxy="http://x", quality=quality, type=type)


def test_F1_consecutive_backends_of_same_type_and_quality_form_a_tier():
    backends = [b(100), b(100), b(60), b(100), b(100, "embed")]
    assert tiers(backends) == [[0, 1], [2], [3], [4]]


def test_F2_lower_quality_serves_only_groups_accepting_degrade_above_their_floor():
    assert may_serve(b(100), 100, None)
    assert not may_serve(b(60), 100, None)
    assert not may_serve(b(60), 100, PriorityGroup(accept_degrade=False))
    assert may_serve(b(60), 100, PriorityGroup(accept_degrade=True))
    assert may_serve(b(60), 100, PriorityGroup(accept_degrade=True, quality_floor=50))
    assert not may_serve(b(40), 100, PriorityGroup(accept_degrade=True, quality_floor=50))
