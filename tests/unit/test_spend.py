"""S6: sliding-window spend limits, reserved at admission, settled with the real cost."""

from corrallm.cost.spend import SpendWindow


def test_S6_spend_under_the_limit_is_admitted_and_reserved():
    w = SpendWindow(limit_usd=1.0, window=3600)
    assert w.try_reserve(0.4, now=0) is None
    assert w.try_reserve(0.4, now=1) is None
    assert w.reserved == 0.8
    # A concurrent third one would overspend with the two reservations: refused.
    assert w.try_reserve(0.4, now=2) is not None


def test_S6_retry_after_is_when_enough_spend_leaves_the_window():
    w = SpendWindow(limit_usd=1.0, window=100)
    w.add(0.5, now=10)
    w.add(0.5, now=40)
    assert w.try_reserve(0.3, now=50) == 100 + 10 - 50  # the first 0.5 leaves at t=110
    assert w.try_reserve(0.8, now=50) == 100 + 40 - 50  # needs both gone
    assert w.try_reserve(0.3, now=110) is None


def test_S6_settle_replaces_the_reservation_with_the_real_cost():
    w = SpendWindow(limit_usd=1.0, window=100)
    assert w.try_reserve(0.9, now=0) is None
    w.settle(0.9, actual=0.1, now=1)
    assert w.reserved == 0 and w.spent(now=2) == 0.1
    assert w.try_reserve(0.85, now=2) is None


def test_S6_a_request_bigger_than_the_whole_limit_waits_a_full_window():
    w = SpendWindow(limit_usd=1.0, window=60)
    assert w.try_reserve(2.0, now=0) == 60
