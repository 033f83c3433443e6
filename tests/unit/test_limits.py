"""T3: per-key rate limits, the pure core (auth/limits.py). Each test replays a scripted
sequence of requests arriving, ending and being refused, with the clock passed in, and
compares what the limiter decided with one equality assert; hypothesis checks the
invariants over random sequences: never more than `rpm` requests admitted in any 60 s, never
more than `concurrent` held at once, never more than `tpm` tokens used and reserved in
the window (when usage stays within the estimates)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.auth.limits import (
    Ask,
    Hold,
    Limiter,
    Remaining,
    rpm_retry,
    tpm_retry,
)
from corrallm.auth.limits import (
    LimitRefusal as Refused,
)
from corrallm.config.schema import RateLimits

KEY = "key:alice"
USER = "key:alice/user:bob"


def limits(**kw: int) -> RateLimits:
    return RateLimits(**kw)


def outcomes(limiter: Limiter, asks: list[Ask], script: list[tuple[float, int]]) -> list[object]:
    """Admit a request of `estimate` tokens at each time (none ends): what each got, as
    "ok" or (rule, retry_after)."""
    out: list[object] = []
    for now, estimate in script:
        got = limiter.admit(asks, estimate, now)
        out.append("ok" if isinstance(got, Hold) else (got.rule, got.retry_after))
    return out


def test_T3_rpm_admits_the_limit_in_60s_then_says_when_the_oldest_leaves():
    asks = [Ask(KEY, limits(rpm=3))]
    script = [(0, 0), (10, 0), (20, 0), (30, 0), (59.5, 0), (60, 0), (61, 0), (70, 0)]
    assert outcomes(Limiter(), asks, script) == [
        "ok",
        "ok",
        "ok",
        ("rpm", 30.0),  # the request of t=0 leaves the window at t=60
        ("rpm", 1.0),  # half a second to go: at least 1
        "ok",  # t=0 is out (exactly 60 s ago)
        ("rpm", 9.0),  # 10, 20, 60 in the window: t=10 leaves at 70
        "ok",
    ]


def test_T3_tpm_reserves_the_estimate_and_settles_with_the_usage():
    limiter = Limiter()
    asks = [Ask(KEY, limits(tpm=1000))]
    first = limiter.admit(asks, 600, now=0)
    assert isinstance(first, Hold)
    refused = limiter.admit(asks, 600, now=1)  # 600 reserved + 600 > 1000
    limiter.release(first, 100, now=2)  # it used 100 of its 600
    second = limiter.admit(asks, 600, now=3)  # 100 + 600 fit
    third = limiter.admit(asks, 600, now=4)  # 100 + 600 + 600 do not; nothing settled
    assert isinstance(second, Hold)
    limiter.release(second, 600, now=5)
    fourth = limiter.admit(asks, 600, now=6)  # 700 used, in two settlements
    assert (refused, third, fourth) == (
        Refused("tpm", KEY, 1000, 600, 600, 60.0),  # all of it reserved: a whole window
        Refused("tpm", KEY, 1000, 700, 600, 60.0),
        Refused("tpm", KEY, 1000, 700, 600, 59.0),  # 300 over: both must leave, at t=65
    )


def test_T3_an_estimate_over_the_whole_tpm_is_refused_without_retry():
    limiter = Limiter()
    got = limiter.admit([Ask(KEY, limits(tpm=1000, rpm=5))], 1001, now=0)
    assert (got, len(limiter)) == (Refused("tpm", KEY, 1000, 0, 1001, None), 0)


def test_T3_concurrent_counts_requests_held_until_they_end():
    limiter = Limiter()
    asks = [Ask(KEY, limits(concurrent=2))]
    a, b = limiter.admit(asks, 10, 0), limiter.admit(asks, 10, 0)
    assert isinstance(a, Hold) and isinstance(b, Hold)
    third = limiter.admit(asks, 10, 1)
    limiter.release(a, 5, now=2)  # a failure or a client gone releases just the same
    fourth = limiter.admit(asks, 10, 3)
    assert (third, isinstance(fourth, Hold)) == (Refused("concurrent", KEY, 2, 2, 10, 1.0), True)


def test_T3_T4_a_user_over_its_perUser_limit_is_refused_and_nothing_is_counted():
    limiter = Limiter()
    key, user = Ask(KEY, limits(rpm=10)), Ask(USER, limits(rpm=1))
    first = limiter.admit([key, user], 0, now=0)
    second = limiter.admit([key, user], 0, now=1)  # the user has had its one
    other = limiter.admit([key, Ask("key:alice/user:carol", limits(rpm=1))], 0, now=2)
    assert isinstance(first, Hold) and isinstance(other, Hold)
    assert (second, limiter.remaining([key], now=3)) == (
        Refused("rpm", USER, 1, 1, 0, 59.0),
        Remaining(10, 8, None, None),  # the key counted bob's first and carol's, not the refused
    )


def test_T3_cancel_takes_a_request_back_and_idle_windows_are_dropped():
    limiter = Limiter()
    asks = [Ask(KEY, limits(rpm=1, tpm=100, concurrent=1))]
    hold = limiter.take(asks, 50, now=0)
    limiter.cancel(hold, now=0)  # a shared store refused it after all
    again = limiter.admit(asks, 50, now=1)
    assert isinstance(again, Hold)
    limiter.release(again, 20, now=2)
    sizes = [len(limiter)]
    limiter.sweep(now=61.5)  # the request of t=1 and its tokens of t=2 are still in it
    sizes.append(len(limiter))
    limiter.sweep(now=62)
    sizes.append(len(limiter))
    assert sizes == [1, 1, 0]


def test_T3_remaining_is_the_tightest_subject_after_this_request():
    limiter = Limiter()
    asks = [Ask(KEY, limits(rpm=60, tpm=1000)), Ask(USER, limits(rpm=5))]
    limiter.admit(asks, 300, now=0)
    remaining = limiter.remaining(asks, now=1)
    assert (remaining, remaining.headers()) == (
        Remaining(5, 4, 1000, 700),
        [
            (b"x-ratelimit-limit-requests", b"5"),
            (b"x-ratelimit-remaining-requests", b"4"),
            (b"x-ratelimit-limit-tokens", b"1000"),
            (b"x-ratelimit-remaining-tokens", b"700"),
        ],
    )


def test_T3_retry_after_from_a_timeline():
    assert [
        rpm_retry([0.0, 10.0, 20.0], 3, now=30),  # one more: t=0 must leave
        rpm_retry([0.0, 10.0, 20.0, 25.0], 3, now=30),  # two must leave: t=10 the later
        tpm_retry([(0.0, 100), (30.0, 500)], 50, now=40),
        tpm_retry([(0.0, 100), (30.0, 500)], 200, now=40),
        tpm_retry([(0.0, 100)], 200, now=40),  # the rest is reserved: a whole window
    ] == [30.0, 40.0, 20.0, 50.0, 60.0]


# -- invariants ---------------------------------------------------------------------------

arrivals = st.lists(
    st.tuples(
        st.floats(0, 30),  # seconds since the previous event
        st.integers(0, 400),  # the request's estimate
        st.floats(0, 1),  # the share of it used
        st.booleans(),  # whether the oldest held request ends first
    ),
    max_size=120,
)
policies = st.builds(
    RateLimits,
    rpm=st.none() | st.integers(1, 8),
    tpm=st.none() | st.integers(1, 1500),
    concurrent=st.none() | st.integers(1, 4),
)


@settings(max_examples=300, deadline=None)
@given(key=policies, user=policies, events=arrivals)
def test_T3_never_more_than_the_limits_admitted(key, user, events):
    limiter = Limiter()
    asks = [Ask(KEY, key), Ask(USER, user)]
    now = 0.0
    admitted: list[float] = []  # when each admitted request arrived
    held: list[tuple[Hold, int]] = []  # (hold, tokens it will use)
    spent: list[tuple[float, int]] = []  # (settled at, tokens)
    for dt, estimate, share, finish in events:
        now += dt
        if finish and held:
            hold, used = held.pop(0)
            limiter.release(hold, used, now)
            spent.append((now, used))
        got = limiter.admit(asks, estimate, now)
        if isinstance(got, Refused):
            continue
        admitted.append(now)
        held.append((got, int(estimate * share)))
        window = [t for t in admitted if t > now - 60]
        tokens = sum(n for t, n in spent if t > now - 60) + sum(h.tokens for h, _ in held)
        for rules in (key, user):
            assert rules.rpm is None or len(window) <= rules.rpm
            assert rules.concurrent is None or len(held) <= rules.concurrent
            assert rules.tpm is None or tokens <= rules.tpm


@settings(max_examples=300, deadline=None)
@given(key=policies, user=policies, events=arrivals, with_user=st.booleans())
def test_T3_the_hot_paths_one_pass_decides_and_counts_as_admit_and_remaining(
    key, user, events, with_user
):
    """`counted` (one pass over the windows; without a list or loop for a key alone)
    against `admit` then `remaining`, fed the same history: the same verdicts, the same
    counts after, the same windows."""
    fast, plain = Limiter(), Limiter()
    asks = [Ask(KEY, key), Ask(USER, user)] if with_user else [Ask(KEY, key)]
    now = 0.0
    held: list[tuple[Hold, Hold, int]] = []
    for dt, estimate, share, finish in events:
        now += dt
        if finish and held:
            one, other, used = held.pop(0)
            fast.release(one, used, now)
            plain.release(other, used, now)
        got = fast.counted(asks, estimate, now)
        expected = plain.admit(asks, estimate, now)
        if isinstance(expected, Refused):
            assert got == expected
            continue
        assert not isinstance(got, Refused) and not isinstance(expected, Refused)
        assert (got.subjects, got.tokens, got.at, got.headers) == (
            expected.subjects,
            expected.tokens,
            expected.at,
            plain.remaining(asks, now).headers(),
        )
        held.append((got, expected, int(estimate * share)))
        assert fast.counts(KEY, now) == plain.counts(KEY, now)
        assert fast.counts(USER, now) == plain.counts(USER, now)
